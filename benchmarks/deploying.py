"""Figures for docs/deploying.md, each on private servers started here.

    python -m benchmarks.deploying                 # all three suites
    python -m benchmarks.deploying --only sizing   # or: replication, hosts

- **sizing**: Redis memory per queued message, per run record and per marker (``INFO
  memory`` before and after N of them, the markers and records then deleted by kind), and
  commands per job (``INFO commandstats`` over N dispatched and run jobs, Lua-internal
  calls included; round trips are the top-level calls);
- **replication**: the cost of making a write survive a fail-over, on a primary with one
  replica: ``dispatch`` rate and latency with nothing, with ``min-replicas-to-write 1``, and
  with a ``WAIT 1 1000`` after each dispatch;
- **hosts**: jobs per second with one and with two worker hosts (network namespaces, root
  only) on the same Redis, for an I/O-bound job (sleeps 20 ms) and a no-op job, with the
  CPU time the workers and Redis spent (CPU-normalised: jobs per CPU-second).

Results go to stdout and ``benchmarks/results/deploying.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import redis

from kumiko_dramatiq import Feature, JobContext, JobRunner, Registry
from tests.apps.host_worker import registry_of as host_registry
from tests.deployment import (
    FAST_SYNC,
    Server,
    cli_env,
    host_network,
    namespaces_problem,
    start_server,
    wait_for_replication,
)

RESULTS = Path(__file__).parent / "results" / "deploying.json"
PREFIX = "bench"


def registry() -> Registry:
    feature = Feature("sz")

    def noop(payload: dict[str, Any], ctx: JobContext) -> None:
        return None

    feature.job("work")(noop)
    feature.job("seq", concurrency="sequential")(noop)
    return Registry([feature])


@contextmanager
def server(name: str, *args: str) -> Iterator[Server]:
    with tempfile.TemporaryDirectory(prefix="kumiko-bench-") as directory:
        started = start_server(name, Path(directory), args=args)
        try:
            yield started
        finally:
            started.stop()


def used_memory(client: redis.Redis) -> int:
    return int(client.info("memory")["used_memory"])


def commandstats(client: redis.Redis) -> dict[str, int]:
    stats: dict[str, Any] = client.info("commandstats")
    return {name.removeprefix("cmdstat_"): int(v["calls"]) for name, v in stats.items()}


def delete(client: redis.Redis, pattern: str) -> int:
    found = list(client.scan_iter(match=pattern, count=10_000))
    for start in range(0, len(found), 1_000):
        client.delete(*found[start : start + 1_000])
    return len(found)


# -- sizing ---------------------------------------------------------------------------------
def sizing(count: int) -> dict[str, Any]:
    out: dict[str, Any] = {"messages": count}
    with server("sizing") as redis_server:
        url = f"redis://127.0.0.1:{redis_server.port}/0"
        admin = redis_server.client()
        runner = JobRunner(registry(), redis_url=url, queue_prefix=PREFIX, worker_threads=8)
        payload = {"invoice": "INV-000042", "email": "someone@example.com", "amount": 1234}
        out["payload_bytes"] = len(json.dumps(payload))

        # queued messages (and their "sent" markers, which live 60 s)
        before = used_memory(admin)
        runner.dispatch_many("sz:job:work", [payload] * count)
        queued = used_memory(admin)
        sent = delete(admin, f"kumiko:{PREFIX}:sent:*")
        without_sent = used_memory(admin)
        out["queued_message_bytes"] = round((without_sent - before) / count)
        out["sent_marker_bytes"] = round((queued - without_sent) / sent)

        # run them: run records, "already completed" markers
        admin.config_resetstat()
        runner.start()
        runner.drain(timeout_s=120)
        runner.stop()
        after_run = used_memory(admin)
        done = delete(admin, f"kumiko:{PREFIX}:done:*")
        without_done = used_memory(admin)
        records = delete(admin, f"kumiko:{PREFIX}:run:*")
        delete(admin, f"kumiko:{PREFIX}:runs:*")
        without_records = used_memory(admin)
        out["done_marker_bytes"] = round((after_run - without_done) / done)
        out["run_record_bytes"] = round((without_done - without_records) / records)

        # commands per job, dispatch included
        ended = threading.Semaphore(0)
        for kind, job, key in (
            ("plain", "sz:job:work", None),
            ("dedup_key", "sz:job:work", "k"),
            ("sequential", "sz:job:seq", None),
        ):
            worker = JobRunner(
                registry(),
                redis_url=url,
                queue_prefix=PREFIX,
                worker_threads=8,
                on_job_complete=lambda *_: ended.release(),
            )
            worker.start()
            admin.config_resetstat()
            # a burst of plain and keyed jobs; sequential ones one after another (a burst
            # of them measures the hand-offs of runs finding the lock held instead)
            jobs = count // 5 if kind != "sequential" else count // 50
            for n in range(jobs):
                worker.dispatch(job, payload, dedup_key=None if key is None else f"{key}{n}")
                if kind == "sequential" and not ended.acquire(timeout=30):
                    raise TimeoutError("a sequential run did not end")
            for _ in range(jobs if kind != "sequential" else 0):
                if not ended.acquire(timeout=120):
                    raise TimeoutError("the jobs did not end")
            stats = commandstats(admin)
            worker.stop()
            stats.pop("config|resetstat", None)
            scripts = stats.get("evalsha", 0) + stats.get("fcall", 0)
            top_level = scripts + sum(
                v for k, v in stats.items() if k in ("mget", "blpop", "hgetall", "multi", "exec")
            )
            out[f"commands_per_job_{kind}"] = {
                "all": round(sum(stats.values()) / jobs, 1),
                "evalsha": round(scripts / jobs, 2),  # EVALSHA and FCALL: the scripts
                "top_level": round(top_level / jobs, 2),
                "busiest": {
                    k: round(v / jobs, 2)
                    for k, v in sorted(stats.items(), key=lambda kv: -kv[1])[:8]
                },
            }
        admin.close()
    return out


# -- replication ----------------------------------------------------------------------------
def replication(count: int, rounds: int = 3) -> dict[str, Any]:
    """Each setting ``rounds`` times, in alternating order; medians."""
    out: dict[str, Any] = {"dispatches": count, "rounds": rounds}
    settings: list[tuple[str, tuple[str, ...], bool]] = [
        ("asynchronous (default)", (), False),
        ("min-replicas-to-write 1, max-lag 10", ("--min-replicas-to-write", "1"), False),
        ("WAIT 1 1000 after each dispatch", (), True),
    ]
    samples: dict[str, list[dict[str, float]]] = {label: [] for label, _, _ in settings}
    for round_ in range(rounds):
        order = settings if round_ % 2 == 0 else settings[::-1]
        for label, args, wait in order:
            samples[label].append(replicated_dispatches(count, args, wait))
    for label, runs in samples.items():
        out[label] = {key: round(statistics.median(run[key] for run in runs), 3) for key in runs[0]}
    return out


def replicated_dispatches(count: int, args: tuple[str, ...], wait: bool) -> dict[str, float]:
    with tempfile.TemporaryDirectory(prefix="kumiko-bench-") as directory:
        base = Path(directory)
        primary = start_server("primary", base, args=[*FAST_SYNC, *args])
        replica = start_server(
            "replica", base, args=["--replicaof", "127.0.0.1", str(primary.port)]
        )
        try:
            wait_for_replication(primary)
            url = f"redis://127.0.0.1:{primary.port}/0"
            runner = JobRunner(registry(), redis_url=url, queue_prefix=PREFIX)
            client = runner.broker.client
            latencies = []
            acked = 0
            began = time.perf_counter()
            for n in range(count):
                start = time.perf_counter()
                runner.dispatch("sz:job:work", {"n": n})
                if wait:
                    # a single-threaded producer gets the dispatch's connection back
                    acked += int(client.execute_command("WAIT", 1, 1000))
                latencies.append(time.perf_counter() - start)
            elapsed = time.perf_counter() - began
            runner.stop()
            if wait and acked != count:
                raise AssertionError(f"WAIT saw the replica acknowledge {acked} of {count}")
            return {
                "dispatches_per_s": count / elapsed,
                "latency_p50_ms": statistics.median(latencies) * 1000,
                "latency_p99_ms": statistics.quantiles(latencies, n=100)[98] * 1000,
            }
        finally:
            replica.stop()
            primary.stop()


# -- hosts ----------------------------------------------------------------------------------
def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    ticks = 100  # os.sysconf("SC_CLK_TCK") on Linux
    return (int(fields[11]) + int(fields[12])) / ticks


def redis_cpu(client: redis.Redis) -> float:
    info: dict[str, Any] = client.info("cpu")
    return float(info["used_cpu_sys"]) + float(info["used_cpu_user"])


def hosts(count: int) -> dict[str, Any]:
    problem = namespaces_problem()
    if problem is not None:
        return {"skipped": problem}
    out: dict[str, Any] = {"threads_per_host": 8}
    with tempfile.TemporaryDirectory(prefix="kumiko-bench-") as directory, host_network(2) as net:
        base = Path(directory)
        shared = start_server(
            "shared",
            base,
            host=net.gateway,
            args=["--requirepass", "pw"],
            client_kwargs={"password": "pw"},
        )
        url = f"redis://:pw@{net.gateway}:{shared.port}/0"
        admin = shared.client()
        try:
            for job, payload, jobs in (
                ("io-bound (sleeps 20 ms)", {"sleep_ms": 20}, count // 3),
                ("no-op", {}, count),
            ):
                for used in (1, 2):
                    prefix = f"{PREFIX}{used}{len(payload)}"
                    out[f"{job}, {used} host(s)"] = run_hosts(
                        net, base, url, admin, prefix, net.hosts[:used], payload, jobs
                    )
        finally:
            admin.close()
            shared.stop()
    for job in ("io-bound (sleeps 20 ms)", "no-op"):
        one, two = out[f"{job}, 1 host(s)"], out[f"{job}, 2 host(s)"]
        out[f"{job}: 2 hosts / 1 host"] = round(two["jobs_per_s"] / one["jobs_per_s"], 2)
        out[f"{job}: per CPU-second, 2 hosts / 1 host"] = round(
            two["jobs_per_cpu_s"] / one["jobs_per_cpu_s"], 2
        )
    return out


def run_hosts(
    net: Any,
    base: Path,
    url: str,
    admin: redis.Redis,
    prefix: str,
    used: list[Any],
    payload: dict[str, Any],
    jobs: int,
) -> dict[str, Any]:
    release = base / "release"
    release.touch()
    env = cli_env(url, prefix, app="")
    env.update(HOST_HEARTBEAT_TIMEOUT_MS="60000", HOST_LOCK_TTL_MS="30000", HOST_THREADS="8")
    producer = JobRunner(
        host_registry(base / "producer.log", release), redis_url=url, queue_prefix=prefix
    )
    # queued, paused, before any worker starts; resumed (the clock starts) once all are ready
    producer.pause("hosts:job:work")
    producer.dispatch_many("hosts:job:work", [payload] * jobs)
    processes = []
    logs = []
    for host in used:
        log = base / f"{prefix}-{host.name}.log"
        logs.append(log)
        argv = [sys.executable, "-m", "tests.apps.host_worker", str(log), str(release)]
        processes.append(net.spawn(host, argv, env, base / f"{prefix}-{host.name}.out"))
    wait_until(lambda: all(log.exists() and "ready" in log.read_text() for log in logs))
    workers_before = sum(cpu_seconds(p.pid) for p in processes)
    redis_before = redis_cpu(admin)
    began = time.perf_counter()
    producer.resume("hosts:job:work")
    producer.drain(timeout_s=300)
    elapsed = time.perf_counter() - began
    redis_used = redis_cpu(admin) - redis_before
    cpu = sum(cpu_seconds(p.pid) for p in processes) - workers_before + redis_used
    producer.stop()
    for process in processes:
        process.terminate()
    for process in processes:
        process.wait(timeout=30)
    return {
        "jobs": jobs,
        "seconds": round(elapsed, 2),
        "jobs_per_s": round(jobs / elapsed),
        "cpu_s": round(cpu, 2),
        "redis_cpu_s": round(redis_used, 2),
        "redis_cpu_ms_per_job": round(redis_used * 1000 / jobs, 3),
        "jobs_per_cpu_s": round(jobs / cpu) if cpu else None,
    }


def wait_until(predicate: Callable[[], bool], timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError("the hosts' workers did not start")
        time.sleep(0.05)


SUITES: dict[str, Callable[[int], dict[str, Any]]] = {
    "sizing": sizing,
    "replication": replication,
    "hosts": hosts,
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.deploying")
    parser.add_argument("--only", choices=sorted(SUITES))
    parser.add_argument("--messages", type=int, default=10_000)
    args = parser.parse_args(argv)
    results: dict[str, Any] = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    for name, suite in SUITES.items():
        if args.only in (None, name):
            results[name] = suite(args.messages if name != "replication" else 3_000)
            print(json.dumps({name: results[name]}, indent=2))
    RESULTS.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
