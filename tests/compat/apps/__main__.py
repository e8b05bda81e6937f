"""Run every example app on Dramatiq's ``RedisBroker`` and on kumiko's broker, and compare.

``python -m tests.compat.apps [APP ...] [--keep]`` (run by ``.ci/run``): for each app (a
module of :mod:`tests.compat.apps`, :data:`APPS`), on a private ``redis-server`` flushed
before each run, ``python -m tests.compat.apps.drive`` runs the app once with the plain
set-up (:mod:`.plain`) and once with kumiko's, set up as docs/dramatiq.md says
(:mod:`.app`), each with ``dramatiq`` CLI workers. It prints a line per app and fails (exit 1)
when an app fails on ``RedisBroker`` (the harness is broken), or when its outcome on kumiko's
broker differs from the plain one in a field :data:`INTENDED_DIFFERENCES` does not name.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis

from examples.redis_server import private_redis
from tests.compat.apps.common import ROOT

#: The apps, each a module of this package (its docstring names the Dramatiq example or
#: feature it stands for). Dramatiq's 13 examples: ``asyncio`` (async_actors), ``basic``,
#: ``composition`` (composition, pickled), ``crawler``, ``issue_351`` (retries),
#: ``long_running`` and ``time_limit`` (limits), ``max_tasks_per_child``, ``persistent``,
#: ``results``, ``scheduling``, ``use_actors_from_different_files`` (split_actors); the 13th,
#: ``callable_broker`` (``dramatiq app:setup_broker``), has no app of its own: on kumiko the
#: ``KUMIKO_APP`` module plays that function's part, as in every app here.
APPS: tuple[str, ...] = (
    "basic",
    "async_actors",
    "results",
    "composition",
    "callbacks",
    "retries",
    "limits",
    "delayed",
    "rate_limits",
    "prometheus",
    "max_tasks_per_child",
    "crawler",
    "scheduling",
    "periodic",
    "persistent",
    "split_actors",
    "pickled",
)

#: Fields of an app's outcome that may differ on kumiko's broker, as ``"app.field"``, with
#: the reason. docs/dramatiq.md points here.
INTENDED_DIFFERENCES: Mapping[str, str] = {}

RUN_TIMEOUT_S = 240


@dataclass(frozen=True)
class Run:
    """One app on one broker: its outcome (JSON values), or the error that ended it."""

    outcome: Any
    error: str | None
    seconds: float
    trace: str = ""


def run_app(app: str, broker: str, url: str, logs: Path) -> Run:
    """Run ``app`` on ``broker`` (``plain`` or ``kumiko``) in a fresh process."""
    redis.Redis.from_url(url).flushdb()  # the harness's own private server
    target = logs / f"{app}-{broker}.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KUMIKO_", "COMPAT_"))}
    env.update(
        PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        # as in an activated venv: the CLI reloads itself (SIGHUP) as `python -m dramatiq`
        PATH=os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]),
        COMPAT_APP=app,
        COMPAT_BROKER=broker,
        COMPAT_REDIS_URL=url,
        COMPAT_OUTCOME=str(target),
        COMPAT_LOGS=str(logs),
        dramatiq_prom_db=str(logs / f"prometheus-{app}-{broker}"),
    )
    if broker == "kumiko":
        env["KUMIKO_APP"] = "tests.compat.apps.app:runner"
    began = time.monotonic()
    with (logs / f"{app}-{broker}-driver.log").open("wb") as output:
        try:
            subprocess.run(
                [sys.executable, "-m", "tests.compat.apps.drive"],
                cwd=ROOT,
                env=env,
                stdout=output,
                stderr=subprocess.STDOUT,
                timeout=RUN_TIMEOUT_S,
                check=False,
            )
        except subprocess.TimeoutExpired:
            return Run(None, f"timed out after {RUN_TIMEOUT_S} s", time.monotonic() - began)
    seconds = time.monotonic() - began
    if not target.exists():
        return Run(None, "the driver wrote no outcome", seconds)
    written = json.loads(target.read_text())
    return Run(written.get("outcome"), written.get("error"), seconds, written.get("trace", ""))


def differences(
    app: str, plain: Any, kumiko: Any, intended: Mapping[str, str] = INTENDED_DIFFERENCES
) -> tuple[list[str], list[str]]:
    """The fields of two outcomes (dicts) that differ: (unintended, intended)."""
    fields = sorted(set(plain) | set(kumiko))
    differing = [f for f in fields if plain.get(f) != kumiko.get(f)]
    return (
        [f for f in differing if f"{app}.{f}" not in intended],
        [f for f in differing if f"{app}.{f}" in intended],
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("apps", nargs="*", help="run only these apps")
    parser.add_argument("--keep", action="store_true", help="keep the logs")
    args = parser.parse_args(argv)
    unknown = [a for a in args.apps if a not in APPS]
    if unknown:
        parser.error(f"unknown apps: {', '.join(unknown)} (known: {', '.join(APPS)})")
    logs = Path(tempfile.mkdtemp(prefix="kumiko-compat-apps-"))
    failures: list[str] = []
    try:
        with private_redis() as url:
            for app in args.apps or APPS:
                failures += compare(app, url, logs)
    finally:
        if args.keep or failures:
            print(f"compat apps: logs kept in {logs}")
        else:
            shutil.rmtree(logs, ignore_errors=True)
    for failure in failures:
        print(f"REGRESSION: {failure}")
    if failures:
        return 1
    print(f"compat apps: {len(args.apps or APPS)} apps behave alike on RedisBroker and kumiko")
    return 0


def compare(app: str, url: str, logs: Path) -> list[str]:
    """Run ``app`` on both brokers, print its line; the failures found."""
    plain = run_app(app, "plain", url, logs)
    kumiko = run_app(app, "kumiko", url, logs)
    timing = f"plain {plain.seconds:.1f} s, kumiko {kumiko.seconds:.1f} s"
    if plain.error is not None:
        print(f"{app}: FAILS ON REDISBROKER ({timing}): {plain.error}\n{plain.trace}")
        return [f"{app} fails on Dramatiq's RedisBroker: {plain.error[:300]}"]
    if kumiko.error is not None:
        print(f"{app}: fails on kumiko ({timing}): {kumiko.error}\n{kumiko.trace}")
        return [f"{app} fails on kumiko's broker: {kumiko.error[:300]}"]
    unintended, intended = differences(app, plain.outcome, kumiko.outcome)
    for field in intended:
        print(f"  intended difference: {app}.{field}: {INTENDED_DIFFERENCES[f'{app}.{field}']}")
    if unintended:
        print(f"{app}: DIFFERS ({timing})")
        for field in unintended:
            print(f"  {field}: plain {plain.outcome.get(field)!r}")
            print(f"  {field}: kumiko {kumiko.outcome.get(field)!r}")
        return [f"{app}: {field} differs" for field in unintended]
    print(f"{app}: same ({timing}): {json.dumps(plain.outcome, sort_keys=True)[:160]}")
    return []


if __name__ == "__main__":
    sys.exit(main())
