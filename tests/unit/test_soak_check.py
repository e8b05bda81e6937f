"""The soak's checker, fed hand-made records: each kind of violation is reported."""

from __future__ import annotations

import random
from typing import Any

from tests.soak import check
from tests.soak.check import (
    DeadLetter,
    DelayedBurst,
    Expected,
    KeyedDispatch,
    Kill,
    KillLog,
    Malformed,
    Poison,
    RunIndex,
)
from tests.soak.run import FAULT_ROUND, completed_drops, deal, log_digest, misfired_ranges

JOB = "soak:job:parallel"
SEQ = "soak:job:sequential"
TENANT_JOB = "soak:job:per_tenant"
TICK = "soak:job:tick"
BOOT = "soak:job:boot"
POISON = "soak:job:poison"


def run(
    token: str,
    start: float,
    *,
    end: float | None = None,
    fail: float | None = None,
    job: str = JOB,
    mid: str = "m1",
    attempt: int = 1,
    n: int | None = 1,
    tenant: str | None = None,
    sched: float | None = None,
    pgid: int = 100,
) -> list[dict[str, Any]]:
    """The records of one handler call."""
    base = {
        "run": token,
        "job": job,
        "mid": mid,
        "attempt": attempt,
        "n": n,
        "tenant": tenant,
        "sched": sched,
        "pgid": pgid,
        "pid": pgid + 1,
    }
    records = [{**base, "ev": "start", "t": start}]
    if end is not None:
        records.append({**base, "ev": "end", "t": end})
    if fail is not None:
        records.append({**base, "ev": "fail", "t": fail})
    return records


def index(*calls: list[dict[str, Any]]) -> RunIndex:
    runs, problems = check.assemble_runs([record for call in calls for record in call])
    assert problems == []
    return RunIndex(runs)


def no_kills() -> KillLog:
    return KillLog([])


def expected(fail_first: int = 0, **kw: Any) -> Expected:
    kw.setdefault("n", 1)
    return Expected("job", kw.pop("job", JOB), fail_first, 3, **kw)


# -- assembling ---------------------------------------------------------------------------------


def test_a_record_stored_twice_by_a_retried_push_counts_once() -> None:
    records = run("r1", 1.0, end=2.0)
    runs, problems = check.assemble_runs([*records, records[1]])
    assert problems == []
    assert [(r.token, r.outcome) for r in runs] == [("r1", "completed")]


def test_an_end_without_a_start_is_reported() -> None:
    _, problems = check.assemble_runs(run("r1", 1.0, end=2.0)[1:])
    assert problems == ["run r1: ['end'] recorded without a start"]


# -- 1. terminal states -------------------------------------------------------------------------


def test_a_job_completing_after_its_planned_failures_passes() -> None:
    runs = index(
        run("a", 1.0, fail=1.1, attempt=1),
        run("b", 2.0, fail=2.1, attempt=2),
        run("c", 3.0, end=3.1, attempt=3),
    )
    assert check.check_terminal([expected(2)], runs, no_kills()).passed


def test_a_job_that_never_finished_is_reported() -> None:
    runs = index(run("a", 1.0, fail=1.1, attempt=1))
    result = check.check_terminal([expected(1)], runs, no_kills())
    assert "never reached a final state" in result.violations[0]


def test_a_kill_counted_as_a_failed_attempt_is_reported() -> None:
    # The run of attempt 1 was cut by a kill, yet the redelivery ran as attempt 2.
    runs = index(run("a", 1.0, attempt=1, pgid=7), run("b", 5.0, end=5.1, attempt=2, pgid=8))
    result = check.check_terminal([expected(0)], runs, KillLog([Kill(7, 2.0)]))
    assert "wrong outcome" in result.violations[0]


def test_a_job_failing_for_good_needs_exactly_all_attempts_and_a_dead_letter() -> None:
    runs = index(*(run(f"r{a}", a, fail=a + 0.1, attempt=a) for a in (1, 2, 3)))
    result = check.check_terminal([expected(3)], runs, no_kills(), dead_lettered={"m1"})
    assert result.passed
    missing = check.check_terminal([expected(3)], runs, no_kills(), dead_lettered=set())
    assert "is not dead-lettered" in missing.violations[0]


def test_a_job_failing_for_good_too_early_is_reported() -> None:
    runs = index(*(run(f"r{a}", a, fail=a + 0.1, attempt=a) for a in (1, 2)))
    result = check.check_terminal([expected(3)], runs, no_kills())
    assert "must fail for good after exactly 3 failed attempts" in result.violations[0]


def test_a_keyed_dispatch_whose_id_never_ran_afterwards_is_reported() -> None:
    runs = index(run("a", 1.0, end=1.5, mid="d1", n=None))
    job = expected(0, n=None, message_id="d1")
    result = check.check_terminal([job], runs, no_kills(), keyed=[KeyedDispatch("d1", 1.2)])
    assert "a trigger was lost" in result.violations[0]
    assert check.check_terminal([job], runs, no_kills(), keyed=[KeyedDispatch("d1", 0.9)]).passed


def test_a_run_cut_short_without_a_kill_is_reported() -> None:
    runs = index(run("a", 1.0, pgid=7), run("b", 5.0, end=5.1, pgid=8))
    result = check.check_terminal([expected(0)], runs, no_kills())
    assert "its worker was never killed" in result.violations[0]
    assert check.check_terminal([expected(0)], runs, KillLog([Kill(7, 2.0)])).passed


# -- 2. re-runs -----------------------------------------------------------------------------------


def test_a_run_after_the_completed_marker_is_reported() -> None:
    runs = index(run("a", 1.0, end=1.1, pgid=7), run("b", 9.0, end=9.1, pgid=8))
    result, _ = check.check_reruns(runs, {"m1": 1.2}, KillLog([Kill(7, 1.15)]))
    assert "after its id completed" in result.violations[0]


def test_a_rerun_after_a_kill_between_end_and_ack_is_explained() -> None:
    runs = index(run("a", 1.0, end=1.1, pgid=7), run("b", 5.0, end=5.1, pgid=8))
    result, explained = check.check_reruns(runs, {"m1": 5.2}, KillLog([Kill(7, 1.15)]))
    assert result.passed
    assert explained == {"b"}


def test_a_rerun_without_a_kill_is_reported() -> None:
    runs = index(run("a", 1.0, end=1.1, pgid=7), run("b", 5.0, end=5.1, pgid=8))
    result, explained = check.check_reruns(runs, {}, no_kills())
    assert "was not killed in between" in result.violations[0]
    assert explained == frozenset()


def test_an_attempt_that_failed_twice_without_a_kill_is_reported() -> None:
    runs = index(run("a", 1.0, fail=1.1, pgid=7), run("b", 2.0, fail=2.1, pgid=8))
    result, _ = check.check_reruns(runs, {}, no_kills())
    assert not result.passed


def test_two_deliveries_of_one_id_at_once_are_reported() -> None:
    runs = index(run("a", 1.0, end=2.0, pgid=7), run("b", 1.5, end=2.5, pgid=8))
    result, _ = check.check_reruns(runs, {}, no_kills())
    assert "two deliveries at once" in result.violations[0]


def test_a_completed_id_without_its_marker_is_reported() -> None:
    runs = index(run("a", 1.0, end=1.1), run("b", 2.0, fail=2.1, mid="m2"))
    result, _ = check.check_reruns(runs, {}, no_kills(), marked=set())
    assert len(result.violations) == 1
    assert "without an 'already completed' marker" in result.violations[0]
    assert check.check_reruns(runs, {}, no_kills(), marked={"m1"})[0].passed


def test_a_retry_chain_that_forked_is_reported_in_both_checks() -> None:
    # Attempt 2 failed and its worker died after enqueuing attempt 3 but before the
    # ack: attempt 2 was redelivered, failed again and enqueued a second attempt 3.
    runs = index(
        run("a", 1.0, fail=1.1, attempt=1, pgid=7),
        run("b", 2.0, fail=2.1, attempt=2, pgid=7),
        run("c", 2.5, fail=2.6, attempt=3, pgid=8),
        run("d", 5.0, fail=5.1, attempt=2, pgid=8),
        run("e", 5.3, fail=5.4, attempt=3, pgid=8),
    )
    kills = KillLog([Kill(7, 2.15)])
    reruns, explained = check.check_reruns(runs, {}, kills)
    assert [text.split(":")[0] for text in reruns.violations] == [
        "retry chain forked",
        "attempt ran twice",
    ]
    terminal = check.check_terminal([expected(3)], runs, kills, explained=explained)
    assert "failures on attempts [1, 2, 2, 3, 3]" in terminal.violations[0]


def test_a_failed_attempt_redelivered_before_its_retry_was_enqueued_is_explained() -> None:
    runs = index(
        run("a", 1.0, fail=1.1, attempt=1, pgid=7),
        run("b", 5.0, fail=5.1, attempt=1, pgid=8),
        run("c", 5.3, end=5.4, attempt=2, pgid=8),
    )
    kills = KillLog([Kill(7, 1.15)])
    reruns, explained = check.check_reruns(runs, {"m1": 5.5}, kills)
    assert reruns.passed
    assert explained == {"b"}
    assert check.check_terminal([expected(1)], runs, kills, explained=explained).passed
    assert not check.check_terminal([expected(1)], runs, kills).passed


def test_a_retry_after_a_failed_attempt_is_no_rerun() -> None:
    runs = index(run("a", 1.0, fail=1.1, attempt=1), run("b", 1.3, end=1.4, attempt=2))
    result, _ = check.check_reruns(runs, {"m1": 1.5}, no_kills())
    assert result.passed


BURST = DelayedBurst(("m1", "m2"), due=3.0, pgid=7, held=2, unmoved=1)


def test_a_delayed_burst_that_ran_once_each_passes() -> None:
    runs = index(run("a", 3.1, end=3.2, pgid=8), run("b", 3.1, end=3.2, mid="m2", pgid=8))
    result, _ = check.check_reruns(runs, {"m1": 3.3, "m2": 3.3}, no_kills(), bursts=[BURST])
    assert result.passed
    assert "1 delayed burst(s) of 2 message(s)" in result.notes[-1]


def test_a_second_copy_of_a_delayed_message_is_reported_even_unrun() -> None:
    runs = index(run("a", 3.1, end=3.2, pgid=8), run("b", 3.1, end=3.2, mid="m2", pgid=8))
    dropped = {"m2": 1, "m9": 2}
    result, _ = check.check_reruns(runs, {}, no_kills(), bursts=[BURST], dropped=dropped)
    assert result.violations == [
        "delayed message m2 had a second copy (1 acked unrun as already completed): its move "
        "from the delay queue left a copy behind"
    ]
    assert any("2 copies of 1 completed message id(s)" in note for note in result.notes)


def test_a_delayed_message_the_kill_lost_is_reported() -> None:
    runs = index(run("a", 3.1, end=3.2, pgid=8))
    result, _ = check.check_reruns(runs, {}, no_kills(), bursts=[BURST])
    assert "1 message(s) never ran" in result.violations[0]


def test_completed_drops_are_counted_from_the_worker_logs() -> None:
    line = "[t] [WARNING] message {} on p-worker already completed: acked without running it again"
    log = "\n".join([line.format("m1"), "other", line.format("m1"), line.format("m2")])
    assert completed_drops(log) == {"m1": 2, "m2": 1}


# -- 3. per-tenant --------------------------------------------------------------------------------


def tenant_run(token: str, tenant: str, start: float, **kw: Any) -> list[dict[str, Any]]:
    kw.setdefault("mid", f"child-{tenant}")
    return run(token, start, end=start + 0.1, job=TENANT_JOB, tenant=tenant, **kw)


def test_every_tenant_completing_once_passes() -> None:
    runs = index(tenant_run("a", "t1", 1.0), tenant_run("b", "t2", 1.0))
    assert check.check_tenants(TENANT_JOB, [1], ["t1", "t2"], runs, frozenset()).passed


def test_a_tenant_child_completing_twice_is_reported() -> None:
    runs = index(tenant_run("a", "t1", 1.0), tenant_run("b", "t1", 5.0), tenant_run("c", "t2", 1))
    result = check.check_tenants(TENANT_JOB, [1], ["t1", "t2"], runs, frozenset())
    assert result.violations == ["wrapper n=1 tenant t1: child completed 2 times"]
    assert check.check_tenants(TENANT_JOB, [1], ["t1", "t2"], runs, frozenset({"b"})).passed


def test_a_tenant_child_enqueued_under_two_ids_is_reported() -> None:
    runs = index(tenant_run("a", "t1", 1.0), tenant_run("b", "t1", 5.0, mid="other"))
    result = check.check_tenants(TENANT_JOB, [1], ["t1"], runs, frozenset({"b"}))
    assert "child enqueued under 2 ids" in result.violations[0]


def test_a_missing_tenant_is_reported() -> None:
    runs = index(tenant_run("a", "t1", 1.0))
    result = check.check_tenants(TENANT_JOB, [1], ["t1", "t2"], runs, frozenset())
    assert result.violations == ["wrapper n=1 tenant t2: child completed 0 times"]


# -- 4. sequential -------------------------------------------------------------------------------


def test_back_to_back_sequential_runs_pass() -> None:
    runs = index(run("a", 1.0, end=2.0, job=SEQ, mid="s1"), run("b", 2.1, end=3, job=SEQ, mid="s2"))
    assert check.check_sequential([SEQ], runs, no_kills()).passed


def test_overlapping_sequential_runs_are_reported() -> None:
    runs = index(run("a", 1.0, end=2.0, job=SEQ, mid="s1"), run("b", 1.5, end=3, job=SEQ, mid="s2"))
    result = check.check_sequential([SEQ], runs, no_kills())
    assert "overlap of 0.500 s" in result.violations[0]


def test_a_run_starting_before_a_cut_run_was_killed_overlaps_it() -> None:
    runs = index(
        run("a", 1.0, job=SEQ, mid="s1", pgid=7), run("b", 2.0, end=3, job=SEQ, mid="s2", pgid=8)
    )
    assert not check.check_sequential([SEQ], runs, KillLog([Kill(7, 2.5)])).passed
    assert check.check_sequential([SEQ], runs, KillLog([Kill(7, 1.5)])).passed


CAPPED = "soak:job:capped"
RATED = "soak:job:rated"


def test_capped_runs_within_the_cap_pass_back_to_back_ones_included() -> None:
    runs = index(
        run("a", 1.0, end=2.0, job=CAPPED, mid="c1"),
        run("b", 1.5, end=2.5, job=CAPPED, mid="c2"),
        run("c", 2.0, end=3.0, job=CAPPED, mid="c3"),  # starts as "a" ends
    )
    assert check.check_capped(CAPPED, 2, runs, no_kills()).passed


def test_more_capped_runs_at_once_than_the_cap_are_reported() -> None:
    runs = index(
        run("a", 1.0, end=2.0, job=CAPPED, mid="c1"),
        run("b", 1.5, end=2.5, job=CAPPED, mid="c2"),
        run("c", 1.9, end=3.0, job=CAPPED, mid="c3"),
    )
    result = check.check_capped(CAPPED, 2, runs, no_kills())
    assert len(result.violations) == 1
    assert result.violations[0].startswith(f"3 runs of {CAPPED} at once at 1.900")


def test_a_cut_capped_run_holds_its_place_until_its_worker_was_killed() -> None:
    runs = index(
        run("a", 1.0, job=CAPPED, mid="c1", pgid=7),
        run("b", 2.0, end=3.0, job=CAPPED, mid="c2", pgid=8),
    )
    assert not check.check_capped(CAPPED, 1, runs, KillLog([Kill(7, 2.5)])).passed
    assert check.check_capped(CAPPED, 1, runs, KillLog([Kill(7, 1.5)])).passed


def test_starts_within_the_rate_pass_and_one_too_many_is_reported() -> None:
    calls = [
        run(str(i), 1.0 + i * 0.2, end=1.1 + i * 0.2, job=RATED, mid=f"r{i}") for i in range(10)
    ]
    assert check.check_rated(RATED, 5, 1_000, index(*calls)).passed
    crowded = [
        run(str(i), 1.0 + i * 0.1, end=1.05 + i * 0.1, job=RATED, mid=f"r{i}") for i in range(6)
    ]
    result = check.check_rated(RATED, 5, 1_000, index(*crowded))
    assert result.violations == [f"6 starts of {RATED} within 0.500 s from 1.000"]


# -- 5. cron ---------------------------------------------------------------------------------------


def tick_run(token: str, tick: int) -> list[dict[str, Any]]:
    return run(
        token, tick + 0.01, end=tick + 0.02, job=TICK, mid=f"tick-{tick}", n=None, sched=tick
    )


def test_each_tick_once_passes_and_ticks_outside_the_window_are_ignored() -> None:
    runs = index(tick_run("a", 10), tick_run("b", 11), tick_run("c", 11 + 100))
    assert check.check_cron(TICK, runs, (9.5, 11.5), frozenset()).passed


def test_a_tick_completing_twice_is_reported() -> None:
    runs = index(tick_run("a", 10), tick_run("b", 10))
    result = check.check_cron(TICK, runs, (10, 10), frozenset())
    assert result.violations == ["tick 10 completed 2 times"]


def test_a_missed_tick_is_reported_unless_a_scheduler_logged_it_as_misfired() -> None:
    runs = index(tick_run("a", 10), tick_run("c", 12))
    assert check.check_cron(TICK, runs, (10, 12), frozenset()).violations == [
        "tick 11 completed 0 times"
    ]
    logged = check.check_cron(TICK, runs, (10, 12), frozenset(), misfired=[(11, 11)])
    assert logged.passed
    assert "misfired" in logged.notes[0]


def test_misfire_log_lines_become_tick_ranges() -> None:
    log = (
        "cron misfire: job=soak:job:tick: 2 missed tick(s) from 2026-01-01T00:00:10+00:00 "
        "coalesced into tick 2026-01-01T00:00:12+00:00\n"
        "cron misfire: job=soak:job:tick: missed ticks from 2026-01-01T00:00:20+00:00 through "
        "2026-01-01T00:00:21+00:00 skipped (misfire=coalesce, grace_s=60)\n"
    )
    base = 1767225600
    assert misfired_ranges(log, TICK) == [(base + 10, base + 11), (base + 20, base + 21)]
    assert misfired_ranges(log, "other:job:x") == []


# -- 6. boot ---------------------------------------------------------------------------------------


def test_the_boot_job_completing_twice_is_reported() -> None:
    once = index(run("a", 1.0, end=1.1, job=BOOT, mid="boot", n=None))
    assert check.check_boot(BOOT, once, frozenset()).passed
    twice = index(
        run("a", 1.0, end=1.1, job=BOOT, mid="boot", n=None),
        run("b", 5.0, end=5.1, job=BOOT, mid="boot", n=None),
    )
    assert check.check_boot(BOOT, twice, frozenset()).violations == [f"{BOOT} completed 2 times"]


# -- 7. leftovers ---------------------------------------------------------------------------------


MARKER_TTLS = {"done": 1_000, "sent": 1_000}


def test_documented_records_pass() -> None:
    keys = [
        ("kumiko:p:boot:soak:job:boot", -1),
        ("kumiko:p:done:m1", 900),
        ("kumiko:p:sent:r1", 900),
        ("kumiko:p:enqueued:m2", 5_000),
        ("kumiko:p:cron:last:soak:job:tick", 5_000),
        ("kumiko:p:soak:runs", -1),
        ("kumiko:p:lock:gone", -2),
    ]
    queue_keys = [
        ("dramatiq:p-worker:bell", 59_000),
        ("dramatiq:p-worker.DQ:bell", 1_000),
        ("dramatiq:p-worker.XQ", -1),
        ("dramatiq:p-worker.XQ.msgs", -1),
    ]
    result = check.check_leftovers(
        keys,
        "p",
        10_000,
        marker_ttls_ms=MARKER_TTLS,
        guarded={"m2"},
        queue_keys=queue_keys,
    )
    assert result.passed
    assert result.checked == 11


def test_markers_are_bound_by_their_window_not_by_the_completed_age() -> None:
    keys = [("kumiko:p:done:m1", 5_000), ("kumiko:p:sent:r1", 5_000)]
    assert check.check_leftovers(keys, "p", 10_000).passed
    result = check.check_leftovers(keys, "p", 10_000, marker_ttls_ms=MARKER_TTLS)
    assert result.violations == [
        "kumiko:p:done:m1: pttl 5000 ms, expected a TTL of at most 1000 ms",
        "kumiko:p:sent:r1: pttl 5000 ms, expected a TTL of at most 1000 ms",
    ]


def test_a_guard_of_an_id_that_is_no_child_tick_or_boot_job_is_reported() -> None:
    keys = [("kumiko:p:enqueued:child", 5_000), ("kumiko:p:enqueued:handoff", 5_000)]
    result = check.check_leftovers(keys, "p", 10_000, guarded={"child"})
    assert len(result.violations) == 1
    assert result.violations[0].startswith("enqueue guard of handoff, which is no fan-out child")


def test_in_flight_entries_and_suspects_left_behind_are_reported() -> None:
    keys = [("kumiko:p:inflight", -1), ("kumiko:p:suspects:p-worker", -1)]
    result = check.check_leftovers(keys, "p", 10_000)
    assert result.violations == [
        "inflight record left behind: kumiko:p:inflight (pttl -1 ms)",
        "suspects record left behind: kumiko:p:suspects:p-worker (pttl -1 ms)",
    ]


def test_a_doorbell_without_a_ttl_or_a_queue_key_left_behind_is_reported() -> None:
    queue_keys = [
        ("dramatiq:p-worker:bell", -1),
        ("dramatiq:p-worker.DQ:bell", 120_000),
        ("dramatiq:p-worker.msgs", -1),
    ]
    result = check.check_leftovers([], "p", 10_000, queue_keys=queue_keys)
    assert result.violations == [
        "dramatiq:p-worker:bell: pttl -1 ms, expected a TTL of at most 60000 ms",
        "dramatiq:p-worker.DQ:bell: pttl 120000 ms, expected a TTL of at most 60000 ms",
        "queue key left behind: dramatiq:p-worker.msgs (pttl -1 ms)",
    ]


def test_a_lock_or_dedup_record_left_behind_is_reported() -> None:
    keys = [("kumiko:p:lock:soak:job:sequential", 2_000), ("kumiko:p:dedup:soak:job:dedup:k1", 9)]
    result = check.check_leftovers(keys, "p", 10_000)
    assert len(result.violations) == 2


def test_a_marker_without_a_ttl_or_beyond_its_bound_is_reported() -> None:
    keys = [("kumiko:p:done:m1", -1), ("kumiko:p:enqueued:m2", 20_000)]
    assert len(check.check_leftovers(keys, "p", 10_000).violations) == 2


def test_an_unknown_record_without_a_ttl_is_reported() -> None:
    result = check.check_leftovers([("kumiko:p:mystery:1", -1)], "p", 10_000)
    assert result.violations == ["unknown record without a TTL: kumiko:p:mystery:1"]


def test_stuck_messages_are_reported() -> None:
    result = check.check_leftovers([], "p", 10_000, stuck=["unacked in acks: rid"])
    assert result.violations == ["stuck: unacked in acks: rid"]


def test_run_history_records_are_bound_by_the_history_ttl() -> None:
    keys = [
        ("kumiko:p:run:m1", 50_000),
        ("kumiko:p:dead:m2", 50_000),
        ("kumiko:p:runs:status:completed", -1),
        ("kumiko:p:runs:job:soak:job:parallel:dead", -1),
    ]
    assert check.check_leftovers(keys, "p", 10_000, history_ttl_ms=60_000).passed
    too_long = check.check_leftovers(
        [("kumiko:p:run:m1", 90_000), ("kumiko:p:dead:m2", -1)], "p", 10_000, history_ttl_ms=60_000
    )
    assert len(too_long.violations) == 2
    unknown = check.check_leftovers(keys[2:], "p", 10_000)
    assert len(unknown.violations) == 2


def test_a_history_record_left_running_is_reported() -> None:
    result = check.check_leftovers([], "p", 10_000, history_ttl_ms=60_000, running=["m1:1: x"])
    assert result.violations == [
        "history record still running after every message settled: m1:1: x"
    ]


# -- 8. malformed ----------------------------------------------------------------------------------


def test_malformed_messages_dead_lettered_with_a_reason_pass() -> None:
    pushed = [Malformed("wrong_args", "r1", "dead-lettering malformed message x", 1.0)]
    runs = index(run("a", 2.0, end=2.1))
    log = "ERROR dead-lettering malformed message x for soak:job:parallel: no args"
    assert check.check_malformed(pushed, {"r1"}, log, runs).passed


def test_a_malformed_message_left_out_of_the_dead_letters_is_reported() -> None:
    pushed = [Malformed("garbage", "r1", "token", 1.0)]
    runs = index(run("a", 2.0, end=2.1))
    result = check.check_malformed(pushed, set(), "DecodeError token", runs)
    assert result.violations == ["garbage message r1 (pushed 1.000) was not dead-lettered"]


def test_a_malformed_message_without_a_logged_reason_is_reported() -> None:
    pushed = [Malformed("unknown_actor", "r1", "ghost", 1.0)]
    runs = index(run("a", 2.0, end=2.1))
    result = check.check_malformed(pushed, {"r1"}, "", runs)
    assert "no logged reason" in result.violations[0]


def test_a_malformed_message_that_ran_is_reported() -> None:
    pushed = [Malformed("forged_options", "r1", "dead-lettering message f1", 1.0, "f1")]
    log = "ERROR dead-lettering message f1 (redis id r1) on q: bad options"
    clean = index(run("a", 2.0, end=2.1))
    assert check.check_malformed(pushed, {"r1"}, log, clean).passed
    ran = index(run("a", 2.0, end=2.1), run("b", 1.5, end=1.6, mid="f1"))
    result = check.check_malformed(pushed, {"r1"}, log, ran)
    assert len(result.violations) == 1
    assert result.violations[0].startswith("forged_options message f1 ran 1 time(s)")


def test_workers_that_stopped_after_a_malformed_message_are_reported() -> None:
    pushed = [Malformed("wrong_args", "r1", "x", 3.0)]
    runs = index(run("a", 2.0, end=2.1))
    result = check.check_malformed(pushed, {"r1"}, "x", runs)
    assert result.violations == ["no job completed after the last malformed message"]


# -- 9. poison messages ---------------------------------------------------------------------------


def poison_runs(count: int, *, mid: str = "p1", first_pgid: int = 10) -> list[list[dict[str, Any]]]:
    """``count`` cut runs of a poison message, one per worker process group, 5 s apart."""
    return [
        run(f"{mid}-{k}", 10.0 + 5 * k, job=POISON, mid=mid, n=None, pgid=first_pgid + k)
        for k in range(count)
    ]


def poison_deaths(count: int, *, first_pgid: int = 10) -> list[Kill]:
    return [Kill(first_pgid + k, 10.05 + 5 * k) for k in range(count)]


BURIED_LOG = "ERROR dead-lettering message rp1 on q-worker: worker died during 5 deliveries"
BURIED = {"p1": DeadLetter("rp1", 40.0)}
POISONS = [Poison("exit", "p1", 9.0)]


def check_poison(
    *calls: list[dict[str, Any]],
    dead_letters: dict[str, DeadLetter] = BURIED,
    log: str = BURIED_LOG,
    kills: list[Kill] | None = None,
    deaths: list[Kill] | None = None,
    poisons: list[Poison] = POISONS,
) -> check.CheckResult:
    healthy = run("h", 20.0, end=20.1, mid="h1", pgid=99)
    return check.check_poison(
        poisons,
        POISON,
        index(healthy, *calls),
        dead_letters,
        log,
        5,
        kills=kills or [],
        deaths=poison_deaths(5) if deaths is None else deaths,
    )


def test_a_poison_message_dead_lettered_after_five_deaths_passes() -> None:
    result = check_poison(*poison_runs(5))
    assert result.passed, result.violations
    assert "5 poison run(s), 5 worker death(s) on their own" in result.notes[-1]


def test_a_poison_message_not_dead_lettered_or_not_logged_is_reported() -> None:
    missing = check_poison(*poison_runs(5), dead_letters={})
    assert missing.violations == ["exit poison p1 was not dead-lettered (5 run(s))"]
    unlogged = check_poison(*poison_runs(5), log=BURIED_LOG.replace("5 deliveries", "4 deliveries"))
    assert len(unlogged.violations) == 1
    assert "no log line dead-lettering message rp1 on" in unlogged.violations[0]


def test_a_poison_message_dead_lettered_too_early_or_too_late_is_reported() -> None:
    early = check_poison(*poison_runs(4), deaths=poison_deaths(4))
    assert early.violations == [
        "exit poison p1 ran 4 times, not max_deliveries (5); "
        "0 SIGKILL(s) of other workers in its lifetime"
    ]
    late = check_poison(*poison_runs(6), deaths=poison_deaths(6))
    assert "exit poison p1 ran 6 times, more than max_deliveries (5)" in late.violations


def test_a_delivery_swallowed_by_a_sigkill_excuses_a_missing_run() -> None:
    # A SIGKILL of another worker while the poison message waited in its prefetch:
    # a delivery without a run.
    excused = check_poison(*poison_runs(4), deaths=poison_deaths(4), kills=[Kill(50, 12.0)])
    assert excused.passed
    assert "may have swallowed 1 delivery(ies)" in excused.notes[0]
    # A kill after the dead letter, or of a worker the poison ran in, excuses nothing.
    after = check_poison(*poison_runs(4), deaths=poison_deaths(4), kills=[Kill(50, 41.0)])
    assert not after.passed


def test_a_poison_run_that_returned_or_ran_after_its_dead_letter_is_reported() -> None:
    runs = poison_runs(4)
    returned = check_poison(*runs, run("p1-x", 30.0, end=30.1, job=POISON, mid="p1", n=None))
    assert any("its handler returned" in text for text in returned.violations)
    late = check_poison(*runs, run("p1-y", 45.0, job=POISON, mid="p1", n=None, pgid=30))
    assert any("ran after it was dead-lettered" in text for text in late.violations)


def test_a_suspect_that_did_not_run_alone_is_reported() -> None:
    # Its first delivery may take healthy runs down with it, the later ones may not.
    first = check_poison(*poison_runs(5), run("c1", 9.5, pgid=10))
    assert first.passed
    second = check_poison(*poison_runs(5), run("c2", 14.5, mid="c2", pgid=11))
    assert len(second.violations) == 1
    assert "run 2 did not run alone" in second.violations[0]


def test_a_worker_death_without_a_poison_run_is_reported() -> None:
    result = check_poison(*poison_runs(5), deaths=[*poison_deaths(5), Kill(77, 33.0)])
    assert result.violations == [
        "process died on its own: worker 77 (noticed at 33.000) "
        "with no poison message running in it"
    ]
    # A poison run that started after the death noticed does not explain it either.
    before = check_poison(*poison_runs(5), deaths=[*poison_deaths(4), Kill(14, 29.0)])
    assert len(before.violations) == 1


def test_workers_that_stopped_after_a_poison_message_are_reported() -> None:
    result = check.check_poison(
        POISONS, POISON, index(*poison_runs(5)), BURIED, BURIED_LOG, 5, deaths=poison_deaths(5)
    )
    assert result.violations == ["no healthy job completed after the first poison message (9.000)"]


def test_a_poison_message_whose_dispatch_raised_is_checked_too() -> None:
    result = check_poison(*poison_runs(5), poisons=[])
    assert result.passed
    assert result.checked == 1
    unburied = check_poison(*poison_runs(5), poisons=[], dead_letters={})
    assert unburied.violations == ["unconfirmed poison p1 was not dead-lettered (5 run(s))"]


# -- the deck ----------------------------------------------------------------------------------


def test_each_round_holds_every_fault_and_one_poison_the_kinds_taking_turns() -> None:
    rng = random.Random(1)
    rounds = [deal(number, set(), rng) for number in range(4)]
    for number, deck in enumerate(rounds):
        poison = ["poison_exit", "poison_segfault"][number % 2]
        assert sorted(deck) == sorted([*FAULT_ROUND, poison])
    assert rounds[0] != sorted(rounds[0]) or rounds[1] != sorted(rounds[1])
    only = deal(0, {"poison_exit", *FAULT_ROUND}, rng)
    assert only == ["poison_segfault"]
    assert deal(1, {"poison_exit", "poison_segfault", *FAULT_ROUND}, rng) == []


# -- summary ---------------------------------------------------------------------------------------


def test_the_summary_counts_faults_and_violations() -> None:
    failing = check.CheckResult(1, "x", 1, violations=["a", "b"])
    line = check.summary_line(10, 20, {"worker_kill": 2, "client_kill": 1}, [failing])
    assert line == (
        "soak: 10 jobs dispatched, 20 runs, faults injected: client_kill 1, worker_kill 2 "
        "(3 in all), violations: 2"
    )
    assert failing.render().startswith("FAIL  1. x: 1 checked, 2 violation(s)")


def test_the_log_digest_counts_surprises_and_tracebacks_by_exception() -> None:
    log = "\n".join(
        [
            "[t] [PID 1] [Thread-2] [dramatiq.worker] [CRITICAL] Consumer encountered an error.",
            "Traceback (most recent call last):",
            '  File "x.py", line 1, in f',
            "dramatiq.errors.DecodeError: failed to decode data",
            "",
            "The above exception was the direct cause of the following exception:",
            "",
            "Traceback (most recent call last):",
            '  File "y.py", line 2, in g',
            "dramatiq.errors.DecodeError: Failed to decode message.",
            "[t] [PID 1] [Thread-7] [dramatiq.worker] [ERROR] Failed to process message x.",
            "Traceback (most recent call last):",
            "tests.soak.app.SoakFailure: attempt 1 fails on purpose",
        ]
    )
    assert log_digest(log) == [
        "     1 x CRITICAL Consumer encountered an error.",
        "     1 x traceback ending in dramatiq.errors.DecodeError",
        "     1 x traceback ending in tests.soak.app.SoakFailure",
    ]
