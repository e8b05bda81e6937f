"""What each dashboard page shows: query parsing and the reads behind every page.

Every read is bounded whatever the size of the dataset (the budget is "under 100 ms with a
million run records and 10,000 queued messages", measured in ``benchmarks/dashboard.py``):

- counts are ``LLEN``/``HLEN``/``ZCARD``/``ZCOUNT`` (the overview and its chart: one
  ``ZCOUNT`` per minute and status on the run history's status indexes);
- lists read sorted-set indexes newest first with ``LIMIT`` (runs, dead letters) and page on
  with a cursor, never an offset into everything;
- locks and dedup keys are read off the indexes their Lua scripts keep
  (:meth:`~kumiko_dramatiq.ops.admin.Admin.locks`,
  :meth:`~kumiko_dramatiq.ops.admin.Admin.dedup_page`, a page at a time), and one dedup key
  is looked up directly; no page walks the keyspace;
- a run page asks where its message waits by the redis ids kumiko derives from its id
  (:meth:`~kumiko_dramatiq.ops.admin.Admin.waiting_state`), never by searching a queue.

Bad input (an unknown job, a status, a time that does not parse) is a :class:`BadInput`
whose message is one line naming the field and the value.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Final

from kumiko_dramatiq.broker import keys
from kumiko_dramatiq.broker.replies import text
from kumiko_dramatiq.cron import Cron
from kumiko_dramatiq.dashboard.chart import bar_chart, minute_edges
from kumiko_dramatiq.middleware.presence import live_processes
from kumiko_dramatiq.ops.admin import DeadCursor, DedupCursor
from kumiko_dramatiq.ops.history import STATUSES, JobRun
from kumiko_dramatiq.ops.waiting import WAITING_STATES, QueuedMessage
from kumiko_dramatiq.runner import JobRunner
from kumiko_dramatiq.workflows.batches import BATCH_STATES, BatchResult

#: Message ids as the admin API accepts them.
MESSAGE_ID: Final = re.compile(r"[A-Za-z0-9._:-]{1,200}")
#: Page sizes offered on the runs page.
RUN_LIMITS: Final = (20, 50, 100, 200)
#: Dead letters per page.
DEAD_PAGE: Final = 50
#: Dedup keys per page.
DEDUP_PAGE: Final = 100
#: Locks shown (held locks number at most the sequential runs in flight).
LOCKS_PAGE: Final = 500
#: Batches and chains a page lists (newest first).
BATCHES_PAGE: Final = 100
#: Cron fire times shown per job on the schedules page.
NEXT_FIRES: Final = 3
#: Ticks (runs) shown per cron job on the schedules page.
RECENT_TICKS: Final = 5
#: Waiting messages per page on a job's page.
WAITING_PAGE: Final = 50
#: Hours of stats on a job's page.
STATS_HOURS: Final = 24
HOUR_MS: Final = 3_600_000
#: A position in the waiting messages (``QueuedMessage.cursor``).
WAITING_CURSOR: Final = re.compile(
    r"(queued|parked|delayed|capwait)\|[A-Za-z0-9._:-]{1,250}\|[0-9:.]{1,40}"
)


class BadInput(ValueError):
    """A query or form value the dashboard cannot use; the message is one line."""


Query = Mapping[str, str]


def _text(query: Query, name: str, max_chars: int = 512) -> str | None:
    value = query.get(name, "").strip()
    if not value:
        return None
    if len(value) > max_chars:
        raise BadInput(f"{name} must be at most {max_chars} characters, got {len(value)}")
    return value


def parse_job(runner: JobRunner, query: Query, name: str = "job") -> str | None:
    """A declared job name from ``query[name]`` (``None`` when empty)."""
    job = _text(query, name)
    if job is not None and job not in runner.registry.jobs:
        known = ", ".join(sorted(runner.registry.jobs)[:10]) or "none"
        raise BadInput(f"{name} {job!r} is not a declared job (known jobs: {known})")
    return job


def parse_message_id(value: str | None, name: str = "message id") -> str:
    if value is None or not MESSAGE_ID.fullmatch(value):
        raise BadInput(f"{name} must be a message id (letters, digits, . _ : -), got {value!r}")
    return value


def parse_time(query: Query, name: str) -> datetime | None:
    """An ISO-8601 time (UTC when it has no offset), as ``<input type=datetime-local>``
    sends it or with seconds and an offset."""
    text = _text(query, name, 64)
    if text is None:
        return None
    try:
        value = datetime.fromisoformat(text)
    except ValueError:
        raise BadInput(f"{name} must be an ISO-8601 time, got {text!r}") from None
    return value if value.tzinfo is not None else value.replace(tzinfo=UTC)


def parse_dead_cursor(query: Query) -> DeadCursor | None:
    text = _text(query, "after", 300)
    if text is None:
        return None
    score, sep, rid = text.partition(":")
    if not sep or not score.isdigit() or not rid:
        raise BadInput(f"after must look like '<ms>:<redis id>', got {text!r}")
    return float(score), rid


def dead_cursor_text(cursor: DeadCursor) -> str:
    return f"{int(cursor[0])}:{cursor[1]}"


def parse_dedup_cursor(runner: JobRunner, query: Query) -> DedupCursor | None:
    text = _text(query, "after", 300)
    if text is None:
        return None
    job, _, rest = text.rpartition("@")
    score, sep, tie = rest.partition(":")
    if not sep or not score.isdigit() or not tie.isdigit() or job not in runner.registry.jobs:
        raise BadInput(f"after must look like '<job>@<ms>:<n>', got {text!r}")
    return job, float(score), int(tie)


def dedup_cursor_text(cursor: DedupCursor) -> str:
    return f"{cursor[0]}@{int(cursor[1])}:{cursor[2]}"


def last_write(run: JobRun) -> datetime | None:
    """The time a run's record was last written (shown in the tables; the history orders by
    the attempt's start, :attr:`JobRun.order_key`)."""
    return run.ended_at or run.started_at


# -- pages -----------------------------------------------------------------------------------
def overview(runner: JobRunner, now: datetime) -> dict[str, Any]:
    status = runner.status()
    edges = minute_edges(int(now.timestamp() * 1000))
    counts = runner.history.counts(("completed", "failed", "dead"), edges)
    failures = [f + d for f, d in zip(counts["failed"], counts["dead"], strict=True)]
    return {
        "status": status,
        "chart": bar_chart(edges, counts["completed"], failures),
        "latest_dead": runner.runs(status="dead", limit=5),
    }


def jobs(runner: JobRunner) -> dict[str, Any]:
    return {"jobs": runner.jobs(), "counts": runner.job_counts()}


def parse_waiting_cursor(query: Query) -> QueuedMessage | None:
    """The ``after`` of a waiting-messages page: a position as the last page's message
    carried it (``QueuedMessage.cursor``)."""
    text = _text(query, "after", 300)
    if text is None:
        return None
    if not WAITING_CURSOR.fullmatch(text):
        raise BadInput(f"after must be a position from the previous page, got {text!r}")
    return QueuedMessage("", "", None, "", 0, datetime.now(UTC), None, None, text)


def job(runner: JobRunner, name: str, query: Query, now: datetime) -> dict[str, Any]:
    """One job: its options, counts, a page of its waiting messages (payloads only shown to
    a signed-in user, by the template), hourly stats (``runner.stats``, when this version
    records them) and its latest runs."""
    if name not in runner.registry.jobs:
        parse_job(runner, {"job": name})
    state = _text(query, "state")
    if state is not None and state not in WAITING_STATES:
        raise BadInput(f"state must be one of {', '.join(WAITING_STATES)}, got {state!r}")
    after = parse_waiting_cursor(query)
    waiting = runner.queued(name, state=state, limit=WAITING_PAGE + 1, after=after)
    more = len(waiting) > WAITING_PAGE
    waiting = waiting[:WAITING_PAGE]
    older = None
    if more and waiting:
        older = {"after": waiting[-1].cursor, **({"state": state} if state else {})}
    info = next(each for each in runner.jobs() if each.name == name)
    hourly, chart = hourly_stats(runner, name, now)
    return {
        "job": info,
        "counts": runner.job_counts()[name],
        "state": state,
        "states": WAITING_STATES,
        "purge_states": ("queued", "delayed", "parked", "dead"),
        "waiting": waiting,
        "older": older,
        "first_page": after is None,
        "hourly": hourly,
        "chart": chart,
        "latest": runner.runs(name, limit=10),
    }


def hourly_stats(runner: JobRunner, job: str, now: datetime) -> tuple[list[Any] | None, Any]:
    """The job's last 24 hours from ``runner.stats`` (``None`` when this version records
    none), and their chart: completed under failed + dead attempts, per hour."""
    stats = getattr(runner, "stats", None)
    if stats is None:
        return None, None
    rows = list(stats(job, hours=STATS_HOURS))
    this_hour = int(now.timestamp() * 1000) // HOUR_MS * HOUR_MS
    edges = [this_hour - (STATS_HOURS - 1 - i) * HOUR_MS for i in range(STATS_HOURS)]
    by_hour = {int(row.hour.timestamp() * 1000): row for row in rows}
    completed = [int(getattr(by_hour.get(e), "completed", 0) or 0) for e in edges]
    failed = [
        int(getattr(by_hour.get(e), "failed", 0) or 0)
        + int(getattr(by_hour.get(e), "dead", 0) or 0)
        for e in edges
    ]
    return rows, bar_chart([*edges, edges[-1] + HOUR_MS], completed, failed)


def busy(runner: JobRunner) -> dict[str, Any]:
    return {"running": runner.running()}


@dataclass(frozen=True)
class RunFilter:
    job: str | None
    status: str | None
    tenant: str | None
    origin: str | None
    since: datetime | None
    before: datetime | None
    limit: int
    #: the run id the page starts after (the "Older" link: the last run of the page before)
    cursor: str | None = None

    def query(self, **changes: Any) -> dict[str, str]:
        """This filter as query parameters (empty ones left out), with ``changes``."""
        values: dict[str, Any] = {
            "job": self.job,
            "status": self.status,
            "tenant": self.tenant,
            "origin": self.origin,
            "since": None if self.since is None else self.since.isoformat(),
            "before": None if self.before is None else self.before.isoformat(),
            "limit": None if self.limit == RUN_LIMITS[1] else str(self.limit),
            "cursor": self.cursor,
            **changes,
        }
        return {k: str(v) for k, v in values.items() if v not in (None, "")}


def parse_run_filter(runner: JobRunner, query: Query) -> RunFilter:
    status = _text(query, "status")
    if status is not None and status not in STATUSES:
        raise BadInput(f"status must be one of {', '.join(STATUSES)}, got {status!r}")
    origin = _text(query, "origin")
    if origin is not None:
        parse_message_id(origin, "origin")
    limit_text = _text(query, "limit") or str(RUN_LIMITS[1])
    if not limit_text.isdigit() or int(limit_text) not in RUN_LIMITS:
        raise BadInput(
            f"limit must be one of {', '.join(map(str, RUN_LIMITS))}, got {limit_text!r}"
        )
    return RunFilter(
        job=parse_job(runner, query),
        status=status,
        tenant=_text(query, "tenant", 256),
        origin=origin,
        since=parse_time(query, "since"),
        before=parse_time(query, "before"),
        limit=int(limit_text),
        cursor=_run_id(query),
    )


def _run_id(query: Query) -> str | None:
    """The ``cursor`` parameter: a run id ``<message id>:<attempt>``."""
    cursor = _text(query, "cursor", 100)
    if cursor is None:
        return None
    message_id, _, attempt = cursor.rpartition(":")
    if not attempt.isdigit():
        raise BadInput(f"cursor must be a run id '<message id>:<attempt>', got {cursor!r}")
    parse_message_id(message_id, "cursor")
    return cursor


def runs(runner: JobRunner, query: Query) -> dict[str, Any]:
    chosen = parse_run_filter(runner, query)
    before: datetime | JobRun | None = chosen.before
    if chosen.cursor is not None:
        before = runner.history.find(chosen.cursor)
        if before is None:
            raise BadInput(f"no run record {chosen.cursor} (expired, or never written)")
    found = runner.runs(
        chosen.job,
        status=chosen.status,  # type: ignore[arg-type]  # checked against STATUSES
        tenant_id=chosen.tenant,
        origin_id=chosen.origin,
        since=chosen.since,
        before=before,
        limit=chosen.limit,
    )
    older = None
    if len(found) == chosen.limit:
        # the next page starts right after the last run of this one: none missed or repeated
        older = chosen.query(cursor=found[-1].run_id, before=None)
    return {
        "filter": chosen,
        "runs": found,
        "older": older,
        "job_names": sorted(runner.registry.jobs),
        "statuses": STATUSES,
        "limits": RUN_LIMITS,
    }


def run(runner: JobRunner, message_id: str) -> dict[str, Any]:
    parse_message_id(message_id)
    attempts = runner.run_record(message_id)
    latest = attempts[-1] if attempts else None
    origin = None if latest is None else latest.origin_id
    family = runner.runs(origin_id=origin, limit=100) if origin is not None else []
    dead_note = runner.history.dead_note(message_id)
    waiting = runner.admin.waiting_state(message_id)
    return {
        "message_id": message_id,
        "batch_id": runner.runtime.batches.batch_of(message_id),
        "attempts": attempts,
        "latest": latest,
        "origin": origin,
        "family": family,
        "dead": dead_note is not None,
        "waiting": waiting,
        # only a message found waiting (queued, parked, delayed, backing off) can be cancelled
        "cancellable": waiting in ("queued", "delayed"),
    }


def dead(runner: JobRunner, query: Query) -> dict[str, Any]:
    job = parse_job(runner, query)
    after = parse_dead_cursor(query)
    letters, next_cursor = runner.admin.dead_letter_page(job, after=after, limit=DEAD_PAGE)
    older = None
    if next_cursor is not None:
        older = {"after": dead_cursor_text(next_cursor), **({"job": job} if job else {})}
    return {
        "job": job,
        "letters": letters,
        "older": older,
        "first_page": after is None,
        "job_names": sorted(runner.registry.jobs),
    }


def batches(runner: JobRunner, query: Query) -> dict[str, Any]:
    state = _text(query, "state", 20)
    if state is not None and state not in BATCH_STATES:
        raise BadInput(f"state must be one of {', '.join(BATCH_STATES)}")
    found = runner.batches(state=state, limit=BATCHES_PAGE + 1)
    return {
        "state": state,
        "states": BATCH_STATES,
        "batches": found[:BATCHES_PAGE],
        "more": len(found) > BATCHES_PAGE,
    }


def batch(runner: JobRunner, batch_id: str) -> dict[str, Any]:
    parse_message_id(batch_id)
    status = runner.batch(batch_id)
    workflows = runner.runtime.batches
    steps: list[tuple[str, list[BatchResult]]] = []
    if status.kind == "chain":
        n = 1
        while (step := workflows.step_results(batch_id, n)) is not None:
            steps.append((f"step {n}", step))
            n += 1
    else:
        steps.append(("children", workflows.results(batch_id)))
    return {"status": status, "steps": steps}


def locks(runner: JobRunner) -> dict[str, Any]:
    found = runner.admin.locks(limit=LOCKS_PAGE + 1)
    return {"locks": found[:LOCKS_PAGE], "more": len(found) > LOCKS_PAGE}


def dedup(runner: JobRunner, query: Query) -> dict[str, Any]:
    job = parse_job(runner, query)
    key = _text(query, "key", 512)
    context: dict[str, Any] = {
        "job": job,
        "key": key,
        "job_names": sorted(runner.registry.jobs),
        "lookup": None,
        "records": [],
        "older": None,
        "first_page": True,
    }
    admin = runner.admin
    if key is not None:
        if job is None:
            raise BadInput("key needs a job: a dedup key belongs to one job")
        context["lookup"] = admin.dedup_record(runner.job(job), key)
        return context
    after = parse_dedup_cursor(runner, query)
    if after is not None and job is not None and after[0] != job:
        raise BadInput(f"after belongs to job {after[0]}, not {job}")
    records, next_cursor = admin.dedup_page(job, after=after, limit=DEDUP_PAGE)
    older = None
    if next_cursor is not None:
        older = {"after": dedup_cursor_text(next_cursor), **({"job": job} if job else {})}
    context.update(records=records, older=older, first_page=after is None)
    return context


def schedules(runner: JobRunner, now: datetime) -> dict[str, Any]:
    infos = {info.name: info for info in runner.jobs()}
    rows = []
    for job in runner.registry.jobs.values():
        trigger = job.options.trigger
        if not isinstance(trigger, Cron):
            continue
        fires, after = [], now
        for _ in range(NEXT_FIRES):
            after = trigger.next_fire_time(after)
            fires.append(after)
        ticks = runner.runs(job.qualified_name, limit=RECENT_TICKS)
        rows.append(
            {"job": infos[job.qualified_name], "cron": trigger, "fires": fires, "ticks": ticks}
        )
    processes = live_processes(runner.broker.client, runner.queue_prefix)
    listed = runner.schedules.list()
    skipped = runner.broker.client.hgetall(keys.cron_skipped(runner.queue_prefix))
    return {
        "skipped": {text(job): int(count) for job, count in skipped.items()},
        "rows": rows,
        "paused": {s.id for s in listed if s.owner == "code" and s.paused},
        "runtime": [s for s in listed if s.owner == "runtime"],
        "schedulers": [p for p in processes if p.role == "scheduler"],
    }


def boot(runner: JobRunner) -> dict[str, Any]:
    gates = [job for job in runner.registry.jobs.values() if job.options.boot_gate]
    return {
        "markers": runner.admin.boot_markers(),
        "gates": [
            {"job": gate, "latest": next(iter(runner.runs(gate.qualified_name, limit=1)), None)}
            for gate in gates
        ],
    }
