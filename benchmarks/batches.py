"""What a batch costs beside the same jobs dispatched plainly (issue 48).

``python -m benchmarks.batches [--children 10000] [--rounds 5] [--callbacks 200]``

On a private redis-server:

- **write**: ``dispatch_batch`` of ``--children`` no-op children beside ``dispatch_many`` of
  as many, alternating, no worker running; wall time (median of ``--rounds``) and the slowest
  single Redis command of each (``SLOWLOG`` with every command logged; the contract's bound:
  5 ms).
- **Redis CPU per child**: ``--jobs`` children (4,000), in batches of 100 (one Lua call each:
  the common size) and in one batch (written staged, then moved), written, then drained by an
  in-process worker of 8 threads (the server's ``INFO cpu``, user + sys, over the write and over the
  drain) beside as many plain jobs (``dispatch_many``); medians of ``--rounds``, and the median
  of each round's ratio of the totals (the contract's bound: 1.15x).
- **callback start**: ``--callbacks`` batches of 10 children, one at a time; each child
  returns when its handler returned (``time.time()``), the ``on_complete`` callback notes when
  it started: p50, p99 and worst of (callback start - last child's return), in ms (the
  contract's bound: 50 ms p99). This includes the settle's linger (up to 25 ms: settles are
  batched with the next claim, docs/flow.md).
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
import uuid
from hashlib import sha1
from typing import Any

import redis

from benchmarks.harness import percentile
from kumiko_dramatiq import Feature, JobContext, JobRunner, Registry
from kumiko_dramatiq.broker.lua import LuaScripts, source
from kumiko_dramatiq.testing import private_redis_server

STARTS: list[float] = []
STARTED = threading.Event()


def registry() -> Registry:
    bench = Feature("bench")

    @bench.job("noop")
    def noop(payload: dict[str, Any], ctx: JobContext) -> float:
        return time.time()

    @bench.job("done")
    def done(payload: dict[str, Any], ctx: JobContext) -> None:
        started = time.time()
        assert ctx.batch is not None
        last = max(result.value for result in ctx.batch.results())
        STARTS.append((started - last) * 1000)
        STARTED.set()

    return Registry([bench])


def server_cpu(client: redis.Redis) -> float:
    info = client.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


def slowest_us(client: redis.Redis) -> tuple[int, str]:
    """The longest command since the last reset (µs, and which script), then reset; loading
    a script or the function library (once per server) is left out."""
    entries = client.slowlog_get(100_000)
    client.slowlog_reset()
    names = {sha1(source(name).encode()).hexdigest(): name for name in LuaScripts.names()}
    found = []
    for entry in entries:
        words = entry["command"].decode(errors="replace").split()
        if words[0].upper() in ("SCRIPT", "FUNCTION", "SLOWLOG"):
            continue
        found.append(
            (int(entry["duration"]), names.get(words[1], words[0]) if len(words) > 1 else words[0])
        )
    return max(found, default=(0, "-"))


def write_round(url: str, children: int) -> tuple[float, tuple[int, str], float, tuple[int, str]]:
    client = redis.Redis.from_url(url)
    runner = JobRunner(registry(), redis_url=url, queue_prefix=f"bw{uuid.uuid4().hex[:6]}")
    items = [("bench:job:noop", {"n": n}) for n in range(children)]
    payloads = [{"n": n} for n in range(children)]
    try:
        slowest_us(client)
        started = time.perf_counter()
        runner.dispatch_batch(items)
        batch_s = time.perf_counter() - started
        batch_worst = slowest_us(client)
        started = time.perf_counter()
        runner.dispatch_many("bench:job:noop", payloads)
        many_s = time.perf_counter() - started
        many_worst = slowest_us(client)
    finally:
        runner.stop()
        client.flushdb()
    return batch_s, batch_worst, many_s, many_worst


def cpu_round(url: str, count: int, size: int) -> tuple[float, float]:
    """Redis CPU per job (µs) of writing ``count`` jobs (in batches of ``size``; 0: plain,
    ``dispatch_many``), and of draining them."""
    client = redis.Redis.from_url(url)
    runner = JobRunner(
        registry(), redis_url=url, queue_prefix=f"bc{uuid.uuid4().hex[:6]}", worker_threads=8
    )
    before = server_cpu(client)
    if size:
        for start in range(0, count, size):
            runner.dispatch_batch(
                [("bench:job:noop", {"n": n}) for n in range(start, min(count, start + size))]
            )
    else:
        runner.dispatch_many("bench:job:noop", [{"n": n} for n in range(count)])
    written = server_cpu(client) - before
    runner.start()
    before = server_cpu(client)
    runner.drain(timeout_s=300)
    drained = server_cpu(client) - before
    runner.stop()
    client.flushdb()
    return written / count * 1e6, drained / count * 1e6


def callback_starts(url: str, batches: int) -> list[float]:
    STARTS.clear()
    runner = JobRunner(
        registry(), redis_url=url, queue_prefix=f"bs{uuid.uuid4().hex[:6]}", worker_threads=8
    )
    runner.start()
    try:
        for _ in range(batches):
            STARTED.clear()
            runner.dispatch_batch(
                [("bench:job:noop", {"n": n}) for n in range(10)],
                on_complete=("bench:job:done", {}),
            )
            if not STARTED.wait(30):
                raise RuntimeError("a callback did not start within 30 s")
    finally:
        runner.stop()
    return list(STARTS)


def slow(found: Any) -> str:
    us, command = max(found)
    return f"{us / 1000:.2f} ms ({command})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--children", type=int, default=10_000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--jobs", type=int, default=4_000)
    parser.add_argument("--callbacks", type=int, default=200)
    args = parser.parse_args()
    with private_redis_server() as url:
        client = redis.Redis.from_url(url)
        client.config_set("slowlog-log-slower-than", 0)
        client.config_set("slowlog-max-len", 100_000)
        rounds = [write_round(url, args.children) for _ in range(args.rounds)]
        batch_s = statistics.median(r[0] for r in rounds)
        many_s = statistics.median(r[2] for r in rounds)
        print(
            f"write {args.children} children: dispatch_batch {batch_s * 1000:.0f} ms, "
            f"dispatch_many {many_s * 1000:.0f} ms ({batch_s / many_s:.2f}x, medians of "
            f"{args.rounds}); slowest command: batch {slow(r[1] for r in rounds)}, "
            f"many {slow(r[3] for r in rounds)}"
        )
        client.config_set("slowlog-log-slower-than", 10_000)
        for size in (100, args.jobs):
            rounds_cpu = [
                (cpu_round(url, args.jobs, size), cpu_round(url, args.jobs, 0))
                for _ in range(args.rounds)
            ]
            for what, at in (("write", 0), ("drain", 1)):
                b = statistics.median(batch[at] for batch, _ in rounds_cpu)
                p = statistics.median(plain[at] for _, plain in rounds_cpu)
                print(
                    f"Redis CPU per job, batches of {size}, {what}: batch child {b:.1f} us, "
                    f"plain {p:.1f} us ({b / p:.2f}x)"
                )
            total = statistics.median(sum(batch) / sum(plain) for batch, plain in rounds_cpu)
            print(
                f"Redis CPU per job, batches of {size}, write and drain: {total:.2f}x a plain "
                f"job (median of {args.rounds} rounds' ratios)"
            )
        starts = callback_starts(url, args.callbacks)
        print(
            f"callback start after the last child returned: p50 {statistics.median(starts):.1f}"
            f" ms, p99 {percentile(starts, 99):.1f} ms, worst {max(starts):.1f} ms "
            f"({len(starts)} batches of 10)"
        )


APP = registry()

if __name__ == "__main__":
    main()
