"""Redis CPU per job on a Redis Cluster vs one standalone Redis (issue 52).

``python -m benchmarks.cluster [--rounds 3] [--messages 5000]``

A local cluster of 3 primaries with a replica each (``tests/cluster.py``) and one private
standalone ``redis-server``, both on this machine. Each round enqueues ``--messages`` no-op
jobs on one dataset, then drains them with one worker of 8 threads; the CPU of the server that
holds the dataset (``INFO cpu`` of the slot's primary on the cluster, of the server alone) is
read before the enqueue and once the queue's message hash is empty. Rounds alternate between
the two; the table gives medians per job and the ratio. The cluster primary also replicates to
its replica and talks on the cluster bus, which the standalone server does not.
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
from kumiko_dramatiq.testing import private_redis_server
from tests.cluster import local_cluster

from .redis_cost import server_cpu_s, wait_empty


def registry() -> Registry:
    feature = Feature("bench")

    def noop(payload: dict[str, Any], ctx: JobContext) -> None:
        return None

    feature.job("noop")(noop)
    return Registry([feature])


def drain_round(url: str, prefix: str, server: redis.Redis, messages: int) -> None:
    """Enqueue ``messages`` no-op jobs on ``prefix``, drain them; ``server`` holds the queue."""
    runner = JobRunner(registry(), redis_url=url, queue_prefix=prefix, worker_threads=8)
    queue = runner.registry.jobs["bench:job:noop"].queue_name(prefix)
    messages_key = keys.queue_messages(queue, keys.namespace(runner.queue_prefix))
    try:
        runner.dispatch_many("bench:job:noop", [{}] * messages)
        runner.start()
        wait_empty(server, messages_key)
    finally:
        runner.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--messages", type=int, default=5_000)
    args = parser.parse_args(argv)
    results: dict[str, list[float]] = {
        "standalone": [],
        "cluster, the slot's primary": [],
        "cluster, all 3 primaries": [],
    }
    with (
        tempfile.TemporaryDirectory() as directory,
        local_cluster(Path(directory)) as cluster,
        private_redis_server() as standalone_url,
    ):
        alone = redis.Redis.from_url(standalone_url)
        for _ in range(args.rounds):
            before = server_cpu_s(alone)
            drain_round(standalone_url, f"cb{uuid.uuid4().hex[:8]}", alone, args.messages)
            results["standalone"].append((server_cpu_s(alone) - before) / args.messages * 1e6)

            prefix = f"cb{uuid.uuid4().hex[:8]}"
            primaries = [cluster.client(port) for port in cluster.primaries()]
            owner = cluster.client(cluster.owner(slot_of(prefix)))
            start = [server_cpu_s(each) for each in primaries]
            start_owner = server_cpu_s(owner)
            drain_round(cluster.url(), prefix, owner, args.messages)
            spent = sum(server_cpu_s(e) - s0 for e, s0 in zip(primaries, start, strict=True))
            results["cluster, all 3 primaries"].append(spent / args.messages * 1e6)
            own = server_cpu_s(owner) - start_owner
            results["cluster, the slot's primary"].append(own / args.messages * 1e6)
            for each in (owner, *primaries):
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
    return 0


if __name__ == "__main__":
    sys.exit(main())
