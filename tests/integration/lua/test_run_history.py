"""State tables of the run history's own writes: ``run_put`` (one record outside a delivery)
and ``trim_runs`` (ages and cap). The records ``fetch_lane`` and ``settle`` write are in
:mod:`~tests.integration.lua.test_fetch` and :mod:`~tests.integration.lua.test_settle`. Rows
and helpers: :mod:`tests.integration.lua.tables`."""

from __future__ import annotations

from typing import Any

import pytest
import redis

from tests.integration.lua.tables import (
    CANCELLED_M1,
    CAP,
    COMPLETED_TTL,
    FAILED_M1,
    FAILED_TTL,
    INDEX_TTL,
    INDEX_TTL_SLACK,
    NOW,
    PAST_COMPLETED_AGE,
    PAST_FAILED_AGE,
    ROOT,
    RUN_WORKER,
    SECOND_ATTEMPT,
    STARTED_AT,
    TENANT_JOB,
    Env,
    J,
    State,
    Z,
    by_job,
    by_origin,
    by_status,
    by_tenant,
    ended,
    indexed,
    merge,
    record,
    run_hash,
    text,
)


# One record outside a delivery (boot gates, which write "running" and then the end): the
# hash field of its attempt, its job and status index entries scored by the write's time
# (an older status's entries of the same attempt removed), its tenant's and origin's
# entries; the hash lives the record's status TTL (at least the failed TTL after the first
# attempt), the tenant and origin indexes the longer TTL. Kumiko's Python writes records
# compact, but json.dumps's default ", " and ": " must read the same.
def _run_put(
    env: Env,
    run: J,
    *,
    python: bool = False,
    at: int = NOW,
    cap: int = CAP,
    budget: int = 0,
    completed_ttl: int | str = COMPLETED_TTL,
    failed_ttl: int | str = FAILED_TTL,
) -> Any:
    """run_put of ``run`` as RunHistory.put calls it (ARGV[1..12], ARGV[13] trim budget)."""
    filled = env.fill_value(run)
    return env.lua.run_put(
        keys=[env.key(run_hash(run["m"]))],
        args=[
            env.key(ROOT),
            run["m"],
            run["a"],
            run["j"],
            run["s"],
            run.get("t", ""),
            run["o"],
            at,
            filled.python() if python else filled.compact(),
            completed_ttl,
            failed_ttl,
            cap,
            budget,
        ],
    )


RUNNING_GATE = record("m1", 1, "running", st=STARTED_AT, w=RUN_WORKER)
TENANT_FAILED = ended(job=TENANT_JOB, max_attempts=2, status="failed", t="acme", o="o1")


@pytest.mark.parametrize(
    ("given", "run", "python", "after", "expiry"),
    [
        pytest.param(
            {},
            ended(),
            False,
            indexed(ended(), NOW),
            {run_hash("m1"): COMPLETED_TTL},
            id="a-completed-record-lives-the-completed-ttl",
        ),
        pytest.param(
            {},
            FAILED_M1,
            False,
            indexed(FAILED_M1, NOW),
            {run_hash("m1"): FAILED_TTL},
            id="a-failed-record-lives-the-failed-ttl",
        ),
        pytest.param(
            {},
            CANCELLED_M1,
            False,
            indexed(CANCELLED_M1, NOW),
            {run_hash("m1"): COMPLETED_TTL},
            id="a-cancelled-record-lives-the-completed-ttl",
        ),
        pytest.param(
            {},
            RUNNING_GATE,
            False,
            indexed(RUNNING_GATE, NOW),
            {run_hash("m1"): FAILED_TTL},
            id="a-running-record-lives-the-failed-ttl",
        ),
        pytest.param(
            indexed(FAILED_M1, NOW - 60_000),
            SECOND_ATTEMPT,
            False,
            merge(indexed(FAILED_M1, NOW - 60_000), indexed(SECOND_ATTEMPT, NOW)),
            {run_hash("m1"): FAILED_TTL},
            id="a-later-completed-attempt-keeps-the-failed-ttl",
        ),
        pytest.param(
            {
                run_hash("m1"): {"1": RUNNING_GATE.python()},
                by_job("running"): Z({"m1:1": STARTED_AT}),
                by_status("running"): Z({"m1:1": STARTED_AT, "m0:1": STARTED_AT}),
            },
            ended(),
            True,
            {**indexed(ended(), NOW), by_status("running"): Z({"m0:1": STARTED_AT})},
            {run_hash("m1"): COMPLETED_TTL},
            id="python-json-running-then-completed-leaves-the-running-indexes",
        ),
        pytest.param(
            indexed(RUNNING_GATE, STARTED_AT),
            ended(),
            False,
            indexed(ended(), NOW),
            {run_hash("m1"): COMPLETED_TTL},
            id="compact-json-running-then-completed-leaves-the-running-indexes",
        ),
        pytest.param(
            indexed(ended(), NOW - 60_000),
            ended(),
            True,
            indexed(ended(), NOW),
            {run_hash("m1"): COMPLETED_TTL},
            id="the-same-status-again-is-scored-anew",
        ),
        pytest.param(
            {by_tenant("acme"): Z({"m0:1": NOW - 1_000}), by_origin("o1"): Z({"o1:1": NOW})},
            TENANT_FAILED,
            True,
            merge(
                {by_tenant("acme"): Z({"m0:1": NOW - 1_000}), by_origin("o1"): Z({"o1:1": NOW})},
                indexed(TENANT_FAILED, NOW),
            ),
            {run_hash("m1"): FAILED_TTL, by_tenant("acme"): INDEX_TTL, by_origin("o1"): INDEX_TTL},
            id="tenant-and-origin-indexes-join-and-live-the-longer-ttl",
        ),
    ],
)
def test_run_put(
    env: Env, given: State, run: J, python: bool, after: State, expiry: dict[str, int]
) -> None:
    env.seed(given)

    assert _run_put(env, run, python=python) == 1

    env.assert_state(after)
    env.assert_expiry(expiry)


@pytest.mark.parametrize(
    ("completed_ttl", "failed_ttl", "attempt", "status", "ttl"),
    [
        pytest.param(
            COMPLETED_TTL, FAILED_TTL, 1, "completed", COMPLETED_TTL, id="first-completed"
        ),
        pytest.param(COMPLETED_TTL, FAILED_TTL, 1, "dead", FAILED_TTL, id="first-dead"),
        pytest.param(COMPLETED_TTL, FAILED_TTL, 2, "completed", FAILED_TTL, id="later-completed"),
        pytest.param(COMPLETED_TTL, FAILED_TTL, 3, "cancelled", FAILED_TTL, id="later-cancelled"),
        pytest.param(
            FAILED_TTL, COMPLETED_TTL, 2, "completed", FAILED_TTL, id="later-completed-longer"
        ),
        pytest.param(
            FAILED_TTL, COMPLETED_TTL, 2, "failed", COMPLETED_TTL, id="later-failed-shorter"
        ),
        pytest.param(FAILED_TTL, COMPLETED_TTL, 1, "running", COMPLETED_TTL, id="first-running"),
    ],
)
def test_run_put_hash_ttl_is_the_status_ttl_at_least_the_failed_one_after_attempt_1(
    env: Env, completed_ttl: int, failed_ttl: int, attempt: int, status: str, ttl: int
) -> None:
    run = ended(attempt=attempt, status=status, job=TENANT_JOB, max_attempts=3, t="acme")

    _run_put(env, run, completed_ttl=completed_ttl, failed_ttl=failed_ttl)

    env.assert_state(indexed(run, NOW))
    env.assert_expiry(
        {run_hash("m1"): ttl, by_tenant("acme"): max(completed_ttl, failed_ttl) + INDEX_TTL_SLACK}
    )


@pytest.mark.parametrize(
    ("completed_ttl", "failed_ttl"),
    [
        pytest.param(0, FAILED_TTL, id="completed-ttl-0"),
        pytest.param("1.5", FAILED_TTL, id="completed-ttl-fraction"),
        pytest.param(COMPLETED_TTL, "soon", id="failed-ttl-not-a-number"),
        pytest.param(COMPLETED_TTL, 2**48 + 1, id="failed-ttl-beyond-2-48"),
    ],
)
def test_run_put_refuses_a_bad_ttl_before_writing(
    env: Env, completed_ttl: int | str, failed_ttl: int | str
) -> None:
    with pytest.raises(redis.ResponseError, match="TTL must be an integer"):
        _run_put(env, ended(), completed_ttl=completed_ttl, failed_ttl=failed_ttl)

    env.assert_state({})


# trim_runs (lua/_history.lua, run by run_put and settle with a budget): run_put
# writes NEW (failed, at NOW), then trims: index entries older than their status age
# leave the status indexes and the written job's; then, while more records than the cap are
# indexed (running ones count), the oldest go, completed first, then cancelled, failed and
# dead (never running), at most the budget: each dropped record leaves its hash and its job,
# tenant and origin indexes (as far as its record tells them).
NEW = ended("m9", status="failed")
C1, C2 = ended("c1"), ended("c2")
X1 = record("x1", 1, "cancelled", en=NOW)
F1, F2 = ended("f1", status="failed"), ended("f2", status="failed")
D1 = ended("d1", status="dead")
OTHER_JOB_C9 = ended("c9", job=TENANT_JOB, max_attempts=2)
TENANT_C1 = ended("c1", job=TENANT_JOB, max_attempts=2, t="acme", o="o1")
TENANT_C2 = ended("c2", job=TENANT_JOB, max_attempts=2, t="acme", o="o1")


@pytest.mark.parametrize(
    ("given", "cap", "budget", "after"),
    [
        pytest.param(
            merge(indexed(C1, PAST_COMPLETED_AGE), indexed(C2, NOW - 5_000)),
            1,
            0,
            merge(indexed(C1, PAST_COMPLETED_AGE), indexed(C2, NOW - 5_000), indexed(NEW, NOW)),
            id="budget-0-trims-nothing",
        ),
        pytest.param(
            merge(
                indexed(C1, PAST_COMPLETED_AGE),
                indexed(OTHER_JOB_C9, PAST_COMPLETED_AGE),
                indexed(F1, PAST_COMPLETED_AGE),
                indexed(F2, PAST_FAILED_AGE),
            ),
            CAP,
            4,
            merge(
                {
                    run_hash("c1"): {"1": C1},
                    run_hash("c9"): {"1": OTHER_JOB_C9},
                    run_hash("f2"): {"1": F2},
                    by_job("completed", TENANT_JOB): Z({"c9:1": PAST_COMPLETED_AGE}),
                },
                indexed(F1, PAST_COMPLETED_AGE),
                indexed(NEW, NOW),
            ),
            id="entries-past-their-status-age-leave-the-status-and-this-jobs-indexes",
        ),
        pytest.param(
            merge(
                indexed(C1, NOW - 5_000),
                indexed(C2, NOW - 4_000),
                indexed(X1, NOW - 9_000),
                indexed(F1, NOW - 8_000),
                indexed(D1, NOW - 9_500),
            ),
            3,
            32,
            merge(indexed(F1, NOW - 8_000), indexed(D1, NOW - 9_500), indexed(NEW, NOW)),
            id="beyond-the-cap-completed-go-first-then-cancelled",
        ),
        pytest.param(
            merge(indexed(F1, NOW - 5_000), indexed(D1, NOW - 9_000)),
            2,
            32,
            merge(indexed(D1, NOW - 9_000), indexed(NEW, NOW)),
            id="failed-go-before-older-dead-ones",
        ),
        pytest.param(
            merge(indexed(C1, NOW - 5_000), indexed(C2, NOW - 4_000), indexed(F1, NOW - 8_000)),
            1,
            2,
            merge(indexed(F1, NOW - 8_000), indexed(NEW, NOW)),
            id="the-budget-bounds-the-drops-a-lowered-cap-is-reached-later",
        ),
        pytest.param(
            merge(indexed(TENANT_C1, NOW - 5_000), indexed(TENANT_C2, NOW - 4_000)),
            2,
            32,
            merge(indexed(TENANT_C2, NOW - 4_000), indexed(NEW, NOW)),
            id="a-dropped-record-leaves-its-tenant-and-origin-indexes",
        ),
        pytest.param(
            {
                by_status("completed"): Z({"c1:1": NOW - 5_000}),
                by_job("completed"): Z({"c1:1": NOW - 5_000}),
            },
            1,
            32,
            {by_job("completed"): Z({"c1:1": NOW - 5_000}), **indexed(NEW, NOW)},
            id="an-entry-whose-record-expired-leaves-the-status-index-only",
        ),
        pytest.param(
            {by_status("completed"): Z({"junk": NOW - 5_000})},
            1,
            32,
            indexed(NEW, NOW),
            id="a-member-without-an-attempt-leaves-the-status-index",
        ),
        pytest.param(
            {
                run_hash("c1"): {"1": "not json {"},
                by_status("completed"): Z({"c1:1": NOW - 5_000}),
                by_job("completed"): Z({"c1:1": NOW - 5_000}),
            },
            1,
            32,
            {by_job("completed"): Z({"c1:1": NOW - 5_000}), **indexed(NEW, NOW)},
            id="an-unreadable-record-is-dropped-with-its-status-entry",
        ),
        pytest.param(
            merge(
                {
                    by_status("running"): Z({"b1:1": PAST_FAILED_AGE, "b2:1": PAST_COMPLETED_AGE}),
                    by_job("running"): Z({"b1:1": PAST_FAILED_AGE, "b2:1": PAST_COMPLETED_AGE}),
                },
                indexed(C1, NOW - 5_000),
            ),
            2,
            32,
            {
                by_status("running"): Z({"b2:1": PAST_COMPLETED_AGE}),
                by_job("running"): Z({"b2:1": PAST_COMPLETED_AGE}),
                **indexed(NEW, NOW),
            },
            id="running-entries-age-out-at-the-failed-age-count-but-are-never-dropped",
        ),
    ],
)
def test_trim_runs(env: Env, given: State, cap: int, budget: int, after: State) -> None:
    env.seed(given)

    assert _run_put(env, NEW, cap=cap, budget=budget) == 1

    env.assert_state(after)


def test_trim_runs_ages_out_a_bounded_step_per_index(env: Env) -> None:
    # Given indexes whose 2,100 entries all aged out during a quiet spell (their records gone)
    aged = Z({f"q{n}:1": PAST_COMPLETED_AGE - n for n in range(2_100)})
    env.seed({by_status("completed"): aged, by_job("completed"): aged})

    # When a write trims (under a cap it does not reach): 2,000 entries leave each index, the
    # oldest first (one trim never holds Redis for the whole index)
    assert _run_put(env, NEW, cap=10_000, budget=32) == 1
    left = text(env.client.zrange(env.key(by_status("completed")), 0, -1))
    assert left == [f"q{n}:1" for n in range(99, -1, -1)]
    assert env.client.zcard(env.key(by_job("completed"))) == 100

    # And the next trim takes the rest
    assert _run_put(env, NEW, cap=10_000, budget=32) == 1
    assert env.client.zcard(env.key(by_status("completed"))) == 0
    assert env.client.zcard(env.key(by_job("completed"))) == 0
