"""The hot path's function library (kumiko_dramatiq/broker/lua/__init__.py, ``library``): how it
is built from the same files as the scripts, and what it refuses."""

from __future__ import annotations

import re

import pytest

from kumiko_dramatiq.broker.lua import FUNCTIONS, Library, _pieces, _read, library

_REGION = re.compile(r"^-- @per-call\n.*?^-- @end per-call\n", re.MULTILINE | re.DOTALL)


def test_the_library_holds_one_function_per_hot_script_named_after_its_code() -> None:
    lib = library()
    assert re.fullmatch(r"kumikofn_[0-9a-f]{12}", lib.name)
    assert lib.code.startswith(f"#!lua name={lib.name}\n")
    assert lib.functions == {name: f"{lib.name}_{name}" for name in FUNCTIONS}


def test_state_a_call_starts_afresh_sits_in_a_per_call_region() -> None:
    # a library's variables outlive a call: an empty table made at the top of an include (a
    # cache, a batch being gathered) must be made again by every call
    for piece in {p for name in FUNCTIONS for p in _pieces(name, _read)}:
        outside = _REGION.sub("", _read(piece))
        assert not re.findall(r"^local [\w, ]+ = \{\}", outside, re.MULTILINE), piece


def fake(files: dict[str, str]) -> Library:
    return library(("main",), files.__getitem__)


def test_a_per_call_region_holds_only_local_statements_with_values() -> None:
    files = {
        "main": "-- @include a\nreturn 1\n",
        "include/a": "-- @per-call\nlocal function f() end\n-- @end per-call\n",
    }
    with pytest.raises(ValueError, match="include/a: a per-call region holds only"):
        fake(files)


def test_two_includes_that_declare_one_name_are_refused() -> None:
    files = {
        "main": "-- @include a\n-- @include b\nreturn 1\n",
        "include/a": "local x = 1\n",
        "include/b": "local function x() end\n",
    }
    with pytest.raises(ValueError, match="include/b and include/a both declare x"):
        fake(files)


def test_a_per_call_region_becomes_a_function_each_call_runs_first() -> None:
    files = {
        "main": "-- @include a\nreturn {now}\n",
        "include/a": "-- @per-call\nlocal now, id = ARGV[1], KEYS[1]\n-- @end per-call\n",
    }
    code = fake(files).code
    assert "local now, id\nlocal function per_call_a_1()\nnow, id = ARGV[1], KEYS[1]\nend\n" in code
    assert "KEYS, ARGV = keys, args\nper_call_a_1()\n-- @include a\nreturn {now}\n" in code
