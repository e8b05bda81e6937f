"""Several worker hosts on one Redis: three network namespaces on this machine (each its own
host name and address, joined to the Redis by a bridge), one cut off mid-run (link down) and
brought back.

Needs root (``ip netns``, ``unshare --uts``): ``.ci/run`` runs as root. Elsewhere the test
is skipped with the reason; nothing is simulated. Throughput per host is measured by
``benchmarks/hosts.py``, not here.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from kumiko_dramatiq import JobRunner
from kumiko_dramatiq.broker import keys as kumiko_keys
from kumiko_dramatiq.broker.keys import heartbeats
from kumiko_dramatiq.ops.history import JobRun
from tests.apps.host_worker import registry_of
from tests.conftest import wait_for
from tests.deployment import (
    Host,
    HostNetwork,
    Server,
    cli_env,
    host_network,
    namespaces_problem,
    start_server,
)

PREFIX = "hosts"
WORK, SEQ = "hosts:job:work", "hosts:job:seq"
HEARTBEAT_TIMEOUT_MS = 2_000
LOCK_TTL_MS = 1_500


@dataclass(frozen=True)
class Event:
    kind: str  # "start" | "end"
    message_id: str
    host: str
    at: float  # epoch s


class Cluster:
    """The shared Redis on the bridge and one worker process per host."""

    def __init__(self, network: HostNetwork, server: Server, base: Path) -> None:
        self.network = network
        self.server = server
        self.base = base
        self.url = f"redis://:pw@{network.gateway}:{server.port}/0"
        self.release = base / "release"
        self.processes: dict[str, subprocess.Popen[bytes]] = {}
        self.broker_ids: dict[str, str] = {}

    def log(self, host: Host) -> Path:
        return self.base / f"{host.name}.log"

    def start(self, host: Host) -> None:
        env = cli_env(self.url, PREFIX, app="")
        env.update(
            HOST_HEARTBEAT_TIMEOUT_MS=str(HEARTBEAT_TIMEOUT_MS),
            HOST_LOCK_TTL_MS=str(LOCK_TTL_MS),
            HOST_THREADS="8",
        )
        argv = [sys.executable, "-m", "tests.apps.host_worker", str(self.log(host))]
        self.processes[host.name] = self.network.spawn(
            host, [*argv, str(self.release)], env, self.base / f"{host.name}.out"
        )
        wait_for(lambda: self._ready(host), what=f"the worker on {host.name}")

    def _ready(self, host: Host) -> bool:
        for line in self._lines(host):
            if line.startswith("ready "):
                _, name, broker_id = line.split()
                assert name == host.name  # its own host name
                self.broker_ids[host.name] = broker_id
                return True
        return False

    def stop(self, host: Host) -> None:
        process = self.processes.pop(host.name, None)
        if process is not None:
            process.terminate()
            process.wait(timeout=30)

    def _lines(self, host: Host) -> list[str]:
        path = self.log(host)
        return path.read_text().splitlines() if path.exists() else []

    def events(self) -> list[Event]:
        found = []
        for host in self.network.hosts:
            for line in self._lines(host):
                kind, *rest = line.split()
                if kind in ("start", "end"):
                    found.append(Event(kind, rest[0], host.name, float(rest[2])))
        return found

    def started(self, message_id: str, hosts: set[str]) -> bool:
        return any(
            e.kind == "start" and e.message_id == message_id and e.host in hosts
            for e in self.events()
        )


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    problem = namespaces_problem()
    if problem is not None:
        pytest.skip(f"several-hosts test not possible here: {problem}")
    with host_network(3) as network:
        server = start_server(
            "shared",
            tmp_path,
            host=network.gateway,
            args=["--requirepass", "pw"],
            client_kwargs={"password": "pw"},
        )
        made = Cluster(network, server, tmp_path)
        try:
            yield made
        finally:
            made.release.touch()
            for host in network.hosts:
                network.restore(host)
                made.stop(host)
            server.stop()


@pytest.mark.slow
def test_a_host_cut_off_mid_run_loses_its_work_to_the_others_and_comes_back(
    cluster: Cluster,
) -> None:
    h1, h2, h3 = cluster.network.hosts
    producer = JobRunner(
        registry_of(cluster.base / "producer.log", cluster.release),
        redis_url=cluster.url,
        queue_prefix=PREFIX,
        boot_redis_timeout_ms=5_000,
    )
    admin = cluster.server.client()
    try:
        # Given h3 alone, running a sequential job and three other jobs (all held)
        cluster.start(h3)
        held_seq = producer.dispatch(SEQ, {"hold": "seq"})
        held = [producer.dispatch(WORK, {"hold": True}) for _ in range(3)]
        wait_for(
            lambda: all(cluster.started(m, {"h3"}) for m in [held_seq, *held]),
            what="h3's held runs",
        )
        # and h1, h2 joining, with more work and a second run of the sequential job queued
        cluster.start(h1)
        cluster.start(h2)
        waiting_seq = producer.dispatch(SEQ, {})
        quick = [producer.dispatch(WORK, {"sleep_ms": 20}) for _ in range(20)]

        # When h3's link goes down mid-run (and the work it holds ends there, unheard)
        cluster.network.cut(h3)
        lock = kumiko_keys.sequential_lock(PREFIX, SEQ, None)
        asked_at = time.time()  # before the PTTL: the earliest the lock can expire
        lock_ttl_ms = int(admin.pttl(lock))
        lock_expires_at = asked_at + lock_ttl_ms / 1000
        last_heartbeat_ms = admin.zscore(heartbeats(), cluster.broker_ids["h3"])
        assert last_heartbeat_ms is not None
        cluster.release.with_name("release.seq").touch()
        cluster.release.touch()

        # Then its lock expires within its TTL and the waiting sequential run takes over
        assert 0 < lock_ttl_ms <= LOCK_TTL_MS
        wait_for(
            lambda: bool(_completed_runs(producer, origin_id=waiting_seq)),
            timeout_s=30,
            what="the waiting sequential run",
        )
        [taken_over] = _completed_runs(producer, origin_id=waiting_seq)
        assert taken_over.started_at is not None
        assert taken_over.started_at.timestamp() >= lock_expires_at - 0.05
        # and the messages it held are redelivered to h1/h2 once its heartbeat is older than
        # the timeout (each runs alone there, as any message whose worker vanished with it)
        wait_for(
            lambda: all(cluster.started(m, {"h1", "h2"}) for m in held),
            timeout_s=30,
            what="h3's messages on h1/h2",
        )
        # (the sequential one may find the lock taken and hand off to a new message id: it
        # is followed by its origin id)
        wait_for(
            lambda: bool(_completed_runs(producer, origin_id=held_seq)),
            timeout_s=30,
            what="h3's sequential run on h1/h2",
        )
        [seq_again] = _completed_runs(producer, origin_id=held_seq)
        assert str(seq_again.worker).split(":")[0] in {"h1", "h2"}
        assert seq_again.started_at is not None
        assert (
            seq_again.started_at.timestamp()
            >= (last_heartbeat_ms + HEARTBEAT_TIMEOUT_MS) / 1000 - 0.01
        )

        producer.drain(timeout_s=30)  # all that h3 had, redelivered, has run elsewhere

        # When h3 comes back (its acks of what it ran while cut off arrive late), and later
        # is the only host left
        cut_until = time.time()  # h3 can fetch nothing before this
        cluster.network.restore(h3)
        restored_at = time.time()
        cluster.stop(h1)
        cluster.stop(h2)
        after = [producer.dispatch(WORK, {}) for _ in range(3)]
        producer.drain(timeout_s=60)
    finally:
        admin.close()

    events = sorted(cluster.events(), key=lambda e: e.at)
    starts: dict[str, list[Event]] = {}
    for event in events:
        if event.kind == "start":
            starts.setdefault(event.message_id, []).append(event)
    # (what starts on h3 until its link is back, the cut included, is what it held when cut)
    on_h3 = {
        m for m, seen in starts.items() if any(e.host == "h3" and e.at < cut_until for e in seen)
    }
    completed = {run.message_id for run in _completed_runs(producer)}
    producer.stop()
    # nothing was lost
    assert {*held, *quick, *after} <= completed
    # the held messages ran twice: on h3, then once on h1/h2 after the heartbeat timeout
    for message_id in held:
        first, second = starts[message_id]
        assert (first.host, second.host in {"h1", "h2"}) == ("h3", True)
        assert second.at >= (last_heartbeat_ms + HEARTBEAT_TIMEOUT_MS) / 1000 - 0.01
    # what h3 had in flight ran at most twice, the rest exactly once
    for message_id, seen in starts.items():
        assert len(seen) <= (2 if message_id in on_h3 else 1), seen
    # h3's late acks, once it was back, made nothing run again
    assert [e for e in events if e.at > restored_at and e.message_id not in after] == []
    # and h3 works again: the last messages ran there
    assert all([e.host for e in starts[m]] == ["h3"] for m in after)


def _completed_runs(producer: JobRunner, origin_id: str | None = None) -> list[JobRun]:
    return list(producer.runs(status="completed", origin_id=origin_id, limit=1000))
