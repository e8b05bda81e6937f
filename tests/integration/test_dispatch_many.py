"""dispatch_many: many payloads of one job, one Lua call per batch, dispatch's guarantees."""

from __future__ import annotations

from typing import Any

import pytest
import redis

from kumiko_dramatiq import Feature, JobContext, PayloadError, Registry
from kumiko_dramatiq.runner import DISPATCH_BATCH
from tests.conftest import Recorder, RunnerFactory


def registry(seen: list[tuple[str | None, dict[str, Any]]] | None = None) -> Registry:
    feature = Feature("bulk")

    def record(payload: dict[str, Any], ctx: JobContext) -> None:
        if seen is not None:
            seen.append((ctx.tenant_id, payload))

    feature.job("send")(record)
    feature.job("nightly", per_tenant=True)(record)
    return Registry([feature])


def queued(client: redis.Redis, prefix: str, queue: str = "worker") -> int:
    return int(client.llen(f"dramatiq:{prefix}-{queue}"))


def test_every_payload_runs_once_in_order_of_the_ids_returned(
    make_runner: RunnerFactory, recorder: Recorder, redis_client: redis.Redis, prefix: str
) -> None:
    seen: list[tuple[str | None, dict[str, Any]]] = []
    runner = make_runner(registry(seen), get_active_tenant_ids=lambda: [], **recorder.hooks())
    count = DISPATCH_BATCH + 7  # two batches
    # When many payloads are dispatched at once
    ids = runner.dispatch_many("bulk:job:send", [{"n": n} for n in range(count)])
    # Then each has its own id, in the order of the payloads, queued in that order
    assert len(set(ids)) == count
    assert queued(redis_client, prefix) == count
    runner.start()
    recorder.wait_until(lambda r: len(r.of("complete")) == count, what="every run")
    assert sorted(n["n"] for _, n in seen) == list(range(count))
    assert {e.message_id for e in recorder.of("complete")} == set(ids)


@pytest.mark.parametrize(
    ("payloads", "dedup_keys", "match"),
    [
        ([{}, {}, {"bad": float("nan")}], None, r"bulk:job:send: payloads\[2\]\['bad'\]"),
        ([{}, "not a dict"], None, r"payloads\[1\] must be a JSON object"),
        ([{}, {}], ["a", ""], r"dedup_keys\[1\]"),
        ([{}, {}], ["a"], "dedup_keys must give one key per payload"),
    ],
)
def test_a_bad_payload_or_key_anywhere_names_its_index_and_enqueues_nothing(
    payloads: list[Any],
    dedup_keys: list[str] | None,
    match: str,
    make_runner: RunnerFactory,
    redis_client: redis.Redis,
    prefix: str,
) -> None:
    runner = make_runner(registry())
    with pytest.raises(PayloadError, match=match):
        runner.dispatch_many("bulk:job:send", payloads, dedup_keys=dedup_keys)
    assert queued(redis_client, prefix) == 0
    assert list(redis_client.scan_iter(match=f"kumiko:{prefix}:*")) == []


def test_dedup_keys_are_decided_as_dispatch_decides_them(
    make_runner: RunnerFactory, redis_client: redis.Redis, prefix: str
) -> None:
    runner = make_runner(registry())
    live = runner.dispatch("bulk:job:send", {"n": 0}, dedup_key="k0")
    # When keys are given: one already live, one given twice, one fresh
    ids = runner.dispatch_many(
        "bulk:job:send",
        [{"n": 1}, {"n": 2}, {"n": 3}, {"n": 4}],
        dedup_keys=["k0", "k1", "k1", "k2"],
    )
    # Then the live key stands for its job, a repeated key for its first message
    assert ids[0] == live
    assert ids[1] == ids[2]
    assert len({live, ids[1], ids[3]}) == 3
    assert queued(redis_client, prefix) == 3


def test_per_tenant_jobs_and_delays_go_as_with_dispatch(
    make_runner: RunnerFactory, recorder: Recorder, redis_client: redis.Redis, prefix: str
) -> None:
    seen: list[tuple[str | None, dict[str, Any]]] = []
    runner = make_runner(
        registry(seen), get_active_tenant_ids=lambda: ["t1", "t2"], **recorder.hooks()
    )
    # A delayed bulk dispatch waits on the delay queue
    runner.dispatch_many("bulk:job:send", [{}, {}], delay_ms=60_000)
    assert int(redis_client.zcard(f"dramatiq:{prefix}-worker.DQ:schedule")) == 2
    # A per-tenant job's payloads become wrappers, each fanning out to every tenant
    wrappers = runner.dispatch_many("bulk:job:nightly", [{"day": 1}, {"day": 2}])
    runner.start()
    recorder.wait_until(
        lambda r: len([e for e in r.of("complete") if e.meta.tenant_id]) == 4,
        what="four children",
    )
    assert sorted(seen, key=repr) == [
        ("t1", {"day": 1}),
        ("t1", {"day": 2}),
        ("t2", {"day": 1}),
        ("t2", {"day": 2}),
    ]
    assert {e.message_id for e in recorder.of("complete") if e.meta.tenant_id is None} == set(
        wrappers
    )
