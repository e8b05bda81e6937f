"""The command lines: ``kumiko`` (also ``python -m kumiko_dramatiq.cli``), operator tools,
and ``kumiko-scheduler`` (:func:`scheduler_main`, also ``python -m kumiko_dramatiq.scheduler``).

``kumiko reset-boot JOB_NAME``  forget that boot-once job ``JOB_NAME`` was
                               enqueued, so the next worker start enqueues it
``kumiko reset-boot --all``     the same for every ``run_on_boot`` job of the app

The app and its dataset come from the same variables as the worker
(:mod:`kumiko_dramatiq.apps`): ``KUMIKO_APP``, ``KUMIKO_REDIS_URL``,
``KUMIKO_QUEUE_PREFIX``. One line is printed per job reset. Exit status: 0 on
success, 1 when Redis does not answer, 2 on bad input (one line on stderr).

``kumiko-scheduler`` runs the cron scheduler (:class:`~kumiko_dramatiq.scheduler.Scheduler`)
for the same app until SIGTERM or SIGINT (status 0); a missing or bad ``KUMIKO_APP`` is one
line on stderr and status 2; Redis unreachable at start (within ``boot_redis_timeout_ms``)
is one line and status 1.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
from collections.abc import Sequence
from types import FrameType
from typing import NoReturn

from .apps import load_runner
from .boot import reset_boot_marker
from .environment import app_target
from .errors import AppLoadError, RedisAccessError, RedisUnavailableError
from .scheduler import Scheduler

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
        runner = load_runner()
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
        try:
            runner.check_redis()
        except (RedisUnavailableError, RedisAccessError) as exc:
            print(f"kumiko reset-boot: {exc}", file=sys.stderr)
            return EXIT_REDIS
        if not names:
            print(f"no run_on_boot job in {app_target()}; nothing to reset")
            return EXIT_OK
        prefix = runner.queue_prefix
        for name in names:
            try:
                deleted = reset_boot_marker(runner.broker.client, prefix, name)
            except (RedisUnavailableError, RedisAccessError) as exc:
                print(f"kumiko reset-boot: {exc}", file=sys.stderr)
                return EXIT_REDIS
            state = "boot marker deleted" if deleted else "had no boot marker"
            print(f"{name}: {state} (prefix {prefix}); the next worker start enqueues it")
        return EXIT_OK
    finally:
        runner.stop()


def scheduler_main() -> int:
    """``kumiko-scheduler``: run the scheduler until SIGTERM or SIGINT; return the status."""
    if not logging.getLogger().handlers:
        logging.basicConfig(
            level=logging.INFO,
            stream=sys.stderr,
            format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        )
        logging.getLogger("apscheduler").setLevel(logging.WARNING)
    try:
        runner = load_runner()
    except Exception as exc:  # any failure to load the app is one line, status 2
        print(f"kumiko-scheduler: {_one_line(exc)}", file=sys.stderr)
        return EXIT_USAGE

    stopping = threading.Event()

    def request_stop(signum: int, frame: FrameType | None) -> None:
        stopping.set()

    previous = {sig: signal.signal(sig, request_stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        try:
            runner.check_redis()
        except (RedisUnavailableError, RedisAccessError) as exc:
            print(f"kumiko-scheduler: {_one_line(exc)}", file=sys.stderr)
            return EXIT_REDIS
        scheduler = Scheduler(runner.broker, runner.registry, retention=runner.retention)
        scheduler.start()
        try:
            while not stopping.wait(timeout=3600):
                pass
        finally:
            scheduler.stop()
    finally:
        runner.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return EXIT_OK


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    if isinstance(exc, AppLoadError | RedisUnavailableError | RedisAccessError):
        return text
    return f"{type(exc).__name__}: {text}"


if __name__ == "__main__":
    raise SystemExit(main())
