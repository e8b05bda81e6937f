"""Redis memory follows the backlog, not the throughput.

Jobs that completed leave nothing behind once the windows that guard against a duplicate copy
have passed: no "already completed" marker, no "sent" marker, no hand-off guard. Only the
records the contract keeps for their own lifetime stay (the capped run history, the guards
of deterministic ids, boot markers). The windows are shortened here (one second instead of
a minute); the code paths are the production ones.
"""

from __future__ import annotations

from typing import Any

import redis

from kumiko_dramatiq import Feature, JobContext, Registry
from tests.conftest import Recorder, RunnerFactory, wait_for

JOBS = 3_000
#: kinds of keys kept for their own documented lifetime, not per message (no job here has a
#: deterministic id, so no "enqueued" guard may be left either)
KEPT = {"run", "runs", "stats", "boot", "cron", "proc", "procs", "dataset"}


def registry() -> Registry:
    feature = Feature("mem")

    @feature.job("noop")
    def noop(payload: dict[str, Any], ctx: JobContext) -> None:
        return None

    @feature.job("one_at_a_time", concurrency="sequential")
    def one_at_a_time(payload: dict[str, Any], ctx: JobContext) -> None:
        return None

    return Registry([feature])


def per_message_keys(client: redis.Redis, prefix: str) -> dict[str, int]:
    """Bytes held by kumiko's per-message keys of ``prefix``, by kind."""
    root = f"kumiko:{prefix}:"
    held: dict[str, int] = {}
    for raw in client.scan_iter(match=f"{root}*", count=1000):
        key = raw.decode()
        kind = key[len(root) :].split(":", 1)[0]
        if kind not in KEPT:
            held[kind] = held.get(kind, 0) + int(client.memory_usage(key) or 0)
    return held


def test_completed_jobs_leave_no_per_message_keys_once_the_windows_pass(
    make_runner: RunnerFactory, recorder: Recorder, redis_client: redis.Redis, prefix: str
) -> None:
    # Given a worker whose duplicate windows are one second
    runner = make_runner(
        registry(), worker_threads=8, sequential_retry_delay_ms=50, **recorder.hooks()
    )
    runner.broker.resend_window_ms = 1_000
    runner.broker.completed_ttl_ms = 1_000
    # When thousands of jobs run, and sequential ones hand off to each other
    runner.dispatch_many("mem:job:noop", [{"n": n} for n in range(JOBS)])
    for _ in range(20):
        runner.dispatch("mem:job:one_at_a_time")
    runner.start()
    recorder.wait_until(
        lambda r: len(r.of("complete")) == JOBS + 20, timeout_s=120, what="every job"
    )
    # Then, once the windows pass, no per-message key is left: under 1 MB (in fact none)
    wait_for(
        lambda: per_message_keys(redis_client, prefix) == {},
        timeout_s=30,
        what=f"the per-message keys to go: {per_message_keys(redis_client, prefix)}",
    )
    queued = [
        key
        for key in redis_client.scan_iter(match=f"dramatiq:{prefix}-*")
        # per queue, not per message: the doorbell and the per-job counts
        if not key.endswith((b":bell", b":counts"))
    ]
    assert queued == []
