"""The dashboard's pages at scale: ``python -m benchmarks.dashboard``.

``[--records 1000000] [--queued 10000] [--dead 1000] [--samples 30]``

Starts a private redis-server (unless ``KUMIKO_REDIS_URL`` is set) and fills one dataset:
``--records`` run records written by the history suite's filler (``fill_history`` in
``benchmarks/run.py``: 20 jobs, one record a millisecond, every tenth failed, a third of them
over 500 tenants), ``--dead`` dead letters left by an in-process worker, ``--queued``
messages on the worker lane that nobody consumes (a tenth of them with dedup keys), a cron job,
a boot job and a sequential job holding its lock on a live api-lane worker. Then it asks
every page ``--samples`` times through Starlette's TestClient (the app in-process: the
server's own time, no network) and prints p50/p99/max per page; the target is every page
under 100 ms. Results also go to ``benchmarks/results/dashboard.json``.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import threading
import time
import uuid
from typing import Any

import redis
from starlette.testclient import TestClient

from kumiko_dramatiq import Cron, Feature, JobContext, JobRunner, Registry
from kumiko_dramatiq.dashboard import create_app

from .harness import percentile
from .run import RESULTS, fill_history, machine

JOBS = [f"bench:job:j{n}" for n in range(20)]
TARGET_MS = 100.0


def registry(release: threading.Event) -> Registry:
    bench = Feature("bench")
    for job in JOBS:
        bench.job(job.rsplit(":", 1)[1])(_noop)

    @bench.job("fail")
    def fail(payload: dict[str, Any], ctx: JobContext) -> None:
        raise RuntimeError(f"gateway down for order {payload.get('n')}")

    @bench.job("hold", concurrency="sequential", run_in="api")
    def hold(payload: dict[str, Any], ctx: JobContext) -> None:
        release.wait(600)

    bench.job("nightly", trigger=Cron("0 3 * * *"))(_noop)
    bench.job("warm", run_on_boot=True)(_noop)
    return Registry([bench])


def _noop(payload: dict[str, Any], ctx: JobContext) -> None:
    return None


def wait_until(predicate: Any, what: str, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        time.sleep(0.05)


def measure(client: Any, paths: list[str], samples: int) -> dict[str, dict[str, float]]:
    timings = {}
    for path in paths:
        client.get(path)  # warm: template compile, script load
        spent = []
        for _ in range(samples):
            begun = time.perf_counter()
            response = client.get(path)
            spent.append((time.perf_counter() - begun) * 1000)
            if response.status_code != 200:
                raise SystemExit(f"{path} answered {response.status_code}")
        timings[path] = {
            "p50_ms": round(percentile(spent, 50), 1),
            "p99_ms": round(percentile(spent, 99), 1),
            "max_ms": round(max(spent), 1),
        }
    return timings


def run(url: str, args: argparse.Namespace) -> dict[str, Any]:
    prefix = f"bd{uuid.uuid4().hex[:6]}"
    release = threading.Event()
    apps = registry(release)
    options: dict[str, Any] = {"redis_url": url, "queue_prefix": prefix, "idle_wait_ms": 50}
    client = redis.Redis.from_url(url)
    client.config_set("maxmemory", 0)

    producer = JobRunner(apps, history_cap=args.records * 2, **options)
    print(f"filling {args.records:,} run records...", file=sys.stderr)
    began = time.perf_counter()
    fill_history(client, producer.history, JOBS, args.records)
    fill_s = time.perf_counter() - began

    print(f"making {args.dead:,} dead letters...", file=sys.stderr)
    worker = JobRunner(apps, history_cap=args.records * 2, worker_threads=8, **options)
    worker.start()
    producer.dispatch_many("bench:job:fail", [{"n": n} for n in range(args.dead)])
    wait_until(lambda: producer.status().lanes[0].dead >= args.dead, "the dead letters")
    worker.stop()

    print(f"queueing {args.queued:,} messages, holding a lock...", file=sys.stderr)
    api = JobRunner(apps, history_cap=args.records * 2, lane="api", **options)
    api.start()
    producer.dispatch("bench:job:hold")
    wait_until(lambda: bool(producer.locks()), "the lock")
    keyed = args.queued // 10
    producer.dispatch_many(
        "bench:job:j1", [{"n": n} for n in range(keyed)], dedup_keys=[f"k{n}" for n in range(keyed)]
    )
    producer.dispatch_many("bench:job:j0", [{"n": n} for n in range(args.queued - keyed)])

    some_run = producer.runs(JOBS[3], limit=1)[0].message_id
    dead_one = producer.dead_letters(limit=1)[0].message_id
    paths = [
        "/",
        "/jobs",
        "/runs",
        f"/runs?job={JOBS[3]}",
        f"/runs?job={JOBS[3]}&status=failed",
        "/runs?tenant=tenant-42",
        "/runs?status=dead",
        f"/runs/{some_run}",
        f"/runs/{dead_one}",
        "/dead",
        "/dead?job=bench:job:fail",
        "/locks",
        "/dedup",
        "/dedup?job=bench:job:j1&key=k7",
        "/schedules",
        "/boot",
    ]
    status = producer.status()
    dataset = {
        "run_records": args.records,
        "queued": status.lanes[0].queued,
        "dead": status.lanes[0].dead,
        "keys_in_redis": int(client.dbsize()),
        "fill_records_per_s": round(args.records / fill_s),
    }
    print(f"dataset: {dataset}; asking each page {args.samples} times...", file=sys.stderr)
    with TestClient(create_app(producer, token=None)) as http:
        timings = measure(http, paths, args.samples)
    release.set()
    api.stop()
    producer.stop()
    for pattern in (f"kumiko:{prefix}:*", f"dramatiq:{prefix}-*"):
        batch: list[Any] = []
        for key in client.scan_iter(match=pattern, count=10_000):
            batch.append(key)
            if len(batch) >= 10_000:
                client.delete(*batch)
                batch = []
        if batch:
            client.delete(*batch)
    return {"dataset": dataset, "pages": timings}


def report(result: dict[str, Any]) -> str:
    lines = [
        f"Machine: {machine()}",
        f"Dataset: {json.dumps(result['dataset'])}",
        "",
        "| page | p50 | p99 | max |",
        "|---|---|---|---|",
    ]
    for path, t in result["pages"].items():
        lines.append(f"| `{path}` | {t['p50_ms']} ms | {t['p99_ms']} ms | {t['max_ms']} ms |")
    worst = max(t["p99_ms"] for t in result["pages"].values())
    verdict = "met" if worst < TARGET_MS else "MISSED"
    lines += [
        "",
        f"Slowest p99: {worst} ms (target: every page under {TARGET_MS:.0f} ms: {verdict})",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--records", type=int, default=1_000_000)
    parser.add_argument("--queued", type=int, default=10_000)
    parser.add_argument("--dead", type=int, default=1_000)
    parser.add_argument("--samples", type=int, default=30)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("kumiko_dramatiq").setLevel(logging.CRITICAL)

    from examples.demo import demo_redis

    with demo_redis() as url:
        result = run(url, args)
    text = report(result)
    print(text)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "dashboard.json").write_text(json.dumps(result, indent=2))
    return 0 if "MISSED" not in text else 1


if __name__ == "__main__":
    sys.exit(main())
