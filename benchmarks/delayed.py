"""Delayed work behind a far-future backlog: kumiko's broker vs Dramatiq's ``RedisBroker``.

``python -m benchmarks.delayed [--backlogs 0,10000,100000] [--million] [--moves 100000]``
(also ``bash benchmarks/run.sh --only delayed``). Both brokers run the same plain Dramatiq
actors (:mod:`benchmarks.delayed_app`) under ``dramatiq ... -p 1 -t 4``, on a private
``redis-server`` (:func:`kumiko_dramatiq.testing.private_redis_server`) flushed before each
turn:

- **lateness**: behind a backlog of N messages due in an hour (written before the worker
  starts: kumiko's ``enqueue_many``, Dramatiq's layout for ``RedisBroker``), 20 messages sent
  with ``delay=1000`` and 20 whose first attempt raises ``Retry(delay=1000)``; lateness is
  how long after its due time each one started (ms, p50 and p99), and ``missing`` how many did
  not run within :data:`WAIT_S` of their due time. ``--million`` adds N = 1,000,000;
- **worker RSS** with that backlog (the worker process, after the 40 ran or timed out);
- **moves**: ``--moves`` messages (100,000) all due at the same instant, with a worker
  running: the seconds from that instant until none is delayed any more (all on the queue,
  or run).

Targets (issue 27): lateness p99 <= 50 ms behind every backlog with none missing; worker
memory flat in the backlog; 100,000 due at once all queued within 2 s.
"""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import redis
from dramatiq.broker import Broker
from dramatiq.brokers.redis import RedisBroker
from dramatiq.message import Message

from benchmarks.harness import cli_environment
from kumiko_dramatiq import JobRunner, Registry
from kumiko_dramatiq.testing import private_redis_server

ROOT = Path(__file__).resolve().parents[1]
QUEUE = "default"
FAR_MS = 3_600_000
DELAY_MS = 1_000
SHORT = 20
RETRIES = 20
WAIT_S = 20
LATE = "bench:late"
HEARTBEATS = "dramatiq:__heartbeats__"
THREADS = 4
FILL_BATCH = 1_000


@dataclass
class Lateness:
    kind: str
    backlog: int
    late_ms: list[float]
    missing: int
    rss_mb: float

    def p(self, q: float) -> str:
        if not self.late_ms:
            return "-"
        ordered = sorted(self.late_ms)
        return f"{ordered[min(len(ordered) - 1, int(q * len(ordered)))]:.0f}"


@contextmanager
def worker(kind: str, url: str, client: redis.Redis) -> Iterator[subprocess.Popen[bytes]]:
    """A ``dramatiq`` CLI worker of ``kind`` (one process, four threads), consuming."""
    module = "benchmarks.delayed_app" if kind == "plain" else "kumiko_dramatiq.app"
    child = subprocess.Popen(
        [sys.executable, "-m", "dramatiq", module, "-p", "1", "-t", str(THREADS)],
        cwd=ROOT,
        env=cli_environment(kind, url, "benchmarks.delayed_app"),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 120
        while client.zcard(HEARTBEATS) < 1:
            if child.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the {kind} worker did not start")
            time.sleep(0.05)
        yield child
    finally:
        child.send_signal(signal.SIGTERM)
        try:
            child.wait(timeout=60)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
        client.delete(HEARTBEATS)


def worker_rss_mb(parent: int) -> float:
    """The largest resident set among the worker processes the CLI forked (MiB)."""
    sizes = [0.0]
    children = Path(f"/proc/{parent}/task/{parent}/children")
    for pid in children.read_text().split() if children.exists() else []:
        status = Path(f"/proc/{pid}/status")
        for line in status.read_text().splitlines() if status.exists() else []:
            if line.startswith("VmRSS:"):
                sizes.append(int(line.split()[1]) / 1024)
    return max(sizes)


def producer(kind: str, url: str) -> tuple[Broker, JobRunner | None]:
    if kind == "plain":
        return RedisBroker(url=url), None  # type: ignore[no-untyped-call]
    runner = JobRunner(Registry([]), redis_url=url)
    return runner.broker, runner


def message(actor: str, arg: int) -> Message[object]:
    return Message(queue_name=QUEUE, actor_name=actor, args=(arg,), kwargs={}, options={})


def fill(kind: str, broker: Broker, client: redis.Redis, count: int, due_ms: int) -> None:
    """``count`` messages of ``far`` (or ``noop`` when due soon) due at ``due_ms`` (epoch ms):
    kumiko through its batch enqueue, RedisBroker as its enqueue lays them out (one pipeline
    per batch: its own enqueue is one round trip a message)."""
    actor = "far" if due_ms - time.time() * 1000 > 600_000 else "noop"
    for start in range(0, count, FILL_BATCH):
        batch = [message(actor, n) for n in range(start, min(count, start + FILL_BATCH))]
        if kind == "kumiko":
            from kumiko_dramatiq.broker.broker import KumikoBroker

            assert isinstance(broker, KumikoBroker)
            broker.enqueue_many(batch, delay=max(0, due_ms - int(time.time() * 1000)))
            continue
        pipe = client.pipeline(transaction=False)
        for each in batch:
            rid = str(uuid.uuid4())
            delayed = each.copy(
                queue_name=f"{QUEUE}.DQ", options={"redis_message_id": rid, "eta": due_ms}
            )
            pipe.hset(f"dramatiq:{QUEUE}.DQ.msgs", rid, delayed.encode())
            pipe.rpush(f"dramatiq:{QUEUE}.DQ", rid)
        pipe.execute()


def lateness(kind: str, url: str, backlog: int) -> Lateness:
    client = redis.Redis.from_url(url)
    client.flushdb()
    broker, runner = producer(kind, url)
    try:
        fill(kind, broker, client, backlog, int(time.time() * 1000) + FAR_MS)
        with worker(kind, url, client) as child:
            time.sleep(1)  # the worker settles (a RedisBroker worker reads its delay queue)
            for _ in range(SHORT):
                broker.enqueue(message("short", int(time.time() * 1000) + DELAY_MS), delay=DELAY_MS)
            for n in range(RETRIES):
                broker.enqueue(message("retry_once", n))
            late: list[float] = []
            deadline = time.monotonic() + DELAY_MS / 1000 + WAIT_S
            while len(late) < SHORT + RETRIES and time.monotonic() < deadline:
                got = client.blpop([LATE], timeout=min(1.0, max(0.1, deadline - time.monotonic())))
                if got is not None:
                    late.append(float(got[1]))
            rss = worker_rss_mb(child.pid)
    finally:
        if runner is not None:
            runner.stop()
        else:
            broker.client.connection_pool.disconnect()  # type: ignore[attr-defined]
        client.close()
    return Lateness(kind, backlog, late, SHORT + RETRIES - len(late), rss)


def moves(kind: str, url: str, count: int) -> float:
    """Seconds from the instant ``count`` messages come due until none is delayed."""
    client = redis.Redis.from_url(url)
    client.flushdb()
    broker, runner = producer(kind, url)
    delayed_key = f"dramatiq:{QUEUE}.DQ.msgs"
    try:
        with worker(kind, url, client):
            began = time.time()
            # far enough ahead for the whole fill (the machine may be loaded)
            due_ms = int(began * 1000) + 10_000 + count // 5
            fill(kind, broker, client, count, due_ms)
            if time.time() * 1000 >= due_ms:
                raise RuntimeError("the fill took longer than its head start")
            time.sleep(max(0.0, due_ms / 1000 - time.time()))
            while client.hlen(delayed_key) > 0:
                time.sleep(0.005)
            return time.time() - due_ms / 1000
    finally:
        if runner is not None:
            runner.stop()
        else:
            broker.client.connection_pool.disconnect()  # type: ignore[attr-defined]
        client.close()


def table(results: list[Lateness], moved: dict[str, float], count: int) -> str:
    rows = [
        f"{SHORT} messages sent with `delay={DELAY_MS}` and {RETRIES} retried with "
        f"`Retry(delay={DELAY_MS})`, behind N messages due in an hour; `dramatiq -p 1 -t "
        f"{THREADS}`; lateness in ms after the due time; missing = not run within {WAIT_S} s",
        "",
        "| backlog N | kumiko p50 / p99 | kumiko missing | kumiko worker RSS"
        " | RedisBroker p50 / p99 | RedisBroker missing | RedisBroker worker RSS |",
        "|---|---|---|---|---|---|---|",
    ]
    for backlog in sorted({r.backlog for r in results}):
        k, p = (
            next(r for r in results if r.kind == kind and r.backlog == backlog)
            for kind in ("kumiko", "plain")
        )
        rows.append(
            f"| {backlog:,} | {k.p(0.5)} / {k.p(0.99)} ms | {k.missing} | {k.rss_mb:.0f} MiB"
            f" | {p.p(0.5)} / {p.p(0.99)} ms | {p.missing} | {p.rss_mb:.0f} MiB |"
        )
    if moved:
        rows += [
            "",
            f"{count:,} messages due at the same instant, until none is delayed: kumiko "
            f"{moved['kumiko']:.2f} s, RedisBroker {moved['plain']:.2f} s",
        ]
    return "\n".join(rows)


def suite(backlogs: list[int], move_count: int) -> str:
    with private_redis_server() as url:
        results: list[Lateness] = []
        for backlog in backlogs:
            for kind in ("kumiko", "plain"):
                result = lateness(kind, url, backlog)
                results.append(result)
                print(
                    f"  {kind:<6} backlog {backlog:>9,}: p50 {result.p(0.5)} ms, p99 "
                    f"{result.p(0.99)} ms, missing {result.missing}, RSS {result.rss_mb:.0f} MiB",
                    file=sys.stderr,
                )
        moved: dict[str, float] = {}
        if move_count:
            for kind in ("kumiko", "plain"):
                moved[kind] = moves(kind, url, move_count)
                print(
                    f"  {kind:<6} {move_count:,} due at once: {moved[kind]:.2f} s", file=sys.stderr
                )
        return table(results, moved, move_count)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--backlogs", default="0,10000,100000")
    parser.add_argument("--million", action="store_true", help="also behind 1,000,000")
    parser.add_argument("--moves", type=int, default=100_000)
    args = parser.parse_args(argv)
    backlogs = [int(n) for n in args.backlogs.split(",") if n]
    if args.million:
        backlogs.append(1_000_000)
    print(suite(backlogs, args.moves))
    return 0


if __name__ == "__main__":
    sys.exit(main())
