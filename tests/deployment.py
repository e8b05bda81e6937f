"""Real Redis deployments for the deployment tests (issue 21): private servers, TLS
certificates, a Sentinel group, and one scenario that walks kumiko's main paths.

Everything here starts real processes (Debian's ``redis-server``, ``redis-sentinel``,
``openssl``) on private ports and temporary directories, and stops them afterwards. A missing
binary is a test FAILURE, never a skip (``.ci/run`` installs them): :func:`require`.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import redis

from kumiko_dramatiq import (
    Backoff,
    Cron,
    Feature,
    JobContext,
    JobRunner,
    Registry,
)
from kumiko_dramatiq.middleware.boot import reset_boot_marker
from tests.conftest import Recorder

#: How long a private server may take to answer its first PING.
START_TIMEOUT_S = 10.0


def require(binary: str, package: str) -> str:
    """The path of ``binary``; FAIL (not skip) the test when it is missing."""
    path = shutil.which(binary)
    if path is None:
        pytest.fail(
            f"{binary} is not installed: `apt-get install {package}` (.ci/run installs it); "
            "the deployment tests fail rather than skip without it",
            pytrace=False,
        )
    return path


def free_port() -> int:
    """A TCP port nothing listens on right now (the kernel's choice)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


# -- processes ------------------------------------------------------------------------------
@dataclass
class Server:
    """One ``redis-server`` (or sentinel) process started by a test."""

    name: str
    port: int
    directory: Path
    process: subprocess.Popen[bytes]
    host: str = "127.0.0.1"
    client_kwargs: dict[str, Any] = field(default_factory=dict)

    @property
    def log(self) -> str:
        path = self.directory / f"{self.name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def client(self, **kwargs: Any) -> redis.Redis:
        options = {"socket_timeout": 5, "socket_connect_timeout": 5, **self.client_kwargs}
        return redis.Redis(host=self.host, port=self.port, **{**options, **kwargs})

    def kill(self) -> None:
        """SIGKILL: no shutdown, no last save, no goodbye to replicas."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(timeout=10)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def start_server(
    name: str,
    directory: Path,
    *,
    port: int | None = None,
    args: Sequence[str] = (),
    sentinel: bool = False,
    config: str = "",
    host: str = "127.0.0.1",
    client_kwargs: dict[str, Any] | None = None,
    ping: bool = True,
) -> Server:
    """Start ``redis-server`` (or ``redis-sentinel``) named ``name`` in ``directory``: no
    persistence, its log in ``<name>.log``, listening on ``host:port`` (a free port if
    ``port`` is None). ``config`` is written to ``<name>.conf`` first (Sentinel rewrites its
    file). Waits until it answers a PING (unless ``ping`` is False)."""
    directory.mkdir(parents=True, exist_ok=True)
    binary = require("redis-sentinel", "redis-sentinel") if sentinel else None
    server_binary = binary or require("redis-server", "redis-server")
    port = free_port() if port is None else port
    conf = directory / f"{name}.conf"
    conf.write_text(config)
    command = [
        server_binary,
        str(conf),
        *("--bind", host, "--port", str(port), "--dir", str(directory)),
        *("--logfile", str(directory / f"{name}.log"), "--save", "", "--appendonly", "no"),
        *args,
    ]
    if sentinel:
        command = [c for c in command if c not in ("--save", "", "--appendonly", "no")]
    with (directory / f"{name}.stderr").open("wb") as stderr:
        process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=stderr)
    server = Server(name, port, directory, process, host, dict(client_kwargs or {}))
    if ping:
        wait_until_answers(server)
    return server


def wait_until_answers(server: Server) -> None:
    """Until ``server`` answers a PING; a server that does not is stopped, and the test fails
    with its log."""
    try:
        _wait_until_answers(server)
    except BaseException:
        server.stop()
        raise


def _wait_until_answers(server: Server) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    client = server.client(socket_timeout=1, socket_connect_timeout=1)
    try:
        while True:
            try:
                client.ping()
                return
            except redis.RedisError as exc:
                if server.process.poll() is not None or time.monotonic() > deadline:
                    stderr = (server.directory / f"{server.name}.stderr").read_text()
                    raise AssertionError(
                        f"{server.name} did not start ({exc}): {stderr[-500:]}{server.log[-1500:]}"
                    ) from exc
                time.sleep(0.02)
    finally:
        client.close()


# -- TLS ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Certificates:
    """A CA, a server certificate for 127.0.0.1/localhost and a client certificate (all
    signed by the CA), plus a second, unrelated CA (the "wrong CA")."""

    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    wrong_ca: Path


def make_certificates(directory: Path) -> Certificates:
    """Make the certificates with ``openssl`` (EC P-256 keys: quick to generate)."""
    openssl = require("openssl", "openssl")
    directory.mkdir(parents=True, exist_ok=True)

    def run(*args: str) -> None:
        subprocess.run([openssl, *args], cwd=directory, check=True, capture_output=True)

    def key(name: str) -> None:
        run("ecparam", "-name", "prime256v1", "-genkey", "-noout", "-out", f"{name}.key")

    for ca in ("ca", "wrong-ca"):
        key(ca)
        run(
            *("req", "-x509", "-new", "-key", f"{ca}.key", "-out", f"{ca}.crt"),
            *("-days", "2", "-subj", f"/CN=kumiko test {ca}"),
        )
    (directory / "server.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    (directory / "client.ext").write_text("extendedKeyUsage=clientAuth\n")
    for name in ("server", "client"):
        key(name)
        run("req", "-new", "-key", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}")
        run(
            *("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key"),
            *("-CAcreateserial", "-out", f"{name}.crt", "-days", "2"),
            *("-extfile", f"{name}.ext"),
        )
    return Certificates(
        ca=directory / "ca.crt",
        server_cert=directory / "server.crt",
        server_key=directory / "server.key",
        client_cert=directory / "client.crt",
        client_key=directory / "client.key",
        wrong_ca=directory / "wrong-ca.crt",
    )


def start_tls_server(directory: Path, certs: Certificates, *, auth_clients: bool) -> Server:
    """A ``redis-server`` that speaks only TLS (``--port 0 --tls-port N``)."""
    tls_port = free_port()
    server = start_server(
        "tls",
        directory,
        port=0,
        args=[
            *("--tls-port", str(tls_port), "--tls-cert-file", str(certs.server_cert)),
            *("--tls-key-file", str(certs.server_key), "--tls-ca-cert-file", str(certs.ca)),
            *("--tls-auth-clients", "yes" if auth_clients else "no"),
        ],
        client_kwargs={
            "ssl": True,
            "ssl_ca_certs": str(certs.ca),
            "ssl_certfile": str(certs.client_cert),
            "ssl_keyfile": str(certs.client_key),
        },
        ping=False,
    )
    server.port = tls_port
    wait_until_answers(server)
    return server


# -- Sentinel -------------------------------------------------------------------------------
#: A full sync at once (Redis 7 waits 5 s by default for more replicas to share it).
FAST_SYNC = ("--repl-diskless-sync-delay", "0")
#: The user the replica replicates as (so a test can cut replication: ``ACL SETUSER ... off``).
REPLICATOR = ("replicator", "replicator-pw")


@dataclass
class SentinelGroup:
    """A primary, its replicas (``replica`` is the first) and three sentinels monitoring
    them as ``master``."""

    master: str
    primary: Server
    replicas: list[Server]
    sentinels: list[Server]

    @property
    def replica(self) -> Server:
        return self.replicas[0]

    def data_nodes(self) -> list[Server]:
        return [self.primary, *self.replicas]

    def node_on(self, port: int) -> Server:
        return next(server for server in self.data_nodes() if server.port == port)

    def url(self, db: int = 0) -> str:
        hosts = ",".join(f"127.0.0.1:{s.port}" for s in self.sentinels)
        return f"redis+sentinel://{hosts}/{db}?master={self.master}"

    def current_primary_port(self) -> int:
        client = self.sentinels[0].client()
        try:
            address: Any = client.sentinel_get_master_addr_by_name(self.master)
            return int(address[1])
        finally:
            client.close()

    def cut_replication(self) -> None:
        """Stop the replica from receiving writes: its user is disabled and its link killed
        (it cannot reconnect until :meth:`restore_replication`)."""
        admin = self.primary.client()
        try:
            admin.acl_setuser(REPLICATOR[0], enabled=False)
            admin.client_kill_filter(_type="replica")
        finally:
            admin.close()

    def restore_replication(self) -> None:
        admin = self.primary.client()
        try:
            admin.acl_setuser(REPLICATOR[0], enabled=True)
        finally:
            admin.close()
        wait_for_replication(self.primary)

    def stop(self) -> None:
        for server in [*self.sentinels, *self.replicas, self.primary]:
            server.stop()


@contextlib.contextmanager
def sentinel_group(
    directory: Path,
    *,
    down_after_ms: int = 500,
    primary_args: Sequence[str] = (),
    replicas: int = 1,
    data_args: Sequence[str] = (),
) -> Iterator[SentinelGroup]:
    """Start primary + ``replicas`` replicas + 3 sentinels (quorum 2) on private ports; stop
    them after. ``primary_args`` go to the primary, ``data_args`` to every data node (settings
    a promoted replica must have too).

    ``down_after_ms`` is each sentinel's ``down-after-milliseconds``: how long the primary
    may be silent before a fail-over starts. The sentinels' files are written as Sentinel
    itself would have rewritten them once they had met (their ids, the replicas, each other),
    so they agree at once instead of after their first rounds of hello messages (~10 s)."""
    require("redis-sentinel", "redis-sentinel")
    master = "kumiko-test"
    user, password = REPLICATOR
    # every data node has the replicator user, so that any of them can be a primary
    replicator = ["--user", user, "on", f">{password}", "+psync", "+replconf", "+ping"]
    auth = ["--masteruser", user, "--masterauth", password]
    primary = start_server(
        "primary",
        directory,
        args=[*primary_args, *data_args, *FAST_SYNC, *auth, *replicator],
    )
    started = [
        start_server(
            "replica" if n == 0 else f"replica{n}",
            directory,
            args=[
                *data_args,
                *FAST_SYNC,
                *("--replicaof", "127.0.0.1", str(primary.port)),
                *auth,
                *replicator,
            ],
        )
        for n in range(replicas)
    ]
    sentinels: list[Server] = []
    group = SentinelGroup(master, primary, started, sentinels)
    try:
        wait_for_replication(primary, replicas)
        ports = [free_port() for _ in range(3)]
        ids = [f"{n + 1:040x}" for n in range(3)]
        for n, port in enumerate(ports):
            config = [
                f"sentinel myid {ids[n]}",
                f"sentinel monitor {master} 127.0.0.1 {primary.port} 2",
                f"sentinel down-after-milliseconds {master} {down_after_ms}",
                f"sentinel failover-timeout {master} 3000",
                f"sentinel parallel-syncs {master} 1",
                *(f"sentinel known-replica {master} 127.0.0.1 {r.port}" for r in started),
                *(
                    f"sentinel known-sentinel {master} 127.0.0.1 {other} {ids[m]}"
                    for m, other in enumerate(ports)
                    if m != n
                ),
            ]
            sentinels.append(
                start_server(
                    f"sentinel{n}", directory, port=port, sentinel=True, config="\n".join(config)
                )
            )
        wait_for_sentinels_to_agree(group)
        yield group
    finally:
        group.stop()


def wait_for_replication(
    primary: Server, replicas: int = 1, timeout_s: float = START_TIMEOUT_S
) -> None:
    """Until the primary has ``replicas`` replicas online."""
    client = primary.client()
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            info: dict[str, Any] = client.info("replication")
            slaves = [v for k, v in info.items() if k.startswith("slave") and isinstance(v, dict)]
            if sum(1 for s in slaves if s.get("state") == "online") >= replicas:
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"the replica never came online: {info}")
            time.sleep(0.02)
    finally:
        client.close()


def wait_for_sentinels_to_agree(group: SentinelGroup, timeout_s: float = 15) -> None:
    """Until every sentinel knows the replica and the other two sentinels."""
    deadline = time.monotonic() + timeout_s
    while True:
        ready = 0
        for sentinel in group.sentinels:
            client = sentinel.client()
            try:
                state: Any = client.sentinel_master(group.master)
                if (
                    int(state.get("num-slaves", 0)) >= len(group.replicas)
                    and int(state.get("num-other-sentinels", 0)) >= 2
                ):
                    ready += 1
            finally:
                client.close()
        if ready == len(group.sentinels):
            return
        if time.monotonic() > deadline:
            raise AssertionError("the sentinels did not discover each other and the replica")
        time.sleep(0.05)


def wait_for_fail_over(group: SentinelGroup, timeout_s: float = 30) -> float:
    """Until the sentinels name a replica as the primary; returns when (monotonic)."""
    deadline = time.monotonic() + timeout_s
    while group.current_primary_port() not in {r.port for r in group.replicas}:
        if time.monotonic() > deadline:
            raise AssertionError(
                f"no fail-over after {timeout_s}s: {group.sentinels[0].log[-2000:]}"
            )
        time.sleep(0.02)
    return time.monotonic()


# -- several hosts --------------------------------------------------------------------------
@dataclass(frozen=True)
class Host:
    """A network namespace standing for one machine: its own host name and address."""

    name: str
    namespace: str
    address: str
    #: the root end of its veth pair (on the bridge): down = the host is cut off
    link: str


@dataclass
class HostNetwork:
    """Network namespaces joined by a bridge in the root namespace, whose address
    (:attr:`gateway`) is where the shared Redis listens."""

    tag: str
    bridge: str
    gateway: str
    hosts: list[Host]

    def cut(self, host: Host) -> None:
        """Take the host's link down: its packets go nowhere (no reset, no error at once)."""
        _ip("link", "set", host.link, "down")

    def restore(self, host: Host) -> None:
        _ip("link", "set", host.link, "up")

    def spawn(
        self, host: Host, argv: Sequence[str], env: dict[str, str], log: Path
    ) -> subprocess.Popen[bytes]:
        """Run ``argv`` on ``host``: in its namespace, under its own host name."""
        command = [
            *("ip", "netns", "exec", host.namespace, "unshare", "--uts", "--"),
            *("sh", "-c", f'hostname {host.name} && exec "$@"', "sh", *argv),
        ]
        with log.open("ab") as out:
            return subprocess.Popen(command, cwd=ROOT, env=env, stdout=out, stderr=out)


def namespaces_problem() -> str | None:
    """Why this machine cannot make network namespaces for the test, or None."""
    if os.geteuid() != 0:
        return "network namespaces need root (ip netns add); run as root, as .ci/run does"
    if shutil.which("ip") is None or shutil.which("unshare") is None:
        return "`ip` (iproute2) and `unshare` (util-linux) are needed"
    probe = f"kumiko-probe-{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"`ip netns add` failed: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "delete", probe], capture_output=True)
    return None


def _ip(*args: str, namespace: str | None = None) -> None:
    prefix = ["ip", "netns", "exec", namespace, "ip"] if namespace else ["ip"]
    done = subprocess.run([*prefix, *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise AssertionError(f"ip {' '.join(args)}: {done.stderr.strip()}")


@contextlib.contextmanager
def host_network(count: int) -> Iterator[HostNetwork]:
    """``count`` namespaces ``h1``.. on a private /24 behind one bridge; removed after."""
    tag = os.urandom(2).hex()
    subnet = f"10.{200 + int(tag[:2], 16) % 50}.{int(tag[2:], 16)}"
    network = HostNetwork(tag, f"kb{tag}", f"{subnet}.1", [])
    try:
        _ip("link", "add", network.bridge, "type", "bridge")
        _ip("addr", "add", f"{network.gateway}/24", "dev", network.bridge)
        _ip("link", "set", network.bridge, "up")
        for n in range(1, count + 1):
            host = Host(f"h{n}", f"kumiko-{tag}-h{n}", f"{subnet}.{10 + n}", f"kv{tag}{n}r")
            inner = f"kv{tag}{n}n"
            _ip("netns", "add", host.namespace)
            network.hosts.append(host)
            _ip("link", "add", host.link, "type", "veth", "peer", "name", inner)
            _ip("link", "set", inner, "netns", host.namespace)
            _ip("link", "set", host.link, "master", network.bridge)
            _ip("link", "set", host.link, "up")
            _ip("addr", "add", f"{host.address}/24", "dev", inner, namespace=host.namespace)
            _ip("link", "set", inner, "up", namespace=host.namespace)
            _ip("link", "set", "lo", "up", namespace=host.namespace)
        yield network
    finally:
        for host in network.hosts:
            subprocess.run(["ip", "link", "delete", host.link], capture_output=True)
            subprocess.run(["ip", "netns", "delete", host.namespace], capture_output=True)
        subprocess.run(["ip", "link", "delete", network.bridge], capture_output=True)


# -- the main paths -------------------------------------------------------------------------
FEATURE = "mp"
WORK, TICK, BOOT, GATE, SEQ, DIES, FAN = (
    f"{FEATURE}:job:{name}" for name in ("work", "tick", "boot", "gate", "seq", "dies", "fan")
)
TENANTS = ("t1", "t2")


@dataclass
class MainPaths:
    """What :func:`run_main_paths` saw."""

    completed: dict[str, int] = field(default_factory=dict)
    failed: dict[str, int] = field(default_factory=dict)
    #: (lane, workers alive) from ``runner.status()``
    status: list[tuple[str, int]] = field(default_factory=list)
    retried_dead_id: str = ""


def main_paths_registry(*, per_tenant: bool = True) -> Registry:
    """One job per main path: retried work, a per-second cron, a boot-once job, a boot
    gate, a sequential job, a per-tenant job, and a job that dies (the dead-letter paths)."""
    feature = Feature(FEATURE)

    def work(payload: dict[str, Any], ctx: JobContext) -> None:
        if payload.get("fail_first") and ctx.attempt == 1:
            raise RuntimeError("first attempt fails")

    def noop(payload: dict[str, Any], ctx: JobContext) -> None:
        return None

    def seq(payload: dict[str, Any], ctx: JobContext) -> None:
        gate = ctx.app
        if isinstance(gate, threading.Event) and payload.get("hold"):
            gate.wait(10)

    def dies(payload: dict[str, Any], ctx: JobContext) -> None:
        raise RuntimeError("always fails")

    feature.job("work", retries=1, backoff=Backoff("fixed", delay_ms=50))(work)
    feature.job("tick", trigger=Cron("* * * * * *"))(noop)
    feature.job("boot", run_on_boot=True)(noop)
    feature.job("gate", boot_gate=True)(noop)
    feature.job("seq", concurrency="sequential")(seq)
    feature.job("dies")(dies)
    if per_tenant:
        feature.job("fan", per_tenant=True)(noop)
    return Registry([feature])


#: For ``KUMIKO_APP=tests.deployment:CLI_APP``: the main paths less the per-tenant job (a
#: CLI worker would need a tenant resolver for it).
CLI_APP = main_paths_registry(per_tenant=False)
ROOT = Path(__file__).resolve().parents[1]


def cli_env(redis_url: str, prefix: str, app: str = "tests.deployment:CLI_APP") -> dict[str, str]:
    """The environment of a ``kumiko``/worker/scheduler subprocess on this dataset."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KUMIKO_")}
    env.update(
        PYTHONPATH=str(ROOT), KUMIKO_APP=app, KUMIKO_REDIS_URL=redis_url, KUMIKO_QUEUE_PREFIX=prefix
    )
    return env


def kumiko(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    """Run the ``kumiko`` command (``python -m kumiko_dramatiq.ops.cli``) to its end."""
    return subprocess.run(
        [sys.executable, "-m", "kumiko_dramatiq.ops.cli", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def run_main_paths(redis_url: str, prefix: str, *, timeout_s: float = 30) -> MainPaths:
    """Start a runner (worker + scheduler) on ``redis_url`` and walk the main paths: boot gate
    and boot-once job, dispatch and run, a retry, a delayed dispatch, a cron tick, a
    sequential job held by a running one (hand-off), dedup keys, a per-tenant fan-out, bulk
    dispatch, a dead letter retried, a cancel, pause/resume, the operating reads (status,
    jobs, runs, locks, dedup keys, dead letters), ``drain`` and ``reset_boot``. Raises
    ``AssertionError`` when a path did not end as it should."""
    recorder = Recorder()
    hold = threading.Event()
    runner = JobRunner(
        main_paths_registry(),
        redis_url=redis_url,
        queue_prefix=prefix,
        worker_threads=4,
        run_scheduler=True,
        boot_redis_timeout_ms=3_000,
        sequential_retry_delay_ms=50,
        context=hold,
        get_active_tenant_ids=lambda: list(TENANTS),
        **recorder.hooks(),
    )
    seen = MainPaths()
    try:
        runner.start()
        recorder.wait_until(lambda r: bool(r.of("complete", BOOT)), timeout_s, "boot job")
        runner.dispatch(WORK, {"fail_first": True})
        runner.dispatch(WORK, {}, delay_ms=50)
        first = runner.dispatch(WORK, {"n": 1}, dedup_key="k", delay_ms=300)
        assert runner.dispatch(WORK, {"n": 2}, dedup_key="k", delay_ms=300) == first
        assert runner.cancel(first) is True
        runner.dispatch(SEQ, {"hold": True})
        recorder.wait_until(lambda r: bool(r.of("start", SEQ)), timeout_s, "the held run")
        runner.dispatch(SEQ, {})  # finds the lock held: handed off
        assert [lock.job_name for lock in runner.locks()] == [SEQ]
        runner.dedup_keys()
        hold.set()
        runner.dispatch(DIES)
        runner.dispatch(FAN)
        runner.dispatch_many(WORK, [{"n": 3}, {"n": 4}])
        recorder.wait_until(lambda r: bool(r.of("failed", DIES)), timeout_s, "the dead letter")
        recorder.wait_until(lambda r: len(r.of("complete", SEQ)) == 2, timeout_s, "seq x2")
        recorder.wait_until(lambda r: len(r.of("complete", WORK)) == 4, timeout_s, "work x4")
        recorder.wait_until(lambda r: len(r.of("complete", FAN)) == 3, timeout_s, "fan-out")
        recorder.wait_until(lambda r: bool(r.of("complete", TICK)), timeout_s, "a cron tick")
        runner.pause(WORK)
        runner.resume(WORK)
        [dead] = _eventually(lambda: runner.dead_letters(), timeout_s)
        retried = runner.retry_dead(dead.message_id)
        assert retried, "the dead letter was retried"
        seen.retried_dead_id = retried
        recorder.wait_until(lambda r: len(r.of("failed", DIES)) == 2, timeout_s, "retried dies")
        status = runner.status()
        seen.status = [(lane.lane, len(status.workers)) for lane in status.lanes]
        runner.jobs()
        runner.runs(limit=10)
        runner.run_record(seen.retried_dead_id)
        runner.drain(timeout_s=timeout_s)
        reset_boot_marker(redis_url, prefix, BOOT)
    finally:
        hold.set()
        runner.stop(timeout_s=10)
    for event in recorder.events:
        bucket = seen.completed if event.kind == "complete" else seen.failed
        if event.kind != "start":
            bucket[event.job_name] = bucket.get(event.job_name, 0) + 1
    return seen


def _eventually(read: Any, timeout_s: float) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        value = read()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {read}")
        time.sleep(0.02)
