"""The soak's verdicts: pure functions over the handlers' records and the driver's notes.

Nothing here talks to Redis or reads a clock: :mod:`tests.soak.run` gathers the
records (see :mod:`tests.soak.app` for their format), what it dispatched, the
faults it injected and what it found in Redis and in the logs, and each
``check_*`` function returns a :class:`CheckResult`. All times are
``time.time()`` seconds of the one machine the soak runs on.

Vocabulary:

- a *run* is one handler call: its ``start`` record and at most one ``end``
  or ``fail`` record (:func:`assemble_runs`). A run with neither was *cut*:
  its worker process died under it.
- a *kill* (:class:`Kill`) ends a worker process group: the driver's SIGKILL,
  or a *death*: the process exited on its own and the driver's supervisor
  noticed it (at or after the death) and started a new one. Deaths are
  expected only from *poison* messages (a job that kills its own process,
  :func:`check_poison`); either kind of kill explains the runs it cut.
- *completed* (of a message id) means its ack wrote the "already completed"
  marker; the driver learns when from Redis keyspace notifications
  (``done_at``). A handler's ``end`` record comes a little before that ack.
- a re-run of a finished attempt (same message id, same attempt) is
  *explained* when the finished run's worker process group was killed after
  it finished and before the re-run started: the kill fell between the
  handler's end (or failure) and the ack, and Dramatiq redelivered the message
  (at-least-once delivery). Explained re-runs count neither as a second
  completion nor as another failed attempt. Any other re-run is a violation:
  the same attempt without such a kill, an attempt that runs after a later
  attempt of its message finished (the retry chain forked), or any run that
  starts after the message's completed marker was set.
"""

from __future__ import annotations

import bisect
import math
from collections import defaultdict
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

Outcome = Literal["completed", "failed", "cut"]


@dataclass(frozen=True)
class Run:
    """One handler call, assembled from its records."""

    token: str
    job: str
    message_id: str
    attempt: int
    n: int | None
    tenant: str | None
    scheduled_at: float | None
    pgid: int
    started: float
    ended: float | None = None
    failed: float | None = None

    @property
    def finished(self) -> float | None:
        """When the handler returned or raised; ``None`` for a cut run."""
        return self.ended if self.ended is not None else self.failed

    @property
    def outcome(self) -> Outcome:
        if self.ended is not None:
            return "completed"
        if self.failed is not None:
            return "failed"
        return "cut"

    def describe(self) -> str:
        tenant = "" if self.tenant is None else f" tenant {self.tenant}"
        return (
            f"{self.job} {self.message_id} attempt {self.attempt}{tenant} "
            f"(pgid {self.pgid}, {self.outcome}, started {self.started:.3f})"
        )


@dataclass(frozen=True)
class Kill:
    """The worker process group ``pgid`` ended at ``at``: the driver SIGKILLed it, or
    (a death) its supervisor noticed at ``at`` that it had exited on its own."""

    pgid: int
    at: float


@dataclass(frozen=True)
class Expected:
    """A logical job the driver dispatched and how it must end.

    Its runs are those of ``message_id`` if set, else those of (``job``, ``n``,
    ``tenant``): a sequential hand-off changes the message id, not ``n``. It
    must complete on attempt ``fail_first + 1`` after failing attempts
    ``1..fail_first``, or, when ``fail_first >= max_attempts``, fail attempts
    ``1..max_attempts`` and never complete.
    """

    label: str
    job: str
    fail_first: int
    max_attempts: int
    n: int | None = None
    tenant: str | None = None
    message_id: str | None = None

    @property
    def completes(self) -> bool:
        return self.fail_first < self.max_attempts


@dataclass(frozen=True)
class KeyedDispatch:
    """``dispatch(..., dedup_key=...)`` called at ``at`` returned ``message_id``."""

    message_id: str
    at: float


@dataclass(frozen=True)
class Malformed:
    """A malformed message the driver pushed onto a queue.

    ``needle``: text that the worker log must contain to count as the logged reason;
    ``message_id``: its message id, when it has one a handler would record.
    """

    kind: str
    redis_message_id: str
    needle: str
    pushed_at: float
    message_id: str | None = None


@dataclass(frozen=True)
class Poison:
    """A message of the poison job (its handler kills its own process) the driver
    dispatched at ``dispatched_at``; ``kind``: how it kills (``exit``, ``segfault``)."""

    kind: str
    message_id: str
    dispatched_at: float


@dataclass(frozen=True)
class DelayedBurst:
    """Delayed messages the driver dispatched together, due at ``due``, and the SIGKILL
    of worker process group ``pgid`` a few ms after ``due``: the worker that held most
    of them (``held``, in its delay queue's ack set shortly before they came due), while
    its delay-queue consumer was moving them to the queue; ``unmoved``: how many of them
    were still in that ack set right after the kill (maintenance gives those back to
    the delay queue once the worker's heartbeat is old; another worker moves them)."""

    message_ids: tuple[str, ...]
    due: float
    pgid: int
    held: int
    unmoved: int


@dataclass(frozen=True)
class DeadLetter:
    """A message in the dead-letter set: its redis id and when it was put there."""

    redis_message_id: str
    at: float


@dataclass
class CheckResult:
    number: int
    title: str
    checked: int = 0
    violations: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return not self.violations

    def render(self, limit: int = 12) -> str:
        verdict = "PASS" if self.passed else "FAIL"
        lines = [
            f"{verdict}  {self.number}. {self.title}: {self.checked} checked, "
            f"{len(self.violations)} violation(s)"
        ]
        lines += [f"        ! {text}" for text in self.violations[:limit]]
        if len(self.violations) > limit:
            lines.append(f"        ! ... and {len(self.violations) - limit} more")
        lines += [f"        - {text}" for text in self.notes[:limit]]
        if len(self.notes) > limit:
            lines.append(f"        - ... and {len(self.notes) - limit} more")
        return "\n".join(lines)


# -- assembling --------------------------------------------------------------------------------


def assemble_runs(records: Iterable[Mapping[str, Any]]) -> tuple[list[Run], list[str]]:
    """Fold records into runs (sorted by start); duplicates of a record (a retried
    ``RPUSH``) count once. Returns the runs and the records that make no sense."""
    by_token: dict[str, dict[str, Mapping[str, Any]]] = defaultdict(dict)
    problems: list[str] = []
    for record in records:
        by_token[str(record["run"])].setdefault(str(record["ev"]), record)
    runs: list[Run] = []
    for token, events in by_token.items():
        start = events.get("start")
        if start is None:
            problems.append(f"run {token}: {sorted(events)} recorded without a start")
            continue
        end, fail = events.get("end"), events.get("fail")
        if end is not None and fail is not None:
            problems.append(f"run {token}: both an end and a fail record")
        unknown = set(events) - {"start", "end", "fail"}
        if unknown:
            problems.append(f"run {token}: unknown events {sorted(unknown)}")
        runs.append(
            Run(
                token=token,
                job=str(start["job"]),
                message_id=str(start["mid"]),
                attempt=int(start["attempt"]),
                n=start.get("n"),
                tenant=start.get("tenant"),
                scheduled_at=start.get("sched"),
                pgid=int(start["pgid"]),
                started=float(start["t"]),
                ended=None if end is None else float(end["t"]),
                failed=None if fail is None else float(fail["t"]),
            )
        )
    runs.sort(key=lambda run: (run.started, run.token))
    return runs, problems


class KillLog:
    """When each worker process group was SIGKILLed."""

    def __init__(self, kills: Iterable[Kill]) -> None:
        self._at: dict[int, list[float]] = defaultdict(list)
        for kill in kills:
            self._at[kill.pgid].append(kill.at)
        for times in self._at.values():
            times.sort()

    def between(self, pgid: int, after: float, before: float) -> bool:
        """Whether ``pgid`` was killed at some time in ``[after, before]``."""
        times = self._at.get(pgid, [])
        index = bisect.bisect_left(times, after)
        return index < len(times) and times[index] <= before

    def first_after(self, pgid: int, after: float) -> float | None:
        times = self._at.get(pgid, [])
        index = bisect.bisect_left(times, after)
        return times[index] if index < len(times) else None


class RunIndex:
    """Runs by message id and by logical job (job, n, tenant)."""

    def __init__(self, runs: Sequence[Run]) -> None:
        self.runs = list(runs)
        self.by_message: dict[str, list[Run]] = defaultdict(list)
        self.by_logical: dict[tuple[str, int | None, str | None], list[Run]] = defaultdict(list)
        for run in self.runs:
            self.by_message[run.message_id].append(run)
            self.by_logical[(run.job, run.n, run.tenant)].append(run)

    def of(self, expected: Expected) -> list[Run]:
        if expected.message_id is not None:
            return self.by_message.get(expected.message_id, [])
        return self.by_logical.get((expected.job, expected.n, expected.tenant), [])

    def of_job(self, job: str) -> list[Run]:
        return [run for run in self.runs if run.job == job]


# -- 1. terminal states ------------------------------------------------------------------------


def is_terminal(expected: Expected, runs: Sequence[Run]) -> bool:
    """Whether ``runs`` show ``expected`` done for good (right or wrong): cheap, for waiting."""
    return any(
        run.ended is not None or (run.failed is not None and run.attempt >= expected.max_attempts)
        for run in runs
    )


def verdict(
    expected: Expected, runs: Sequence[Run], explained: frozenset[str] = frozenset()
) -> str | None:
    """``None`` if ``runs`` end ``expected`` exactly as it must, else what is wrong.

    Every run counts but cut runs and the explained re-runs (``explained``): the
    attempts seen must be exactly ``1..fail_first`` failing and ``fail_first + 1``
    completing, or ``1..max_attempts`` failing and none completing.
    """
    counted = [run for run in runs if run.token not in explained]
    end_attempts = sorted(run.attempt for run in counted if run.ended is not None)
    fail_attempts = sorted(run.attempt for run in counted if run.failed is not None)
    seen = (
        f"saw {len(runs)} run(s), completions on attempts {end_attempts}, "
        f"failures on attempts {fail_attempts}"
    )
    if expected.completes:
        want_failures = list(range(1, expected.fail_first + 1))
        if end_attempts == [expected.fail_first + 1] and fail_attempts == want_failures:
            return None
        state = "wrong outcome" if is_terminal(expected, runs) else "never reached a final state"
        return (
            f"{expected.label}: {state}: must complete once, on attempt "
            f"{expected.fail_first + 1}, after failing attempts {want_failures} once each; {seen}"
        )
    want_failures = list(range(1, expected.max_attempts + 1))
    if fail_attempts == want_failures and not end_attempts:
        return None
    state = "wrong outcome" if is_terminal(expected, runs) else "never reached a final state"
    return (
        f"{expected.label}: {state}: must fail for good after exactly "
        f"{expected.max_attempts} failed attempts {want_failures}; {seen}"
    )


def check_terminal(
    expected: Sequence[Expected],
    index: RunIndex,
    kills: KillLog,
    *,
    keyed: Sequence[KeyedDispatch] = (),
    dead_lettered: set[str] | None = None,
    record_problems: Sequence[str] = (),
    explained: frozenset[str] = frozenset(),
) -> CheckResult:
    """1. Every dispatched job reached its terminal state: completed on the attempt its
    payload allows, or failed after exactly ``retries + 1`` failed attempts (a cut run
    is no attempt, nor is an explained re-run: see :func:`check_reruns`) and
    dead-lettered; every keyed dispatch was followed by a run of the id it returned;
    every cut run's worker was killed."""
    result = CheckResult(1, "every dispatched job reached its terminal state", len(expected))
    result.violations += [f"record: {problem}" for problem in record_problems]
    completed = failed = 0
    for item in expected:
        runs = index.of(item)
        problem = verdict(item, runs, explained)
        if problem is not None:
            result.violations.append(problem)
            continue
        if item.completes:
            completed += 1
            continue
        failed += 1
        if dead_lettered is not None:
            last = max((run for run in runs if run.failed is not None), key=lambda r: r.attempt)
            if last.message_id not in dead_lettered:
                result.violations.append(
                    f"{item.label}: failed for good but {last.message_id} is not dead-lettered"
                )
    for dispatch in keyed:
        if not any(
            run.started > dispatch.at for run in index.by_message.get(dispatch.message_id, [])
        ):
            result.violations.append(
                f"keyed dispatch at {dispatch.at:.3f} returned {dispatch.message_id}, "
                "which never ran after it: a trigger was lost"
            )
    cut = [run for run in index.runs if run.outcome == "cut"]
    for run in cut:
        if kills.first_after(run.pgid, run.started) is None:
            result.violations.append(
                f"run cut short but its worker was never killed: {run.describe()}"
            )
    result.notes.append(
        f"{completed} completed, {failed} failed for good as their payload asked; "
        f"{len(keyed)} keyed dispatches; {len(cut)} run(s) cut short by a SIGKILL or death"
    )
    return result


# -- 2. nothing runs after it completed --------------------------------------------------------


def check_reruns(
    index: RunIndex,
    done_at: Mapping[str, float],
    kills: KillLog,
    *,
    marked: Collection[str] | None = None,
    bursts: Sequence[DelayedBurst] = (),
    dropped: Mapping[str, int] | None = None,
) -> tuple[CheckResult, frozenset[str]]:
    """2. No message id started after it had completed, no attempt ran twice, no two
    deliveries of one id at once; and, if ``marked`` (the ids whose completed
    marker exists at the end) is given, every id that completed has its marker.

    ``bursts``: the delayed bursts whose holder was SIGKILLed as they came due
    (:class:`DelayedBurst`); each of their messages must have run (a message the kill
    lost is a violation), and none may have had a second copy. ``dropped``: message id ->
    how many copies of it a fetch acked unrun because the id had completed (the
    workers' log): a copy of a burst's message is a violation (its move from the delay
    queue left a copy behind, the gap Dramatiq's enqueue-then-ack leaves); any other is
    a note (the safety net caught a copy).

    Returns the result and the tokens of the *explained* re-runs (see the module
    docstring), which the other checks do not count as a second completion.
    """
    result = CheckResult(
        2, "no message id ran after it had completed (nor any attempt twice)", len(index.by_message)
    )
    explained: set[str] = set()
    for message_id, runs in index.by_message.items():
        marker = done_at.get(message_id)
        completed = any(run.ended is not None for run in runs)
        if completed and marked is not None and message_id not in marked:
            result.violations.append(
                f"completed without an 'already completed' marker: {runs[-1].describe()}"
            )
        for position, run in enumerate(runs):
            earlier = runs[:position]
            if marker is not None and run.started > marker:
                result.violations.append(
                    f"started {run.started - marker:.3f} s after its id completed "
                    f"(marker set at {marker:.3f}): {run.describe()}"
                )
                continue
            together = [
                other
                for other in earlier
                if (other.finished is not None and other.finished > run.started)
                or (
                    other.finished is None
                    and not kills.between(other.pgid, other.started, run.started)
                )
            ]
            if together:
                result.violations.append(
                    f"two deliveries at once: {run.describe()} while {together[0].describe()}"
                )
                continue
            before = [
                other
                for other in earlier
                if other.finished is not None
                and (other.ended is not None or other.attempt >= run.attempt)
            ]
            if not before:
                continue
            problems = []
            for other in before:
                if other.attempt != run.attempt:
                    problems.append(
                        f"retry chain forked: {run.describe()} ran after {other.describe()} "
                        "had finished"
                    )
                elif not kills.between(other.pgid, other.finished or other.started, run.started):
                    problems.append(
                        f"attempt ran twice: {run.describe()} after {other.describe()} "
                        "finished, and that worker was not killed in between"
                    )
            if problems:
                problems.sort(key=lambda text: not text.startswith("retry chain forked"))
                result.violations.append(problems[0])
            else:
                explained.add(run.token)
    if explained:
        result.notes.append(
            f"{len(explained)} re-run(s) of an attempt whose worker was SIGKILLed after the "
            "handler's end or failure and before the ack (at-least-once redelivery)"
        )
    result.notes.append(f"{len(done_at)} completed markers observed")
    _check_bursts(result, index, bursts, dropped or {})
    return result, frozenset(explained)


def _check_bursts(
    result: CheckResult,
    index: RunIndex,
    bursts: Sequence[DelayedBurst],
    dropped: Mapping[str, int],
) -> None:
    delayed = {message_id for burst in bursts for message_id in burst.message_ids}
    for burst in bursts:
        never = [
            message_id for message_id in burst.message_ids if message_id not in index.by_message
        ]
        if never:
            result.violations.append(
                f"delayed burst due at {burst.due:.3f}: {len(never)} message(s) never ran "
                f"(lost by the kill of {burst.pgid}?), e.g. {never[0]}"
            )
    for message_id, copies in sorted(dropped.items()):
        if message_id in delayed:
            result.violations.append(
                f"delayed message {message_id} had a second copy ({copies} acked unrun as "
                "already completed): its move from the delay queue left a copy behind"
            )
    others = {mid: copies for mid, copies in dropped.items() if mid not in delayed}
    if others:
        result.notes.append(
            f"{sum(others.values())} copies of {len(others)} completed message id(s) acked "
            f"unrun by a fetch (the safety net caught them), e.g. {sorted(others)[:3]}"
        )
    if bursts:
        runs = [run for message_id in delayed for run in index.by_message.get(message_id, [])]
        first_attempts = [run for run in runs if run.attempt == 1]
        again = len(first_attempts) - len({run.message_id for run in first_attempts})
        result.notes.append(
            f"{len(bursts)} delayed burst(s) of {len(delayed)} message(s) SIGKILLed as they "
            "came due (held by the killed worker / still unmoved at the kill: "
            + ", ".join(f"{burst.held}/{burst.unmoved}" for burst in bursts)
            + "); "
            f"{sum(1 for run in runs if run.outcome == 'cut')} run(s) cut, "
            f"{again} first attempt(s) ran again"
        )


# -- 3. per-tenant -----------------------------------------------------------------------------


def check_tenants(
    job: str,
    wrappers: Sequence[int],
    tenants: Sequence[str],
    index: RunIndex,
    explained: frozenset[str],
) -> CheckResult:
    """3. Every tenant's child completed exactly once per wrapper, under one message id."""
    result = CheckResult(
        3,
        "every tenant child completed once per wrapper, none twice",
        len(wrappers) * len(tenants),
    )
    runs = index.of_job(job)
    by_child: dict[tuple[int | None, str | None], list[Run]] = defaultdict(list)
    for run in runs:
        by_child[(run.n, run.tenant)].append(run)
    known_wrappers, known_tenants = set(wrappers), set(tenants)
    for (n, tenant), child_runs in by_child.items():
        if n not in known_wrappers or tenant not in known_tenants:
            result.violations.append(
                f"child of an unknown wrapper or tenant: {child_runs[0].describe()} (n={n})"
            )
    for n in wrappers:
        for tenant in tenants:
            child_runs = by_child.get((n, tenant), [])
            ids = sorted({run.message_id for run in child_runs})
            done = [
                run for run in child_runs if run.ended is not None and run.token not in explained
            ]
            if len(ids) > 1:
                result.violations.append(
                    f"wrapper n={n} tenant {tenant}: child enqueued under {len(ids)} ids {ids}"
                )
            if len(done) != 1:
                result.violations.append(
                    f"wrapper n={n} tenant {tenant}: child completed {len(done)} times"
                )
    return result


# -- 4. sequential -----------------------------------------------------------------------------


def check_sequential(jobs: Iterable[str], index: RunIndex, kills: KillLog) -> CheckResult:
    """4. No two runs of a sequential job (per tenant) overlapped.

    A run's span is start..end/fail; a cut run's span ends when its worker was killed
    (a cut run whose worker was never killed has no known end and is left out).
    """
    spans: dict[tuple[str, str | None], list[tuple[float, float, Run]]] = defaultdict(list)
    for job in jobs:
        for run in index.of_job(job):
            end = run.finished
            if end is None:
                end = kills.first_after(run.pgid, run.started)
            if end is not None:
                spans[(run.job, run.tenant)].append((run.started, end, run))
    result = CheckResult(4, "no sequential overlap", sum(len(items) for items in spans.values()))
    for items in spans.values():
        items.sort(key=lambda item: item[0])
        latest_end, holder = -math.inf, None
        for start, end, run in items:
            if start < latest_end and holder is not None:
                result.violations.append(
                    f"overlap of {latest_end - start:.3f} s: {run.describe()} started while "
                    f"{holder.describe()} ran"
                )
            if end > latest_end:
                latest_end, holder = end, run
    return result


def check_capped(job: str, max_running: int, index: RunIndex, kills: KillLog) -> CheckResult:
    """4b. At no instant did more than ``max_running`` runs of a capped job overlap (spans as
    in :func:`check_sequential`: a cut run's ends when its worker was killed; its slot is then
    held until its lease runs out, so the cap may only be undershot there)."""
    events: list[tuple[float, int, Run]] = []
    for run in index.of_job(job):
        end = run.finished
        if end is None:
            end = kills.first_after(run.pgid, run.started)
        if end is not None:
            events += [(run.started, 1, run), (end, -1, run)]
    result = CheckResult(4, f"no more than {max_running} capped runs at once", len(events) // 2)
    running = 0
    # an end and a start at the same instant do not overlap: ends first
    for at, step, run in sorted(events, key=lambda event: (event[0], event[1])):
        running += step
        if running > max_running:
            result.violations.append(
                f"{running} runs of {job} at once at {at:.3f}: {run.describe()} started"
            )
    return result


#: Handlers stamp their start with their process's wall clock after the fetch that counted
#: it (on Redis's clock): a loaded machine's scheduling jitter is allowed this much.
RATE_JITTER_S = 0.25


def check_rated(job: str, count: int, per_ms: int, index: RunIndex) -> CheckResult:
    """4c. At most ``count`` runs of a rate-limited job started in any window of ``per_ms``
    (less :data:`RATE_JITTER_S`)."""
    starts = sorted(run.started for run in index.of_job(job))
    result = CheckResult(4, f"at most {count} starts per {per_ms} ms", len(starts))
    window = per_ms / 1000 - RATE_JITTER_S
    for i in range(len(starts) - count):
        if starts[i + count] - starts[i] < window:
            result.violations.append(
                f"{count + 1} starts of {job} within {starts[i + count] - starts[i]:.3f} s "
                f"from {starts[i]:.3f}"
            )
    return result


# -- 5. cron -----------------------------------------------------------------------------------


def check_cron(
    job: str,
    index: RunIndex,
    window: tuple[float, float],
    explained: frozenset[str],
    misfired: Sequence[tuple[float, float]] = (),
) -> CheckResult:
    """5. Each cron tick in ``window`` (a 1-second cron) completed exactly once.

    A tick that never ran but lies in a range a scheduler logged as a misfire
    (coalesced or skipped because the scheduler thread woke up late: documented
    behaviour) is a note, not a violation.
    """
    low, high = window
    ticks = list(range(math.ceil(low), math.floor(high) + 1))
    result = CheckResult(5, "each cron tick completed once", len(ticks))
    completions: dict[int, int] = defaultdict(int)
    for run in index.of_job(job):
        if run.scheduled_at is None:
            result.violations.append(f"cron run without a tick: {run.describe()}")
            continue
        if run.ended is not None and run.token not in explained:
            completions[round(run.scheduled_at)] += 1
    missed_logged = []
    for tick in ticks:
        count = completions.get(tick, 0)
        if count == 1:
            continue
        if count == 0 and any(first <= tick <= last for first, last in misfired):
            missed_logged.append(tick)
            continue
        result.violations.append(f"tick {tick} completed {count} times")
    if missed_logged:
        result.notes.append(
            f"{len(missed_logged)} tick(s) logged as misfired by the schedulers: "
            f"{missed_logged[:10]}"
        )
    return result


# -- 6. boot -----------------------------------------------------------------------------------


def check_boot(job: str, index: RunIndex, explained: frozenset[str]) -> CheckResult:
    """6. The boot-once job completed exactly once, under one message id."""
    result = CheckResult(6, "the boot job ran once", 1)
    runs = index.of_job(job)
    done = [run for run in runs if run.ended is not None and run.token not in explained]
    ids = sorted({run.message_id for run in runs})
    if len(done) != 1:
        result.violations.append(f"{job} completed {len(done)} times")
    if len(ids) > 1:
        result.violations.append(f"{job} ran under {len(ids)} message ids {ids}")
    return result


# -- 7. leftovers ------------------------------------------------------------------------------

#: Record kinds (the segment after ``kumiko:{prefix}:``) kept ``Retention.completed_age_s``:
#: the enqueue guards of deterministic ids (``enqueued:{id}``: fan-out children, cron
#: ticks, the boot job; a sequential hand-off writes none, its ack enqueues it), the
#: cron jobs' last ticks (``cron:last:{job}``) and the records of batches and chains
#: (``batch:{id}``...: kept that long once their callbacks ended; one without a TTL never
#: ended) and a chain's result (``result:{chain id}``).
TTL_BOUND = frozenset({"enqueued", "cron", "batch", "result"})
#: Per-message markers that only guard against a second copy, each kept the window in which
#: such a copy can appear (``done``: ``KumikoBroker.completed_ttl_ms``; ``sent``:
#: ``KumikoBroker.resend_window_ms``; both a minute), not ``completed_age_s``.
MARKERS = frozenset({"done", "sent"})
#: Kinds that must be gone once the run is over and the lock TTL has passed: the locks, the
#: dedup records, the in-flight hash (an entry per message out with a worker) and the
#: suspects lists.
MUST_BE_GONE = frozenset(
    {"lock", "dedup", "inflight", "suspects", "capwait", "capwaiting", "capwaits"}
)
#: The asks about held messages and their answers (``lua/include/holds.lua``), each kept a
#: minute past its last write.
HOLD_ASKS = frozenset({"asks", "askbell", "answer"})
HOLD_ASKS_TTL_MS = 60_000
#: Documented persistent records: boot markers, the dataset marker (``dataset``: a token
#: kept as long as the dataset, whose disappearance reads as a dataset reset), the index of
#: batches (trimmed as its entries' records expire) and the batches' outcome counts.
PERSISTENT = frozenset({"boot", "dataset", "batches", "batch-outcomes"})
#: The per-job hourly stats (``stats:{job}:{hour}``, :mod:`kumiko_dramatiq.ops.stats`): each
#: hash's TTL set to 8 days by the write that creates any of its fields.
STATS = frozenset({"stats"})
STATS_TTL_MS = 8 * 86_400_000
#: The soak's own records.
OWN = frozenset({"soak"})
#: The run history's records (``run:{id}``, ``dead:{id}``: :mod:`kumiko_dramatiq.ops.history`),
#: each with a TTL of at most ``Retention.failed_age_s``.
HISTORY = frozenset({"run", "dead"})
#: The run history's indexes (``runs:...``): sorted sets trimmed on every write, documented
#: without a TTL of their own.
HISTORY_INDEXES = frozenset({"runs"})
#: Liveness entries (:mod:`kumiko_dramatiq.middleware.presence`): each with a TTL of its own.
PRESENCE = frozenset({"proc", "procs"})
#: The TTL of a queue's doorbell token (``dramatiq:{queue}:bell``, ``lua/_bell.lua``).
BELL_TTL_MS = 60_000


def check_leftovers(
    keys: Sequence[tuple[str, int]],
    queue_prefix: str,
    ttl_bound_ms: int,
    *,
    stuck: Sequence[str] = (),
    history_ttl_ms: int | None = None,
    running: Sequence[str] = (),
    marker_ttls_ms: Mapping[str, int] | None = None,
    guarded: Collection[str] | None = None,
    queue_keys: Sequence[tuple[str, int]] = (),
    caps_ttls_ms: Mapping[str, int] | None = None,
) -> CheckResult:
    """7. No lock, dedup record, in-flight entry or marker left behind but the documented
    TTL-bound ones.

    ``keys``: every ``kumiko:{queue_prefix}:*`` key with its ``PTTL`` (-1: none,
    -2: gone meanwhile). ``ttl_bound_ms``: the longest TTL of a :data:`TTL_BOUND` record
    (``completed_age_s``). ``marker_ttls_ms``: the longest TTL of each kind of
    :data:`MARKERS` (a kind not given: ``ttl_bound_ms``). ``guarded``: the message ids that
    may carry an enqueue guard (fan-out children, cron ticks, the boot job; ``None``: any
    id): a guard of any other id (a sequential hand-off's, say) is a violation. ``stuck``:
    messages left in queues, delay queues or ack sets, and processes that did not stop
    (each a violation). ``history_ttl_ms``: the longest TTL of a run-history record
    (``None``: history keys are unknown keys). ``running``: run-history records still
    "running" once every message has settled (each a violation: a cut run's record must be
    superseded by its redelivery's or turned "dead" with its dead letter). ``queue_keys``:
    every ``dramatiq:{queue}*`` key of the prefix's queues with its ``PTTL``: a doorbell
    (``...:bell``) must expire within :data:`BELL_TTL_MS`, dead letters (``.XQ``,
    ``.XQ.msgs``) may stay (maintenance expires them), any other queue key is a violation.
    ``caps_ttls_ms``: the longest TTL of the capped jobs' records by kind (``slots``: two
    leases; ``rate``: the window and a second); the lists of waiting messages must be gone.
    """
    result = CheckResult(
        7, "nothing left behind but TTL-bound records", len(keys) + len(queue_keys)
    )
    root = f"kumiko:{queue_prefix}:"
    marker_ttls = marker_ttls_ms or {}
    counts: dict[str, int] = defaultdict(int)
    for key, pttl in keys:
        if pttl == -2:
            continue
        kind = key[len(root) :].split(":", 1)[0] if key.startswith(root) else "?"
        counts[kind] += 1
        if kind in OWN or kind in PERSISTENT:
            continue
        if history_ttl_ms is not None and kind in HISTORY_INDEXES:
            continue
        if kind in PRESENCE:
            if pttl < 0:
                result.violations.append(f"liveness entry without a TTL: {key}")
            continue
        if caps_ttls_ms is not None and kind in caps_ttls_ms:
            _bound(result, key, pttl, caps_ttls_ms[kind])
        elif history_ttl_ms is not None and kind in HISTORY:
            _bound(result, key, pttl, history_ttl_ms)
        elif kind in MUST_BE_GONE:
            result.violations.append(f"{kind} record left behind: {key} (pttl {pttl} ms)")
        elif kind in MARKERS:
            _bound(result, key, pttl, marker_ttls.get(kind, ttl_bound_ms))
        elif kind in STATS:
            _bound(result, key, pttl, STATS_TTL_MS)
        elif kind in HOLD_ASKS:
            _bound(result, key, pttl, HOLD_ASKS_TTL_MS)
        elif kind in TTL_BOUND:
            message_id = key[len(root) + len(kind) + 1 :]
            if kind == "enqueued" and guarded is not None and message_id not in guarded:
                result.violations.append(
                    f"enqueue guard of {message_id}, which is no fan-out child, cron tick or "
                    f"boot job (a sequential hand-off's?): {key} (pttl {pttl} ms)"
                )
            _bound(result, key, pttl, ttl_bound_ms)
        elif pttl < 0:
            result.violations.append(f"unknown record without a TTL: {key}")
        else:
            result.notes.append(f"unknown TTL-bound record: {key} (pttl {pttl} ms)")
    for key, pttl in queue_keys:
        if pttl == -2:
            continue
        if key.endswith(":bell"):
            counts["(queue) bell"] += 1
            _bound(result, key, pttl, BELL_TTL_MS)
        elif key.endswith((".XQ", ".XQ.msgs")):
            counts["(queue) dead letters"] += 1
        elif key.endswith(":counts"):
            # the per-job message counts (``keys.queue_counts``): a few fields per job, kept
            # as long as the queue (docs/operations.md)
            counts["(queue) counts"] += 1
        else:
            counts["(queue) other"] += 1
            result.violations.append(f"queue key left behind: {key} (pttl {pttl} ms)")
    result.violations += [f"stuck: {item}" for item in stuck]
    result.violations += [
        f"history record still running after every message settled: {item}" for item in running
    ]
    result.notes.insert(
        0, "keys by kind: " + ", ".join(f"{k}={v}" for k, v in sorted(counts.items()))
    )
    return result


def _bound(result: CheckResult, key: str, pttl: int, bound_ms: int) -> None:
    """A violation unless ``key`` expires within ``bound_ms``."""
    if pttl < 0 or pttl > bound_ms:
        result.violations.append(f"{key}: pttl {pttl} ms, expected a TTL of at most {bound_ms} ms")


# -- 8. malformed messages ---------------------------------------------------------------------


def check_malformed(
    pushed: Sequence[Malformed],
    dead_lettered: set[str],
    log_text: str,
    index: RunIndex,
) -> CheckResult:
    """8. Each malformed message was dead-lettered with a logged reason and never ran
    (no run of its message id, if it has one), and the workers kept going: some job
    completed after the last push."""
    result = CheckResult(8, "malformed messages dead-lettered, workers kept going", len(pushed))
    found = [m for m in pushed if m.redis_message_id in dead_lettered]
    for item in pushed:
        ran = [] if item.message_id is None else index.by_message.get(item.message_id, [])
        if ran:
            result.violations.append(
                f"{item.kind} message {item.message_id} ran {len(ran)} time(s) (first: "
                f"{ran[0].describe()}): it must be dead-lettered at fetch, unrun"
            )
        if item.redis_message_id not in dead_lettered:
            result.violations.append(
                f"{item.kind} message {item.redis_message_id} (pushed {item.pushed_at:.3f}) "
                "was not dead-lettered"
            )
        if item.needle not in log_text:
            result.violations.append(
                f"{item.kind} message {item.redis_message_id}: no logged reason "
                f"(looked for {item.needle!r})"
            )
    if pushed:
        last = max(item.pushed_at for item in pushed)
        if not any(run.ended is not None and run.started > last for run in index.runs):
            result.violations.append("no job completed after the last malformed message")
    kinds: dict[str, int] = defaultdict(int)
    for item in found:
        kinds[item.kind] += 1
    result.notes.append(
        f"{len(found)} of {len(pushed)} in the dead-letter queue ("
        + ", ".join(f"{k}={v}" for k, v in sorted(kinds.items()))
        + ")"
    )
    return result


# -- 9. poison messages ------------------------------------------------------------------------


def check_poison(
    poisons: Sequence[Poison],
    job: str,
    index: RunIndex,
    dead_letters: Mapping[str, DeadLetter],
    log_text: str,
    max_deliveries: int,
    *,
    kills: Sequence[Kill] = (),
    deaths: Sequence[Kill] = (),
) -> CheckResult:
    """9. Each poison message (a message of ``job``: dispatched, or seen running) was
    delivered ``max_deliveries`` times, each ending in its worker's death, then
    dead-lettered at fetch with the logged reason "worker died during N deliveries";
    from its second run on it ran alone in its worker (its death cut no other run);
    healthy jobs completed after the first poison was dispatched; and every worker
    death (``deaths``) had a poison run in it: any other death is a violation.

    A poison message with fewer runs than ``max_deliveries`` passes only if as many of
    the driver's SIGKILLs (``kills``) fell in its lifetime (dispatch to dead letter),
    each of a worker it never ran in: a SIGKILL of a worker that holds the message
    before its handler starts swallows a delivery without a run.
    """
    dispatched = {poison.message_id: poison for poison in poisons}
    seen = sorted({run.message_id for run in index.of_job(job)} - set(dispatched))
    for message_id in seen:
        started = index.by_message[message_id][0].started
        dispatched[message_id] = Poison("unconfirmed", message_id, started)
    result = CheckResult(
        9,
        f"poison messages dead-lettered after {max_deliveries} deaths, nothing else died",
        len(dispatched),
    )
    if seen:
        result.notes.append(f"{len(seen)} poison message(s) ran whose dispatch raised: {seen}")
    buried_lines = [
        line
        for line in log_text.splitlines()
        if "dead-lettering message" in line and "worker died during" in line
    ]
    want = f"worker died during {max_deliveries} deliveries"
    runs_of_poison = 0
    for message_id, poison in dispatched.items():
        label = f"{poison.kind} poison {message_id}"
        runs = index.by_message.get(message_id, [])
        runs_of_poison += len(runs)
        letter = dead_letters.get(message_id)
        end = math.inf
        if letter is None:
            result.violations.append(f"{label} was not dead-lettered ({len(runs)} run(s))")
        else:
            end = letter.at
            needle = f"dead-lettering message {letter.redis_message_id} on "
            logged = [line for line in buried_lines if needle in line]
            if not any(want in line for line in logged):
                result.violations.append(
                    f"{label}: no log line {needle}...: {want!r}; logged: {logged[:2]}"
                )
            late = [run for run in runs if run.started > letter.at]
            if late:
                result.violations.append(
                    f"{label} ran after it was dead-lettered at {letter.at:.3f}: "
                    f"{late[0].describe()}"
                )
        for run in runs:
            if run.outcome != "cut":
                result.violations.append(f"{label}: its handler returned: {run.describe()}")
        if len(runs) > max_deliveries:
            result.violations.append(
                f"{label} ran {len(runs)} times, more than max_deliveries ({max_deliveries})"
            )
        elif len(runs) < max_deliveries:
            missing = max_deliveries - len(runs)
            pgids = {run.pgid for run in runs}
            swallowing = [
                kill
                for kill in kills
                if poison.dispatched_at <= kill.at <= end and kill.pgid not in pgids
            ]
            text = (
                f"{label} ran {len(runs)} times, not max_deliveries ({max_deliveries}); "
                f"{len(swallowing)} SIGKILL(s) of other workers in its lifetime"
            )
            if len(swallowing) >= missing:
                result.notes.append(f"{text} may have swallowed {missing} delivery(ies)")
            else:
                result.violations.append(text)
        for delivery, run in enumerate(runs[1:], start=2):
            beside = [
                other
                for other in index.runs
                if other.pgid == run.pgid and other.token != run.token and other.outcome == "cut"
            ]
            if beside:
                result.violations.append(
                    f"{label}: run {delivery} did not run alone: its worker's death cut "
                    f"{len(beside)} other run(s), e.g. {beside[0].describe()}"
                )
    for death in deaths:
        culprits = [
            run
            for run in index.runs
            if run.pgid == death.pgid
            and run.job == job
            and run.outcome == "cut"
            and run.started <= death.at
        ]
        if not culprits:
            result.violations.append(
                f"process died on its own: worker {death.pgid} (noticed at {death.at:.3f}) "
                "with no poison message running in it"
            )
    if dispatched:
        first = min(poison.dispatched_at for poison in dispatched.values())
        healthy = [
            run
            for run in index.runs
            if run.job != job and run.ended is not None and run.started > first
        ]
        if not healthy:
            result.violations.append(
                f"no healthy job completed after the first poison message ({first:.3f})"
            )
        during = []
        for poison in dispatched.values():
            letter = dead_letters.get(poison.message_id)
            until = math.inf if letter is None else letter.at
            during.append(sum(1 for run in healthy if poison.dispatched_at < run.started < until))
        result.notes.append(
            f"{runs_of_poison} poison run(s), {len(deaths)} worker death(s) on their own; "
            f"healthy jobs completed while each poison was undecided: {during}"
        )
    return result


# -- summary -----------------------------------------------------------------------------------


def summary_line(
    dispatched: int, runs: int, faults: Mapping[str, int], results: Sequence[CheckResult]
) -> str:
    violations = sum(len(result.violations) for result in results)
    injected = ", ".join(f"{kind} {count}" for kind, count in sorted(faults.items()))
    return (
        f"soak: {dispatched} jobs dispatched, {runs} runs, faults injected: {injected} "
        f"({sum(faults.values())} in all), violations: {violations}"
    )
