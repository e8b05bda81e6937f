"""Operating on messages waiting for a cap: ``python -m benchmarks.capwait [--waiting 100000]``.

Starts a private redis-server (``SLOWLOG`` of every command) and sets up a job with
``max_running=1`` whose one slot is held, with ``--waiting`` of its messages waiting for it
(in its ``keys.cap_wait`` list, counted in ``keys.cap_waits``, its group due in an hour: as
the fetch leaves them, written here directly rather than by 1,600 fetches). Then it measures,
through the public API (in-process), the slowest Redis command each operator action causes:
``cancel`` of the last waiter (the worst case: its list is scanned whole), ``queued`` (a page
of the job's), ``purge --dry-run`` and ``purge``. Target: no single Redis command over 5 ms.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from typing import Any

import redis

from examples.redis_server import private_redis
from kumiko_dramatiq import Feature, JobContext, JobRunner, Registry
from kumiko_dramatiq.broker import keys

from .operating import slowest
from .run import machine

PREFIX = "bench"
JOB = "bench:job:work"


def registry() -> Registry:
    feature = Feature("bench")

    @feature.job("work", max_running=1)
    def work(payload: dict[str, Any], ctx: JobContext) -> None:
        return None

    return Registry([feature])


def build(runner: JobRunner, client: redis.Redis, waiting: int) -> list[str]:
    ids: list[str] = []
    for start in range(0, waiting, 1_000):
        count = min(1_000, waiting - start)
        ids += runner.dispatch_many(
            JOB,
            [{"n": start + n} for n in range(count)],
            dedup_keys=[f"k{start + n}" for n in range(count)],
        )
    queue = runner.registry.jobs[JOB].queue_name(PREFIX)
    now_ms = int(time.time() * 1000)
    client.zadd(keys.cap_slots(PREFIX, JOB), {"holder#1": now_ms + 3_600_000})
    # what the fetch does to a message that finds its job at the cap, in bulk
    client.eval(
        """
        local n = 0
        while true do
            local rids = redis.call("lpop", KEYS[1], 1000)
            if not rids then break end
            redis.call("rpush", KEYS[2], unpack(rids))
            n = n + #rids
        end
        redis.call("hincrby", KEYS[3], ARGV[1], n)
        redis.call("zadd", KEYS[4], ARGV[2], ARGV[1])
        return n
        """,
        4,
        keys.queue_list(queue),
        keys.cap_wait(PREFIX, JOB),
        keys.cap_waits(PREFIX),
        keys.cap_waiting(PREFIX, queue),
        JOB,
        now_ms + 3_600_000,
    )
    return ids


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--waiting", type=int, default=100_000)
    args = parser.parse_args(argv)
    with private_redis("--slowlog-log-slower-than", "0", "--slowlog-max-len", "1000000") as url:
        client = redis.Redis.from_url(url)
        own = str(client.client_info()["addr"])
        runner = JobRunner(registry(), redis_url=url, queue_prefix=PREFIX)
        ids = build(runner, client, args.waiting)
        print(f"machine: {machine()}")
        print(f"waiting for the cap: {runner.job_counts()[JOB]['queued']:,}")
        actions: dict[str, Callable[[], object]] = {
            "cancel (the last waiter)": lambda: runner.cancel(ids[-1]),
            "queued (a page of 50)": lambda: len(runner.queued(JOB, state="queued")),
            "purge --dry-run": lambda: runner.admin.purge(
                runner.registry.jobs[JOB], "queued", dry_run=True
            ),
            "purge": lambda: runner.purge(JOB, state="queued"),
        }
        for name, action in actions.items():
            client.slowlog_reset()
            began = time.perf_counter()
            result = action()
            wall_ms = (time.perf_counter() - began) * 1000
            worst = slowest(client, own)
            print(
                f"{name:28} -> {result!s:8} wall {wall_ms:8.1f} ms, slowest Redis command "
                f"{worst.command_us / 1000:.2f} ms ({worst.command})"
            )
        print(f"left waiting: {runner.job_counts()[JOB]['queued']}")
        runner.stop()
        client.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
