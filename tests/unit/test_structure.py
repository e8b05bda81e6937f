"""The package's structure: no import cycles, one seam to the hosts' internals, keys in one
module, Lua in files, a light module for declaring jobs."""

from __future__ import annotations

import ast
import pkgutil
import re
import subprocess
import sys
from pathlib import Path

import pytest

import kumiko_dramatiq
from kumiko_dramatiq.broker.lua import LuaScripts, source

PACKAGE = Path(kumiko_dramatiq.__file__).parent
MODULES = [
    "kumiko_dramatiq",
    *sorted(info.name for info in pkgutil.walk_packages([str(PACKAGE)], prefix="kumiko_dramatiq.")),
]
#: Modules imported only for their side effect of running something.
RUN_ON_IMPORT = {"kumiko_dramatiq.app", "kumiko_dramatiq.scheduler.__main__"}


def _sources() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def test_every_module_imports_alone_in_a_fresh_interpreter() -> None:
    # Given each module on its own, first in a new process (so no other module of the
    # package was imported before it), When it is imported, Then it imports: an import
    # cycle shows up as an ImportError for the module that closes the cycle.
    modules = [name for name in MODULES if name not in RUN_ON_IMPORT]
    script = "import importlib, sys\nname = sys.argv[1]\nimportlib.import_module(name)\n"
    failures = []
    for name in modules:
        done = subprocess.run(
            [sys.executable, "-c", script, name], capture_output=True, text=True, check=False
        )
        if done.returncode != 0:
            failures.append(f"{name}: {done.stderr.strip().splitlines()[-1]}")
    assert failures == []


def test_no_module_imports_inside_a_function() -> None:
    # A function-level import is how an import cycle hides; there are none.
    offenders = []
    for path in _sources():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                for inner in ast.walk(node):
                    if isinstance(inner, ast.Import | ast.ImportFrom):
                        offenders.append(f"{path.relative_to(PACKAGE)}:{inner.lineno}")
    assert offenders == []


#: Names of Dramatiq's and redis-py's internals kumiko leans on: only the seam touches them.
INTERNAL_ATTRIBUTES = {
    "consumer_whitelist",  # Worker's queues
    "manager",  # TimeLimit's timer
    "__rsub__",  # the actor-options check of dramatiq.actor
    "_dispatch",
    "_RedisConsumer",
}
SEAM = "broker/seam.py"


def _private_uses(path: Path) -> list[str]:
    """Where ``path`` imports a private name or module of Dramatiq or redis-py, or touches an
    attribute of :data:`INTERNAL_ATTRIBUTES`."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module:
            root = node.module.split(".")[0]
            if root in ("dramatiq", "redis"):
                if any(part.startswith("_") for part in node.module.split(".")):
                    found.append(f"{node.lineno}: from {node.module}")
                found += [
                    f"{node.lineno}: {alias.name}"
                    for alias in node.names
                    if alias.name.startswith("_")
                ]
        if isinstance(node, ast.Attribute) and node.attr in INTERNAL_ATTRIBUTES:
            found.append(f"{node.lineno}: .{node.attr}")
        if isinstance(node, ast.FunctionDef) and node.name in INTERNAL_ATTRIBUTES:
            found.append(f"{node.lineno}: def {node.name}")
    return found


def test_only_the_seam_touches_dramatiqs_or_redis_pys_internals() -> None:
    offenders = {}
    for path in _sources():
        relative = str(path.relative_to(PACKAGE))
        if relative != SEAM and (uses := _private_uses(path)):
            offenders[relative] = uses
    assert offenders == {}
    # and the seam does: the structure test would otherwise pass on a seam that moved
    assert _private_uses(PACKAGE / SEAM)


def test_only_the_broker_imports_dramatiqs_redis_broker() -> None:
    importers = []
    for path in _sources():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
                "dramatiq.brokers"
            ):
                importers.append(str(path.relative_to(PACKAGE)))
    assert importers == ["broker/broker.py"]


#: Literal pieces of a Redis key: kumiko's and Dramatiq's namespaces, Dramatiq's suffixes and
#: every segment ``broker/keys.py`` builds kumiko's keys with.
KEY_PIECES = re.compile(
    r"kumiko:|dramatiq:|\.msgs|\.XQ|\.DQ|__acks__|__heartbeats__|"
    r"(?<![\w-])(?:sent|enqueued|boot|lock|locks|dedup|dedupidx|done|cron|inflight|suspects|"
    r"probe|cancel|paused|parked|parked-withdrawn|withdrawn|proc|procs|run|runs|dead|bell|"
    r"tenant|status|job|origin|progress):"
)


def test_only_the_keys_module_spells_a_redis_key() -> None:
    # Every key is built by one function of broker/keys.py; an f-string (or a plain string)
    # holding a piece of a key anywhere else is a key spelled by hand.
    spellers = []
    for path in _sources():
        relative = str(path.relative_to(PACKAGE))
        if relative == "broker/keys.py":
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        docstrings = {
            id(node.body[0].value)
            for node in ast.walk(tree)
            if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
            and node.body
            and isinstance(node.body[0], ast.Expr)
            and isinstance(node.body[0].value, ast.Constant)
        }
        for node in ast.walk(tree):
            if isinstance(node, ast.JoinedStr):
                text = "".join(
                    str(v.value) if isinstance(v, ast.Constant) else "{}" for v in node.values
                )
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                if id(node) in docstrings or " " in node.value:
                    continue
                text = node.value
            else:
                continue
            if " " not in text and KEY_PIECES.search(text):
                spellers.append(f"{relative}:{node.lineno}: {text}")
    # job names are "feature:job:name" (not keys), built in one place
    assert [s for s in spellers if not s.startswith("registry.py:")] == []


def test_declaring_jobs_loads_neither_redis_py_nor_the_broker() -> None:
    # An app module that only declares jobs (a web app importing it, a unit test) stays light
    script = (
        "import sys\n"
        "from kumiko_dramatiq import Backoff, Cron, Event, Feature, JobContext, Registry\n"
        "billing = Feature('billing')\n"
        "@billing.job('send', retries=2, backoff=Backoff('fixed', delay_ms=10))\n"
        "def send(payload: dict, ctx: JobContext) -> None: ...\n"
        "@billing.job('nightly', trigger=Cron('0 2 * * *'))\n"
        "def nightly(payload: dict, ctx: JobContext) -> None: ...\n"
        "Registry([billing])\n"
        "loaded = sorted(m for m in sys.modules if m == 'redis' or m.startswith(\n"
        "    ('redis.', 'kumiko_dramatiq.broker', 'dramatiq.brokers')))\n"
        "print(loaded)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True
    )
    assert done.stdout.strip() == "[]"


def test_only_the_environment_module_reads_the_environment() -> None:
    readers = []
    for path in _sources():
        text = path.read_text(encoding="utf-8")
        if "os.environ" in text or "os.getenv" in text:
            readers.append(str(path.relative_to(PACKAGE)))
    assert readers == ["environment.py"]


def test_only_the_codec_spells_a_kumiko_message_option() -> None:
    spellers = []
    for path in _sources():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Constant)
                and isinstance(node.value, str)
                and node.value.startswith("kumiko_")
                and not node.value.startswith("kumiko_dramatiq")
                and " " not in node.value
            ):
                spellers.append(f"{path.relative_to(PACKAGE)}: {node.value}")
    assert {entry.split(":")[0] for entry in spellers} == {"codec.py"}


LUA = PACKAGE / "broker" / "lua"


def test_every_lua_file_is_a_registered_script_or_a_shared_piece() -> None:
    scripts = {path.stem for path in LUA.glob("*.lua")}
    assert scripts == set(LuaScripts.names())
    pieces = {path.stem for path in (LUA / "include").glob("*.lua")}
    included = {
        piece
        for name in LuaScripts.names()
        for piece in re.findall(r"^-- @include ([a-z_]+)", source(name), re.MULTILINE)
    }
    assert pieces == included


@pytest.mark.parametrize("name", LuaScripts.names())
def test_every_script_names_its_keys_and_arguments_in_its_header(name: str) -> None:
    header = (LUA / f"{name}.lua").read_text(encoding="utf-8").splitlines()
    assert header[0].startswith(f"-- {name}: ")
    comments = "\n".join(line for line in header if line.startswith("--"))
    assert "KEYS[" in comments
    assert "ARGV[" in comments
    assert "Returns" in comments


def test_an_include_is_pasted_once_before_the_script() -> None:
    # guarded includes enqueue; a script including both gets each once.
    text = source("guarded_enqueue")
    assert text.count("local function enqueue_message") == 1
    assert text.count("local function enqueue_unless_guarded") == 1
    assert text.index("enqueue_message(") < text.index("enqueue_unless_guarded(")
