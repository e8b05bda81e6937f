"""Dramatiq's own tests against kumiko's broker, side by side with Dramatiq's ``RedisBroker``.

``python -m tests.compat.run`` (run by ``.ci/run``):

1. fetches the sdist of the installed Dramatiq with
   ``pip download --no-binary :all: --no-deps dramatiq==<version>`` into a cache directory
   outside the repository (``$KUMIKO_COMPAT_CACHE``, else ``$XDG_CACHE_HOME/kumiko-compat``,
   else ``~/.cache/kumiko-compat``; reused on later runs) and unpacks its ``tests/*.py`` there
   as the package ``dramatiq_tests``, with :mod:`tests.compat.common` as its ``common``
   module (the sdist ships neither ``common.py`` nor ``conftest.py``);
2. starts a private ``redis-server`` (:func:`examples.redis_server.private_redis`);
3. runs :data:`FILES` twice with pytest, first on Dramatiq's ``RedisBroker``, then on the
   broker of ``JobRunner(Registry([]))``, the fixtures coming from :mod:`tests.compat.plugin`
   (``-p``), each test under a timeout of :data:`TEST_TIMEOUT_S`;
4. prints passed/failed per file for each broker, and fails (exit 1) when a test that passes
   on ``RedisBroker`` does not pass on kumiko's broker (after :data:`RERUNS` reruns, for
   Dramatiq's timing-sensitive tests), unless :data:`INTENDED_DIFFERENCES` names it with
   the reason. Nothing of Dramatiq's is copied into the repository.

The tests in :data:`SLOW` are left out unless ``--full`` (CI time); ``--keep`` keeps the
pytest logs and JUnit reports; naming files runs only those.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import xml.etree.ElementTree as ET
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from examples.redis_server import private_redis

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = "dramatiq_tests"

#: Dramatiq's test_redis.py and its generic tests, which run on a Redis broker here: the
#: files whose fixtures are brokers, workers and result/rate-limit backends (not the CLI,
#: RabbitMQ, the stub broker's own API or the rate limiters alone).
FILES: tuple[str, ...] = (
    "test_redis.py",
    "test_actors.py",
    "test_broker.py",
    "test_callbacks.py",
    "test_composition.py",
    "test_encoders.py",
    "test_generic_actors.py",
    "test_messages.py",
    "test_results.py",
    "test_worker.py",
)

#: Tests kumiko's broker is MEANT to fail, by id (``file::test[param]``), with the reason. The
#: one place these differences are listed; docs/dramatiq.md points here.
INTENDED_DIFFERENCES: Mapping[str, str] = {
    "test_redis.py::test_redis_requeues_unhandled_delay_messages_on_shutdown": (
        "reads Dramatiq's <queue>.DQ list directly: kumiko keeps delayed messages on a "
        "schedule by due time (dramatiq:<queue>.DQ:schedule), never in a worker's memory, so "
        "there is nothing to put back on shutdown and the list stays empty (docs/upgrading.md)"
    ),
    "test_redis.py::test_redis_join_race_condition": (
        "expects do_qsize to count a delayed message twice while a worker holds it in memory "
        "(its body and the worker's claim on <queue>.DQ): kumiko's workers hold no delayed "
        "message, so the count is 3 where Dramatiq's is 4; the message is counted (join "
        "waits for it) and runs as on RedisBroker"
    ),
}

#: Tests left out unless ``--full``, to keep the suite near three minutes of CI time.
SLOW: Mapping[str, str] = {
    "test_redis.py::test_redis_dead_lettered_messages_are_cleaned_up": (
        "16,000 failing messages, then Dramatiq's maintenance: about 17 s on RedisBroker and "
        "28 s on kumiko's broker (both pass)"
    ),
}

TEST_TIMEOUT_S = 60
RERUNS = 2


@dataclass(frozen=True)
class Outcomes:
    """The outcome of every test of one run, by id: passed, failed, error or skipped."""

    by_test: dict[str, str]
    seconds: float

    def passed(self, test: str) -> bool:
        return self.by_test.get(test) == "passed"

    def count(self, file: str, outcome: str) -> int:
        return sum(
            1
            for test, seen in self.by_test.items()
            if test.startswith(file + "::")
            and (seen == outcome or (outcome == "failed" and seen == "error"))
        )


def cache_dir() -> Path:
    explicit = os.environ.get("KUMIKO_COMPAT_CACHE")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "kumiko-compat"


def fetch_suite(version: str, cache: Path) -> Path:
    """The directory holding ``dramatiq_tests/`` for Dramatiq ``version`` (fetched once)."""
    suite = cache / f"dramatiq-{version}"
    tests = suite / PACKAGE
    if not (tests / "test_redis.py").exists():
        cache.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=cache) as scratch:
            subprocess.run(
                [
                    *(sys.executable, "-m", "pip", "download", "--quiet", "--no-binary"),
                    *(":all:", "--no-deps", f"dramatiq=={version}", "-d", scratch),
                ],
                check=True,
            )
            (sdist,) = Path(scratch).glob("dramatiq-*.tar.gz")
            unpacked = Path(scratch) / PACKAGE
            unpacked.mkdir()
            with tarfile.open(sdist) as archive:
                for member in archive.getmembers():
                    parts = Path(member.name).parts
                    if member.isfile() and parts[1:2] == ("tests",) and len(parts) == 3:
                        source = archive.extractfile(member)
                        assert source is not None
                        (unpacked / parts[2]).write_bytes(source.read())
            suite.mkdir(exist_ok=True)
            shutil.rmtree(tests, ignore_errors=True)
            unpacked.rename(tests)
    (tests / "__init__.py").write_text("")
    shutil.copyfile(Path(__file__).with_name("common.py"), tests / "common.py")
    (suite / "pytest.ini").write_text("[pytest]\n")
    return suite


def run_suite(
    kind: str,
    redis_url: str,
    suite: Path,
    tests: Sequence[str],
    work: Path,
    label: str,
    deselect: Iterable[str] = (),
) -> Outcomes:
    """Run ``tests`` (paths or node ids under ``dramatiq_tests/``) on broker ``kind``."""
    junit = work / f"{label}.xml"
    log = work / f"{label}.log"
    env = {
        **os.environ,
        "KUMIKO_COMPAT_BROKER": kind,
        "KUMIKO_COMPAT_REDIS_URL": redis_url,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    began = time.monotonic()
    with log.open("w") as output:
        done = subprocess.run(
            [
                *(sys.executable, "-m", "pytest", "-q", "-p", "tests.compat.plugin"),
                *("-p", "no:cacheprovider", "-c", str(suite / "pytest.ini")),
                # native tracebacks: pytest's own parse the failing test's source, which
                # CPython 3.11 can refuse after a deep recursion ("AST constructor recursion
                # depth mismatch"), an INTERNALERROR that ends the whole run
                "--tb=native",
                "--continue-on-collection-errors",
                *("--rootdir", str(suite), "--timeout", str(TEST_TIMEOUT_S)),
                *(f"--deselect={PACKAGE}/{test}" for test in deselect),
                *("--junitxml", str(junit), *(f"{PACKAGE}/{test}" for test in tests)),
            ],
            cwd=suite,
            env=env,
            stdout=output,
            stderr=subprocess.STDOUT,
            check=False,
        )
    seconds = time.monotonic() - began
    if done.returncode not in (0, 1) or not junit.exists():  # interrupted, internal error...
        print(log.read_text()[-3000:])
        sys.exit(f"compat: pytest exited with status {done.returncode} on the {label} run")
    return Outcomes(read_junit(junit), seconds)


def read_junit(path: Path) -> dict[str, str]:
    outcomes: dict[str, str] = {}
    for case in ET.parse(path).iter("testcase"):
        module = case.get("classname", "").rpartition(".")[2]
        test = f"{module}.py::{case.get('name')}"
        outcome = "passed"
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome = "failed" if child.tag == "failure" else child.tag
                break
        outcomes[test] = outcome
    return outcomes


def regressions(
    plain: Outcomes, kumiko: Outcomes, intended: Iterable[str] = INTENDED_DIFFERENCES
) -> list[str]:
    """Tests that pass on Dramatiq's broker and not on kumiko's, less the intended ones."""
    allowed = set(intended)
    return sorted(
        test
        for test in plain.by_test
        if plain.passed(test) and not kumiko.passed(test) and test not in allowed
    )


def table(version: str, plain: Outcomes, kumiko: Outcomes) -> str:
    rows = [
        f"Dramatiq {version}'s tests on a private redis-server "
        f"(plain: {plain.seconds:.0f} s, kumiko: {kumiko.seconds:.0f} s)",
        f"{'file':<24}{'tests':>6} | {'plain passed':>12}{'failed':>7} | "
        f"{'kumiko passed':>13}{'failed':>7} | {'intended':>8}",
    ]
    totals: Counter[str] = Counter()
    for file in FILES:
        counts = {
            "tests": sum(1 for test in plain.by_test if test.startswith(file + "::")),
            "plain_passed": plain.count(file, "passed"),
            "plain_failed": plain.count(file, "failed"),
            "kumiko_passed": kumiko.count(file, "passed"),
            "kumiko_failed": kumiko.count(file, "failed"),
            "intended": sum(1 for test in INTENDED_DIFFERENCES if test.startswith(file + "::")),
        }
        totals.update(counts)
        rows.append(_row(file, counts))
    rows.append(_row("total", totals))
    return "\n".join(rows)


def _row(name: str, counts: Mapping[str, int]) -> str:
    return (
        f"{name:<24}{counts['tests']:>6} | {counts['plain_passed']:>12}"
        f"{counts['plain_failed']:>7} | {counts['kumiko_passed']:>13}"
        f"{counts['kumiko_failed']:>7} | {counts['intended']:>8}"
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="*", help="run only these files of the suite")
    parser.add_argument("--keep", action="store_true", help="keep the logs and reports")
    parser.add_argument("--full", action="store_true", help="also run the SLOW tests")
    args = parser.parse_args(argv)
    files = args.files or list(FILES)
    version = importlib.metadata.version("dramatiq")
    suite = fetch_suite(version, cache_dir())
    work = Path(tempfile.mkdtemp(prefix="kumiko-compat-"))
    try:
        with private_redis() as url:
            return compare(version, url, suite, files, work, () if args.full else SLOW)
    finally:
        if args.keep:
            print(f"compat: logs and reports kept in {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


def compare(
    version: str, url: str, suite: Path, files: Sequence[str], work: Path, slow: Iterable[str]
) -> int:
    """Run ``files`` on both brokers, print the table; 1 if kumiko's broker regressed."""
    left_out = list(slow)
    plain = run_suite("plain", url, suite, files, work, "plain", left_out)
    kumiko = run_suite("kumiko", url, suite, files, work, "kumiko", left_out)
    if not plain.by_test:
        print((work / "plain.log").read_text()[-3000:])
        sys.exit("compat: no test ran on Dramatiq's RedisBroker")
    print(table(version, plain, kumiko))
    failing = regressions(plain, kumiko)
    for attempt in range(1, RERUNS + 1):
        if not failing:
            break
        rerun = run_suite("kumiko", url, suite, failing, work, f"rerun{attempt}")
        failing = [test for test in failing if not rerun.passed(test)]
    for test, reason in INTENDED_DIFFERENCES.items():
        shown = kumiko.by_test.get(test, "missing")
        print(f"intended difference: {test} ({shown} on kumiko): {reason}")
    for test in left_out:
        print(f"left out (--full runs it): {test}: {SLOW.get(test, '')}")
    if failing:
        print((work / "kumiko.log").read_text()[-6000:])
        for test in failing:
            print(f"REGRESSION: {test} passes on Dramatiq's RedisBroker, not on kumiko's")
        return 1
    print("compat: kumiko's broker passes every test Dramatiq's RedisBroker passes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
