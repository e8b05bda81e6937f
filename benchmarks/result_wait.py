"""How fast ``runner.result`` returns after a job ends, and what waiters cost Redis (issue 48).

``python -m benchmarks.result_wait [--waiters 1000] [--idle-s 5] [--rounds 3]``

On a private redis-server:

- **idle waiters**: ``--waiters`` threads each wait in ``result(id, timeout_s=...)`` for a
  message of its own that no worker runs yet; the server's CPU (``INFO cpu``, user + sys) is read
  over ``--idle-s`` seconds of that wait, beside the same span with no waiter (the baseline).
- **latency**: a CLI worker of 8 threads (``dramatiq kumiko_dramatiq.app``, a process of its
  own, as in production) is started; each job returns the time its handler returned, and each
  waiter notes when ``result`` gave it back. Reported: p50, p99 and worst of the difference (ms)
  over every waiter of every round (the contract's bound: 50 ms p99).
- **write cost**: Redis CPU per job for 2,000 no-op jobs with ``keep_result_s`` beside the same
  jobs without (the value rides on the settle call; the publish is one command more).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import redis

from benchmarks.harness import percentile
from kumiko_dramatiq import Feature, JobContext, JobRunner, Registry
from kumiko_dramatiq.testing import private_redis_server

ROOT = Path(__file__).resolve().parents[1]


def registry() -> Registry:
    bench = Feature("bench")

    @bench.job("kept", keep_result_s=600)
    def kept(payload: dict[str, Any], ctx: JobContext) -> float:
        return time.time()  # when the handler returned: the waiter's reference

    @bench.job("plain")
    def plain(payload: dict[str, Any], ctx: JobContext) -> None:
        return None

    return Registry([bench])


def server_cpu(client: redis.Redis) -> float:
    info = client.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


def one_round(url: str, waiters: int, idle_s: float) -> tuple[list[float], float, float]:
    prefix = f"rw{uuid.uuid4().hex[:6]}"
    client = redis.Redis.from_url(url)
    runner = JobRunner(registry(), redis_url=url, queue_prefix=prefix)
    ids = runner.dispatch_many("bench:job:kept", [{"n": n} for n in range(waiters)])
    delays: list[float] = []
    lock = threading.Lock()

    def wait(message_id: str) -> None:
        ended = runner.result(message_id, timeout_s=120)
        returned = time.time()
        with lock:
            delays.append((returned - ended) * 1000)

    before = server_cpu(client)
    time.sleep(idle_s)
    baseline = server_cpu(client) - before
    threads = [threading.Thread(target=wait, args=(m,), daemon=True) for m in ids]
    for thread in threads:
        thread.start()
    time.sleep(1.0)  # every waiter is in its wait
    before = server_cpu(client)
    time.sleep(idle_s)
    idle = server_cpu(client) - before
    env = {k: v for k, v in os.environ.items() if not k.startswith("KUMIKO_")}
    env.update(
        PYTHONPATH=str(ROOT),
        KUMIKO_APP="benchmarks.result_wait:APP",
        KUMIKO_REDIS_URL=url,
        KUMIKO_QUEUE_PREFIX=prefix,
    )
    worker = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "dramatiq",
            "kumiko_dramatiq.app",
            "--processes",
            "1",
            "--threads",
            "8",
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        for thread in threads:
            thread.join(180)
    finally:
        worker.terminate()
        worker.wait(30)
        runner.stop()
    return delays, baseline, idle


def write_cost(url: str, job: str, count: int) -> float:
    prefix = f"wc{uuid.uuid4().hex[:6]}"
    client = redis.Redis.from_url(url)
    runner = JobRunner(registry(), redis_url=url, queue_prefix=prefix, worker_threads=8)
    runner.dispatch_many(job, [{"n": n} for n in range(count)])
    before = server_cpu(client)
    runner.start()
    runner.drain(timeout_s=300)
    spent = server_cpu(client) - before
    runner.stop()
    return spent / count * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--waiters", type=int, default=1000)
    parser.add_argument("--idle-s", type=float, default=5.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--jobs", type=int, default=2000)
    args = parser.parse_args()
    with private_redis_server() as url:
        delays: list[float] = []
        for n in range(args.rounds):
            found, baseline, idle = one_round(url, args.waiters, args.idle_s)
            delays += found
            print(
                f"round {n + 1}: {len(found)} waiters returned; Redis CPU over {args.idle_s:g} s:"
                f" {baseline * 1000:.1f} ms without waiters, {idle * 1000:.1f} ms with "
                f"{args.waiters} waiting"
            )
        print(
            f"result() after the job ended: p50 {statistics.median(delays):.1f} ms, "
            f"p99 {percentile(delays, 99):.1f} ms, worst {max(delays):.1f} ms "
            f"({len(delays)} waits)"
        )
        kept, plain = [], []
        for _ in range(args.rounds):
            kept.append(write_cost(url, "bench:job:kept", args.jobs))
            plain.append(write_cost(url, "bench:job:plain", args.jobs))
        k, p = statistics.median(kept), statistics.median(plain)
        print(
            f"Redis CPU per job: keep_result_s {k:.1f} us, none {p:.1f} us ({k / p:.2f}x; "
            f"medians of {args.rounds})"
        )


APP = registry()

if __name__ == "__main__":
    main()
