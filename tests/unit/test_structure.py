"""The package's structure: no import cycles, one seam to Dramatiq's internals, Lua in files."""

from __future__ import annotations

import ast
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

import kumiko_dramatiq
from kumiko_dramatiq.lua import LuaScripts, source

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


def test_only_the_broker_module_imports_dramatiq_brokers() -> None:
    # Everything that depends on Dramatiq's Redis broker lives in kumiko_dramatiq/broker.py,
    # and no module imports a private Dramatiq name.
    importers, private = [], []
    for path in _sources():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module:
                if node.module.startswith("dramatiq.brokers"):
                    importers.append(str(path.relative_to(PACKAGE)))
                if node.module.startswith("dramatiq"):
                    private += [
                        f"{path.relative_to(PACKAGE)}: {alias.name}"
                        for alias in node.names
                        if alias.name.startswith("_")
                    ]
            if isinstance(node, ast.Attribute) and node.attr in {"_dispatch", "_RedisConsumer"}:
                private.append(f"{path.relative_to(PACKAGE)}: {node.attr}")
    assert importers == ["broker.py"]
    assert private == []


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


def test_every_lua_file_is_a_registered_script_or_a_shared_piece() -> None:
    files = {path.stem for path in (PACKAGE / "lua").glob("*.lua")}
    scripts = {name for name in files if not name.startswith("_")}
    assert scripts == set(LuaScripts.names())


@pytest.mark.parametrize("name", LuaScripts.names())
def test_every_script_names_its_keys_and_arguments_in_its_header(name: str) -> None:
    header = (PACKAGE / "lua" / f"{name}.lua").read_text(encoding="utf-8").splitlines()
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
