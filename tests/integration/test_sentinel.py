"""Sentinel (``redis+sentinel://``) against a real group: primary + replica + 3 sentinels on
private ports (Debian's ``redis-server`` and ``redis-sentinel``).

- the primary is killed mid-load: workers, the scheduler and a producer carry on by
  themselves; what was acknowledged afterwards runs exactly once; no message whose completion
  had reached the replica runs again; what was lost is measured and printed;
- a write acknowledged to a producer but not replicated is lost in a fail-over (made
  deterministic by cutting replication first): the honest limit of asynchronous replication;
- ``min-replicas-to-write`` turns that loss into a refusal: ``dispatch`` raises
  ``RedisUnavailableError``, a worker's refused ack is retried until it lands, nothing is
  stuck once the replica is back.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

from kumiko_dramatiq import Cron, Feature, JobContext, JobMeta, JobRunner, Registry
from kumiko_dramatiq.broker import keys as kumiko_keys
from kumiko_dramatiq.broker.connection import SentinelPool, connection_pool
from kumiko_dramatiq.errors import RedisUnavailableError
from tests.conftest import wait_for
from tests.deployment import SentinelGroup, Server, sentinel_group, wait_for_fail_over

PREFIX = "failover"
WORK, SEQ, TICK, HOLD = (f"so:job:{name}" for name in ("work", "seq", "tick", "hold"))


@dataclass
class Ledger:
    """Every start and completion the workers' hooks saw (monotonic times), by message id."""

    starts: dict[str, list[float]] = field(default_factory=dict)
    completions: dict[str, list[float]] = field(default_factory=dict)
    jobs: dict[str, str] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def on_job_start(self, job_name: str, message_id: str, meta: JobMeta) -> None:
        with self.lock:
            self.starts.setdefault(message_id, []).append(time.monotonic())
            self.jobs[message_id] = job_name

    def on_job_complete(self, job_name: str, message_id: str, meta: JobMeta) -> None:
        with self.lock:
            self.completions.setdefault(message_id, []).append(time.monotonic())

    def completed(self, job_name: str) -> list[str]:
        with self.lock:
            return [m for m in self.completions if self.jobs.get(m) == job_name]


def registry_of(release: threading.Event) -> Registry:
    feature = Feature("so")

    def work(payload: dict[str, Any], ctx: JobContext) -> None:
        return None

    def hold(payload: dict[str, Any], ctx: JobContext) -> None:
        # Python code between short waits: a run fenced during the outage stops at once
        deadline = time.monotonic() + 30
        while not release.wait(0.02) and time.monotonic() < deadline:
            pass

    feature.job("work")(work)
    feature.job("seq", concurrency="sequential")(hold)
    feature.job("hold")(hold)
    feature.job("tick", trigger=Cron("* * * * * *"))(work)
    return Registry([feature])


@pytest.fixture
def group(tmp_path: Path) -> Iterator[SentinelGroup]:
    with sentinel_group(tmp_path) as started:
        yield started


def runner(url: str, release: threading.Event, ledger: Ledger, **options: Any) -> JobRunner:
    options.setdefault("worker_threads", 4)
    return JobRunner(
        registry_of(release),
        redis_url=url,
        queue_prefix=PREFIX,
        # above the outage (promotion + Dramatiq's 5 s ack retry): a shorter one makes the
        # first worker back take the others for dead and run their messages again
        heartbeat_timeout_ms=20_000,
        # the held sequential run's lease outlives the outage (fenced at 0.75 of it)
        lock_ttl_ms=10_000,
        sequential_retry_delay_ms=100,
        boot_redis_timeout_ms=2_000,
        on_job_start=ledger.on_job_start,
        on_job_complete=ledger.on_job_complete,
        **options,
    )


def replica_snapshot(group: SentinelGroup, pattern: str) -> set[str]:
    """Keys matching ``pattern`` on the replica (what had been replicated, read right after
    the primary died and before anything can write to the replica)."""
    client = group.replica.client()
    try:
        return {key.decode() for key in client.scan_iter(match=pattern, count=1000)}
    finally:
        client.close()


def wait_until_replicated(group: SentinelGroup) -> None:
    """Until the replica has applied everything the primary has written so far."""
    primary, replica = group.primary.client(), group.replica.client()
    try:
        target = int(primary.info("replication")["master_repl_offset"])
        wait_for(
            lambda: int(replica.info("replication")["slave_repl_offset"]) >= target,
            what="the replica to catch up",
        )
    finally:
        primary.close()
        replica.close()


class Producer(threading.Thread):
    """Dispatches ``WORK`` until stopped or ``limit`` messages are acknowledged, as an
    application would: an error is noted and the same dispatch tried again (a failed
    dispatch enqueued nothing it reported). ``every_s``: at a steady pace; ``delay_ms``:
    every other dispatch delayed that long."""

    def __init__(
        self,
        producer: JobRunner,
        limit: int,
        *,
        every_s: float = 0.0,
        delay_ms: int | None = None,
    ) -> None:
        super().__init__(daemon=True)
        self.producer = producer
        self.limit = limit
        self.every_s = every_s
        self.delay_ms = delay_ms
        self.acked: list[tuple[str, float]] = []
        self.errors: list[tuple[float, str]] = []
        self.stopping = threading.Event()
        self.progress = threading.Condition()

    def run(self) -> None:
        n = 0
        while not self.stopping.is_set() and n < self.limit:
            try:
                delay_ms = self.delay_ms if n % 2 else None
                message_id = self.producer.dispatch(WORK, {"n": n}, delay_ms=delay_ms)
            except RedisUnavailableError as exc:
                self.errors.append((time.monotonic(), str(exc)))
                self.stopping.wait(0.02)  # an application's retry back-off
                continue
            n += 1
            with self.progress:
                self.acked.append((message_id, time.monotonic()))
                self.progress.notify_all()
            if self.every_s:
                self.stopping.wait(self.every_s)

    def wait_for(self, count: int, after: float = 0.0, timeout_s: float = 30) -> None:
        deadline = time.monotonic() + timeout_s
        with self.progress:
            while sum(1 for _, t in self.acked if t > after) < count:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise AssertionError(f"the producer did not reach {count} after {after}")
                self.progress.wait(remaining)


@pytest.mark.slow
def test_a_fail_over_mid_load_is_survived_without_restarting_anything(
    group: SentinelGroup,
) -> None:
    # Given two workers (one also schedules a per-second cron job) and a producer on a
    # redis+sentinel:// URL, a sequential run holding its lock and a dedup key's run with a
    # follow-up coalesced
    url = group.url()
    release, ledger = threading.Event(), Ledger()
    workers = [runner(url, release, ledger, run_scheduler=n == 0) for n in range(2)]
    producer = runner(url, release, ledger)
    for worker in workers:
        worker.start()
    held = producer.dispatch(SEQ, {})
    keyed = producer.dispatch(HOLD, {}, dedup_key="nightly")
    wait_for(lambda: {held, keyed} <= set(ledger.starts), what="the held runs")
    follow_up = producer.dispatch(HOLD, {}, dedup_key="nightly")  # coalesced while running
    load = Producer(producer, limit=400)
    load.start()
    try:
        load.wait_for(150)

        # When the primary is killed mid-load
        killed_at = time.monotonic()
        group.primary.kill()
        # the primary answers until the signal lands: a run can start and settle there after
        # killed_at; once kill() returns (it waits for the exit) nothing reaches it
        dead_at = time.monotonic()
        replicated_done = replica_snapshot(group, kumiko_keys.completed(PREFIX, "*"))
        replicated_lock = kumiko_keys.sequential_lock(PREFIX, SEQ, None) in replica_snapshot(
            group, kumiko_keys.sequential_lock(PREFIX, SEQ, None)
        )
        replicated_dedup = bool(replica_snapshot(group, kumiko_keys.dedup(PREFIX, HOLD, "nightly")))
        promoted_at = wait_for_fail_over(group)

        # Then the same producer, workers and scheduler carry on by themselves
        load.wait_for(150, after=killed_at)
        after_fail_over = producer.dispatch(SEQ, {})  # finds the lock held (or lost)
        again = producer.dispatch(HOLD, {}, dedup_key="nightly")
        release.set()
        wait_for(
            lambda: any(t > promoted_at for t in _ticks(ledger)),
            timeout_s=30,
            what="a cron tick after the fail-over",
        )
    finally:
        release.set()
        load.stopping.set()
        load.join(timeout=30)
    producer.drain(timeout_s=60)
    # a sequential run that found the lock held went on as a hand-off (a message id of its own,
    # derived from the one dispatch returned): its runs are found by their origin
    carriers = {after_fail_over} | {
        run.message_id for run in producer.runs(origin_id=after_fail_over, limit=20)
    }
    for worker in workers:
        worker.stop(timeout_s=10)
    producer.stop()

    # recovered: the first acknowledgement after the producer's last error
    last_error = max((t for t, _ in load.errors), default=killed_at)
    recovered_at = min(t for _, t in load.acked if t >= last_error)
    acked_before = {m for m, t in load.acked if t < recovered_at}
    acked_after = {m for m, t in load.acked if t >= recovered_at}
    lost = acked_before - set(ledger.completions)
    ran_twice = {m for m, ends in ledger.completions.items() if len(ends) > 1}
    completed_ids = {key.rsplit(":", 1)[1] for key in replicated_done}
    restarted = {m for m in completed_ids if any(t > dead_at for t in ledger.starts.get(m, []))}
    print(
        f"\nfail-over: {len(load.acked)} dispatches acknowledged, {len(acked_before)} before "
        f"the producer recovered; producer outage {recovered_at - killed_at:.2f} s "
        f"({len(load.errors)} failed dispatches, each retried); promotion after "
        f"{promoted_at - killed_at:.2f} s; lost {len(lost)}; ran twice {len(ran_twice)}"
    )
    # everything acknowledged once the producer had recovered ran, exactly once
    assert all(len(ledger.completions.get(m, [])) == 1 for m in acked_after)
    # a message whose completion had reached the replica never ran again
    assert restarted == set(), {
        m: (ledger.jobs.get(m), [round(t - dead_at, 3) for t in ledger.starts.get(m, [])])
        for m in restarted
    }
    # what was lost or ran twice was acknowledged or running around the kill
    assert ran_twice <= acked_before | {held, keyed}
    # the producer's errors were all during the outage
    assert all(killed_at <= t <= recovered_at for t, _ in load.errors)
    # the lock and the dedup record, as far as they were replicated, held across the fail-over
    if replicated_lock:
        started = sorted(t for m in carriers for t in ledger.starts.get(m, []))
        assert started[0] >= ledger.completions[held][0]
    if replicated_dedup:
        assert again == follow_up
    assert len(ledger.completions.get(again, [])) == 1
    assert len(ledger.completions.get(keyed, [])) == 1
    assert any(ledger.completions.get(m) for m in carriers)


def _ticks(ledger: Ledger) -> list[float]:
    with ledger.lock:
        return [ends[0] for m, ends in ledger.completions.items() if ledger.jobs.get(m) == TICK]


def test_a_write_acknowledged_but_not_replicated_is_lost_in_a_fail_over(
    group: SentinelGroup,
) -> None:
    # Given 20 messages that reached the replica and 10 more acknowledged to the producer
    # after replication was cut (asynchronous replication: the primary does not wait)
    url = group.url()
    release, ledger = threading.Event(), Ledger()
    producer = runner(url, release, ledger)
    replicated = [producer.dispatch(WORK, {"n": n}) for n in range(20)]
    wait_until_replicated(group)
    group.cut_replication()
    unreplicated = [producer.dispatch(WORK, {"n": n}) for n in range(20, 30)]

    # When the primary dies and Sentinel promotes the replica
    group.primary.kill()
    wait_for_fail_over(group)
    worker = runner(url, release, ledger)
    worker.start()
    producer.drain(timeout_s=30)
    worker.stop()
    producer.stop()

    # Then the replicated messages run, and the 10 acknowledged ones are gone for good
    assert sorted(ledger.completed(WORK)) == sorted(replicated)
    assert not set(unreplicated) & set(ledger.starts)


@pytest.mark.slow
def test_min_replicas_to_write_refuses_writes_instead_of_losing_them(tmp_path: Path) -> None:
    with sentinel_group(
        tmp_path, primary_args=["--min-replicas-to-write", "1", "--min-replicas-max-lag", "1"]
    ) as group:
        url = group.url()
        release, ledger = threading.Event(), Ledger()
        worker = runner(url, release, ledger)
        worker.start()
        running = worker.dispatch(HOLD, {})
        wait_for(lambda: running in ledger.starts, what="the held run")

        # When the replica falls behind for longer than min-replicas-max-lag
        group.cut_replication()
        admin = group.primary.client()
        wait_for(
            lambda: int(admin.info("replication")["min_slaves_good_slaves"]) == 0,
            what="the primary to count no good replica",
        )

        # Then a dispatch is refused as Redis being unavailable (nothing acknowledged, so
        # nothing to lose), and the held run's ack is refused too and retried
        with pytest.raises(RedisUnavailableError, match="NOREPLICAS"):
            worker.dispatch(WORK, {})
        release.set()

        # And once the replica is back, the ack lands and new work flows
        group.restore_replication()
        wait_for(
            lambda: int(admin.info("replication")["min_slaves_good_slaves"]) == 1,
            what="a good replica again",
        )
        admin.close()
        later = worker.dispatch(WORK, {})
        worker.drain(timeout_s=30)
        worker.stop()
        assert ledger.completions.get(running) is not None
        assert len(ledger.starts[running]) == 1
        assert ledger.completions.get(later) is not None


def test_a_sentinel_url_without_a_reachable_sentinel_is_unavailable_within_the_bound(
    tmp_path: Path,
) -> None:
    release, ledger = threading.Event(), Ledger()
    url = "redis+sentinel://127.0.0.1:1,127.0.0.1:2/0?master=nowhere"
    runner_ = JobRunner(registry_of(release), redis_url=url, boot_redis_timeout_ms=500)
    began = time.monotonic()
    with pytest.raises(RedisUnavailableError, match="No master found for 'nowhere'") as caught:
        runner_.start()
    runner_.stop()
    assert time.monotonic() - began < 10
    assert ledger.starts == {}
    # one line naming each sentinel and what went wrong, no redis-py object dump
    message = str(caught.value)
    assert "\n" not in message
    assert "<redis" not in message
    assert "127.0.0.1:1" in message
    assert "127.0.0.1:2" in message


@pytest.mark.slow
def test_a_delayed_message_a_worker_holds_runs_after_a_fail_over(group: SentinelGroup) -> None:
    release, ledger = threading.Event(), Ledger()
    worker = runner(group.url(), release, ledger)
    worker.start()
    message_id = worker.dispatch(WORK, {}, delay_ms=1_000)
    wait_until_replicated(group)
    group.primary.kill()
    wait_for_fail_over(group)
    try:
        wait_for(lambda: message_id in ledger.completions, timeout_s=6, what="the delayed run")
    finally:
        worker.stop(timeout_s=5)


#: The settings docs/deploying.md recommends on every data node (with two replicas or more).
RECOMMENDED = ("--min-replicas-to-write", "1", "--min-replicas-max-lag", "2")


def evalsha_calls(server: Server) -> int:
    """How many scripts ``server`` ran so far, ``EVALSHA`` and ``FCALL`` (every write kumiko
    makes is one)."""
    client = server.client()
    try:
        stats: dict[str, Any] = client.info("commandstats")
        return sum(
            int(stats.get(f"cmdstat_{command}", {}).get("calls", 0))
            for command in ("evalsha", "fcall")
        )
    finally:
        client.close()


def role_of(server: Server) -> str:
    client = server.client()
    try:
        role: Any = client.execute_command("ROLE")  # type: ignore[no-untyped-call]
        return str(role[0].decode() if isinstance(role[0], bytes) else role[0])
    finally:
        client.close()


@pytest.mark.slow
def test_a_planned_fail_over_under_a_steady_producer_loses_no_accepted_dispatch(
    tmp_path: Path,
) -> None:
    with sentinel_group(tmp_path, replicas=2, data_args=RECOMMENDED) as group:
        # Given two workers and a steady producer (every other dispatch delayed by a second:
        # work that waits in Redis across the switch) on the recommended settings
        url = group.url()
        release, ledger = threading.Event(), Ledger()
        release.set()
        workers = [runner(url, release, ledger) for _ in range(2)]
        producer = runner(url, release, ledger)
        for worker in workers:
            worker.start()
        load = Producer(producer, limit=100_000, every_s=0.01, delay_ms=1_000)
        load.start()
        old = group.primary
        try:
            load.wait_for(100)

            # When an operator runs SENTINEL FAILOVER
            began = time.monotonic()
            with ledger.lock:
                in_flight = {m for m in ledger.starts if m not in ledger.completions}
            admin = group.sentinels[0].client()
            admin.execute_command("SENTINEL", "FAILOVER", group.master)  # type: ignore[no-untyped-call]
            admin.close()
            switched = wait_for_fail_over(group)

            # Then no process writes to the old primary any more, although it still takes
            # writes until the sentinels demote it
            scripts_at_switch = evalsha_calls(old)
            load.wait_for(50, after=switched)
            assert role_of(old) == "master"
            assert evalsha_calls(old) == scripts_at_switch

            # and the load goes on past the old primary's demotion
            wait_for(lambda: role_of(old) == "slave", timeout_s=40, what="the demotion")
            load.wait_for(50, after=time.monotonic())
        finally:
            load.stopping.set()
            load.join(timeout=30)
        accepted = {message_id for message_id, _ in load.acked}
        wait_for(
            lambda: accepted <= set(ledger.completions),
            timeout_s=30,
            what="every accepted dispatch to run",
        )
        producer.drain(timeout_s=30)
        for worker in workers:
            worker.stop(timeout_s=10)
        producer.stop()

    # Every dispatch that returned an id ran; what ran twice was in flight at the switch
    ran_twice = {m for m, ends in ledger.completions.items() if len(ends) > 1}
    print(
        f"\nplanned fail-over: {len(accepted)} accepted, lost "
        f"{len(accepted - set(ledger.completions))}, ran twice {len(ran_twice)}, in flight "
        f"{len(in_flight)}, {len(load.errors)} failed dispatches over "
        f"{(max((t for t, _ in load.errors), default=began) - began):.2f} s"
    )
    assert ran_twice <= in_flight


def test_a_moved_primary_leaves_the_sentinel_connections_in_use_open(redis_url: str) -> None:
    # Given a Sentinel pool (its sentinel here: the tests' Redis, which answers PING as one
    # does) and a connection to that sentinel in use by a thread asking it for the primary
    address = urlsplit(redis_url)
    pool = connection_pool(
        f"redis+sentinel://{address.hostname}:{address.port}/0?master=m", timeout_s=5
    )
    assert isinstance(pool, SentinelPool)
    [sentinel] = pool.sentinel_manager.sentinels
    in_use = sentinel.connection_pool.get_connection()
    # When redis-py sees the primary move: it disconnects the pool's idle connections
    pool.disconnect(inuse_connections=False)
    # Then the connection in use stays open under its thread (closing it there made the
    # thread's command fail with "I/O operation on closed file" in a fail-over)
    assert in_use.is_connected
    in_use.send_command("PING")  # type: ignore[no-untyped-call]
    assert in_use.read_response() in (b"PONG", "PONG")
    # and a full disconnect (a runner's stop) still closes it
    sentinel.connection_pool.release(in_use)
    pool.disconnect()
    assert not in_use.is_connected


def test_an_async_producer_follows_a_planned_fail_over(group: SentinelGroup) -> None:
    # Given an asyncio producer and a worker on the Sentinel URL
    release, ledger = threading.Event(), Ledger()
    release.set()
    worker = runner(group.url(), release, ledger)
    producer = runner(group.url(), release, ledger)
    worker.start()

    async def produce() -> tuple[list[str], int]:
        accepted = [await producer.adispatch(WORK, {})]  # discovered the primary, connected
        admin = group.sentinels[0].client()
        admin.execute_command("SENTINEL", "FAILOVER", group.master)  # type: ignore[no-untyped-call]
        admin.close()
        old_port = group.primary.port
        failed = 0
        # When the primary moves while the producer dispatches
        while True:
            try:
                accepted.append(await producer.adispatch(WORK, {}))
            except RedisUnavailableError:
                failed += 1
                await asyncio.sleep(0.01)
            if await asyncio.to_thread(group.current_primary_port) != old_port:
                break
        after = 0
        refused_after: list[bool] = []
        while after < 20:  # and on, against the new primary, once the sentinels switched
            try:
                accepted.append(await producer.adispatch(WORK, {}))
                after += 1
            except RedisUnavailableError as exc:
                refused_after.append(exc.maybe_enqueued)
                failed += 1
                await asyncio.sleep(0.01)
        await producer.aclose()
        # a dispatch refused once the sentinels named the new primary was never sent: the
        # old one is behind the barrier until they switch
        assert not any(refused_after)
        return accepted, failed

    try:
        accepted, failed = asyncio.run(produce())
        # Then every dispatch that returned an id runs
        wait_for(
            lambda: set(accepted) <= set(ledger.completions),
            timeout_s=30,
            what="every accepted dispatch to run",
        )
    finally:
        worker.stop(timeout_s=5)
        producer.stop()
    print(f"\nasync producer over a fail-over: {len(accepted)} accepted, {failed} refused")
