"""README.md and docs/: every Python sample runs; every page is linked; links and paths resolve.

Each ```python block of ``README.md`` and ``docs/*.md`` is one test. It runs in a fresh namespace
on a queue prefix of the test's own (deleted before and after): every string literal that is a
``redis://`` URL is pointed at the test Redis, and the queue prefix ``"kumiko"`` at the private
prefix where the block names it as a dataset's prefix (a ``queue_prefix=`` argument, or a
positional argument of a call that also names a Redis URL). ``KUMIKO_REDIS_URL`` and
``KUMIKO_QUEUE_PREFIX`` point the same way, for runners that read them. Every ``JobRunner`` the
block leaves in its namespace is stopped afterwards. Functions the block defines whose names start
with ``test_`` are called (with ``kumiko_runner`` as the pytest plugin gives it), so a sample test
runs too; modules a block lists in ``pytest_plugins`` must import.

A block that cannot run on its own has a marker on the line just before it::

    <!-- doc-test: setup=NAME[,NAME...] -->   run the named preludes (SETUPS below) first
    <!-- doc-test: compile-only: REASON -->   compile the block only; the reason is required

A marker with an unknown prelude or without its reason, or one that is not right before a python
block, fails. So does a block without a marker that needs a name it does not define.

``OLD_PATHS`` are the paths that moved in issue 26 (docs/upgrading.md), which only
docs/upgrading.md may name.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import re
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from kumiko_dramatiq import Feature, JobContext, JobRunner, Registry
from kumiko_dramatiq.testing import RUNNER_DEFAULTS

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]

#: The README is a front door, not the manual.
README_MAX_LINES = 300

#: Paths that moved in issue 26: docs/upgrading.md names them as what they were; no other page may.
OLD_PATHS = frozenset(
    {
        "kumiko_dramatiq.boot.reset_boot_marker",
        "kumiko_dramatiq.metrics.serving",
        "kumiko_dramatiq.history.RunHistory",
        "kumiko_dramatiq.cli",
        "kumiko_dramatiq.acl",
        "kumiko_dramatiq.ticks.plan_ticks",
        "kumiko_dramatiq.retries.retry_delay_ms",
        "kumiko_dramatiq.apps",
        "kumiko_dramatiq/keys.py",
        "kumiko_dramatiq/connection.py",
        "kumiko_dramatiq/lua/",
        "kumiko_dramatiq/guests.py",
        "kumiko_dramatiq/completed.py",
    }
)
UPGRADING = "docs/upgrading.md"
#: Paths the pages name that are not this repository's.
NOT_OURS = frozenset({"tests/test_redis.py"})  # Dramatiq's own, run by the compatibility suite


# -- reading the pages ------------------------------------------------------------------------

FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})(?P<info>[^`]*)$")
MARKER = re.compile(r"^\s*<!--\s*doc-test:(?P<body>.*?)-->\s*$")
ANY_MARKER = re.compile(r"<!--\s*doc-test", re.IGNORECASE)
CODE_SPAN = re.compile(r"`(?P<code>[^`]+)`")


@dataclass(frozen=True)
class Block:
    """One fenced code block of a page."""

    page: str  # relative to the repository root
    line: int  # the opening fence, 1-based
    language: str
    source: str
    marker: str | None = None  # the body of the doc-test marker right before it

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"


@dataclass(frozen=True)
class Page:
    path: str
    blocks: list[Block]
    prose: str  # the page without its fenced blocks
    problems: list[str]


def read_page(path: str, text: str) -> Page:
    """Split a page into fenced blocks and prose, attaching each doc-test marker to its block."""
    lines = text.splitlines()
    blocks: list[Block] = []
    prose: list[str] = []
    problems: list[str] = []
    pending: tuple[int, str] | None = None
    index = 0
    while index < len(lines):
        line = lines[index]
        opening = FENCE.match(line)
        if opening is not None:
            indent, fence = opening["indent"], opening["fence"]
            closing = re.compile(rf"^[ \t]*{re.escape(fence[0])}{{{len(fence)},}}\s*$")
            end = index + 1
            while end < len(lines) and not closing.match(lines[end]):
                end += 1
            if end == len(lines):
                problems.append(f"{path}:{index + 1}: a code block that is never closed")
            body = [each.removeprefix(indent) for each in lines[index + 1 : end]]
            language = (opening["info"].split() or [""])[0]
            marker = None
            if pending is not None:
                marker = pending[1]
                if language != "python":
                    problems.append(
                        f"{path}:{pending[0]}: a doc-test marker before a non-python block"
                    )
                pending = None
            blocks.append(Block(path, index + 1, language, "\n".join(body) + "\n", marker))
            index = end + 1
            continue
        prose.append(line)
        found = MARKER.match(line)
        if found is not None:
            if pending is not None:
                problems.append(f"{path}:{pending[0]}: a doc-test marker not followed by a block")
            pending = (index + 1, found["body"].strip())
        elif ANY_MARKER.search(CODE_SPAN.sub("", line)):  # a marker quoted as code is prose
            problems.append(f"{path}:{index + 1}: a malformed doc-test marker: {line.strip()}")
        elif line.strip() and pending is not None:
            problems.append(f"{path}:{pending[0]}: a doc-test marker not followed by a block")
            pending = None
        index += 1
    if pending is not None:
        problems.append(f"{path}:{pending[0]}: a doc-test marker not followed by a block")
    return Page(path, blocks, "\n".join(prose), problems)


def _pages() -> list[Page]:
    return [read_page(str(p.relative_to(ROOT)), p.read_text(encoding="utf-8")) for p in PAGES]


PAGES_READ = _pages()
PYTHON_BLOCKS = [
    block for page in PAGES_READ for block in page.blocks if block.language == "python"
]


# -- how a block runs ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Plan:
    setups: tuple[str, ...] = ()
    compile_only: str | None = None  # the reason


def plan_of(marker: str | None) -> Plan:
    """What a block's marker asks for; ``ValueError`` for a marker that is not understood."""
    if marker is None:
        return Plan()
    if marker.startswith("compile-only:"):
        reason = marker.removeprefix("compile-only:").strip()
        if not reason:
            raise ValueError(f"compile-only needs a reason: {marker!r}")
        return Plan(compile_only=reason)
    if marker.startswith("setup="):
        names = tuple(name.strip() for name in marker.removeprefix("setup=").split(","))
        unknown = [name for name in names if name not in SETUPS]
        if unknown:
            raise ValueError(f"no prelude named {unknown} (known: {sorted(SETUPS)})")
        return Plan(setups=names)
    raise ValueError(f"unknown doc-test marker {marker!r}")


@dataclass
class DocEnv:
    """A block's Redis dataset, and what it started there."""

    redis_url: str
    prefix: str
    monkeypatch: pytest.MonkeyPatch
    runners: list[JobRunner] = field(default_factory=list)

    def runner(self, registry: Registry, *, start: bool = False, **options: Any) -> JobRunner:
        settings = {
            **RUNNER_DEFAULTS,
            "redis_url": self.redis_url,
            "queue_prefix": self.prefix,
            **options,
        }
        runner = JobRunner(registry, **settings)
        self.adopt(runner)
        if start:
            runner.start()
        return runner

    def kumiko_runner(self, registry: Registry, **options: Any) -> JobRunner:
        """The pytest plugin's ``kumiko_runner`` fixture: a started runner on this dataset."""
        return self.runner(registry, start=True, **options)

    def adopt(self, runner: JobRunner) -> None:
        if not any(runner is known for known in self.runners):
            self.runners.append(runner)

    def module(self, name: str, **attributes: Any) -> ModuleType:
        """Install module ``name`` until the test ends (as a package: ``import name.sub`` then
        finds a sub-module installed the same way)."""
        module = ModuleType(name)
        module.__path__ = []
        for key, value in attributes.items():
            setattr(module, key, value)
        self.monkeypatch.setitem(sys.modules, name, module)
        parent, _, child = name.rpartition(".")
        if parent:
            setattr(sys.modules[parent], child, module)
        return module


class Redirect(ast.NodeTransformer):
    """Points the Redis URLs of a block at the test Redis, and its queue prefix ``"kumiko"`` at
    the test's own prefix (see the module docstring for where)."""

    def __init__(self, redis_url: str, prefix: str) -> None:
        self.redis_url = redis_url
        self.prefix = prefix

    @staticmethod
    def _is_url(node: ast.expr) -> bool:
        return (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and node.value.startswith("redis://")
        )

    @staticmethod
    def _is_default_prefix(node: ast.expr) -> bool:
        return isinstance(node, ast.Constant) and node.value == "kumiko"

    def visit_Constant(self, node: ast.Constant) -> ast.AST:
        if self._is_url(node):
            return ast.copy_location(ast.Constant(self.redis_url), node)
        return node

    def visit_Call(self, node: ast.Call) -> ast.AST:
        names_url = any(
            self._is_url(arg) for arg in [*node.args, *(k.value for k in node.keywords)]
        )
        self.generic_visit(node)
        if names_url:
            node.args = [
                ast.copy_location(ast.Constant(self.prefix), arg)
                if self._is_default_prefix(arg)
                else arg
                for arg in node.args
            ]
        for keyword in node.keywords:
            if keyword.arg == "queue_prefix" and self._is_default_prefix(keyword.value):
                keyword.value = ast.copy_location(ast.Constant(self.prefix), keyword.value)
        return node


#: Fixtures a sample test may ask for, by parameter name.
FIXTURES: dict[str, Callable[[DocEnv], object]] = {"kumiko_runner": lambda env: env.kumiko_runner}


def run_block(block: Block, env: DocEnv) -> None:
    """Run ``block`` as its marker says; whatever it raises comes through."""
    plan = plan_of(block.marker)
    filename = str(ROOT / block.page)
    tree = ast.parse(block.source, filename=filename)
    ast.increment_lineno(tree, block.line)  # tracebacks name the page's own lines
    if plan.compile_only is not None:
        compile(tree, filename, "exec")
        return
    tree = ast.fix_missing_locations(Redirect(env.redis_url, env.prefix).visit(tree))
    code = compile(tree, filename, "exec")
    # A module of its own, in sys.modules, as a sample runs in a reader's code (freezegun, for
    # one, patches `datetime` only in modules).
    namespace: dict[str, Any] = env.module("doc_sample").__dict__
    for name in plan.setups:
        namespace.update(SETUPS[name](env))
    given = set(namespace)
    try:
        exec(code, namespace)
    finally:
        for value in namespace.values():
            if isinstance(value, JobRunner):
                env.adopt(value)
    for name, value in list(namespace.items()):
        if name.startswith("test_") and name not in given and callable(value):
            _call_test(value, env)
    for plugin in namespace.get("pytest_plugins", ()):
        importlib.import_module(plugin)


def _call_test(test: Callable[..., object], env: DocEnv) -> None:
    wanted = list(inspect.signature(test).parameters)
    unknown = [name for name in wanted if name not in FIXTURES]
    assert not unknown, f"{test.__name__} asks for fixtures the doc test has not: {unknown}"
    test(**{name: FIXTURES[name](env) for name in wanted})


# -- preludes: what a marked block may assume -----------------------------------------------


def _billing(env: DocEnv) -> dict[str, object]:
    """``registry``: the billing example's (examples/billing/app.py); ``payloads``: invoices."""
    from examples.billing.app import registry

    payloads = [{"invoice": f"INV-{n}", "email": "ada@example.com"} for n in range(1, 4)]
    return {"registry": registry, "payloads": payloads}


def _billing_example(env: DocEnv) -> dict[str, object]:
    """What examples/billing/test_billing.py imports: ``pytest``, ``registry``,
    ``MailGatewayError``."""
    from examples.billing.app import MailGatewayError, registry

    return {"pytest": pytest, "registry": registry, "MailGatewayError": MailGatewayError}


def _history(env: DocEnv) -> dict[str, object]:
    """``runner``: a started runner of the billing example after an invoice that failed once and
    was sent on attempt 2; ``message_id``: that invoice's."""
    from examples.billing.app import registry

    runner = env.runner(registry, start=True)
    message_id = runner.dispatch(
        "billing:job:send_invoice",
        {"invoice": "INV-7", "email": "ada@example.com", "gateway_failures": 1},
    )
    assert [run.status for run in runner.drain()] == ["failed", "completed"]
    return {"runner": runner, "message_id": message_id}


def _tenant_history(env: DocEnv) -> dict[str, object]:
    """``runner``: a started runner after two dispatches of a per-tenant
    ``billing:job:send_invoice`` over tenants acme and globex, whose first attempt for acme
    failed once: acme has one failed and two completed runs."""
    billing = Feature("billing")

    @billing.job("send_invoice", per_tenant=True, retries=1)
    def send_invoice(payload: dict[str, Any], ctx: JobContext) -> None:
        if payload.get("fail_for") == ctx.tenant_id and ctx.attempt == 1:
            raise RuntimeError("gateway down")

    runner = env.runner(
        Registry([billing]), start=True, get_active_tenant_ids=lambda: ["acme", "globex"]
    )
    runner.dispatch("billing:job:send_invoice", {"fail_for": "acme"})
    runner.dispatch("billing:job:send_invoice", {})
    statuses = sorted(run.status for run in runner.drain() if run.tenant_id == "acme")
    assert statuses == ["completed", "completed", "failed"]
    return {"runner": runner}


def _myapp(env: DocEnv) -> dict[str, object]:
    """The reader's own package, ``myapp``: ``myapp.jobs`` holds the billing example's
    ``registry`` and a ``runner`` of it (not started); ``myapp.tasks`` (their plain Dramatiq
    actors) is empty here."""
    from examples.billing.app import registry

    env.module("myapp")
    env.module("myapp.tasks")
    env.module("myapp.jobs", registry=registry, runner=env.runner(registry))
    return {}


def _fastapi(env: DocEnv) -> dict[str, object]:
    """FastAPI is no dependency of kumiko_dramatiq. Its app class is a Starlette subclass whose
    ``mount`` is Starlette's, so where FastAPI is not installed, ``fastapi.FastAPI`` is
    Starlette itself."""
    if importlib.util.find_spec("fastapi") is None:
        from starlette.applications import Starlette

        env.module("fastapi", FastAPI=Starlette)
    return {}


SETUPS: dict[str, Callable[[DocEnv], dict[str, object]]] = {
    "billing": _billing,
    "billing_example": _billing_example,
    "history": _history,
    "tenant_history": _tenant_history,
    "myapp": _myapp,
    "fastapi": _fastapi,
}


@pytest.fixture
def env(redis_url: str, prefix: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[DocEnv]:
    monkeypatch.setenv("KUMIKO_REDIS_URL", redis_url)
    monkeypatch.setenv("KUMIKO_QUEUE_PREFIX", prefix)
    doc_env = DocEnv(redis_url, prefix, monkeypatch)
    yield doc_env
    for runner in reversed(doc_env.runners):
        runner.stop(timeout_s=10)


# -- the samples ----------------------------------------------------------------------------


@pytest.mark.parametrize("block", PYTHON_BLOCKS, ids=[block.id for block in PYTHON_BLOCKS])
def test_the_sample_runs(block: Block, env: DocEnv) -> None:
    run_block(block, env)


@pytest.mark.parametrize("page", PAGES_READ, ids=[page.path for page in PAGES_READ])
def test_every_marker_is_well_formed_and_right_before_a_python_block(page: Page) -> None:
    problems = list(page.problems)
    for block in page.blocks:
        try:
            plan_of(block.marker)
        except ValueError as exc:
            problems.append(f"{block.id}: {exc}")
    assert problems == []


# -- links and paths --------------------------------------------------------------------------

LINK = re.compile(r"!?\[[^\]]*\]\((?P<target>[^)\s]+)\)")
HEADING = re.compile(r"^#{1,6}\s+(?P<title>.+?)\s*#*\s*$", re.MULTILINE)
DOTTED = re.compile(r"(?<![\w.])kumiko_dramatiq(?:\.[A-Za-z_]\w*)+")
FILE = re.compile(r"(?<![\w./$-])(?:kumiko_dramatiq|tests|examples|benchmarks|docs|\.ci)/[\w./-]*")
RUN_MODULE = re.compile(r"-m\s+(?P<module>[A-Za-z_][\w.]*)")
SHELL = frozenset({"bash", "sh", "shell", "console"})


def anchors(prose: str) -> set[str]:
    """The anchors GitHub gives a page's headings."""
    found: set[str] = set()
    seen: dict[str, int] = {}
    for heading in HEADING.finditer(prose):
        slug = re.sub(r"[^\w\- ]", "", heading["title"].strip().lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        found.add(slug if count == 0 else f"{slug}-{count}")
    return found


def _page(path: str) -> Page:
    return next(page for page in PAGES_READ if page.path == path)


def links(page: Page) -> list[str]:
    return [found["target"] for found in LINK.finditer(page.prose)]


@pytest.mark.parametrize("page", PAGES_READ, ids=[page.path for page in PAGES_READ])
def test_every_relative_link_resolves(page: Page) -> None:
    broken = []
    for target in links(page):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
            continue
        path, _, fragment = target.partition("#")
        resolved = (ROOT / page.path).parent / path if path else ROOT / page.path
        if not resolved.exists():
            broken.append(f"{target}: no such file")
        elif fragment and resolved.suffix == ".md":
            linked = read_page(str(resolved), resolved.read_text(encoding="utf-8"))
            if fragment not in anchors(linked.prose):
                broken.append(f"{target}: no heading #{fragment}")
    assert broken == []


def test_the_readme_links_every_docs_page() -> None:
    linked = {
        (ROOT / target.partition("#")[0]).resolve()
        for target in links(_page("README.md"))
        if target.partition("#")[0]
    }
    unlinked = [str(p.relative_to(ROOT)) for p in PAGES[1:] if p.resolve() not in linked]
    assert unlinked == []


def test_the_readme_is_a_front_door() -> None:
    lines = README.read_text(encoding="utf-8").count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines: move the manual into docs/"


def named_paths(page: Page) -> set[str]:
    """Module paths, attribute paths and files the page names in code spans and shell blocks."""
    texts = [found["code"] for found in CODE_SPAN.finditer(page.prose)]
    texts += [block.source for block in page.blocks if block.language in SHELL]
    names: set[str] = set()
    for text in texts:
        names.update(DOTTED.findall(text))
        names.update(found.rstrip(".") for found in FILE.findall(text))
        names.update(found["module"] for found in RUN_MODULE.finditer(text))
    return names


def resolves(name: str) -> bool:
    """Whether ``name`` is a file of the repository, or a module with attributes that exists
    (without importing a module that is named whole: ``kumiko_dramatiq.app`` runs on import)."""
    if "/" in name:
        return (ROOT / name).exists()
    parts = name.split(".")
    module, index = parts[0], 1
    if importlib.util.find_spec(module) is None:
        return False
    while index < len(parts):
        spec = importlib.util.find_spec(f"{module}.{parts[index]}")
        if spec is None:
            break
        module, index = f"{module}.{parts[index]}", index + 1
        if spec.submodule_search_locations is None:
            break
    value: object = importlib.import_module(module) if index < len(parts) else None
    for attribute in parts[index:]:
        if not hasattr(value, attribute):
            return False
        value = getattr(value, attribute)
    return True


@pytest.mark.parametrize("page", PAGES_READ, ids=[page.path for page in PAGES_READ])
def test_every_path_a_page_names_exists(page: Page) -> None:
    names = named_paths(page) - NOT_OURS
    moved = sorted(names & OLD_PATHS)
    if page.path != UPGRADING:
        assert moved == [], f"{page.path} names paths that moved (see {UPGRADING})"
    missing = sorted(name for name in names - OLD_PATHS if not resolves(name))
    assert missing == []


# -- the harness itself can fail --------------------------------------------------------------


def _block(source: str, marker: str | None = None) -> Block:
    return Block("docs/example.md", 10, "python", source, marker)


def test_a_sample_that_raises_fails(env: DocEnv) -> None:
    with pytest.raises(RuntimeError, match="boom"):
        run_block(_block("raise RuntimeError('boom')\n"), env)


def test_a_sample_that_needs_a_name_it_does_not_define_fails(env: DocEnv) -> None:
    with pytest.raises(NameError, match="runner"):
        run_block(_block("runner.dispatch('billing:job:send_invoice')\n"), env)


def test_a_failing_sample_test_fails(env: DocEnv) -> None:
    with pytest.raises(AssertionError, match="sample"):
        run_block(_block("def test_it():\n    assert False, 'sample'\n"), env)


def test_a_compile_only_block_must_still_compile(env: DocEnv) -> None:
    with pytest.raises(SyntaxError):
        run_block(_block("def broken(:\n", "compile-only: needs a running Sentinel"), env)


@pytest.mark.parametrize(
    ("marker", "error"),
    [
        ("compile-only:", "needs a reason"),
        ("setup=billing,nowhere", "no prelude named"),
        ("skip", "unknown doc-test marker"),
    ],
)
def test_a_marker_that_is_not_understood_fails(marker: str, error: str) -> None:
    with pytest.raises(ValueError, match=error):
        plan_of(marker)


def test_a_marker_must_stand_right_before_a_python_block() -> None:
    page = read_page(
        "docs/example.md",
        "<!-- doc-test: setup=billing -->\nSome prose.\n\n<!-- doc-test: setup=billing -->\n"
        "```bash\nls\n```\n<!-- doc-test setup=billing -->\n",
    )
    assert page.problems == [
        "docs/example.md:1: a doc-test marker not followed by a block",
        "docs/example.md:4: a doc-test marker before a non-python block",
        "docs/example.md:8: a malformed doc-test marker: <!-- doc-test setup=billing -->",
    ]


def test_a_block_is_pointed_at_the_test_dataset() -> None:
    source = (
        'reset("redis://host:6379/0", "kumiko", "ops:job:warm")\n'
        'JobRunner(r, redis_url="redis://127.0.0.1:6379/0", queue_prefix="kumiko")\n'
        'acl.setuser("kumiko", "orders")\n'
    )
    tree = Redirect("redis://test:1/13", "t_private").visit(ast.parse(source))
    assert ast.unparse(tree).splitlines() == [
        "reset('redis://test:1/13', 't_private', 'ops:job:warm')",
        "JobRunner(r, redis_url='redis://test:1/13', queue_prefix='t_private')",
        "acl.setuser('kumiko', 'orders')",
    ]


def test_the_printed_acl_rules_are_what_acl_setuser_prints() -> None:
    # the ACL example in docs/deploying.md is output, not prose: a command a new script runs
    # and the page does not list would be refused to a user who copied it
    from kumiko_dramatiq.broker import acl

    page = (ROOT / "docs" / "deploying.md").read_text(encoding="utf-8")
    printed = re.search(r"```text\n(ACL SETUSER kumiko .*?)```", page, re.DOTALL)
    assert printed is not None, "docs/deploying.md has no printed ACL SETUSER block"
    assert printed.group(1).split() == acl.setuser("kumiko", "orders").split()
