"""The command lines: ``kumiko`` (also ``python -m kumiko_dramatiq.ops.cli``), the operator's
tool, and ``kumiko-scheduler`` (:func:`scheduler_main`, also ``python -m
kumiko_dramatiq.scheduler``).

``kumiko`` commands (every one takes ``--json``: one JSON document on stdout)::

    status                       per lane: queued, delayed, running, dead, parked; live
                                 workers and schedulers; paused jobs
    jobs                         declared jobs: options, lane, next/last cron fire, paused;
                                 each typed job's payload fields (name, type, required)
    runs [--job J] [--status S] [--tenant T] [--message ID] [--origin ID]
         [--since ISO] [--before ISO] [--limit N]       run records, newest first
    dead [--job J] [--limit N]   dead letters with their last error and traceback
    retry MESSAGE_ID | --all [--job J]                  re-enqueue dead letters
    cancel MESSAGE_ID            a message that has not started never starts
    pause JOB / resume JOB       hold a job's messages back / let them run
    locks                        held sequential locks and the runs holding them
    dedup [--job J]              live dedup keys
    reset-boot JOB | --all       the next worker start enqueues a boot-once job again
    dashboard [--host H] [--port P]   serve the web dashboard (needs the dashboard extra;
                                 a non-loopback host needs KUMIKO_DASHBOARD_TOKEN)

The app and its dataset come from ``KUMIKO_APP``, ``KUMIKO_REDIS_URL`` and
``KUMIKO_QUEUE_PREFIX`` (:mod:`kumiko_dramatiq.loader`). Exit status: 0 on success; 1 when Redis
is unreachable (or refuses the user) or the action found nothing to act on (a message that is
not dead for ``retry``, a message no longer waiting for ``cancel``, a job not paused for
``resume``); 2 on bad input (unknown job, malformed id or time). Every error is one line on
stderr. Human output is aligned tables that fit 100 columns.

``kumiko-scheduler`` runs the cron scheduler (:class:`~kumiko_dramatiq.scheduler.Scheduler`)
for the same app until SIGTERM or SIGINT (status 0); a missing or bad ``KUMIKO_APP`` is one
line on stderr and status 2; Redis unreachable at start (within ``boot_redis_timeout_ms``)
is one line and status 1.
"""

from __future__ import annotations

import argparse
import importlib
import ipaddress
import json
import logging
import signal
import sys
import threading
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from types import FrameType
from typing import Any, NoReturn

from kumiko_dramatiq.environment import DASHBOARD_TOKEN, dashboard_token
from kumiko_dramatiq.errors import (
    AppLoadError,
    KumikoError,
    NotFoundError,
    RedisAccessError,
    RedisUnavailableError,
    UnknownJobError,
)
from kumiko_dramatiq.loader import load_runner
from kumiko_dramatiq.middleware.boot import reset_boot_marker
from kumiko_dramatiq.middleware.metrics import serving
from kumiko_dramatiq.ops.history import STATUSES
from kumiko_dramatiq.runner import JobRunner
from kumiko_dramatiq.scheduler import Scheduler

EXIT_OK = 0
EXIT_REDIS = 1
EXIT_NOTHING = 1
EXIT_USAGE = 2
#: Human tables fit this many columns.
WIDTH = 100


class _Parser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors are one line on stderr, status 2."""

    def error(self, message: str) -> NoReturn:
        _fail(f"{self.prog}: {message} (see --help)")


def _fail(line: str, status: int = EXIT_USAGE) -> NoReturn:
    print(" ".join(line.split()), file=sys.stderr)
    raise SystemExit(status)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="kumiko", description="Operator tools for kumiko_dramatiq apps.")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")

    def command(name: str, help_text: str) -> argparse.ArgumentParser:
        sub = commands.add_parser(name, help=help_text, description=help_text)
        sub.add_argument("--json", action="store_true", help="one JSON document on stdout")
        return sub

    command("status", "queues per lane, live workers and schedulers, paused jobs")
    command(
        "jobs", "declared jobs: options, lane, next and last cron fire, paused, payload schemas"
    )
    runs = command("runs", "run records, newest first")
    runs.add_argument("--job", help="qualified job name")
    runs.add_argument("--status", choices=STATUSES)
    runs.add_argument("--tenant")
    runs.add_argument("--message", help="every attempt of one message id")
    runs.add_argument("--origin", help="every run that came of what dispatch returned")
    runs.add_argument("--since", help="ISO-8601 time (UTC when no offset)")
    runs.add_argument("--before", help="ISO-8601 time (UTC when no offset)")
    runs.add_argument("--limit", type=int, default=50)
    dead = command("dead", "dead-lettered messages with their last error")
    dead.add_argument("--job", help="qualified job name")
    dead.add_argument("--limit", type=int, default=100)
    retry = command("retry", "re-enqueue dead letters with a fresh attempt budget")
    retry.add_argument("message_id", nargs="?", metavar="MESSAGE_ID")
    retry.add_argument("--all", action="store_true", help="every dead letter (of --job)")
    retry.add_argument("--job", help="with --all: only this job's")
    cancel = command("cancel", "a queued, delayed or waiting message never starts")
    cancel.add_argument("message_id", metavar="MESSAGE_ID")
    pause = command("pause", "hold a job's messages back on every worker")
    pause.add_argument("job", metavar="JOB")
    resume = command("resume", "let a paused job's messages run again")
    resume.add_argument("job", metavar="JOB")
    command("locks", "held sequential locks")
    dedup = command("dedup", "live dedup keys")
    dedup.add_argument("--job", help="qualified job name")
    reset = command(
        "reset-boot",
        "make the next worker start enqueue a run_on_boot job again (once its earlier run is over)",
    )
    reset.add_argument("job_name", nargs="?", metavar="JOB_NAME", help="qualified job name")
    reset.add_argument("--all", action="store_true", help="every run_on_boot job of the app")
    dashboard = commands.add_parser(
        "dashboard",
        help="serve the web dashboard",
        description="Serve the web dashboard (pip install 'kumiko_dramatiq[dashboard]'). "
        "Actions need KUMIKO_DASHBOARD_TOKEN; without it the dashboard is read-only and "
        "binds only a loopback address.",
    )
    dashboard.add_argument("--host", default="127.0.0.1")
    dashboard.add_argument("--port", type=int, default=8787)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command is None:
        _fail("kumiko: give a command (see --help)")
    if args.command == "dashboard":
        return _dashboard(args)
    handler = _COMMANDS[args.command]
    prog = f"kumiko {args.command}"
    try:
        runner = load_runner()
    except KumikoError as exc:
        _fail(f"{prog}: {exc}")
    try:
        try:
            runner.check_redis()
            document, text, status = handler(runner, args)
        except (RedisUnavailableError, RedisAccessError) as exc:
            _fail(f"{prog}: {exc}", EXIT_REDIS)
        except NotFoundError as exc:
            _fail(f"{prog}: {exc}", EXIT_NOTHING)
        except (UnknownJobError, ValueError) as exc:
            _fail(f"{prog}: {exc}")
    finally:
        runner.stop()
    if args.json:
        print(json.dumps(document, indent=2, sort_keys=True))
    elif text:
        print(text)
    return status


Result = tuple[Any, str, int]


def _status(runner: JobRunner, args: argparse.Namespace) -> Result:
    status = runner.status()
    lanes = table(
        ["lane", "queue", "queued", "delayed", "running", "dead", "parked"],
        [[s.lane, s.queue, s.queued, s.delayed, s.running, s.dead, s.parked] for s in status.lanes],
    )
    procs = table(
        ["role", "host", "pid", "lane", "version", "started", "last seen"],
        [
            [
                p.role,
                p.host,
                p.pid,
                p.lane or "-",
                p.version,
                _time(p.started_at),
                _ago(p.last_seen),
            ]
            for p in [*status.workers, *status.schedulers]
        ],
    )
    paused = ", ".join(status.paused) or "none"
    text = f"{lanes}\n\n{procs or 'no live worker or scheduler'}\n\npaused jobs: {paused}"
    return status.to_json(), text, EXIT_OK


def _jobs(runner: JobRunner, args: argparse.Namespace) -> Result:
    jobs = runner.jobs()
    rows = [
        [
            j.name,
            j.lane,
            j.trigger,
            j.retries,
            j.concurrency,
            _time(j.next_fire),
            _time(j.last_fire),
            "yes" if j.paused else "",
        ]
        for j in jobs
    ]
    text = table(
        ["job", "lane", "trigger", "retries", "concurrency", "next fire", "last fire", "paused"],
        rows,
    )
    fields = []
    for j in jobs:
        if j.payload_model is None:
            continue
        if not j.payload_schema:
            fields.append([j.name, j.payload_model, "(no JSON schema)", "", ""])
        for n, f in enumerate(j.payload_schema or ()):
            first = n == 0
            fields.append(
                [
                    j.name if first else "",
                    j.payload_model if first else "",
                    f.name,
                    f.type,
                    "yes" if f.required else "no",
                ]
            )
    if fields:
        payloads = table(["typed job", "payload model", "field", "type", "required"], fields)
        text = f"{text}\n\n{payloads}"
    return {"jobs": [j.to_json() for j in jobs]}, text, EXIT_OK


def _runs(runner: JobRunner, args: argparse.Namespace) -> Result:
    runs = runner.runs(
        args.job,
        status=args.status,
        tenant_id=args.tenant,
        message_id=args.message,
        origin_id=args.origin,
        since=_instant("--since", args.since),
        before=_instant("--before", args.before),
        limit=args.limit,
    )
    rows = [
        [
            _time(r.ended_at or r.started_at),
            r.job_name,
            r.message_id[:8],
            r.tenant_id or "",
            r.trigger,
            f"{r.attempt}/{r.max_attempts}",
            r.status,
            "" if r.duration_ms is None else f"{r.duration_ms} ms",
            r.error_type or "",
        ]
        for r in runs
    ]
    text = table(
        ["when", "job", "message", "tenant", "trigger", "att.", "status", "took", "error"],
        rows,
        keep=("when", "message", "att.", "status", "took"),
    )
    return {"runs": [r.to_json() for r in runs]}, text or "no run matches", EXIT_OK


def _dead(runner: JobRunner, args: argparse.Namespace) -> Result:
    letters = runner.dead_letters(args.job, limit=args.limit)
    rows = [
        [
            _time(d.dead_at),
            d.job_name,
            d.message_id,
            d.attempts or "",
            f"{d.error_type or ''}: {d.error_message or ''}".strip(": "),
        ]
        for d in letters
    ]
    text = table(
        ["dead since", "job", "message id", "att.", "error"],
        rows,
        keep=("dead since", "message id", "att."),
    )
    return {"dead_letters": [d.to_json() for d in letters]}, text or "no dead letter", EXIT_OK


def _retry(runner: JobRunner, args: argparse.Namespace) -> Result:
    if (args.message_id is None) == (not args.all):
        raise ValueError("give either MESSAGE_ID or --all")
    if args.job is not None and not args.all:
        raise ValueError("--job goes with --all")
    if args.all:
        targets = [d.message_id for d in runner.dead_letters(args.job, limit=1_000_000)]
        if not targets:
            raise NotFoundError("no dead letter to retry")
    else:
        targets = [args.message_id]
    retried = []
    for message_id in targets:
        retried.append({"message_id": message_id, "new_message_id": runner.retry_dead(message_id)})
    text = "\n".join(
        f"{item['message_id']}: re-enqueued as {item['new_message_id']}" for item in retried
    )
    return {"retried": retried}, text, EXIT_OK


def _cancel(runner: JobRunner, args: argparse.Namespace) -> Result:
    cancelled = runner.cancel(args.message_id)
    document = {"message_id": args.message_id, "cancelled": cancelled}
    if not cancelled:
        print(
            f"kumiko cancel: message {args.message_id} is running: not interrupted, nothing "
            "changed",
            file=sys.stderr,
        )
        return {**document, "state": "running"}, "", EXIT_NOTHING
    return {**document, "state": "cancelled"}, f"{args.message_id}: cancelled", EXIT_OK


def _pause(runner: JobRunner, args: argparse.Namespace) -> Result:
    changed = runner.admin.pause(runner.job(args.job))
    text = f"{args.job}: paused" if changed else f"{args.job}: was paused already"
    return {"job": args.job, "paused": True, "changed": changed}, text, EXIT_OK


def _resume(runner: JobRunner, args: argparse.Namespace) -> Result:
    outcome = runner.admin.resume(runner.job(args.job))
    if outcome is None:
        raise NotFoundError(f"job {args.job} is not paused")
    requeued, dropped = outcome
    text = f"{args.job}: resumed; {requeued} held-back message(s) queued, {dropped} skipped"
    document = {"job": args.job, "paused": False, "requeued": requeued, "dropped": dropped}
    return document, text, EXIT_OK


def _locks(runner: JobRunner, args: argparse.Namespace) -> Result:
    locks = runner.locks()
    rows = [
        [
            lock.job_name,
            lock.tenant_id or "",
            lock.message_id[:8],
            (lock.origin_id or "")[:8],
            lock.worker or "",
            f"{lock.expires_in_ms / 1000:.1f} s",
        ]
        for lock in locks
    ]
    text = table(["job", "tenant", "message", "origin", "worker", "expires in"], rows)
    return {"locks": [lock.to_json() for lock in locks]}, text or "no lock held", EXIT_OK


def _dedup(runner: JobRunner, args: argparse.Namespace) -> Result:
    records = runner.dedup_keys(args.job)
    rows = [
        [r.job_name, r.dedup_key, r.message_id[:8], r.state, "yes" if r.follow_up_id else ""]
        for r in records
    ]
    text = table(["job", "key", "message", "state", "follow-up"], rows)
    return {"dedup_keys": [r.to_json() for r in records]}, text or "no live dedup key", EXIT_OK


def _reset_boot(runner: JobRunner, args: argparse.Namespace) -> Result:
    if (args.job_name is None) == (not args.all):
        raise ValueError("give either JOB_NAME or --all")
    boot_jobs = [j.qualified_name for j in runner.registry.jobs.values() if j.options.run_on_boot]
    if args.all:
        names = boot_jobs
    elif args.job_name not in runner.registry.jobs:
        raise UnknownJobError(args.job_name, boot_jobs)
    elif args.job_name not in boot_jobs:
        raise ValueError(f"job {args.job_name} is not run_on_boot; it has no boot marker")
    else:
        names = [args.job_name]
    reset = []
    for name in names:
        deleted = reset_boot_marker(runner.broker.client, runner.queue_prefix, name)
        reset.append({"job": name, "deleted": deleted})
    lines = [
        f"{item['job']}: {'boot marker deleted' if item['deleted'] else 'had no boot marker'} "
        f"(prefix {runner.queue_prefix}); the next worker start enqueues it"
        for item in reset
    ]
    if not names:
        lines = ["no run_on_boot job in this app; nothing to reset"]
    return {"reset": reset}, "\n".join(lines), EXIT_OK


def _dashboard(args: argparse.Namespace) -> int:
    """``kumiko dashboard``: serve until SIGINT or SIGTERM. Refuses (status 2, one line) a
    non-loopback host without a token, and a missing ``dashboard`` extra."""
    prog = "kumiko dashboard"
    try:
        token = dashboard_token()
    except KumikoError as exc:
        _fail(f"{prog}: {exc}")
    if token is None and not is_loopback(args.host):
        _fail(
            f"{prog}: refusing to serve on {args.host} without a token: set "
            f"{DASHBOARD_TOKEN}, or bind a loopback address such as 127.0.0.1"
        )
    if not 0 < args.port < 65536:
        _fail(f"{prog}: --port must be from 1 to 65535, got {args.port}")
    try:
        server = importlib.import_module("kumiko_dramatiq.dashboard.server")
    except ModuleNotFoundError as exc:
        _fail(
            f"{prog}: the dashboard needs its extra: pip install 'kumiko_dramatiq[dashboard]' "
            f"(missing module {(exc.name or '?').split('.')[0]})"
        )
    try:
        runner = load_runner()
    except KumikoError as exc:
        _fail(f"{prog}: {exc}")
    try:
        try:
            runner.check_redis()
        except (RedisUnavailableError, RedisAccessError) as exc:
            _fail(f"{prog}: {exc}", EXIT_REDIS)
        server.serve(runner, host=args.host, port=args.port, token=token)
    finally:
        runner.stop()
    return EXIT_OK


def is_loopback(host: str) -> bool:
    """Whether ``host`` names only this machine: ``localhost`` or a loopback address."""
    if host.strip().lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


_COMMANDS: dict[str, Callable[[JobRunner, argparse.Namespace], Result]] = {
    "status": _status,
    "jobs": _jobs,
    "runs": _runs,
    "dead": _dead,
    "retry": _retry,
    "cancel": _cancel,
    "pause": _pause,
    "resume": _resume,
    "locks": _locks,
    "dedup": _dedup,
    "reset-boot": _reset_boot,
}


def table(
    headers: Sequence[str], rows: Sequence[Sequence[Any]], *, keep: Sequence[str] = ()
) -> str:
    """Rows aligned under ``headers``, every line at most :data:`WIDTH` columns: the widest
    columns not named in ``keep`` (times, ids an operator copies) are cut (with "...")
    until it fits, and the kept ones only if that is not enough. A column empty in every row
    is left out. Empty without rows."""
    if not rows:
        return ""
    cells = [[str(cell) for cell in row] for row in rows]
    shown = [i for i in range(len(headers)) if any(row[i] for row in cells)]
    headers = [headers[i] for i in shown]
    cells = [[row[i] for i in shown] for row in cells]
    widths = [max(len(h), *(len(row[i]) for row in cells)) for i, h in enumerate(headers)]
    cuttable = [i for i, h in enumerate(headers) if h not in keep] or list(range(len(headers)))
    while sum(widths) + 2 * (len(widths) - 1) > WIDTH:
        candidates = [i for i in cuttable if widths[i] > 3] or list(range(len(headers)))
        widest = max(candidates, key=lambda i: widths[i])
        widths[widest] -= 1

    def line(values: Sequence[str]) -> str:
        return "  ".join(_cut(v, w).ljust(w) for v, w in zip(values, widths, strict=True)).rstrip()

    return "\n".join([line(list(headers)), *(line(row) for row in cells)])


def _cut(text: str, width: int) -> str:
    return text if len(text) <= width else text[: max(0, width - 3)] + "..."


def _time(value: datetime | None) -> str:
    return "-" if value is None else value.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S")


def _ago(value: datetime) -> str:
    seconds = (datetime.now(UTC) - value).total_seconds()
    return f"{max(0.0, seconds):.0f} s ago"


def _instant(option: str, text: str | None) -> datetime | None:
    if text is None:
        return None
    try:
        value = datetime.fromisoformat(text)
    except ValueError:
        raise ValueError(f"{option} must be an ISO-8601 time, got {text!r}") from None
    return value if value.tzinfo is not None else value.replace(tzinfo=UTC)


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
        with serving(runner.broker, scheduler=True):  # KUMIKO_METRICS_PORT, if set
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
