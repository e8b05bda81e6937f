"""The command lines: ``kumiko`` (also ``python -m kumiko_dramatiq.ops.cli``), the operator's
tool, and ``kumiko-scheduler`` (:func:`scheduler_main`, also ``python -m
kumiko_dramatiq.scheduler``).

``kumiko`` commands (every one takes ``--json``: one JSON document on stdout)::

    status [--check]             per lane: queued, delayed, running, dead, parked; live
                                 workers and schedulers; paused jobs; problems (--check:
                                 exit 1 when there is any, with one line on stderr)
    jobs                         declared jobs: options, lane, next/last cron fire, paused;
                                 each typed job's payload fields (name, type, required)
    runs [--job J] [--status S] [--tenant T] [--message ID] [--origin ID]
         [--since WHEN] [--before WHEN] [--limit N] [--tracebacks]
                                 run records, newest first
    dead [--job J] [--limit N] [--no-tracebacks]
                                 dead letters with their last error and traceback
    dead --delete MESSAGE_ID     discard one dead letter
    purge JOB [--state queued|delayed|parked|dead] [--yes] [--dry-run]
                                 remove a job's messages in that state (asks first)
    retry MESSAGE_ID | --all [--job J]                  re-enqueue dead letters
    cancel MESSAGE_ID            a message that has not started never starts
    state MESSAGE_ID             queued, delayed, parked, running, completed, dead, cancelled
                                 or unknown
    batches [--state S] [--limit N]  batches and chains, newest first, with their progress
    batch ID                     one batch or chain: state, counts, its ended children
    cancel-batch ID              its children not started never start (on_complete runs)
    schedules                    every schedule, runtime and code-declared, by next fire
    schedule pause|resume|trigger|remove ID
                                 pause or resume its ticks, enqueue one run now, delete it
    result MESSAGE_ID [--wait S] the value its completed run returned (JSON), waiting up to
                                 S seconds for it to end (status 1: not ended, ended without
                                 a value, or none kept)
    queued [--job J] [--state queued|parked|delayed] [--limit N] [--payload] [--cursor C]
                                 waiting messages (payloads only with --payload)
    run-now MESSAGE_ID           queue a delayed or backing-off message now
    stats [--job J] [--hours H]  per job and hour: completed, failed, dead, cancelled,
                                 duration p50 and p95 (kept 7 days)
    busy [--job J]               attempts running now: worker, started, for how long, progress
    stop MESSAGE_ID              ask a running attempt to stop (it ends cancelled)
    pause JOB / resume JOB       hold a job's messages back / let them run
    locks [--limit N]            held sequential locks and capped jobs' slots, and the runs
                                 holding them
    dedup [--job J] [--limit N]  live dedup keys
    reset-boot JOB | --all       the next worker start enqueues a boot-once job again
    dashboard [--host H] [--port P]   serve the web dashboard (needs the dashboard extra;
                                 a non-loopback host needs KUMIKO_DASHBOARD_TOKEN)

The app and its dataset come from ``KUMIKO_APP``, ``KUMIKO_REDIS_URL`` and
``KUMIKO_QUEUE_PREFIX`` (:mod:`kumiko_dramatiq.loader`). Exit status: 0 on success, listings
also when empty; 1 when Redis is unreachable (or refuses the user, or is not Redis) or the
action found nothing to act on (a message that is not dead for ``retry``, a message no
longer waiting for ``cancel``, a job not paused for ``resume``); 2 on bad input (unknown
job, malformed or ambiguous id, a time that does not parse). Every error is one line on
stderr; a closed stdout (``kumiko runs --json | head -1``) ends the command quietly.

Ids are printed whole. A message id argument may be a unique prefix of one (at least 4
characters): it is looked up among the newest 1,000 run records of each status and the
runs in flight (:meth:`~kumiko_dramatiq.ops.admin.Admin.ids_starting_with`); several
matches are bad input naming them, none leaves it as given. Times (``--since``,
``--before``) are ISO-8601 (UTC without an offset) or a span before now: ``30m``, ``1h``,
``2d``, ``1h30m``. Tables count wide (CJK) characters as two columns and cut only free text
(errors, keys, triggers) to fit 100 columns; a listing that stops at its limit says so.

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
import os
import re
import signal
import sys
import textwrap
import threading
from collections.abc import Callable, Iterable, Sequence
from datetime import UTC, datetime, timedelta
from types import FrameType
from typing import Any, Final, NoReturn

import dramatiq
import redis
from pydantic import BaseModel

import kumiko_dramatiq
from kumiko_dramatiq.broker.connection import describe
from kumiko_dramatiq.environment import DASHBOARD_TOKEN, dashboard_token
from kumiko_dramatiq.errors import (
    AppLoadError,
    JobFailedError,
    KumikoError,
    NotFoundError,
    RedisAccessError,
    RedisUnavailableError,
    ResultPending,
    UnknownJobError,
    redact_url,
)
from kumiko_dramatiq.loader import load_runner
from kumiko_dramatiq.middleware.boot import reset_boot_marker
from kumiko_dramatiq.middleware.metrics import serving
from kumiko_dramatiq.ops.admin import COUNT_STATES
from kumiko_dramatiq.ops.history import STATUSES, JobRun
from kumiko_dramatiq.ops.order import LEVELS, waiting_by_priority
from kumiko_dramatiq.ops.status import Status
from kumiko_dramatiq.ops.terminal import indented, parse_when, table, without_frames_of
from kumiko_dramatiq.ops.waiting import WAITING_STATES, QueuedMessage
from kumiko_dramatiq.progress import progress_label
from kumiko_dramatiq.runner import JobRunner
from kumiko_dramatiq.scheduler import Scheduler
from kumiko_dramatiq.schedules.commands import COMMANDS as SCHEDULE_COMMANDS
from kumiko_dramatiq.schedules.commands import add_parsers as add_schedule_parsers
from kumiko_dramatiq.workflows.commands import COMMANDS as WORKFLOW_COMMANDS
from kumiko_dramatiq.workflows.commands import add_parsers as add_workflow_parsers
from kumiko_dramatiq.workflows.results import MAX_RESULT_WAIT_S

EXIT_OK = 0
EXIT_REDIS = 1
EXIT_NOTHING = 1
EXIT_USAGE = 2
#: The states ``kumiko purge --state`` takes.
PURGE_STATES = ("queued", "delayed", "parked", "dead")
#: A whole message id as kumiko makes them (a UUID); anything shorter that could begin one
#: (at least 4 characters) is looked up as a prefix.
FULL_ID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
ID_PREFIX = re.compile(r"[0-9a-f][0-9a-f-]{3,34}")
#: How many candidates an ambiguous prefix names.
SHOWN_CANDIDATES = 5
#: Where the worker's own code lives: its frames are left out of tracebacks shown as text.
WORKER_CODE = tuple(
    os.path.dirname(package.__file__ or "") + os.sep for package in (dramatiq, kumiko_dramatiq)
)


class _Parser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors are one line on stderr, status 2."""

    def error(self, message: str) -> NoReturn:
        _fail(f"{self.prog}: {message} (see --help)")


class AmbiguousIdError(ValueError):
    """A message id prefix that more than one id starts with (bad input: status 2)."""


def _fail(line: str, status: int = EXIT_USAGE) -> NoReturn:
    print(" ".join(line.split()), file=sys.stderr)
    raise SystemExit(status)


def _limit(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
    if not 0 < value <= 1_000:
        raise argparse.ArgumentTypeError(f"must be from 1 to 1000, got {value}")
    return value


def _hours(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
    if not 0 < value <= 168:
        raise argparse.ArgumentTypeError(f"must be from 1 to 168, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="kumiko", description="Operator tools for kumiko_dramatiq apps.")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")

    def command(name: str, help_text: str) -> argparse.ArgumentParser:
        sub = commands.add_parser(name, help=help_text, description=help_text)
        sub.add_argument("--json", action="store_true", help="one JSON document on stdout")
        return sub

    when = "ISO-8601 time (UTC when no offset) or a span before now: 30m, 1h, 2d, 1h30m"
    an_id = "a message id, or a unique prefix of one (at least 4 characters)"
    status = command(
        "status", "queues per lane, live workers and schedulers, paused jobs, problems"
    )
    status.add_argument(
        "--check", action="store_true", help="exit 1 when there is any problem (for a probe)"
    )
    command(
        "jobs", "declared jobs: options, lane, next and last cron fire, paused, payload schemas"
    )
    runs = command("runs", "run records, newest first")
    runs.add_argument("--job", help="qualified job name")
    runs.add_argument("--status", choices=STATUSES)
    runs.add_argument("--tenant")
    runs.add_argument("--message", help=f"every attempt of one message: {an_id}")
    runs.add_argument("--origin", help=f"every run that came of what dispatch returned: {an_id}")
    runs.add_argument("--since", help=when)
    runs.add_argument("--before", help=when)
    runs.add_argument(
        "--cursor",
        metavar="RUN_ID",
        help="the next page: the runs right after this one (the last run_id of the previous "
        "page, as --json prints it) in the order runs are listed",
    )
    runs.add_argument("--limit", type=_limit, default=50, help="at most this many (1-1000)")
    runs.add_argument(
        "--tracebacks",
        action="store_true",
        help="print the traceback of each failed run below the table (the default with "
        "--message and --origin)",
    )
    dead = command("dead", "dead-lettered messages with their last error and traceback")
    dead.add_argument("--job", help="qualified job name")
    dead.add_argument("--limit", type=_limit, default=100, help="at most this many (1-1000)")
    dead.add_argument(
        "--no-tracebacks", action="store_true", help="the table alone, no traceback below it"
    )
    dead.add_argument("--delete", metavar="MESSAGE_ID", help=f"discard this dead letter: {an_id}")
    purge = command(
        "purge", "remove a job's messages in one state (default queued), in bounded steps"
    )
    purge.add_argument("job", metavar="JOB", help="qualified job name")
    purge.add_argument("--state", choices=PURGE_STATES, default="queued")
    purge.add_argument("--yes", action="store_true", help="do not ask for confirmation")
    purge.add_argument("--dry-run", action="store_true", help="print the count, remove nothing")
    retry = command("retry", "re-enqueue dead letters with a fresh attempt budget")
    retry.add_argument("message_id", nargs="?", metavar="MESSAGE_ID", help=an_id)
    retry.add_argument("--all", action="store_true", help="every dead letter (of --job)")
    retry.add_argument("--job", help="with --all: only this job's")
    state = command("state", "where a message is: queued, delayed, parked, running, completed, ...")
    state.add_argument("message_id", metavar="MESSAGE_ID", help=an_id)
    cancel = command("cancel", "a queued, delayed or waiting message never starts")
    cancel.add_argument("message_id", metavar="MESSAGE_ID", help=an_id)
    add_workflow_parsers(command)
    add_schedule_parsers(command)
    result = command("result", "the value a message's completed run returned (keep_result_s)")
    result.add_argument("message_id", metavar="MESSAGE_ID", help=an_id)
    result.add_argument(
        "--wait", type=_wait_s, default=0.0, metavar="S", help="wait up to S seconds (0-86400)"
    )
    queued = command("queued", "waiting messages: queued and parked oldest first, delayed by due")
    queued.add_argument("--job", help="qualified job name")
    queued.add_argument("--state", choices=WAITING_STATES)
    queued.add_argument("--limit", type=_limit, default=50, help="at most this many (1-1000)")
    queued.add_argument("--payload", action="store_true", help="show each message's payload")
    queued.add_argument("--cursor", help="start after this position (printed below a page)")
    run_now = command("run-now", "queue a delayed or backing-off message now")
    run_now.add_argument("message_id", metavar="MESSAGE_ID", help=an_id)
    stats = command("stats", "per job and hour: completed, failed, dead, cancelled, p50, p95")
    stats.add_argument("--job", help="qualified job name")
    stats.add_argument("--hours", type=_hours, default=24, help="how far back (1-168)")
    busy = command(
        "busy", "attempts running now: which worker runs what, for how long, how far it is"
    )
    busy.add_argument("--job", help="qualified job name")
    stop = command("stop", "ask a running attempt to stop: it ends cancelled, is not retried")
    stop.add_argument("message_id", metavar="MESSAGE_ID", help=an_id)
    pause = command("pause", "hold a job's messages back on every worker")
    pause.add_argument("job", metavar="JOB")
    resume = command("resume", "let a paused job's messages run again")
    resume.add_argument("job", metavar="JOB")
    locks = command("locks", "held sequential locks and capped jobs' slots")
    locks.add_argument("--limit", type=_limit, default=100, help="at most this many (1-1000)")
    dedup = command("dedup", "live dedup keys")
    dedup.add_argument("--job", help="qualified job name")
    dedup.add_argument("--limit", type=_limit, default=100, help="at most this many (1-1000)")
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
    """``kumiko``: run one command; return its exit status. A closed stdout ends it quietly
    (status 0: the reader had what it wanted)."""
    try:
        return _main(argv)
    except BrokenPipeError:
        _quiet_stdout()
        return EXIT_OK


def _main(argv: Sequence[str] | None) -> int:
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
        except (NotFoundError, ResultPending, JobFailedError) as exc:
            _fail(f"{prog}: {exc}", EXIT_NOTHING)
        except (UnknownJobError, ValueError) as exc:
            _fail(f"{prog}: {exc}")
        except redis.RedisError as exc:  # a read outside the runner's own error mapping
            _fail(f"{prog}: Redis at {redact_url(runner.redis_url)} failed: {exc}", EXIT_REDIS)
    finally:
        runner.stop()
    if args.json:
        _write(json.dumps(document, indent=2, sort_keys=True))
    elif text:
        _write(text)
    return status


def _write(text: str) -> None:
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


def _quiet_stdout() -> None:
    """After a closed pipe: point stdout at /dev/null, so that the interpreter's own flush
    at exit does not complain about it (Python's documented way)."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass
    finally:
        os.close(devnull)


Result = tuple[Any, str, int]


def resolve_id(runner: JobRunner, given: str) -> str:
    """The message id ``given`` stands for: itself when it is a whole id or cannot begin
    one; else the one id that starts with it (:meth:`Admin.ids_starting_with`). Several:
    :class:`AmbiguousIdError` naming them; none: ``given`` as it is (an unknown id)."""
    if FULL_ID.fullmatch(given) or not ID_PREFIX.fullmatch(given):
        return given
    found = runner.admin.ids_starting_with(given, limit=SHOWN_CANDIDATES + 1)
    if len(found) == 1:
        return found[0]
    if found:
        named = ", ".join(found[:SHOWN_CANDIDATES])
        more = ", ..." if len(found) > SHOWN_CANDIDATES else ""
        raise AmbiguousIdError(
            f"message id prefix {given!r} is ambiguous: {named}{more}; give more characters"
        )
    return given


def _more(shown: int, what: str, how: str) -> str:
    return f"... {shown} {what} shown; more exist ({how})"


def _status(runner: JobRunner, args: argparse.Namespace) -> Result:
    status = runner.status()
    lanes = table(
        ["lane", "queue", "queued", "delayed", "running", "dead", "parked"],
        [[s.lane, s.queue, s.queued, s.delayed, s.running, s.dead, s.parked] for s in status.lanes],
        cuttable=("queue",),  # "<prefix>-<lane>": the lane says it
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
        cuttable=("host", "version"),
    )
    paused = ", ".join(status.paused) or "none"
    text = f"{lanes}\n\n{procs or 'no live worker or scheduler'}\n\npaused jobs: {paused}"
    if status.shards:
        text += "\n\n" + _shards_text(runner, status.shards)
    text += "\n\n" + _problems_text(status.problems)
    code = EXIT_OK
    if args.check and status.problems:
        code = EXIT_NOTHING
        sys.stderr.write(f"kumiko status: {len(status.problems)} problem(s)\n")
    return status.to_json(), text, code


def _shards_text(runner: JobRunner, shards: Sequence[Status]) -> str:
    """Each shard of ``kumiko status``: its queue prefix, where it lives, its counts."""
    rows = []
    for n, (shard, status) in enumerate(zip(runner.shard_runners, shards, strict=True)):
        totals = [sum(getattr(lane, state) for lane in status.lanes) for state in _COUNTED]
        rows.append([n, shard.queue_prefix, describe(shard.broker.client), *totals])
        rows[-1].append(len(status.workers))
    return "shards:\n" + table(
        ["shard", "prefix", "redis", *_COUNTED, "workers"], rows, cuttable=("redis",)
    )


_COUNTED: Final = ("queued", "delayed", "running", "dead", "parked")


def _problems_text(problems: Sequence[str]) -> str:
    """The problems of ``kumiko status``, one line each."""
    if not problems:
        return "problems: none"
    lines = [f"problems ({len(problems)}):"]
    for problem in problems:
        lines += textwrap.wrap(problem, 100, initial_indent="  - ", subsequent_indent="    ")
    return "\n".join(lines)


def _jobs(runner: JobRunner, args: argparse.Namespace) -> Result:
    jobs = runner.jobs()
    counts = runner.job_counts()
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
            *(counts[j.name][state] for state in COUNT_STATES),
        ]
        for j in jobs
    ]
    # never cut: names, triggers and times are what an operator reads here
    text = table(
        [
            "job",
            "lane",
            "trigger",
            "retries",
            "concurrency",
            "next fire",
            "last fire",
            "paused",
            *COUNT_STATES,
        ],
        rows,
    )
    caps = [
        [
            j.name,
            "" if j.max_running is None else f"{j.running_slots}/{j.max_running} running",
            "" if j.max_running_per_key is None else j.max_running_per_key,
            ""
            if j.rate_limit is None
            else f"{j.rate_limit}"
            + ("" if "per tenant" in j.rate_limit else f" ({j.rate_window_starts} in window)"),
            j.cap_waiting,
        ]
        for j in jobs
        if j.max_running is not None or j.rate_limit is not None or j.max_running_per_key
    ]
    if caps:
        text += "\n\n" + table(
            ["capped job", "max running", "per key", "rate limit", "waiting"], caps
        )
    levels = waiting_by_priority(runner.broker.client, runner.queue_prefix)
    used = [level for level in LEVELS if any(counts[level] for counts in levels.values())]
    if any(level != 0 for level in used) or any(j.priority for j in jobs):
        text += "\n\n" + table(
            ["lane", *(f"priority {level}" for level in used)],
            [[lane, *(counts[level] for level in used)] for lane, counts in levels.items()],
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
    document = [{**j.to_json(), "counts": counts[j.name]} for j in jobs]
    waiting = {lane: {str(k): v for k, v in counts.items()} for lane, counts in levels.items()}
    return {"jobs": document, "waiting_by_priority": waiting}, text, EXIT_OK


def _runs(runner: JobRunner, args: argparse.Namespace) -> Result:
    now = datetime.now(UTC)
    message_id = None if args.message is None else resolve_id(runner, args.message)
    origin_id = None if args.origin is None else resolve_id(runner, args.origin)
    since = None if args.since is None else parse_when("--since", args.since, now)
    before: datetime | JobRun | None = None
    if args.before is not None:
        before = parse_when("--before", args.before, now)
    if args.cursor is not None:
        if args.before is not None:
            _fail("kumiko runs: give --cursor or --before, not both")
        message, sep, attempt = args.cursor.rpartition(":")
        if not sep or not attempt.isdigit() or not message:
            _fail(
                "kumiko runs: --cursor must be a run id '<message id>:<attempt>', "
                f"got {args.cursor!r}"
            )
        before = runner.history.find(f"{resolve_id(runner, message)}:{attempt}")
        if before is None:
            raise NotFoundError(f"no run record {args.cursor} (expired, or never written)")
    asked = min(args.limit + 1, 1_000)
    runs = runner.runs(
        args.job,
        status=args.status,
        tenant_id=args.tenant,
        message_id=message_id,
        origin_id=origin_id,
        since=since,
        before=before,
        limit=asked,
    )
    more = len(runs) > args.limit
    runs = runs[: args.limit]
    rows = [
        [
            _time(r.ended_at or r.started_at),
            r.job_name,
            r.message_id,
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
        cuttable=("tenant",),  # the error column holds the error's type: never cut
    )
    if not text:
        text = "no run matches"
    elif more:
        text += "\n" + _more(
            len(runs), "runs", f"next page: --cursor {runs[-1].run_id}, or narrow the filters"
        )
    if args.tracebacks or message_id is not None or origin_id is not None:
        text += _tracebacks(
            (f"{r.message_id} {r.job_name} attempt {r.attempt}", r.traceback) for r in runs
        )
    return {"runs": [r.to_json() for r in runs]}, text, EXIT_OK


def _tracebacks(items: Iterable[tuple[str, str | None]]) -> str:
    """The tracebacks of ``(heading, traceback)`` items, each under its heading, without the
    worker's own frames (Dramatiq's and kumiko's); one the same as an earlier one is named,
    not repeated."""
    blocks: list[str] = []
    first: dict[str, str] = {}
    for heading, traceback in items:
        if not traceback:
            continue
        shown = without_frames_of(traceback, WORKER_CODE)
        if shown in first:
            earlier = first[shown].split()
            same = heading.split()
            while len(earlier) > 2 and same and earlier[0] == same[0]:
                earlier, same = earlier[1:], same[1:]
            blocks.append(f"--- {heading}: the same traceback as {' '.join(earlier)} ---")
            continue
        first[shown] = heading
        blocks.append(f"--- {heading} ---\n{indented(shown)}")
    return "".join("\n\n" + block for block in blocks)


def _dead(runner: JobRunner, args: argparse.Namespace) -> Result:
    if args.delete is not None:
        return _delete_dead(runner, args)
    letters = runner.dead_letters(args.job, limit=args.limit + 1)
    more = len(letters) > args.limit
    letters = letters[: args.limit]
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
        ["dead since", "job", "message id", "att.", "error"], rows, cuttable=("error",), floor=40
    )
    if not text:
        text = "no dead letter"
    elif more:
        text += "\n" + _more(len(letters), "dead letters", "raise --limit, up to 1000")
    if not args.no_tracebacks:
        text += _tracebacks(
            (f"{d.message_id} {d.job_name} (dead since {_time(d.dead_at)})", d.traceback)
            for d in letters
        )
    return {"dead_letters": [d.to_json() for d in letters]}, text, EXIT_OK


def _delete_dead(runner: JobRunner, args: argparse.Namespace) -> Result:
    if args.job is not None:
        raise ValueError("--delete takes no --job")
    message_id = resolve_id(runner, args.delete)
    deleted = runner.delete_dead(message_id)
    document = {"message_id": message_id, "deleted": deleted}
    if not deleted:
        print(
            f"kumiko dead: message {message_id} is not a dead letter, nothing changed",
            file=sys.stderr,
        )
        return document, "", EXIT_NOTHING
    return document, f"{message_id}: dead letter deleted", EXIT_OK


def _purge(runner: JobRunner, args: argparse.Namespace) -> Result:
    runner.job(args.job)
    what = f"{args.state} message(s) of {args.job}"
    if args.dry_run or not args.yes:
        found = runner.purge(args.job, state=args.state, dry_run=True)
        if args.dry_run:
            return {"job": args.job, "state": args.state, "count": found}, str(found), EXIT_OK
        if found == 0:
            return _purged(args, 0)
        if not _confirmed(f"Remove {found} {what}? [y/N] "):
            print("kumiko purge: not confirmed, nothing removed", file=sys.stderr)
            return {"job": args.job, "state": args.state, "purged": 0}, "", EXIT_NOTHING
    return _purged(args, runner.purge(args.job, state=args.state))


def _purged(args: argparse.Namespace, count: int) -> Result:
    document = {"job": args.job, "state": args.state, "purged": count}
    return document, f"{args.job}: {count} {args.state} message(s) removed", EXIT_OK


def _confirmed(question: str) -> bool:
    """Ask on stderr (stdout stays the command's output), read the answer from stdin."""
    sys.stderr.write(question)
    sys.stderr.flush()
    answer = sys.stdin.readline()
    return answer.strip().lower() in ("y", "yes")


def _retry(runner: JobRunner, args: argparse.Namespace) -> Result:
    if (args.message_id is None) == (not args.all):
        raise ValueError("give either MESSAGE_ID or --all")
    if args.job is not None and not args.all:
        raise ValueError("--job goes with --all")
    if args.all:
        if args.job is not None:
            runner.job(args.job)
        pairs = runner.admin.retry_all_dead(args.job)
        if not pairs:
            raise NotFoundError("no dead letter to retry")
        retried = [{"message_id": old, "new_message_id": new} for old, new in pairs]
    else:
        message_id = resolve_id(runner, args.message_id)
        new_id = runner.retry_dead(message_id)
        if new_id is False:
            print(
                f"kumiko retry: message {message_id} is not a dead letter, nothing changed",
                file=sys.stderr,
            )
            return {"message_id": message_id, "retried": False}, "", EXIT_NOTHING
        retried = [{"message_id": message_id, "new_message_id": new_id}]
    text = "\n".join(
        f"{item['message_id']}: re-enqueued as {item['new_message_id']}" for item in retried
    )
    return {"retried": retried}, text, EXIT_OK


def _cancel(runner: JobRunner, args: argparse.Namespace) -> Result:
    message_id = resolve_id(runner, args.message_id)
    cancelled = runner.cancel(message_id)
    document = {"message_id": message_id, "cancelled": cancelled}
    if not cancelled:
        running = runner.admin.waiting_state(message_id) == "running"
        why = "is running: not interrupted" if running else "has ended (or was cancelled)"
        print(f"kumiko cancel: message {message_id} {why}, nothing changed", file=sys.stderr)
        return {**document, "state": "running" if running else "ended"}, "", EXIT_NOTHING
    return {**document, "state": "cancelled"}, f"{message_id}: cancelled", EXIT_OK


def _state(runner: JobRunner, args: argparse.Namespace) -> Result:
    message_id = resolve_id(runner, args.message_id)
    state = runner.job_state(message_id)
    return {"message_id": message_id, "state": state}, state, EXIT_OK


def _result(runner: JobRunner, args: argparse.Namespace) -> Result:
    message_id = resolve_id(runner, args.message_id)
    value = runner.result(message_id, timeout_s=args.wait)
    if isinstance(value, BaseModel):
        value = value.model_dump(mode="json")
    document = {"message_id": message_id, "value": value}
    return document, json.dumps(value, ensure_ascii=False), EXIT_OK


def _wait_s(text: str) -> float:
    try:
        seconds = float(text)
    except ValueError:
        seconds = -1.0
    if not 0 <= seconds <= MAX_RESULT_WAIT_S:
        raise argparse.ArgumentTypeError(f"must be seconds from 0 to {MAX_RESULT_WAIT_S}")
    return seconds


def _queued(runner: JobRunner, args: argparse.Namespace) -> Result:
    after = None
    if args.cursor is not None:
        after = QueuedMessage("", "", None, "", 0, datetime.now(UTC), None, None, args.cursor)
    found = runner.queued(args.job, state=args.state, limit=args.limit + 1, after=after)
    more = len(found) > args.limit
    found = found[: args.limit]
    rows = [
        [
            m.job_name,
            m.message_id,
            m.tenant_id or "",
            m.state,
            m.attempt,
            m.priority,
            m.fair_key or "",
            _time(m.enqueued_at),
            _time(m.due_at) if m.due_at is not None else "",
        ]
        for m in found
    ]
    text = table(
        ["job", "message", "tenant", "state", "att.", "prio.", "fair key", "enqueued", "due"],
        rows,
        cuttable=("tenant", "fair key"),
    )
    document: dict[str, Any] = {
        "queued": [m.to_json(payload=args.payload) for m in found],
        "cursor": found[-1].cursor if more and found else None,
    }
    if not text:
        text = "nothing waits"
    elif more:
        text += "\n" + _more(len(found), "messages", f"--cursor {found[-1].cursor}")
    if args.payload:  # below the table, whole: a payload is never cut
        text += "".join(
            f"\n\n--- {m.message_id} {m.job_name} ---\n"
            + indented(json.dumps(m.payload, indent=2, sort_keys=True))
            for m in found
        )
    return document, text, EXIT_OK


def _stats(runner: JobRunner, args: argparse.Namespace) -> Result:
    if args.job is not None:
        runner.job(args.job)
    rows = runner.stats(args.job, hours=args.hours)
    text = table(
        ["hour (UTC)", "job", "completed", "failed", "dead", "cancelled", "p50", "p95"],
        [
            [
                _time(s.hour),
                s.job_name,
                s.completed,
                s.failed,
                s.dead,
                s.cancelled,
                _ms(s.p50_ms),
                _ms(s.p95_ms),
            ]
            for s in rows
        ],
    )
    document = {
        "stats": [
            {
                "job_name": s.job_name,
                "hour": s.hour.isoformat(),
                **{
                    name: getattr(s, name)
                    for name in ("completed", "failed", "dead", "cancelled", "p50_ms", "p95_ms")
                },
            }
            for s in rows
        ]
    }
    return document, text or "no attempt in that time", EXIT_OK


def _ms(value: int | None) -> str:
    return "-" if value is None else f"{value} ms"


def _run_now(runner: JobRunner, args: argparse.Namespace) -> Result:
    message_id = resolve_id(runner, args.message_id)
    moved = runner.run_now(message_id)
    document = {"message_id": message_id, "queued_now": moved}
    if not moved:
        print(
            f"kumiko run-now: message {message_id} is not delayed, nothing changed", file=sys.stderr
        )
        return document, "", EXIT_NOTHING
    return document, f"{message_id}: queued now", EXIT_OK


def _busy(runner: JobRunner, args: argparse.Namespace) -> Result:
    runs = runner.running(args.job)
    rows = [
        [
            r.job_name,
            r.message_id,
            r.tenant_id or "",
            f"{r.attempt}/{r.max_attempts}",
            r.worker or "-",
            _time(r.started_at),
            "" if r.started_at is None else _span(datetime.now(UTC) - r.started_at),
            progress_label(r.progress, r.progress_note),
        ]
        for r in runs
    ]
    text = table(
        ["job", "message", "tenant", "att.", "worker", "started", "running for", "progress"],
        rows,
        cuttable=("tenant", "progress"),
    )
    return {"running": [r.to_json() for r in runs]}, text or "nothing runs", EXIT_OK


def _stop(runner: JobRunner, args: argparse.Namespace) -> Result:
    message_id = resolve_id(runner, args.message_id)
    asked = runner.stop_run(message_id)
    document = {"message_id": message_id, "stop_requested": asked}
    if not asked:
        print(f"kumiko stop: message {message_id} is not running, nothing changed", file=sys.stderr)
        return document, "", EXIT_NOTHING
    return document, f"{message_id}: stop requested (the attempt ends cancelled)", EXIT_OK


def _span(delta: timedelta) -> str:
    seconds = max(0, int(delta.total_seconds()))
    if seconds < 60:
        return f"{seconds} s"
    minutes, seconds = divmod(seconds, 60)
    if minutes < 60:
        return f"{minutes} min {seconds} s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes} min"


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
    locks = runner.locks(limit=args.limit + 1)
    more = len(locks) > args.limit
    locks = locks[: args.limit]
    rows = [
        [
            lock.job_name,
            lock.tenant_id or "",
            lock.message_id,
            lock.origin_id if lock.origin_id not in (None, lock.message_id) else "",
            (lock.worker or "-") + ("" if lock.worker_alive else " (gone)"),
            _ago(lock.held_since) if lock.held_since is not None else "",
            f"{lock.expires_in_ms / 1000:.1f} s",
            lock.kind,
        ]
        for lock in locks
    ]
    text = table(
        ["job", "tenant", "message", "origin", "worker", "held since", "expires in", "kind"],
        rows,
        cuttable=("tenant",),
    )
    if not text:
        text = "no lock held"
    elif more:
        text += "\n" + _more(len(locks), "locks", "raise --limit, up to 1000")
    return {"locks": [lock.to_json() for lock in locks]}, text, EXIT_OK


def _dedup(runner: JobRunner, args: argparse.Namespace) -> Result:
    if args.job is not None:
        runner.job(args.job)
    records, cursor = runner.admin.dedup_page(args.job, limit=args.limit)
    rows = [[r.job_name, r.dedup_key, r.message_id, r.state, r.follow_up_id or ""] for r in records]
    text = table(
        ["job", "key", "message", "state", "follow-up"], rows, cuttable=("key", "follow-up")
    )
    if not text:
        text = "no live dedup key"
    elif cursor is not None:
        text += "\n" + _more(len(records), "keys", "raise --limit, up to 1000, or give --job")
    return {"dedup_keys": [r.to_json() for r in records]}, text, EXIT_OK


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
    "state": _state,
    "result": _result,
    "purge": _purge,
    "queued": _queued,
    "run-now": _run_now,
    "stats": _stats,
    "busy": _busy,
    "stop": _stop,
    "pause": _pause,
    "resume": _resume,
    "locks": _locks,
    "dedup": _dedup,
    "reset-boot": _reset_boot,
    **WORKFLOW_COMMANDS,
    **SCHEDULE_COMMANDS,
}


def _time(value: datetime | None) -> str:
    return "-" if value is None else value.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S")


def _ago(value: datetime) -> str:
    seconds = (datetime.now(UTC) - value).total_seconds()
    return f"{max(0.0, seconds):.0f} s ago"


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
        schedulers = [  # one per shard: each ticks the cron jobs that live in it
            Scheduler(
                shard.broker,
                shard.registry,
                retention=shard.retention,
                max_payload_bytes=shard.settings.max_payload_bytes,
                shard=(shard.settings.shard, shard.settings.shards),
            )
            for shard in runner.shard_runners
        ]
        with serving(runner.broker, scheduler=True):  # KUMIKO_METRICS_PORT, if set
            for scheduler in schedulers:
                scheduler.start()
            try:
                while not stopping.wait(timeout=3600):
                    pass
            finally:
                for scheduler in schedulers:
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
