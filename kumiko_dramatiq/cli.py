"""The ``kumiko`` command (also ``python -m kumiko_dramatiq.cli``): operator tools.

``kumiko reset-boot JOB_NAME``  forget that boot-once job ``JOB_NAME`` was
                               enqueued, so the next worker start enqueues it
``kumiko reset-boot --all``     the same for every ``run_on_boot`` job of the app

The app and its dataset come from the same variables as the worker
(:mod:`kumiko_dramatiq.environment`): ``KUMIKO_APP``, ``KUMIKO_REDIS_URL``,
``KUMIKO_QUEUE_PREFIX``. One line is printed per job reset. Exit status: 0 on
success, 1 when Redis does not answer, 2 on bad input (one line on stderr).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import NoReturn

from .boot import reset_boot_marker
from .environment import AppLoadError, runner_from_environment
from .errors import RedisUnavailableError

EXIT_OK = 0
EXIT_REDIS = 1
EXIT_USAGE = 2


class _Parser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors are one line on stderr, status 2."""

    def error(self, message: str) -> NoReturn:
        _fail(f"{self.prog}: {message} (see --help)")


def _fail(line: str) -> NoReturn:
    print(line, file=sys.stderr)
    raise SystemExit(EXIT_USAGE)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="kumiko", description="Operator tools for kumiko_dramatiq apps.")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    reset = commands.add_parser(
        "reset-boot",
        help="make the next worker start enqueue a run_on_boot job again",
        description=(
            "Delete the boot marker and id guard of a run_on_boot job in the dataset "
            "named by KUMIKO_REDIS_URL and KUMIKO_QUEUE_PREFIX (app: KUMIKO_APP), so "
            "the next worker start enqueues the job again. Reset only once its "
            "earlier run is over."
        ),
    )
    reset.add_argument("job_name", nargs="?", metavar="JOB_NAME", help="qualified job name")
    reset.add_argument("--all", action="store_true", help="every run_on_boot job of the app")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "reset-boot":
        return _reset_boot(args.job_name, args.all)
    _fail("kumiko: give a command: reset-boot (see --help)")


def _reset_boot(job_name: str | None, every: bool) -> int:
    if (job_name is None) == (not every):
        _fail("kumiko reset-boot: give either JOB_NAME or --all")
    try:
        runner = runner_from_environment()
    except AppLoadError as exc:
        _fail(f"kumiko reset-boot: {exc}")
    try:
        boot_jobs = [
            job.qualified_name for job in runner.registry.jobs.values() if job.options.run_on_boot
        ]
        if every:
            names = boot_jobs
        elif job_name not in runner.registry.jobs:
            _fail(
                f"kumiko reset-boot: unknown job {job_name!r} "
                f"(run_on_boot jobs: {', '.join(boot_jobs) or 'none'})"
            )
        elif job_name not in boot_jobs:
            _fail(f"kumiko reset-boot: job {job_name} is not run_on_boot; it has no boot marker")
        else:
            names = [job_name]
        if not names:
            print(f"no run_on_boot job in {os.environ.get('KUMIKO_APP')}; nothing to reset")
            return EXIT_OK
        prefix = runner.queue_prefix
        for name in names:
            try:
                deleted = reset_boot_marker(runner.broker.client, prefix, name)
            except RedisUnavailableError as exc:
                print(f"kumiko reset-boot: {exc}", file=sys.stderr)
                return EXIT_REDIS
            state = "boot marker deleted" if deleted else "had no boot marker"
            print(f"{name}: {state} (prefix {prefix}); the next worker start enqueues it")
        return EXIT_OK
    finally:
        runner.stop()


if __name__ == "__main__":
    raise SystemExit(main())
