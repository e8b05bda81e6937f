"""Redis CPU per job on a Redis Cluster vs one standalone Redis (issue 52).

``python -m benchmarks.cluster [--rounds 3] [--messages 5000]``

A local cluster of 3 primaries with a replica each (``tests/cluster.py``) and one private
standalone ``redis-server``, both on this machine. Each round enqueues ``--messages`` no-op
jobs on one dataset, then drains them with one worker of 8 threads; the CPU of the server that
holds the dataset (``INFO cpu`` of the slot's primary on the cluster, of the server alone) is
read before the enqueue and once the queue's message hash is empty. Rounds alternate between
the two; the table gives medians per job and the ratio. The cluster primary also replicates to
its replica and talks on the cluster bus, which the standalone server does not.

A third case runs the same rounds on a dataset of ``shards=3`` whose three slots are served
by the three primaries: each primary's share of the Redis CPU the round cost, and the ceiling
in jobs/s that the busiest primary's CPU per job allows (one Redis core at 100%), beside the
one-shard dataset's.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import uuid
from pathlib import Path
from typing import Any

import redis

from kumiko_dramatiq import Feature, JobContext, JobRunner, Registry
from kumiko_dramatiq.broker import keys
from kumiko_dramatiq.broker.cluster import slot_of
from kumiko_dramatiq.shards.routing import shard_prefix
from kumiko_dramatiq.testing import private_redis_server
from tests.cluster import Cluster, local_cluster

from .redis_cost import server_cpu_s, wait_empty

SHARDS = 3


def registry() -> Registry:
    feature = Feature("bench")

    def noop(payload: dict[str, Any], ctx: JobContext) -> None:
        return None

    feature.job("noop")(noop)
    return Registry([feature])


def drain_round(
    url: str, prefix: str, servers: list[redis.Redis], messages: int, shards: int = 1
) -> None:
    """Enqueue ``messages`` no-op jobs on ``prefix``, drain them; ``servers``: the server
    holding each shard's queue."""
    runner = JobRunner(
        registry(), redis_url=url, queue_prefix=prefix, worker_threads=8, shards=shards
    )
    try:
        runner.dispatch_many("bench:job:noop", [{}] * messages)
        runner.start()
        for shard, server in zip(runner.shard_runners, servers, strict=True):
            queue = shard.registry.jobs["bench:job:noop"].queue_name(shard.queue_prefix)
            wait_empty(server, keys.queue_messages(queue, keys.namespace(shard.queue_prefix)))
    finally:
        runner.stop()


def over_every_primary(cluster: Cluster, shards: int) -> str:
    """A fresh queue prefix whose ``shards`` slots are served by as many primaries."""
    while True:
        prefix = f"cb{uuid.uuid4().hex[:8]}"
        owners = {cluster.owner(slot_of(shard_prefix(prefix, n))) for n in range(shards)}
        if len(owners) == shards:
            return prefix


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--messages", type=int, default=5_000)
    args = parser.parse_args(argv)
    results: dict[str, list[float]] = {
        "standalone": [],
        "cluster, the slot's primary": [],
        "cluster, all 3 primaries": [],
        "shards=3, the busiest primary": [],
        "shards=3, all 3 primaries": [],
    }
    shares: list[list[float]] = []
    with (
        tempfile.TemporaryDirectory() as directory,
        local_cluster(Path(directory)) as cluster,
        private_redis_server() as standalone_url,
    ):
        alone = redis.Redis.from_url(standalone_url)
        for _ in range(args.rounds):
            before = server_cpu_s(alone)
            drain_round(standalone_url, f"cb{uuid.uuid4().hex[:8]}", [alone], args.messages)
            results["standalone"].append((server_cpu_s(alone) - before) / args.messages * 1e6)

            prefix = f"cb{uuid.uuid4().hex[:8]}"
            primaries = [cluster.client(port) for port in cluster.primaries()]
            owner = cluster.client(cluster.owner(slot_of(prefix)))
            start = [server_cpu_s(each) for each in primaries]
            start_owner = server_cpu_s(owner)
            drain_round(cluster.url(), prefix, [owner], args.messages)
            spent = sum(server_cpu_s(e) - s0 for e, s0 in zip(primaries, start, strict=True))
            results["cluster, all 3 primaries"].append(spent / args.messages * 1e6)
            own = server_cpu_s(owner) - start_owner
            results["cluster, the slot's primary"].append(own / args.messages * 1e6)

            prefix = over_every_primary(cluster, SHARDS)
            owners = [
                cluster.client(cluster.owner(slot_of(shard_prefix(prefix, n))))
                for n in range(SHARDS)
            ]
            start = [server_cpu_s(each) for each in owners]
            drain_round(cluster.url(), prefix, owners, args.messages, shards=SHARDS)
            each_us = [
                (server_cpu_s(e) - s0) / args.messages * 1e6
                for e, s0 in zip(owners, start, strict=True)
            ]
            results["shards=3, all 3 primaries"].append(sum(each_us))
            results["shards=3, the busiest primary"].append(max(each_us))
            shares.append([us / sum(each_us) for us in each_us])
            for each in (owner, *primaries, *owners):
                each.close()
        alone.close()
    plain = statistics.median(results["standalone"])
    print(f"Redis CPU per job, {args.messages:,} no-op jobs per round, medians\n")
    print("| case | µs/job (enqueue + drain) | rounds | vs standalone |")
    print("|---|---|---|---|")
    for name, values in results.items():
        shown = ", ".join(f"{v:.0f}" for v in values)
        median = statistics.median(values)
        print(f"| {name} | {median:.1f} | {shown} | {median / plain:.2f}x |")
    print("\nshards=3, each primary's share of the round's Redis CPU (target 1/3 +-15%):")
    for n, round_shares in enumerate(shares, 1):
        print(f"  round {n}: " + ", ".join(f"{share:.1%}" for share in round_shares))
    one = statistics.median(results["cluster, the slot's primary"])
    three = statistics.median(results["shards=3, the busiest primary"])
    print(
        f"\nceiling at one Redis core per primary: 1 shard {1e6 / one:,.0f} jobs/s, "
        f"3 shards {1e6 / three:,.0f} jobs/s ({one / three:.2f}x)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
