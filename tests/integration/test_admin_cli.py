"""The ``kumiko`` commands of issue 33 (busy, stop, purge, dead --delete, queued, run-now),
driven as subprocesses against a real Redis and a real CLI worker."""

from __future__ import annotations

from tests.conftest import wait_for
from tests.integration.test_operating import Ops, ops  # noqa: F401 (the fixture)

BLOCK = "ops:job:block"


def test_busy_lists_what_runs_and_stop_ends_it_cancelled(ops: Ops) -> None:  # noqa: F811
    ops.worker()
    running = ops.producer.dispatch(BLOCK)
    wait_for(lambda: running in ops.ran(BLOCK), timeout_s=30, what="it to start")
    wait_for(lambda: bool(ops.json("busy")["running"]), what="it to show as running")
    (run,) = ops.json("busy", "--job", BLOCK)["running"]
    assert (run["message_id"], run["status"]) == (running, "running")
    assert run["worker"]
    assert running in ops.kumiko("busy").stdout
    done = ops.kumiko("stop", running)
    assert done.returncode == 0, done.stderr
    wait_for(
        lambda: [r.status for r in ops.producer.run_record(running)] == ["cancelled"],
        what="it to end cancelled",
    )
    assert ops.json("busy")["running"] == []
    assert ops.kumiko("busy").stdout.strip() == "nothing runs"
    again = ops.kumiko("stop", running)
    assert again.returncode == 1
    assert "not running" in again.stderr
