"""Plain Dramatiq actors under the CLI worker: kumiko's broker vs Dramatiq's ``RedisBroker``.

``python -m benchmarks.plain_actors [--rounds 3] [--only sleep,join,...]`` (also
``bash benchmarks/run.sh --only plain_actors``). The scenarios of issue 31, each timed from
the first send to the last message done, with ``dramatiq ... -t 4`` workers already consuming
(both brokers' workers have written Dramatiq's heartbeat), on a private ``redis-server``
flushed before each broker's turn:

- ``sleep -p 1``: 40 messages to a plain actor sleeping 0.1 s (ideal: 1.0 s);
- ``asyncio -p 1``: the same with an ``async def`` actor under ``AsyncIO`` (Dramatiq's asyncio
  example);
- ``join -p 1``: the 40 sleeping messages, timed until ``broker.join(queue)`` returns in the
  producer;
- ``delayed -p 1``: 40 messages to the sleeping actor sent with ``delay=200`` ms;
- ``retries -p 1``: 40 messages to an actor sleeping 0.1 s whose first attempt fails,
  retried after 100 ms (ideal: 2.1 s);
- ``sleep -p 2``: the first scenario with two worker processes (ideal: 0.5 s).

Rounds alternate the brokers (the first of each pair alternates); the table gives median
seconds and the time ratio kumiko/plain (target: at most 1.10).
"""

from __future__ import annotations

import argparse
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import redis
from dramatiq.broker import Broker
from dramatiq.brokers.redis import RedisBroker
from dramatiq.message import Message

from benchmarks.harness import cli_environment
from examples.redis_server import private_redis
from kumiko_dramatiq import JobRunner, Registry

ROOT = Path(__file__).resolve().parents[1]
MESSAGES = 40
THREADS = 4
TARGET = 1.10
DONE = "bench:done"
HEARTBEATS = "dramatiq:__heartbeats__"
QUEUE = "default"


@dataclass
class Scenario:
    name: str
    processes: int
    actor: str
    delay_ms: int | None = None
    join: bool = False
    times: dict[str, list[float]] = field(default_factory=lambda: {"kumiko": [], "plain": []})

    def ratio(self) -> float:
        return statistics.median(self.times["kumiko"]) / statistics.median(self.times["plain"])

    def send(self, broker: Broker, n: int) -> None:
        sent: Message[object] = Message(
            queue_name=QUEUE, actor_name=self.actor, args=(n,), kwargs={}, options={}
        )
        broker.enqueue(sent, delay=self.delay_ms)


def scenarios() -> list[Scenario]:
    return [
        Scenario("sleep -p 1", 1, "sleeper"),
        Scenario("asyncio -p 1", 1, "async_sleeper"),
        Scenario("join -p 1", 1, "sleeper", join=True),
        Scenario("delayed -p 1", 1, "sleeper", delay_ms=200),
        Scenario("retries -p 1", 1, "fails_once"),
        Scenario("sleep -p 2", 2, "sleeper"),
    ]


@contextmanager
def worker(kind: str, url: str, processes: int, client: redis.Redis) -> Iterator[None]:
    """``dramatiq`` CLI workers of ``kind``, consuming once this yields."""
    module = "benchmarks.plain_app" if kind == "plain" else "kumiko_dramatiq.app"
    child = subprocess.Popen(
        [sys.executable, "-m", "dramatiq", module, "-p", str(processes), "-t", str(THREADS)],
        cwd=ROOT,
        env=cli_environment(kind, url, "benchmarks.plain_app"),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 60
        while client.zcard(HEARTBEATS) < processes:
            if child.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the {kind} worker did not start")
            time.sleep(0.05)
        yield
    finally:
        child.send_signal(signal.SIGTERM)
        try:
            child.wait(timeout=60)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()


def producer(kind: str, url: str) -> tuple[Broker, Callable[[], None]]:
    """A broker to send with (and its closing), as a producer of that kind has one."""
    if kind == "plain":
        plain = RedisBroker(url=url)  # type: ignore[no-untyped-call]
        return plain, plain.client.connection_pool.disconnect
    runner = JobRunner(Registry([]), redis_url=url)
    return runner.broker, runner.stop


def measure(scenario: Scenario, kind: str, url: str, client: redis.Redis) -> float:
    """Seconds from the first send to the last message done (or to ``join`` returning)."""
    client.delete(DONE)
    broker, close = producer(kind, url)
    try:
        began = time.perf_counter()
        for n in range(MESSAGES):
            scenario.send(broker, n)
        if scenario.join:
            broker.join(QUEUE, timeout=120_000)
            elapsed = time.perf_counter() - began
        for _ in range(MESSAGES):
            if client.blpop([DONE], timeout=120) is None:
                raise TimeoutError(f"{scenario.name} on {kind}: a message never finished")
        if not scenario.join:
            elapsed = time.perf_counter() - began
    finally:
        close()
    return elapsed


def run_round(kind: str, url: str, chosen: list[Scenario]) -> None:
    client = redis.Redis.from_url(url)
    client.flushdb()  # the benchmark's own private server
    for processes in sorted({s.processes for s in chosen}):
        with worker(kind, url, processes, client):
            for scenario in (s for s in chosen if s.processes == processes):
                seconds = measure(scenario, kind, url, client)
                scenario.times[kind].append(seconds)
                print(f"  {kind:<6} {scenario.name:<14} {seconds:6.2f} s", file=sys.stderr)
        client.delete(HEARTBEATS)
    client.close()


def run(url: str, rounds: int, only: str = "") -> list[Scenario]:
    chosen = [s for s in scenarios() if not only or s.name.split()[0] in only.split(",")]
    if not chosen:
        names = ", ".join(dict.fromkeys(s.name.split()[0] for s in scenarios()))
        raise SystemExit(f"plain_actors: no scenario matches --only {only!r} (there are: {names})")
    for index in range(rounds):
        order = ("kumiko", "plain") if index % 2 == 0 else ("plain", "kumiko")
        print(f"round {index + 1} of {rounds}", file=sys.stderr)
        for kind in order:
            run_round(kind, url, chosen)
    return chosen


def table(chosen: list[Scenario]) -> str:
    rows = [
        f"{MESSAGES} messages per scenario, `-t {THREADS}`, medians of "
        f"{len(chosen[0].times['plain'])} alternating rounds",
        "",
        "| scenario | kumiko (median) | RedisBroker (median) | time ratio | within 1.10x |",
        "|---|---|---|---|---|",
    ]
    for s in chosen:
        rows.append(
            f"| {s.name} | {statistics.median(s.times['kumiko']):.2f} s"
            f" | {statistics.median(s.times['plain']):.2f} s | {s.ratio():.2f}x"
            f" | {'yes' if s.ratio() <= TARGET else 'NO'} |"
        )
    return "\n".join(rows)


def suite(rounds: int, only: str = "") -> str:
    """Run the scenarios on a private redis-server of their own; the table."""
    with private_redis() as url:
        return table(run(url, rounds, only))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--only", default="", help="scenarios by first word: sleep,join,...")
    args = parser.parse_args(argv)
    print(suite(args.rounds, args.only))
    return 0


if __name__ == "__main__":
    sys.exit(main())
