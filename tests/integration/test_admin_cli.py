"""The ``kumiko`` commands of issue 33 (busy, stop, purge, dead --delete, queued, run-now),
driven as subprocesses against a real Redis and a real CLI worker."""

from __future__ import annotations

import json
import subprocess
import sys

from kumiko_dramatiq import JobRunner
from tests.conftest import wait_for
from tests.integration.test_operating import ROOT, Ops, ops  # noqa: F401 (the fixture)

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


def test_purge_asks_first_dry_run_counts_and_yes_removes(ops: Ops) -> None:  # noqa: F811
    ops.producer.dispatch_many("ops:job:note", [{}] * 7)
    dry = ops.kumiko("purge", "ops:job:note", "--dry-run")
    assert (dry.returncode, dry.stdout.strip()) == (0, "7")
    declined = subprocess.run(
        [sys.executable, "-m", "kumiko_dramatiq.ops.cli", "purge", "ops:job:note"],
        cwd=ROOT,
        env=ops.env,
        input="n\n",
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert declined.returncode == 1
    assert "Remove 7 queued message(s) of ops:job:note?" in declined.stderr
    assert ops.json("purge", "ops:job:note", "--dry-run")["count"] == 7
    done = ops.json("purge", "ops:job:note", "--yes")
    assert done == {"job": "ops:job:note", "state": "queued", "purged": 7}
    assert ops.kumiko("purge", "ops:job:note", "--yes").returncode == 0  # nothing left: 0
    assert ops.kumiko("purge", "ops:job:nope", "--yes").returncode == 2


def test_dead_delete_discards_one_dead_letter(ops: Ops) -> None:  # noqa: F811
    ops.worker()
    dead = ops.producer.dispatch("ops:job:flaky")
    wait_for(lambda: bool(ops.json("dead")["dead_letters"]), timeout_s=30, what="a dead letter")
    done = ops.kumiko("dead", "--delete", dead)
    assert done.returncode == 0, done.stderr
    assert ops.json("dead")["dead_letters"] == []
    assert ops.kumiko("dead", "--delete", dead).returncode == 1
    assert ops.kumiko("retry", dead).returncode == 1


def test_queued_shows_payloads_only_when_asked(ops: Ops) -> None:  # noqa: F811
    ids = [ops.producer.dispatch("ops:job:note", {"secret": f"s{n}"}) for n in range(3)]
    listed = ops.json("queued", "--job", "ops:job:note")
    assert [m["message_id"] for m in listed["queued"]] == ids
    assert all("payload" not in m for m in listed["queued"])
    assert "s0" not in ops.kumiko("queued").stdout
    shown = ops.json("queued", "--payload", "--limit", "2")
    assert [m["payload"] for m in shown["queued"]] == [{"secret": "s0"}, {"secret": "s1"}]
    rest = ops.json("queued", "--cursor", shown["cursor"])
    assert [m["message_id"] for m in rest["queued"]] == ids[2:]
    assert '"secret": "s0"' in ops.kumiko("queued", "--payload").stdout


def test_jobs_shows_counts_per_job(ops: Ops) -> None:  # noqa: F811
    ops.producer.dispatch_many("ops:job:note", [{}] * 4)
    ops.producer.dispatch("ops:job:note", {}, delay_ms=600_000)
    jobs = {j["name"]: j for j in ops.json("jobs")["jobs"]}
    assert jobs["ops:job:note"]["counts"] == {
        "queued": 4,
        "delayed": 1,
        "running": 0,
        "parked": 0,
        "dead": 0,
    }


def test_run_now_queues_a_delayed_message_now(ops: Ops) -> None:  # noqa: F811
    later = ops.producer.dispatch("ops:job:note", {}, delay_ms=600_000)
    done = ops.kumiko("run-now", later)
    assert done.returncode == 0, done.stderr
    assert [m["state"] for m in ops.json("queued")["queued"]] == ["queued"]
    again = ops.kumiko("run-now", later)
    assert again.returncode == 1
    assert "not delayed" in again.stderr


def test_stats_reads_the_hourly_stats_or_says_none_are_recorded(ops: Ops) -> None:  # noqa: F811
    assert ops.kumiko("stats", "--hours", "169").returncode == 2
    assert ops.kumiko("stats", "--job", "ops:job:nope").returncode == 2
    done = ops.kumiko("stats", "--json")
    if hasattr(JobRunner, "stats"):  # the release that records them (issue 32)
        assert done.returncode == 0, done.stderr
        assert isinstance(json.loads(done.stdout)["stats"], list)
    else:
        assert done.returncode == 1
        assert "records no hourly stats" in done.stderr


def test_queued_and_jobs_show_priorities_and_fair_keys(ops: Ops) -> None:  # noqa: F811
    keyed = ops.producer.dispatch("ops:job:note", {}, priority=3, fair_key="acme")
    plain = ops.producer.dispatch("ops:job:note", {})
    cancelled = ops.producer.dispatch("ops:job:note", {}, priority=3, fair_key="globex")
    assert ops.producer.cancel(cancelled)
    listed = {m["message_id"]: m for m in ops.json("queued")["queued"]}
    assert (listed[keyed]["priority"], listed[keyed]["fair_key"]) == (3, "acme")
    assert (listed[plain]["priority"], listed[plain]["fair_key"]) == (0, None)
    assert cancelled not in listed
    table = ops.kumiko("queued").stdout
    assert "prio." in table
    assert "acme" in table
    waiting = ops.json("jobs")["waiting_by_priority"]["worker"]
    assert (waiting["0"], waiting["3"]) == (1, 1)
    assert "priority 3" in ops.kumiko("jobs").stdout


def test_schedules_are_listed_paused_triggered_and_removed(ops: Ops) -> None:  # noqa: F811
    ops.producer.schedules.upsert("nightly-note", "ops:job:note", every_ms=60_000)
    listed = {s["id"]: s for s in ops.json("schedules")["schedules"]}
    assert (listed["nightly-note"]["every_ms"], listed["nightly-note"]["owner"]) == (
        60_000,
        "runtime",
    )
    assert "nightly-note" in ops.kumiko("schedules").stdout
    assert ops.json("schedule", "pause", "nightly-note")["changed"] is True
    assert ops.producer.schedules.get("nightly-note").paused
    again = ops.kumiko("schedule", "pause", "nightly-note")
    assert again.returncode == 1
    triggered = ops.json("schedule", "trigger", "nightly-note")["message_id"]
    assert triggered in [m.message_id for m in ops.producer.admin.queued(limit=10)]
    assert ops.json("schedule", "remove", "nightly-note")["changed"] is True
    assert "nightly-note" not in {s["id"] for s in ops.json("schedules")["schedules"]}
