"""Jobs of real length at full speed (issue 47): kumiko and plain Dramatiq side by side.

``python -m benchmarks.run_ahead [--rounds 3] [--job-ms 0,2,20] [--threads 8]``

For each job length (no-op jobs, and jobs that wait 2 and 20 ms, as jobs that call a service
do), rounds of kumiko's plain case and plain Dramatiq's ``RedisBroker`` alternate on one
private redis-server (alone on its core, :mod:`benchmarks.redis_cost`): each round enqueues a
backlog, then one worker of ``--threads`` threads drains it. Reported, medians over the
rounds, kumiko / plain Dramatiq: the server's CPU per job over the drain (``INFO cpu``), this
process's CPU per job over the drain (the worker's threads and its client:
``time.process_time()``), and the drain's pace beside the ideal (threads / job length).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from typing import Any

from .redis_cost import RESULTS, RedisCost, Series, _server

#: Jobs per round by job length (ms): enough for a drain of a few seconds.
MESSAGES = {0.0: 10_000, 2.0: 5_000, 20.0: 3_000}


def measure(rounds: int, lengths: list[float], threads: int, pin: bool) -> list[dict[str, Any]]:
    found = []
    with _server(pin) as url:
        for job_ms in lengths:
            messages = MESSAGES.get(job_ms, 3_000)
            bench = RedisCost(url, messages, 0, rounds, job_ms, threads)
            result = bench.run([])
            kumiko: Series = result["rows"][0]
            plain: Series = result["plain"]
            found.append(
                {
                    "job_ms": job_ms,
                    "messages": messages,
                    "kumiko": [s.__dict__ for s in kumiko.samples],
                    "plain": [s.__dict__ for s in plain.samples],
                    "redis_us": (kumiko.median("drain_us"), plain.median("drain_us")),
                    "worker_us": (kumiko.median("worker_us"), plain.median("worker_us")),
                    "jobs_s": (kumiko.median("drain_jobs_s"), plain.median("drain_jobs_s")),
                    "ideal_jobs_s": threads * 1000 / job_ms if job_ms else None,
                    "commands": bench.commands,
                }
            )
    return found


def table(found: list[dict[str, Any]], threads: int) -> str:
    lines = [
        f"Drains with one worker of {threads} threads, kumiko / plain Dramatiq, medians",
        "",
        "| job | Redis CPU µs/job | worker CPU µs/job | drain jobs/s | pace of the ideal |",
        "|---|---|---|---|---|",
    ]
    for row in found:
        (kr, pr), (kw, pw), (kj, pj) = row["redis_us"], row["worker_us"], row["jobs_s"]
        ideal = row["ideal_jobs_s"]
        pace = "" if ideal is None else f"{kj / ideal:.2f} / {pj / ideal:.2f} (ideal {ideal:,.0f})"
        name = "no-op" if not row["job_ms"] else f"{row['job_ms']:g} ms"
        lines.append(
            f"| {name} | {kr:.1f} / {pr:.1f} = {kr / pr:.2f}x | {kw:.0f} / {pw:.0f} ="
            f" {kw / pw:.2f}x | {kj:,.0f} / {pj:,.0f} = {kj / pj:.2f}x | {pace} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--job-ms", default="0,2,20", help="job lengths, comma-separated")
    parser.add_argument("--threads", type=int, default=8)
    parser.add_argument("--no-pin", action="store_true")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    lengths = [float(each) for each in args.job_ms.split(",") if each]
    uptime = os.popen("uptime").read().strip()
    found = measure(args.rounds, lengths, args.threads, not args.no_pin)
    text = table(found, args.threads)
    print(text)
    print(f"\nLoad (`uptime` before the run): {uptime}")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "run_ahead.json").write_text(
        json.dumps(
            {
                "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "uptime": uptime,
                "threads": args.threads,
                "cases": found,
            },
            indent=2,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
