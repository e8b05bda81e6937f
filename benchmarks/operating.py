"""Operating a big dataset: ``python -m benchmarks.operating``.

``[--other-keys 1000000] [--queued 100000] [--delayed 100000] [--dedup 20000] [--samples 3]``

Starts a private redis-server and builds the dataset of issue 30: ``--other-keys`` keys of
another app (pipelined), and a kumiko dataset (``benchmarks/ops_app.py``) with a run history
(2,000 completed runs, 20 dead letters left by an in-process worker, stopped before anything
is measured), ``--queued`` queued messages of which ``--dedup`` hold a dedup key, ``--delayed``
messages delayed by an hour (written the way this branch writes delayed messages) and a
sequential lock whose holder is gone. Then it runs every ``kumiko`` command as a subprocess
(``python -m kumiko_dramatiq.ops.cli``, Python start included) and asks every dashboard page
through Starlette's TestClient (in-process), ``--samples`` times each, and reports per
command its median wall time and the slowest Redis command it caused: the server's
``SLOWLOG`` with ``slowlog-log-slower-than 0``, reset before each run, this script's own
commands left out. The start-up check every command runs first (issue 29's) is reported
apart: its probe script (``EVALSHA`` of ``probe.lua``, and the commands it runs, which Redis 7
logs too) and every command on its probe keys; the rest is the command's own.

Targets (issue 30): no single Redis command over 5 ms caused by any command or page (the
start-up check aside), and each command done in 1.5 s wall including Python start.
Results also go to ``benchmarks/results/operating.json``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import statistics
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis
from starlette.testclient import TestClient

from examples.redis_server import private_redis
from kumiko_dramatiq import JobRunner
from kumiko_dramatiq.broker import keys
from kumiko_dramatiq.broker.counts import backfill_counts
from kumiko_dramatiq.broker.lua import source as lua_source
from kumiko_dramatiq.dashboard import create_app

from .ops_app import registry
from .run import RESULTS, machine

ROOT = Path(__file__).resolve().parents[1]
PREFIX = "shop"
PLAIN, KEYED, FAILING, SEQUENTIAL = (
    "shop:job:send_invoice",
    "shop:job:sync_customer",
    "shop:job:charge",
    "shop:job:close_books",
)
#: Targets of issue 30.
COMMAND_TARGET_MS = 5.0
WALL_TARGET_S = 1.5
PROBE_SHA = hashlib.sha1(lua_source("probe").encode()).hexdigest()  # Redis's script id


@dataclass
class Slowest:
    """The slowest Redis command of one run: how long (µs) and what, split into the start-up
    check's probe script and everything else."""

    command_us: int
    command: str
    probe_us: int


def slowest(client: redis.Redis, own: str) -> Slowest:
    entries: list[dict[str, Any]] = client.slowlog_get(1_000_000)
    worst_us, worst, probe_us = 0, "-", 0
    for entry in entries:
        if _text(entry.get("client_address", "")) == own:
            continue
        words = (
            [_text(word) for word in entry["command"].split()]
            if isinstance(entry["command"], bytes | str)
            else [_text(word) for word in entry["command"]]
        )
        duration = int(entry["duration"])
        check = len(words) > 1 and words[0].lower() == "evalsha" and words[1] == PROBE_SHA
        if check or any("probe" in word for word in words[1:]):
            # the start-up check: its probe script, what the script ran (Redis 7 logs the
            # commands of scripts too), and its checks of the commands sent from Python
            probe_us = max(probe_us, duration)
            continue
        if duration > worst_us:
            worst_us, worst = duration, " ".join(words[:3])[:80]
    return Slowest(worst_us, worst, probe_us)


def _text(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def reset(client: redis.Redis) -> None:
    client.slowlog_reset()


def build(url: str, args: argparse.Namespace, client: redis.Redis) -> dict[str, Any]:
    """The dataset; returns the ids the commands act on."""
    began = time.perf_counter()
    pipe = client.pipeline(transaction=False)
    for n in range(args.other_keys):
        pipe.set(f"otherapp:session:{n:07d}", "x" * 32)
        if n % 10_000 == 9_999:
            pipe.execute()
    pipe.execute()
    other_s = time.perf_counter() - began
    print(f"{args.other_keys:,} keys of another app in {other_s:.1f} s", file=sys.stderr)

    # a run history and dead letters, from a worker stopped before anything is measured
    worker = JobRunner(
        registry, redis_url=url, queue_prefix=PREFIX, worker_threads=8, idle_wait_ms=50
    )
    worker.start()
    worker.dispatch_many(PLAIN, [{"n": n} for n in range(2_000)])
    dead = worker.dispatch_many(FAILING, [{"n": n} for n in range(20)])
    worker.drain(timeout_s=120)
    worker.stop()

    began = time.perf_counter()
    producer = JobRunner(registry, redis_url=url, queue_prefix=PREFIX)
    plain: list[str] = []
    for start in range(0, args.queued - args.dedup, 1_000):
        count = min(1_000, args.queued - args.dedup - start)
        plain += producer.dispatch_many(PLAIN, [{"n": start + n} for n in range(count)])
    keyed: list[str] = []
    for start in range(0, args.dedup, 1_000):
        count = min(1_000, args.dedup - start)
        keyed += producer.dispatch_many(
            KEYED,
            [{"n": start + n} for n in range(count)],
            dedup_keys=[f"customer-{start + n}" for n in range(count)],
        )
    delayed: list[str] = []
    for start in range(0, args.delayed, 1_000):
        count = min(1_000, args.delayed - start)
        delayed += producer.dispatch_many(
            PLAIN, [{"n": start + n} for n in range(count)], delay_ms=3_600_000
        )
    lock = keys.sequential_lock(PREFIX, SEQUENTIAL, None)
    producer.broker.lua.lock_acquire(keys=[lock], args=[f"{uuid.uuid4()}:lease", 3_600_000])
    kumiko_s = time.perf_counter() - began
    lane = producer.status().lanes[0]
    dataset = {
        "keys_in_redis": int(client.dbsize()),
        "other_app_keys": args.other_keys,
        "queued": lane.queued,
        "delayed": lane.delayed,
        "dead": lane.dead,
        "dedup_records": args.dedup,
        "run_records": 2_000 + 2 * len(dead),
        "build_s": round(other_s + kumiko_s, 1),
    }
    producer.stop()
    print(f"dataset: {dataset}", file=sys.stderr)
    return {
        "dataset": dataset,
        "queued": plain,
        "keyed": keyed,
        "delayed": delayed,
        "dead": dead,
        "a_run": plain[0],
    }


def commands(ids: dict[str, Any], samples: int) -> dict[str, list[list[str]]]:
    """Each command, once per sample (actions get a fresh target each time)."""
    unknown = [str(uuid.uuid4()) for _ in range(samples)]
    listings: dict[str, list[str]] = {
        "status": ["status"],
        "jobs": ["jobs"],
        "runs": ["runs"],
        "runs --since 1h": ["runs", "--since", "1h"],
        "runs --job J --status dead": ["runs", "--job", FAILING, "--status", "dead"],
        "runs --message PREFIX": ["runs", "--message", ids["dead"][0][:8]],
        "dead": ["dead"],
        "locks": ["locks"],
        "dedup": ["dedup"],
        "dedup --job J": ["dedup", "--job", KEYED],
    }
    out = {name: [argv] * samples for name, argv in listings.items()}
    out["cancel ID (queued, the queue's last)"] = [
        ["cancel", ids["queued"][-1 - n]] for n in range(samples)
    ]
    out["cancel ID (delayed)"] = [["cancel", ids["delayed"][-1 - n]] for n in range(samples)]
    out["cancel ID (unknown)"] = [["cancel", unknown[n]] for n in range(samples)]
    out["pause JOB"] = [["pause", PLAIN]] * samples
    out["resume JOB"] = [["resume", PLAIN]] * samples
    out["retry ID"] = [["retry", ids["dead"][n]] for n in range(samples)]
    # issue 33: browsing, counts, single-message actions, then the bulk ones (destructive:
    # last; the first purge removes them all, the later samples find none)
    out["queued"] = [["queued"]] * samples
    out["queued --job J --state delayed --payload"] = [
        ["queued", "--job", PLAIN, "--state", "delayed", "--payload"]
    ] * samples
    out["busy"] = [["busy"]] * samples
    out["stats"] = [["stats"]] * samples
    out["stop ID (queued: not running)"] = [["stop", ids["queued"][n]] for n in range(samples)]
    out["run-now ID (delayed)"] = [["run-now", ids["delayed"][n]] for n in range(samples)]
    out["dead --delete ID"] = [["dead", "--delete", ids["dead"][-1 - n]] for n in range(samples)]
    out["purge JOB --dry-run"] = [["purge", PLAIN, "--dry-run"]] * samples
    out["purge JOB --state delayed --yes"] = [["purge", PLAIN, "--state", "delayed", "--yes"]] * (
        samples
    )
    out["purge JOB --yes"] = [["purge", PLAIN, "--yes"]] * samples
    return out


def run_commands(
    url: str,
    ids: dict[str, Any],
    client: redis.Redis,
    own: str,
    samples: int,
    code: Path | None = None,
) -> dict[str, dict[str, Any]]:
    """Every command, ``samples`` times; run from ``code`` (a directory holding another
    version's ``kumiko_dramatiq``) when given, else from this tree."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KUMIKO_")}
    env.update(
        PYTHONPATH=os.pathsep.join([*([str(code)] if code else []), str(ROOT)]),
        KUMIKO_APP="benchmarks.ops_app:registry",
        KUMIKO_REDIS_URL=url,
        KUMIKO_QUEUE_PREFIX=PREFIX,
    )
    results: dict[str, dict[str, Any]] = {}
    check = [
        sys.executable,
        "-c",
        "from kumiko_dramatiq.loader import load_runner as l; r = l(); r.check_redis(); r.stop()",
    ]
    imports = [sys.executable, "-c", "import kumiko_dramatiq.ops.cli"]
    every: dict[str, list[list[str]]] = {
        "(Python start and imports alone)": [["<imports>"]] * samples,
        "(start-up check alone)": [[]] * samples,
    }
    every.update(commands(ids, samples))
    for name, argvs in every.items():
        walls, slows, statuses = [], [], []
        for argv in argvs:
            reset(client)
            began = time.perf_counter()
            if argv == ["<imports>"]:
                line = imports
            elif not argv:
                line = check
            else:
                line = [sys.executable, "-m", "kumiko_dramatiq.ops.cli", *argv]
            done = subprocess.run(
                line,
                cwd=ROOT if code is None else code,
                env=env,
                capture_output=True,
                text=True,
                timeout=120,
                check=False,
            )
            walls.append(time.perf_counter() - began)
            slows.append(slowest(client, own))
            statuses.append(done.returncode)
            if done.returncode not in (0, 1) and code is None:
                raise SystemExit(f"kumiko {' '.join(argv)}: {done.stderr.strip()}")
        worst = max(slows, key=lambda s: s.command_us)
        without = [wall - slow.probe_us / 1e6 for wall, slow in zip(walls, slows, strict=True)]
        results[name] = {
            "wall_s_median": round(statistics.median(walls), 2),
            "wall_s_max": round(max(walls), 2),
            "wall_s_median_without_probe": round(statistics.median(without), 2),
            "slowest_ms": round(worst.command_us / 1000, 2),
            "slowest_command": worst.command,
            "probe_ms": round(max(s.probe_us for s in slows) / 1000, 2),
            "exit": sorted(set(statuses)),
        }
        print(f"{name}: {results[name]}", file=sys.stderr)
    return results


def run_backfill(url: str, client: redis.Redis, own: str) -> dict[str, Any]:
    """The per-job counts counted over data written before they were kept (issue 33): the
    counts hash of the lane deleted, then the backfill of the whole lane, in bounded steps."""
    runner = JobRunner(registry, redis_url=url, queue_prefix=PREFIX)
    queue = f"{PREFIX}-worker"
    try:
        client.delete(keys.queue_counts(queue))
        reset(client)
        began = time.perf_counter()
        steps = backfill_counts(runner.broker, queue)
        spent = time.perf_counter() - began
        worst = slowest(client, own)
        result = {
            "steps": steps,
            "wall_s": round(spent, 2),
            "slowest_ms": round(worst.command_us / 1000, 2),
            "slowest_command": worst.command,
            "counts_exact": runner.job_counts()[PLAIN],
        }
    finally:
        runner.stop()
    print(f"backfill: {result}", file=sys.stderr)
    return result


def run_pages(
    url: str, ids: dict[str, Any], client: redis.Redis, own: str, samples: int
) -> dict[str, dict[str, Any]]:
    runner = JobRunner(registry, redis_url=url, queue_prefix=PREFIX)
    paths = [
        "/",
        "/jobs",
        "/runs",
        f"/runs?job={FAILING}&status=dead",
        f"/runs/{ids['a_run']}",
        f"/runs/{ids['queued'][-10]}",
        f"/runs/{uuid.uuid4()}",
        "/dead",
        "/locks",
        "/dedup",
        f"/dedup?job={KEYED}",
        f"/dedup?job={KEYED}&key=customer-7",
        "/schedules",
        "/boot",
        f"/jobs/{PLAIN}",
        f"/jobs/{PLAIN}?state=delayed",
        "/busy",
    ]
    results: dict[str, dict[str, Any]] = {}
    try:
        with TestClient(create_app(runner, token=None)) as http:
            for path in paths:
                http.get(path)  # warm: templates, scripts
                spent, slows = [], []
                for _ in range(samples):
                    reset(client)
                    began = time.perf_counter()
                    response = http.get(path)
                    spent.append(time.perf_counter() - began)
                    slows.append(slowest(client, own))
                    if response.status_code != 200:
                        raise SystemExit(f"{path} answered {response.status_code}")
                worst = max(slows, key=lambda s: s.command_us)
                results[path] = {
                    "ms_median": round(statistics.median(spent) * 1000, 1),
                    "slowest_ms": round(worst.command_us / 1000, 2),
                    "slowest_command": worst.command,
                }
        with TestClient(create_app(runner, token="benchmark-token-0123456789")) as http:
            spent, slows = [], []
            for _ in range(samples):
                reset(client)
                began = time.perf_counter()
                assert http.get("/login").status_code == 200
                spent.append(time.perf_counter() - began)
                slows.append(slowest(client, own))
            worst = max(slows, key=lambda s: s.command_us)
            results["/login (with a token)"] = {
                "ms_median": round(statistics.median(spent) * 1000, 1),
                "slowest_ms": round(worst.command_us / 1000, 2),
                "slowest_command": worst.command,
            }
    finally:
        runner.stop()
    return results


def report(result: dict[str, Any]) -> str:
    lines = [
        f"Machine: {result['machine']} (shared with other work: wall times are indicative)",
        f"Dataset: {json.dumps(result['dataset'])}",
        "",
        "| command | wall (median, Python start included) | the same less the probe's "
        "blocking | slowest Redis command it caused | start-up check's probe |",
        "|---|---|---|---|---|",
    ]
    for name, r in result["commands"].items():
        lines.append(
            f"| `kumiko {name}` | {r['wall_s_median']} s | {r['wall_s_median_without_probe']} s "
            f"| {r['slowest_ms']} ms (`{r['slowest_command']}`) | {r['probe_ms']} ms |"
        )
    if "before" in result:
        lines += [
            "",
            "The same commands, on the same data, from the earlier version (`--before`):",
            "",
            "| command | wall (median) | slowest Redis command it caused | the check's probe |",
            "|---|---|---|---|",
        ]
        for name, r in result["before"].items():
            if 2 in r["exit"]:
                lines.append(f"| `kumiko {name}` | refused (bad input) | | |")
                continue
            lines.append(
                f"| `kumiko {name}` | {r['wall_s_median']} s | {r['slowest_ms']} ms "
                f"(`{r['slowest_command']}`) | {r['probe_ms']} ms |"
            )
    lines += ["", "| dashboard page | time (median, in-process) | slowest Redis command |"]
    lines.append("|---|---|---|")
    for path, r in result["pages"].items():
        lines.append(
            f"| `{path}` | {r['ms_median']} ms | {r['slowest_ms']} ms (`{r['slowest_command']}`) |"
        )
    backfill = result["backfill"]
    lines += [
        "",
        f"Counts backfill over the whole dataset (issue 33): {backfill['steps']} steps in "
        f"{backfill['wall_s']} s, slowest Redis command {backfill['slowest_ms']} ms "
        f"(`{backfill['slowest_command']}`); then {json.dumps(backfill['counts_exact'])}",
    ]
    worst_command = max(
        [r["slowest_ms"] for r in result["commands"].values()]
        + [r["slowest_ms"] for r in result["pages"].values()]
        + [backfill["slowest_ms"]]
    )
    commands = [r for name, r in result["commands"].items() if not name.startswith("(")]
    worst_wall = max(r["wall_s_median"] for r in commands)
    worst_without = max(r["wall_s_median_without_probe"] for r in commands)
    worst_probe = max(r["probe_ms"] for r in result["commands"].values())
    lines += [
        "",
        f"Slowest Redis command caused by a command or page (start-up check aside): "
        f"{worst_command} ms (target {COMMAND_TARGET_MS:g} ms: "
        f"{'met' if worst_command <= COMMAND_TARGET_MS else 'MISSED'})",
        f"Slowest command, median wall: {worst_wall} s (target {WALL_TARGET_S:g} s: "
        f"{'met' if worst_wall <= WALL_TARGET_S else 'MISSED'}); less the start-up check's "
        f"probe: {worst_without} s ({'met' if worst_without <= WALL_TARGET_S else 'MISSED'})",
        f"The start-up check's probe (issue 29's) blocked Redis for up to {worst_probe} ms.",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--other-keys", type=int, default=1_000_000)
    parser.add_argument("--queued", type=int, default=100_000)
    parser.add_argument("--delayed", type=int, default=100_000)
    parser.add_argument("--dedup", type=int, default=20_000)
    parser.add_argument("--samples", type=int, default=3)
    parser.add_argument(
        "--before",
        type=Path,
        help="also run the commands from this directory's kumiko_dramatiq (an earlier "
        "version, e.g. `git archive BASE kumiko_dramatiq | tar -x -C DIR`), on the same data",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("kumiko_dramatiq").setLevel(logging.CRITICAL)
    with private_redis("--slowlog-log-slower-than", "0", "--slowlog-max-len", "1000000") as url:
        client = redis.Redis.from_url(url)
        own = _text(client.client_info()["addr"])
        ids = build(url, args, client)
        result: dict[str, Any] = {"machine": machine(), "dataset": ids["dataset"]}
        if args.before is not None:
            print("the commands of the earlier version...", file=sys.stderr)
            # its cancel and resume act too: the later version's get the next targets
            result["before"] = run_commands(url, ids, client, own, args.samples, args.before)
            for name in ("queued", "delayed", "dead"):
                ids[name] = (
                    ids[name][: -args.samples] if name != "dead" else ids[name][args.samples :]
                )
        result["backfill"] = run_backfill(url, client, own)
        result["pages"] = run_pages(url, ids, client, own, args.samples)
        result["commands"] = run_commands(url, ids, client, own, args.samples)
        client.close()
    text = report(result)
    print(text)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "operating.json").write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
