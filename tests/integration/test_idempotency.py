"""``idempotency_key``: a retried dispatch returns the first dispatch's id and enqueues nothing,
whatever became of that message, on a real Redis. Synchronises on ``drain``; no sleeps."""

from __future__ import annotations

from typing import Any

import pytest
import redis

from kumiko_dramatiq import Feature, JobConfigError, JobContext, JobRunner, PayloadError, Registry
from kumiko_dramatiq.broker import keys
from tests.conftest import RunnerFactory


def registry_of(runs: list[str]) -> Registry:
    app = Feature("app")

    @app.job("welcome")
    def welcome(payload: dict[str, Any], ctx: JobContext) -> None:
        runs.append(ctx.message_id)

    return Registry([app])


def test_a_key_used_again_returns_the_first_id_even_after_the_job_ended(
    make_runner: RunnerFactory, redis_client: redis.Redis, prefix: str
) -> None:
    runs: list[str] = []
    runner = make_runner(registry_of(runs), idempotency_ttl_s=600)
    first = runner.dispatch("app:job:welcome", {"user": 1}, idempotency_key="signup-1")
    assert runner.dispatch("app:job:welcome", {"user": 1}, idempotency_key="signup-1") == first
    runner.start()
    runner.drain(timeout_s=30)
    # the job completed; a client retrying its HTTP call still gets the same id, no second run
    assert runner.dispatch("app:job:welcome", {"user": 1}, idempotency_key="signup-1") == first
    runner.drain(timeout_s=30)
    assert runs == [first]
    # another key is another dispatch; the record lives idempotency_ttl_s
    other = runner.dispatch("app:job:welcome", {"user": 2}, idempotency_key="signup-2")
    assert other != first
    ttl = redis_client.pttl(keys.idempotency(prefix, "app:job:welcome", "signup-1"))
    assert 0 < ttl <= 600_000


def test_dispatch_many_with_keys_stands_each_key_for_its_first_message(
    make_runner: RunnerFactory,
) -> None:
    runs: list[str] = []
    runner = make_runner(registry_of(runs))
    before = runner.dispatch("app:job:welcome", {}, idempotency_key="k0")
    ids = runner.dispatch_many(
        "app:job:welcome", [{}, {}, {}, {}], idempotency_keys=["k0", "k1", "k2", "k1"]
    )
    assert ids[0] == before
    assert ids[3] == ids[1]
    assert len({before, ids[1], ids[2]}) == 3
    runner.start()
    runner.drain(timeout_s=30)
    assert sorted(runs) == sorted([before, ids[1], ids[2]])


def test_bad_keys_and_settings_are_refused(make_runner: RunnerFactory) -> None:
    runner = make_runner(registry_of([]))
    with pytest.raises(PayloadError, match="idempotency_key"):
        runner.dispatch("app:job:welcome", {}, idempotency_key="")
    with pytest.raises(PayloadError, match="cannot go with a dedup_key"):
        runner.dispatch("app:job:welcome", {}, idempotency_key="a", dedup_key="b")
    with pytest.raises(PayloadError, match=r"idempotency_keys\[1\]"):
        runner.dispatch_many("app:job:welcome", [{}, {}], idempotency_keys=["a", ""])
    with pytest.raises(PayloadError, match="one key per payload"):
        runner.dispatch_many("app:job:welcome", [{}, {}], idempotency_keys=["a"])
    assert runner.job_counts()["app:job:welcome"]["queued"] == 0
    with pytest.raises(JobConfigError, match="idempotency_ttl_s"):
        JobRunner(registry_of([]), idempotency_ttl_s=0)


def batch_of(n: int) -> list[tuple[str, dict[str, Any]]]:
    return [("app:job:welcome", {"user": i}) for i in range(n)]


@pytest.mark.parametrize("children", [3, 300])  # one Lua call; staged, then opened
def test_a_batch_dispatched_again_with_its_key_is_the_first_batch(
    make_runner: RunnerFactory, children: int
) -> None:
    runner = make_runner(registry_of([]))
    first = runner.dispatch_batch(batch_of(children), idempotency_key="import-7")
    again = runner.dispatch_batch(batch_of(children), idempotency_key="import-7")
    other = runner.dispatch_batch(batch_of(children), idempotency_key="import-8")
    assert again == first != other
    assert runner.batch(first).total == children
    assert runner.job_counts()["app:job:welcome"]["queued"] == 2 * children


def test_a_staged_batch_whose_writer_died_before_the_open_leaves_the_key_free(
    make_runner: RunnerFactory, prefix: str
) -> None:
    # Given a writer that staged a batch under a key and died before opening it
    runner = make_runner(registry_of([]))
    batches = runner.runtime.batches
    batches._write(
        "abandoned", batches._children("abandoned", batch_of(2), "items"), {"kind": "batch"}
    )
    # When the client retries with the key, Then a batch is written and opened
    retried = runner.dispatch_batch(batch_of(2), idempotency_key="k")
    assert retried != "abandoned"
    assert runner.batch(retried).state == "running"
    # and the abandoned one can no longer open under the key: the first open won
    record = [keys.idempotency(prefix, "batch", "k")]
    assert batches._open("abandoned", record) == retried
    assert runner.job_counts()["app:job:welcome"]["queued"] == 2


def test_a_chain_dispatched_again_with_its_key_is_the_first_chain(
    make_runner: RunnerFactory,
) -> None:
    runs: list[str] = []
    runner = make_runner(registry_of(runs))
    steps: list[Any] = [("app:job:welcome", {"step": 1}), ("app:job:welcome", {"step": 2})]
    first = runner.dispatch_chain(steps, idempotency_key="etl-2026-12-07")
    assert runner.dispatch_chain(steps, idempotency_key="etl-2026-12-07") == first
    runner.start()
    runner.drain(timeout_s=30)
    assert len(runs) == 2
    assert runner.batch(first).state == "succeeded"


def test_a_bad_batch_key_is_refused_before_anything_is_written(
    make_runner: RunnerFactory,
) -> None:
    runner = make_runner(registry_of([]))
    with pytest.raises(PayloadError, match="idempotency_key"):
        runner.dispatch_batch(batch_of(2), idempotency_key="")
    assert runner.job_counts()["app:job:welcome"]["queued"] == 0
