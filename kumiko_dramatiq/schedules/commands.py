"""The ``kumiko`` commands of schedules (``kumiko_dramatiq.ops.cli`` adds them)::

    schedules                    every schedule, runtime and code-declared, by next fire
    schedule pause|resume|trigger|remove ID
                                 pause or resume its ticks, enqueue one run now, delete it

Each returns ``(JSON document, text, exit status)`` as every ``kumiko`` command does.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from kumiko_dramatiq.ops.terminal import table

if TYPE_CHECKING:
    from kumiko_dramatiq.runner import JobRunner

Result = tuple[Any, str, int]
Command = Callable[[str, str], argparse.ArgumentParser]
#: What ``kumiko schedule`` does.
ACTIONS = ("pause", "resume", "trigger", "remove")


def add_parsers(command: Command) -> None:
    """Declare the commands on the ``kumiko`` parser (``command(name, help)`` adds one)."""
    command("schedules", "every schedule, runtime and code-declared, by next fire")
    one = command("schedule", "pause or resume a schedule, trigger one run now, or remove it")
    one.add_argument("action", choices=ACTIONS)
    one.add_argument("schedule_id", metavar="ID", help="a schedule id (a cron job's name)")


def _time(value: datetime | None) -> str:
    return "-" if value is None else value.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S")


def _schedules(runner: JobRunner, args: argparse.Namespace) -> Result:
    found = runner.schedules.list()
    rows = [
        [
            s.id,
            s.job_name,
            s.cron if s.cron is not None else f"every {s.every_ms} ms",
            s.timezone,
            s.overlap,
            "yes" if s.paused else "",
            _time(s.next_fire),
            _time(s.last_fire),
            s.owner,
        ]
        for s in found
    ]
    text = table(
        ["ID", "JOB", "WHEN", "ZONE", "OVERLAP", "PAUSED", "NEXT FIRE", "LAST FIRE", "OWNER"],
        rows,
        cuttable=["ID"],
    )
    return {"schedules": [s.to_json() for s in found]}, text or "no schedules", 0


def _schedule(runner: JobRunner, args: argparse.Namespace) -> Result:
    schedules, sid = runner.schedules, args.schedule_id
    if args.action == "trigger":
        message_id = schedules.trigger(sid)
        return {"schedule": sid, "message_id": message_id}, f"{sid}: enqueued {message_id}", 0
    changed = {"pause": schedules.pause, "resume": schedules.resume, "remove": schedules.remove}[
        args.action
    ](sid)
    done = {"pause": "paused", "resume": "resumed", "remove": "removed"}[args.action]
    text = f"{sid}: {done}" if changed else f"{sid}: nothing to do (unknown, or {done} already)"
    return {"schedule": sid, "changed": changed}, text, 0 if changed else 1


COMMANDS: dict[str, Callable[[JobRunner, argparse.Namespace], Result]] = {
    "schedules": _schedules,
    "schedule": _schedule,
}
