"""Redis Cluster (``redis+cluster://``) against a local cluster of 3 primaries with a replica
each (``tests/cluster.py``): a dataset lives in the slot of its queue prefix's hash tag, runs
there as on one Redis, and follows planned fail-overs of its shard and a live move of its
slot under a steady producer without losing a dispatch that returned an id.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from kumiko_dramatiq import Feature, JobContext, JobRunner, Registry
from kumiko_dramatiq.broker.cluster import slot_of
from kumiko_dramatiq.broker.urls import parse
from kumiko_dramatiq.errors import JobConfigError, KumikoError, RedisAccessError
from kumiko_dramatiq.shards.routing import shard_prefix
from tests.cluster import Cluster, local_cluster
from tests.conftest import wait_for


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with local_cluster(tmp_path_factory.mktemp("cluster")) as started:
        yield started


class Ledger:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.runs: dict[str, int] = {}

    def work(self, payload: dict[str, Any], ctx: JobContext) -> None:
        with self.lock:
            self.runs[ctx.message_id] = self.runs.get(ctx.message_id, 0) + 1


def registry_of(ledger: Ledger) -> Registry:
    feature = Feature("cl")
    feature.job("work")(ledger.work)
    feature.job("seq", concurrency="sequential")(ledger.work)
    feature.job("keyed")(ledger.work)
    return Registry([feature])


def prefix_on_the_second_shard(name: str) -> str:
    """A queue prefix whose slot is not on the first node the URL names."""
    return next(p for p in (f"{name}{i}" for i in range(1000)) if 5461 <= slot_of(p) <= 10922)


def test_a_cluster_url_names_its_nodes_and_database_0_only() -> None:
    target = parse("redis+cluster://u:pw@a:7000,b/0")
    assert target.is_cluster
    assert target.nodes == (("a", 7000), ("b", 6379))
    assert target.connection["username"] == "u"
    with pytest.raises(JobConfigError, match="database 0 only"):
        parse("redis+cluster://a:7000/2")
    with pytest.raises(JobConfigError, match="TLS options need rediss"):
        parse("redis+cluster://a:7000?ssl_cert_reqs=none")
    assert parse("rediss+cluster://a:7000?ssl_cert_reqs=none").is_cluster


def test_a_dataset_lives_in_the_slot_of_its_prefix_and_runs_as_on_one_redis(
    cluster: Cluster,
) -> None:
    prefix = prefix_on_the_second_shard("one")
    ledger = Ledger()
    runner = JobRunner(
        registry_of(ledger), redis_url=cluster.url(), queue_prefix=prefix, worker_threads=4
    )
    runner.start()
    try:
        ids = [runner.dispatch("cl:job:work", {"n": n}) for n in range(10)]
        ids += [runner.dispatch("cl:job:seq", {"n": n}, delay_ms=200) for n in range(3)]
        first = runner.dispatch("cl:job:keyed", {}, dedup_key="k")
        assert runner.dispatch("cl:job:keyed", {}, dedup_key="k") == first
        runner.drain(timeout_s=30)
        assert sum(ledger.runs.values()) == len(ids) + 1
        runs = runner.runs(limit=100)
        assert {run.origin_id for run in runs} == {*ids, first}
        assert {run.status for run in runs} == {"completed"}
        assert runner.job_state(first) == "completed"
        assert [lane.queued for lane in runner.status().lanes] == [0, 0]

        # every key of the dataset is in its slot, on the primary that serves it
        slot = slot_of(prefix)
        owner = cluster.client(cluster.owner(slot))
        names = owner.keys(f"*{{{prefix}}}*")
        assert names
        assert all(slot_of(prefix) == owner.cluster("KEYSLOT", n) for n in names)
        assert len(names) == owner.execute_command("CLUSTER", "COUNTKEYSINSLOT", slot)  # type: ignore[no-untyped-call]
        owner.close()
        for port in cluster.primaries():  # and no key of it is anywhere without the tag
            with contextlib.closing(cluster.client(port)) as node:
                assert [n for n in node.keys(f"*{prefix}*") if f"{{{prefix}}}" not in n] == []
    finally:
        runner.stop()


def test_a_plain_url_to_a_cluster_node_is_refused_in_one_line_naming_redis_cluster(
    cluster: Cluster,
) -> None:
    runner = JobRunner(
        registry_of(Ledger()),
        redis_url=f"redis://127.0.0.1:{cluster.nodes[0].port}/0",
        queue_prefix="plain",
    )
    with pytest.raises(RedisAccessError, match=r"redis\+cluster://") as caught:
        runner.start()
    assert "\n" not in str(caught.value)
    runner.stop()


def test_fail_overs_and_a_live_slot_move_under_a_producer_lose_no_accepted_dispatch(
    cluster: Cluster,
) -> None:
    # Given a worker and a steady producer (every other dispatch delayed) on one dataset
    prefix = prefix_on_the_second_shard("moving")
    ledger = Ledger()
    options: dict[str, Any] = {"redis_url": cluster.url(), "queue_prefix": prefix}
    worker = JobRunner(registry_of(ledger), worker_threads=4, **options)
    producer = JobRunner(registry_of(ledger), **options)
    worker.start()
    accepted: list[str] = []
    refused: list[str] = []
    stopping = threading.Event()

    def produce() -> None:
        n = 0
        while not stopping.wait(0.005):
            n += 1
            try:
                delay = 300 if n % 2 else None
                accepted.append(producer.dispatch("cl:job:work", {"n": n}, delay_ms=delay))
            except KumikoError as exc:
                refused.append(str(exc))

    thread = threading.Thread(target=produce)
    thread.start()
    slot = slot_of(prefix)
    try:
        # When the dataset's shard fails over twice and its slot then moves to another primary
        wait_for(lambda: len(accepted) >= 50, what="a first load")
        for _ in range(2):
            cluster.fail_over(slot)
            seen = len(accepted)
            wait_for(
                lambda seen=seen: len(accepted) >= seen + 50,  # type: ignore[misc]
                what="the load after a fail-over",
            )
        target = next(port for port in cluster.primaries() if port != cluster.owner(slot))
        assert cluster.move_slot(slot, target) > 0
        assert cluster.owner(slot) == target
        seen = len(accepted)
        wait_for(lambda: len(accepted) >= seen + 50, what="the load after the move")
    finally:
        stopping.set()
        thread.join(timeout=30)

    # Then every dispatch that returned an id runs
    wait_for(
        lambda: set(accepted) <= set(ledger.runs), timeout_s=60, what="every accepted dispatch"
    )
    producer.drain(timeout_s=30)
    print(
        f"\ncluster: {len(accepted)} accepted, lost {len(set(accepted) - set(ledger.runs))}, "
        f"ran twice {sum(1 for n in ledger.runs.values() if n > 1)}, refused {len(refused)}"
    )
    with contextlib.suppress(Exception):
        worker.stop(timeout_s=10)
    producer.stop()


def prefix_over_every_primary(cluster: Cluster, name: str, shards: int) -> str:
    """A queue prefix whose ``shards`` shards' slots are served by as many primaries."""
    for i in range(10_000):
        prefix = f"{name}{i}"
        owners = {cluster.owner(slot_of(shard_prefix(prefix, n))) for n in range(shards)}
        if len(owners) == shards:
            return prefix
    raise AssertionError("no such prefix")  # pragma: no cover


def test_a_dataset_of_3_shards_spreads_over_the_3_primaries(cluster: Cluster) -> None:
    # Given a dataset of 3 shards whose slots are on the 3 primaries
    prefix = prefix_over_every_primary(cluster, "spread", 3)
    ledger = Ledger()
    runner = JobRunner(
        registry_of(ledger),
        redis_url=cluster.url(),
        queue_prefix=prefix,
        worker_threads=4,
        shards=3,
    )
    runner.start()
    try:
        # When spread, sequential and keyed messages are dispatched and the dataset drains
        ids = runner.dispatch_many("cl:job:work", [{"n": n} for n in range(60)])
        ids += [runner.dispatch("cl:job:seq", {"n": n}) for n in range(5)]
        first = runner.dispatch("cl:job:keyed", {}, dedup_key="k")
        assert runner.dispatch("cl:job:keyed", {}, dedup_key="k") == first
        runner.drain(timeout_s=60)
        # Then each ran once (a sequential hand-off runs under an id of its own), and the
        # admin reads see them all
        assert sum(ledger.runs.values()) == len(ids) + 1
        runs = runner.runs(limit=1000)
        assert {run.origin_id for run in runs if run.status == "completed"} == {*ids, first}
        # And each primary holds one shard, every key of it in its slot
        for n, shard in enumerate(runner.shard_runners):
            tag = shard_prefix(prefix, n)
            slot = slot_of(tag)
            with contextlib.closing(cluster.client(cluster.owner(slot))) as owner:
                names = owner.keys(f"*{{{tag}}}*")
                assert len(names) == owner.execute_command("CLUSTER", "COUNTKEYSINSLOT", slot)  # type: ignore[no-untyped-call]
            assert shard.job_counts()["cl:job:work"] == dict.fromkeys(
                ("queued", "delayed", "running", "parked", "dead"), 0
            )
            assert len(shard.runs(job="cl:job:work", limit=1000)) == 20
    finally:
        runner.stop()
