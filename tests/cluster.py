"""A local Redis Cluster for the cluster tests and benchmarks: 3 primaries, each with a
replica, on private ports (Debian's ``redis-server`` and ``redis-cli --cluster create``), and
the two operations an operator runs on a live one: a planned ``CLUSTER FAILOVER`` of a
shard and a live move of one slot to another primary (what ``redis-cli --cluster reshard``
does for each slot it moves: ``SETSLOT IMPORTING``/``MIGRATING``, ``MIGRATE`` of its keys in
batches while clients keep writing, then ``SETSLOT NODE``).
"""

from __future__ import annotations

import contextlib
import random
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import redis

from tests.deployment import Server, require, start_server


@dataclass
class Cluster:
    nodes: list[Server]

    def url(self) -> str:
        return "redis+cluster://" + ",".join(f"127.0.0.1:{n.port}" for n in self.nodes[:3]) + "/0"

    def client(self, port: int) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=port, socket_timeout=10, decode_responses=True)

    def owner(self, slot: int) -> int:
        """The port of the primary that serves ``slot`` (as the first node answering says)."""
        for node in self.nodes:
            if node.process.poll() is not None:
                continue
            with contextlib.closing(self.client(node.port)) as c:
                for start, end, primary, *_ in c.execute_command("CLUSTER", "SLOTS"):  # type: ignore[no-untyped-call]
                    if int(start) <= slot <= int(end):
                        return int(primary[1])
        raise AssertionError(f"no node serves slot {slot}")

    def node_id(self, port: int) -> str:
        with contextlib.closing(self.client(port)) as c:
            return str(c.execute_command("CLUSTER", "MYID"))  # type: ignore[no-untyped-call]

    def replicas_of(self, port: int) -> list[int]:
        with contextlib.closing(self.client(port)) as c:
            info = c.execute_command("INFO", "replication")  # type: ignore[no-untyped-call]
        return [int(v["port"]) for k, v in info.items() if k.startswith("slave")]

    def fail_over(self, slot: int, timeout_s: float = 30) -> tuple[int, int]:
        """``CLUSTER FAILOVER`` on a replica of ``slot``'s primary; until the replica serves
        the slot. Returns (old primary's port, new primary's port)."""
        old = self.owner(slot)
        new = self.replicas_of(old)[0]
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            # a manual fail-over that does not complete in time is given up by Redis
            # (replication not caught up within its 5 s): ask again
            with contextlib.closing(self.client(new)) as c:
                c.execute_command("CLUSTER", "FAILOVER")  # type: ignore[no-untyped-call]
            again = time.monotonic() + 8
            while time.monotonic() < min(again, deadline):
                if self.owner(slot) == new and self._role(old) == "slave":
                    return old, new
                time.sleep(0.05)
        raise AssertionError(f"slot {slot} did not move to {new}")

    def move_slot(self, slot: int, to_port: int, batch: int = 10) -> int:
        """Move ``slot`` live to the primary on ``to_port``; returns how many keys moved."""
        source = self.owner(slot)
        src, dst = self.client(source), self.client(to_port)
        src_id, dst_id = self.node_id(source), self.node_id(to_port)
        moved = 0
        try:
            dst.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", src_id)  # type: ignore[no-untyped-call]
            src.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", dst_id)  # type: ignore[no-untyped-call]
            while True:
                names = src.execute_command("CLUSTER", "GETKEYSINSLOT", slot, batch)  # type: ignore[no-untyped-call]
                if not names:
                    break
                src.execute_command(  # type: ignore[no-untyped-call]
                    "MIGRATE", "127.0.0.1", to_port, "", 0, 5000, "REPLACE", "KEYS", *names
                )
                moved += len(names)
            for each in (dst, src):
                each.execute_command("CLUSTER", "SETSLOT", slot, "NODE", dst_id)  # type: ignore[no-untyped-call]
            for node in self.primaries():
                if node not in (source, to_port):
                    with contextlib.closing(self.client(node)) as c:
                        c.execute_command("CLUSTER", "SETSLOT", slot, "NODE", dst_id)  # type: ignore[no-untyped-call]
        finally:
            src.close()
            dst.close()
        return moved

    def primaries(self) -> list[int]:
        return [
            n.port
            for n in self.nodes
            if n.process.poll() is None and self._role(n.port) == "master"
        ]

    def _role(self, port: int) -> str:
        with contextlib.closing(self.client(port)) as c:
            return str(c.execute_command("ROLE")[0])  # type: ignore[no-untyped-call]

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()


def _wait_until_ok(cluster: Cluster, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        states = []
        for node in cluster.nodes:
            with contextlib.closing(cluster.client(node.port)) as c:
                info = c.execute_command("CLUSTER", "INFO")  # type: ignore[no-untyped-call]
                text = info if isinstance(info, str) else str(info)
                states.append("cluster_state:ok" in text and "cluster_known_nodes:6" in text)
        if all(states):
            return
        time.sleep(0.1)
    raise AssertionError("the local cluster did not come up")


def _free(port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def cluster_port() -> int:
    """A free port below 55536 whose cluster bus port (+10000) is free too."""
    while True:
        port = random.randint(20_000, 45_000)
        if _free(port) and _free(port + 10_000):
            return port


@contextlib.contextmanager
def local_cluster(directory: Path) -> Iterator[Cluster]:
    """3 primaries with a replica each, on free ports, for the ``with`` block."""
    cli = require("redis-cli", "redis-tools")
    nodes: list[Server] = []
    try:
        for index in range(6):
            nodes.append(
                start_server(
                    f"node{index}",
                    directory,
                    port=cluster_port(),
                    args=(
                        "--cluster-enabled",
                        "yes",
                        "--cluster-config-file",
                        str(directory / f"nodes{index}.conf"),
                        "--cluster-node-timeout",
                        "3000",
                    ),
                )
            )
        subprocess.run(
            [
                cli,
                "--cluster",
                "create",
                *(f"127.0.0.1:{n.port}" for n in nodes),
                "--cluster-replicas",
                "1",
                "--cluster-yes",
            ],
            check=True,
            capture_output=True,
            timeout=60,
        )
        cluster = Cluster(nodes)
        _wait_until_ok(cluster)
        yield cluster
    finally:
        for node in nodes:
            node.stop()
