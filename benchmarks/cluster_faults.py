"""Planned shard fail-overs and live slot moves under a producer, on a dataset of 3 shards
over a local Redis Cluster of 3 primaries with a replica each (issue 52).

``python -m benchmarks.cluster_faults [--fail-overs 5] [--moves 2]``

A worker (8 threads) and a producer thread (a dispatch every 2 ms, every other one delayed
300 ms) run on a ``shards=3`` dataset whose slots are served by the three primaries. Once
the load runs, each shard in turn fails over (``CLUSTER FAILOVER`` on a replica of its
primary), ``--fail-overs`` times in all, then ``--moves`` shards' slots move live to another
primary (``tests/cluster.py``: ``SETSLOT MIGRATING/IMPORTING``, ``MIGRATE`` of its keys in
batches, ``SETSLOT NODE``), with 200 more dispatches between two faults. It prints how many
dispatches returned an id, how many of those never ran, how many ran twice, and how many
dispatches were refused (raised, so the caller knows to retry them).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from kumiko_dramatiq import Feature, JobContext, JobRunner, KumikoError, Registry
from kumiko_dramatiq.broker.cluster import slot_of
from kumiko_dramatiq.shards.routing import shard_prefix
from tests.cluster import local_cluster

from .cluster import SHARDS, over_every_primary


class Ledger:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.runs: dict[str, int] = {}

    def work(self, payload: dict[str, Any], ctx: JobContext) -> None:
        with self.lock:
            self.runs[ctx.message_id] = self.runs.get(ctx.message_id, 0) + 1


def registry(ledger: Ledger) -> Registry:
    feature = Feature("faults")
    feature.job("work")(ledger.work)
    return Registry([feature])


def wait(predicate: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(0.05)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--fail-overs", type=int, default=5)
    parser.add_argument("--moves", type=int, default=2)
    args = parser.parse_args(argv)
    ledger = Ledger()
    accepted: list[str] = []
    refused: list[str] = []
    stopping = threading.Event()
    with tempfile.TemporaryDirectory() as directory, local_cluster(Path(directory)) as cluster:
        prefix = over_every_primary(cluster, SHARDS)
        slots = [slot_of(shard_prefix(prefix, n)) for n in range(SHARDS)]
        options: dict[str, Any] = {
            "redis_url": cluster.url(),
            "queue_prefix": prefix,
            "shards": SHARDS,
        }
        worker = JobRunner(registry(ledger), worker_threads=8, **options)
        producer = JobRunner(registry(ledger), **options)
        worker.start()

        def produce() -> None:
            n = 0
            while not stopping.wait(0.002):
                n += 1
                try:
                    delay = 300 if n % 2 else None
                    accepted.append(producer.dispatch("faults:job:work", {"n": n}, delay_ms=delay))
                except KumikoError as exc:
                    refused.append(str(exc).splitlines()[0])

        def more_load() -> None:
            seen = len(accepted)
            wait(lambda: len(accepted) >= seen + 200, 120, "the load after a fault")

        thread = threading.Thread(target=produce)
        thread.start()
        faults = []
        try:
            more_load()
            for n in range(args.fail_overs):
                slot = slots[n % SHARDS]
                old, new = cluster.fail_over(slot)
                faults.append(f"fail-over of shard {n % SHARDS}: primary {old} -> {new}")
                more_load()
            for n in range(args.moves):
                slot = slots[n % SHARDS]
                target = next(p for p in cluster.primaries() if p != cluster.owner(slot))
                moved = cluster.move_slot(slot, target)
                faults.append(f"slot move of shard {n % SHARDS}: {moved} keys to {target}")
                more_load()
        finally:
            stopping.set()
            thread.join(timeout=60)
        wait(lambda: set(accepted) <= set(ledger.runs), 120, "every accepted dispatch to run")
        producer.drain(timeout_s=60)
        worker.stop(timeout_s=30)
        producer.stop()
    for fault in faults:
        print(fault)
    lost = set(accepted) - set(ledger.runs)
    twice = sum(1 for count in ledger.runs.values() if count > 1)
    print(
        f"\n{len(accepted)} dispatches returned an id; lost {len(lost)}, ran twice {twice}; "
        f"refused (raised) {len(refused)}"
    )
    for reason in sorted(set(refused))[:5]:
        print(f"  refused: {reason}")
    return 0 if not lost else 1


if __name__ == "__main__":
    sys.exit(main())
