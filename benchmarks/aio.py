"""The asyncio producer beside the sync one (issue 49).

``python -m benchmarks.aio [--calls 3000] [--rounds 5] [--freeze-s 2]``

On a private redis-server (TCP, ``--enable-debug-command``), no worker running:

- **one coroutine**: ``--calls`` awaited ``adispatch`` calls in a row beside as many sync
  ``dispatch`` calls in a row (one thread), alternating; µs per call, median of ``--rounds``,
  and the median of the rounds' ratios (the target: <= 1.1x).
- **100 coroutines**: the same number of calls by 100 coroutines on one loop, beside one thread
  calling ``dispatch``: calls per second and the ratio (the target: >= 3x), and the server's
  CPU per call (``INFO cpu``) of each; meanwhile a task that sleeps 1 ms at a time measures
  the loop's lag (how late it wakes): p99 (the target: <= 5 ms).
- **Redis frozen** (``DEBUG SLEEP --freeze-s``): 100 coroutines dispatch, each call with an
  idempotency key of its own and a read timeout of 1 s, retrying a failed call once with the
  same key after the freeze; the loop's lag p99 over the freeze (the target: <= 10 ms), that
  every call returned an id or raised a ``KumikoError``, and that each key stands for exactly
  one message (the queue holds one per key: none lost, none twice).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import threading
import time
from typing import Any

import redis

from benchmarks.harness import percentile
from examples.redis_server import private_redis
from kumiko_dramatiq import Feature, JobContext, JobRunner, KumikoError, Registry

JOB = "bench:job:noop"


def registry() -> Registry:
    bench = Feature("bench")

    @bench.job("noop", retries=3)
    def noop(payload: dict[str, Any], ctx: JobContext) -> None: ...

    return Registry([bench])


class LagMeter:
    """A task that sleeps 1 ms at a time and records how late it woke (ms)."""

    def __init__(self) -> None:
        self.lags_ms: list[float] = []
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.ensure_future(self._run())

    async def stop(self) -> list[float]:
        self._stop.set()
        if self._task is not None:
            await self._task
        return self.lags_ms

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while not self._stop.is_set():
            began = loop.time()
            await asyncio.sleep(0.001)
            self.lags_ms.append((loop.time() - began - 0.001) * 1000)


def one_caller(runner: JobRunner, calls: int, *, sync_first: bool = False) -> tuple[float, float]:
    """(µs per awaited call, µs per sync call); ``sync_first``: the sync calls first (rounds
    alternate the order)."""

    async def awaited() -> float:
        await runner.adispatch(JOB, {})  # this loop's connection, opened
        began = time.perf_counter()
        for n in range(calls):
            await runner.adispatch(JOB, {"n": n})
        return (time.perf_counter() - began) / calls * 1e6

    def in_a_row() -> float:
        began = time.perf_counter()
        for n in range(calls):
            runner.dispatch(JOB, {"n": n})
        return (time.perf_counter() - began) / calls * 1e6

    if sync_first:
        sync = in_a_row()
        return asyncio.run(awaited()), sync
    value = asyncio.run(awaited())
    return value, in_a_row()


def server_cpu_s(client: redis.Redis) -> float:
    info = client.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


def many_callers(
    runner: JobRunner, calls: int, coroutines: int = 100
) -> tuple[float, float, float, float, float]:
    """(calls/s of ``coroutines`` on one loop, calls/s of one sync thread, lag p99 ms, Redis
    CPU µs per awaited call, per sync call)."""
    client = redis.Redis.from_url(runner.redis_url)

    async def awaited() -> tuple[float, float]:
        meter = LagMeter()
        meter.start()

        async def caller(share: int) -> None:
            for n in range(share):
                await runner.adispatch(JOB, {"n": n})

        began = time.perf_counter()
        await asyncio.gather(*(caller(calls // coroutines) for _ in range(coroutines)))
        elapsed = time.perf_counter() - began
        lags = await meter.stop()
        return calls / elapsed, percentile(lags, 99)

    cpu = server_cpu_s(client)
    rate, lag = asyncio.run(awaited())
    async_cpu = (server_cpu_s(client) - cpu) / calls * 1e6
    cpu = server_cpu_s(client)
    began = time.perf_counter()
    for n in range(calls):
        runner.dispatch(JOB, {"n": n})
    sync_rate = calls / (time.perf_counter() - began)
    sync_cpu = (server_cpu_s(client) - cpu) / calls * 1e6
    client.close()
    return rate, sync_rate, lag, async_cpu, sync_cpu


def frozen(url: str, prefix: str, freeze_s: float, coroutines: int = 100) -> dict[str, Any]:
    runner = JobRunner(registry(), redis_url=url, queue_prefix=prefix, boot_redis_timeout_ms=1_000)
    client = redis.Redis.from_url(url)
    outcomes: dict[str, str] = {}
    failed: list[str] = []
    errors: list[BaseException] = []

    async def scenario() -> list[float]:
        await runner.adispatch(JOB, {})  # connected
        meter = LagMeter()
        meter.start()
        sleeper = threading.Thread(
            target=lambda: redis.Redis.from_url(url).execute_command(  # type: ignore[no-untyped-call]
                "DEBUG", "SLEEP", str(freeze_s)
            )
        )
        stop = asyncio.Event()

        async def caller(index: int) -> None:
            n = 0
            while not stop.is_set():
                key = f"c{index}-{n}"
                n += 1
                try:
                    outcomes[key] = await runner.adispatch(JOB, {"k": key}, idempotency_key=key)
                except KumikoError:
                    outcomes[key] = "failed"
                except BaseException as exc:  # anything else breaks the promise
                    errors.append(exc)
                    return
                await asyncio.sleep(0.001)

        callers = [asyncio.ensure_future(caller(i)) for i in range(coroutines)]
        await asyncio.sleep(0.2)
        sleeper.start()
        await asyncio.to_thread(sleeper.join)
        await asyncio.sleep(0.2)
        stop.set()
        await asyncio.gather(*callers)
        lags = await meter.stop()
        failed.extend(key for key, outcome in outcomes.items() if outcome == "failed")
        for key in failed:  # the one retry of each failed call, with its key
            outcomes[key] = await runner.adispatch(JOB, {"k": key}, idempotency_key=key)
        await runner.aclose()
        return lags

    with runner:
        lags = asyncio.run(scenario())
        queued = runner.job_counts()[JOB]["queued"]
    client.close()
    failed_first = len(failed)
    return {
        "calls": len(outcomes),
        "lag_p99_ms": percentile(lags, 99),
        "lag_max_ms": max(lags),
        "other_errors": len(errors),
        "queued": queued - 1,  # the connecting dispatch
        "keys": len(outcomes),
        "failed_first": failed_first,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=3_000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--freeze-s", type=float, default=2.0)
    options = parser.parse_args()
    with private_redis("--enable-debug-command", "yes", "--save", "") as url:
        runner = JobRunner(registry(), redis_url=url, queue_prefix="bench")
        one_caller(runner, 300)  # warm up both paths
        singles, rates, lags = [], [], []
        for n in range(options.rounds):
            singles.append(one_caller(runner, options.calls, sync_first=n % 2 == 1))
            rates.append(many_callers(runner, options.calls))
            lags.append(rates[-1][2])
            redis.Redis.from_url(url).flushall()
        runner.stop()
        print(f"one coroutine, {options.calls} calls x {options.rounds} rounds (µs per call):")
        print(
            f"  adispatch {statistics.median(a for a, _ in singles):.0f}, dispatch "
            f"{statistics.median(s for _, s in singles):.0f}: "
            f"{statistics.median(a / s for a, s in singles):.2f}x"
        )
        print("100 coroutines on one loop vs one thread (calls/s):")
        print(
            f"  {statistics.median(r[0] for r in rates):,.0f} vs "
            f"{statistics.median(r[1] for r in rates):,.0f}: "
            f"{statistics.median(r[0] / r[1] for r in rates):.2f}x; loop lag p99 "
            f"{statistics.median(lags):.2f} ms (worst round {max(lags):.2f} ms); Redis CPU "
            f"per call {statistics.median(r[3] for r in rates):.1f} vs "
            f"{statistics.median(r[4] for r in rates):.1f} µs"
        )
        found = frozen(url, "frozen", options.freeze_s)
        print(f"Redis frozen {options.freeze_s:g} s under 100 coroutines:")
        print(
            f"  loop lag p99 {found['lag_p99_ms']:.2f} ms, worst {found['lag_max_ms']:.1f} ms; "
            f"{found['calls']} calls, {found['failed_first']} raised a KumikoError and were "
            f"retried once, {found['other_errors']} raised anything else; "
            f"{found['queued']} messages for {found['keys']} keys"
        )


if __name__ == "__main__":
    main()
