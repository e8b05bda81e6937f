"""The start-up check on servers of their own: a Redis Cluster node is refused in one line, and
the check's work does not grow with the keyspace (SLOWLOG shows nothing from it on a Redis
holding half a million keys)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kumiko_dramatiq import JobRunner
from kumiko_dramatiq.errors import RedisAccessError
from tests.deployment import cli_env, free_port, kumiko, main_paths_registry, start_server

#: A command that took longer than this shows in SLOWLOG (µs). The old check ran KEYS over
#: the whole keyspace twice: about 100 ms at half a million keys.
SLOW_US = 20_000


def test_a_redis_cluster_node_is_refused_at_start_in_one_line(tmp_path: Path, prefix: str) -> None:
    node = start_server(
        "cluster",
        tmp_path,
        args=[
            *("--cluster-enabled", "yes", "--cluster-config-file", str(tmp_path / "nodes.conf")),
            # the bus port defaults to the port + 10000, past 65535 for a high free port
            *("--cluster-port", str(free_port())),
        ],
    )
    try:
        admin = node.client()
        admin.execute_command("CLUSTER", "ADDSLOTSRANGE", "0", "16383")  # type: ignore[no-untyped-call]
        admin.close()
        url = f"redis://127.0.0.1:{node.port}/0"
        runner = JobRunner(
            main_paths_registry(per_tenant=False), redis_url=url, queue_prefix=prefix
        )
        with pytest.raises(RedisAccessError, match="is a Redis Cluster node") as caught:
            runner.start()
        runner.stop()
        assert "\n" not in str(caught.value)
        done = kumiko(cli_env(url, prefix), "status")
        assert done.returncode == 1, done.stderr
        [line] = done.stderr.strip().splitlines()
        assert "is a Redis Cluster node" in line
    finally:
        node.stop()


def test_the_start_up_check_does_no_work_that_grows_with_the_keyspace(
    tmp_path: Path, prefix: str
) -> None:
    node = start_server("big", tmp_path, args=["--enable-debug-command", "yes"])
    try:
        admin = node.client()
        admin.execute_command("DEBUG", "POPULATE", "500000", "filler")  # type: ignore[no-untyped-call]
        admin.config_set("slowlog-log-slower-than", SLOW_US)
        admin.slowlog_reset()
        runner = JobRunner(
            main_paths_registry(per_tenant=False),
            redis_url=f"redis://127.0.0.1:{node.port}/0",
            queue_prefix=prefix,
        )
        runner.check_redis()
        runner.stop()
        stats: dict[str, Any] = admin.info("commandstats")
        slow: Any = admin.slowlog_get(128)
        admin.close()
        assert int(stats["cmdstat_evalsha"]["calls"]) >= 1  # the probe ran
        assert [entry["command"] for entry in slow] == []
    finally:
        node.stop()
