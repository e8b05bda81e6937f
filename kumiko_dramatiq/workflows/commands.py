"""The ``kumiko`` commands of batches and chains (``kumiko_dramatiq.ops.cli`` adds them)::

    batches [--state running|succeeded|failed|cancelled] [--limit N]
                                 batches and chains, newest first, with their progress
    batch ID                     one batch or chain: state, counts, and each ended child
    cancel-batch ID              children not started never start; on_complete still runs

Each returns ``(JSON document, text, exit status)`` as every ``kumiko`` command does.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import asdict
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from kumiko_dramatiq.ops.terminal import table
from kumiko_dramatiq.workflows.batches import BATCH_STATES, BatchStatus

if TYPE_CHECKING:
    from kumiko_dramatiq.runner import JobRunner

Result = tuple[Any, str, int]
Command = Callable[[str, str], argparse.ArgumentParser]


def add_parsers(command: Command) -> None:
    """Declare the commands on the ``kumiko`` parser (``command(name, help)`` adds one)."""
    listed = command("batches", "batches and chains, newest first, with their progress")
    listed.add_argument("--state", choices=BATCH_STATES)
    listed.add_argument("--limit", type=int, default=50, help="at most this many (1-1000)")
    shown = command("batch", "one batch or chain: its state, counts and ended children")
    shown.add_argument("batch_id", metavar="ID", help="a batch or chain id")
    cancel = command("cancel-batch", "children not started never start; on_complete still runs")
    cancel.add_argument("batch_id", metavar="ID", help="a batch or chain id")


def _time(value: datetime | None) -> str:
    return "-" if value is None else value.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S")


def _document(status: BatchStatus) -> dict[str, Any]:
    document = asdict(status)
    document["created_at"] = status.created_at.isoformat()
    document["ended_at"] = None if status.ended_at is None else status.ended_at.isoformat()
    return document


def progress_bar(status: BatchStatus, width: int = 20) -> str:
    """``[#####.....] 12/40``: the share of children ended."""
    ended = status.total - status.pending
    filled = 0 if status.total == 0 else round(width * ended / status.total)
    return f"[{'#' * filled}{'.' * (width - filled)}] {ended}/{status.total}"


def _batches(runner: JobRunner, args: argparse.Namespace) -> Result:
    if not 0 < args.limit <= 1_000:
        raise ValueError(f"--limit must be from 1 to 1000, got {args.limit}")
    found = runner.batches(state=args.state, limit=args.limit)
    rows = [
        [s.id, s.kind, s.state, progress_bar(s), s.dead, s.cancelled, _time(s.created_at)]
        for s in found
    ]
    text = table(["ID", "KIND", "STATE", "PROGRESS", "DEAD", "CANCELLED", "CREATED"], rows)
    return {"batches": [_document(s) for s in found]}, text or "no batches", 0


def _batch(runner: JobRunner, args: argparse.Namespace) -> Result:
    status = runner.batch(args.batch_id)
    children = runner.runtime.batches.results(args.batch_id) if status.kind == "batch" else []
    lines = [
        f"{status.id}: {status.kind} {status.state} {progress_bar(status)}",
        f"completed {status.completed}, dead {status.dead}, cancelled {status.cancelled}, "
        f"pending {status.pending}; created {_time(status.created_at)}, "
        f"ended {_time(status.ended_at)}",
    ]
    rows = [
        [c.message_id, c.job_name, c.tenant_id or "", c.status, c.error_message or ""]
        for c in children
    ]
    if rows:
        lines += [
            "",
            table(["CHILD", "JOB", "TENANT", "STATUS", "ERROR"], rows, cuttable=["ERROR"]),
        ]
    document = {
        **_document(status),
        "children": [
            {**asdict(c), "value": c.value if not hasattr(c.value, "model_dump") else None}
            for c in children
        ],
    }
    return document, "\n".join(lines), 0


def _cancel_batch(runner: JobRunner, args: argparse.Namespace) -> Result:
    cancelled = runner.cancel_batch(args.batch_id)
    text = f"{args.batch_id}: cancelled ({cancelled} children will never start)"
    return {"batch_id": args.batch_id, "never_start": cancelled}, text, 0


COMMANDS: dict[str, Callable[[JobRunner, argparse.Namespace], Result]] = {
    "batches": _batches,
    "batch": _batch,
    "cancel-batch": _cancel_batch,
}
