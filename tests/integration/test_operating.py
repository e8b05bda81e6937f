"""The ``kumiko`` command, driven as a subprocess against a real Redis and real workers."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import redis

from kumiko_dramatiq import JobRunner
from kumiko_dramatiq.ops.history import record_write
from kumiko_dramatiq.ops.terminal import display_width
from tests.apps.ops_app import registry
from tests.conftest import wait_for

ROOT = Path(__file__).resolve().parents[2]


def env_of(redis_url: str, prefix: str, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KUMIKO_")}
    env.update(
        PYTHONPATH=str(ROOT),
        KUMIKO_APP="tests.apps.ops_app:registry",
        KUMIKO_REDIS_URL=redis_url,
        KUMIKO_QUEUE_PREFIX=prefix,
        **extra,
    )
    return env


class Ops:
    """Runs ``kumiko`` for the test's dataset; in-process helpers for the same dataset."""

    def __init__(self, redis_url: str, prefix: str, client: redis.Redis) -> None:
        self.redis_url = redis_url
        self.prefix = prefix
        self.client = client
        self.env = env_of(redis_url, prefix)
        os.environ["KUMIKO_REDIS_URL"], os.environ["KUMIKO_QUEUE_PREFIX"] = redis_url, prefix
        self.producer = JobRunner(registry, redis_url=redis_url, queue_prefix=prefix)
        self.workers: list[subprocess.Popen[bytes]] = []

    def kumiko(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "kumiko_dramatiq.ops.cli", *args],
            cwd=ROOT,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )

    def json(self, *args: str) -> Any:
        done = self.kumiko(*args, "--json")
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout)

    def worker(self, **extra: str) -> subprocess.Popen[bytes]:
        proc = subprocess.Popen(
            [sys.executable, "-m", "dramatiq", "kumiko_dramatiq.app", "-p", "1", "-t", "2"],
            cwd=ROOT,
            env={**self.env, **extra},
            start_new_session=True,
            stderr=subprocess.DEVNULL,
        )
        self.workers.append(proc)
        return proc

    def scheduler(self) -> subprocess.Popen[bytes]:
        proc = subprocess.Popen(
            [sys.executable, "-m", "kumiko_dramatiq.scheduler"],
            cwd=ROOT,
            env=self.env,
            start_new_session=True,
            stderr=subprocess.DEVNULL,
        )
        self.workers.append(proc)
        return proc

    def ran(self, job: str) -> list[str]:
        return [_text(m) for m in self.client.lrange(f"kumiko:{self.prefix}:test:ran:{job}", 0, -1)]

    def flag(self, what: str) -> None:
        self.client.set(f"kumiko:{self.prefix}:test:{what}", 1)

    def close(self) -> None:
        self.flag("release")  # blocked handlers end, so the workers' graceful stop is quick
        for proc in self.workers:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in self.workers:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        self.producer.stop()
        del os.environ["KUMIKO_REDIS_URL"], os.environ["KUMIKO_QUEUE_PREFIX"]


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


@pytest.fixture
def ops(redis_url: str, prefix: str, redis_client: redis.Redis) -> Iterator[Ops]:
    helper = Ops(redis_url, prefix, redis_client)
    yield helper
    helper.close()


def lanes(status: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {lane["lane"]: lane for lane in status["lanes"]}


# -- liveness ----------------------------------------------------------------------------------


@pytest.mark.slow
def test_status_lists_live_workers_and_schedulers_and_forgets_a_killed_one(ops: Ops) -> None:
    # Given a worker (heartbeat timeout 1 s) and a scheduler
    worker = ops.worker(KUMIKO_HEARTBEAT_TIMEOUT_MS="1000")
    ops.scheduler()
    wait_for(
        lambda: (
            {p["role"] for p in [*ops.json("status")["workers"], *ops.json("status")["schedulers"]]}
            == {"worker", "scheduler"}
        ),
        timeout_s=30,
        what="both registered",
    )
    (alive,) = ops.json("status")["workers"]
    assert alive["lane"] == "worker"
    assert set(alive) == {"id", "role", "host", "pid", "lane", "version", "started_at", "last_seen"}
    # When the worker is killed, Then status forgets it by itself, within its TTL
    os.killpg(worker.pid, signal.SIGKILL)
    worker.wait()
    wait_for(lambda: ops.json("status")["workers"] == [], timeout_s=10, what="it is forgotten")
    assert len(ops.json("status")["schedulers"]) == 1


def test_status_counts_queued_delayed_and_dead(ops: Ops) -> None:
    ops.producer.dispatch("ops:job:note")
    ops.producer.dispatch("ops:job:note", delay_ms=60_000)
    status = lanes(ops.json("status"))
    assert (status["worker"]["queued"], status["worker"]["delayed"]) == (1, 1)
    assert status["api"]["queued"] == 0
    human = ops.kumiko("status")
    assert human.returncode == 0
    assert all(len(line) <= 100 for line in human.stdout.splitlines())


# -- dead letters: find it, read its traceback, fix, retry ------------------------------------


def test_a_dead_job_shows_its_traceback_and_retries_once_fixed(ops: Ops) -> None:
    ops.worker()
    message_id = ops.producer.dispatch("ops:job:flaky")
    wait_for(lambda: bool(ops.json("dead")["dead_letters"]), timeout_s=30, what="a dead letter")
    (letter,) = ops.json("dead", "--job", "ops:job:flaky")["dead_letters"]
    assert letter["message_id"] == message_id
    assert letter["attempts"] == 2
    assert letter["error_type"] == "RuntimeError"
    assert letter["error_message"] == "export failed on attempt 2: <disk full>"
    assert "RuntimeError" in letter["traceback"]
    # When the cause is fixed and the dead letter retried
    ops.flag("fixed")
    (retried,) = ops.json("retry", message_id)["retried"]
    new_id = retried["new_message_id"]
    # Then it runs again with a fresh attempt budget under a new id of the same origin
    wait_for(lambda: new_id in ops.ran("ops:job:flaky"), timeout_s=30, what="the retry ran")
    runs = ops.json("runs", "--origin", message_id)["runs"]
    wait_for(
        lambda: any(
            r["message_id"] == new_id and r["status"] == "completed"
            for r in ops.json("runs", "--origin", message_id)["runs"]
        ),
        what="the retry completed",
    )
    runs = ops.json("runs", "--origin", message_id)["runs"]
    assert {r["origin_id"] for r in runs} == {message_id}
    assert ops.json("dead")["dead_letters"] == []
    # And retrying it again finds nothing: exit 1, one line
    again = ops.kumiko("retry", message_id)
    assert again.returncode == 1
    assert again.stderr.strip().count("\n") == 0
    assert "not a dead letter" in again.stderr


def test_retry_all_re_enqueues_every_dead_letter_of_a_job(
    ops: Ops, redis_client: redis.Redis
) -> None:
    ops.worker()
    ids = [ops.producer.dispatch("ops:job:flaky") for _ in range(3)]
    wait_for(lambda: len(ops.json("dead")["dead_letters"]) == 3, timeout_s=30, what="3 dead")
    ops.flag("fixed")
    retried = ops.json("retry", "--all", "--job", "ops:job:flaky")["retried"]
    assert sorted(item["message_id"] for item in retried) == sorted(ids)
    assert ops.json("dead")["dead_letters"] == []


# -- cancel --------------------------------------------------------------------------------------


def test_cancel_reaches_queued_and_delayed_messages_and_frees_their_dedup_key(ops: Ops) -> None:
    queued = ops.producer.dispatch("ops:job:note", dedup_key="nightly")
    delayed = ops.producer.dispatch("ops:job:note", delay_ms=60_000)
    assert ops.json("dedup")["dedup_keys"][0]["dedup_key"] == "nightly"
    for message_id in (queued, delayed):
        assert ops.json("cancel", message_id) == {
            "message_id": message_id,
            "cancelled": True,
            "state": "cancelled",
        }
    assert ops.json("dedup")["dedup_keys"] == []
    status = lanes(ops.json("status"))["worker"]
    assert (status["queued"], status["delayed"]) == (0, 0)
    assert {r["status"] for r in ops.json("runs", "--job", "ops:job:note")["runs"]} == {"cancelled"}
    # the key is free: the next dispatch with it runs
    assert ops.producer.dispatch("ops:job:note", dedup_key="nightly") != queued


@pytest.mark.slow
def test_a_cancelled_delayed_message_never_runs_and_is_no_longer_counted(ops: Ops) -> None:
    # Given a worker that runs (its start-up must not eat into the delay below)
    ops.worker()
    first = ops.producer.dispatch("ops:job:note")
    wait_for(lambda: first in ops.ran("ops:job:note"), timeout_s=30, what="the worker to run")
    # and a delayed message waiting on the schedule (no worker holds it)
    delayed = ops.producer.dispatch("ops:job:note", delay_ms=2_500)
    assert ops.producer.status().lanes[0].delayed == 1
    # When it is cancelled (by what `kumiko cancel` runs, here: a new process's start-up, seconds
    # on a loaded machine, would eat into the 2.5 s before the message is due)
    assert ops.producer.cancel(delayed) is True
    # Then the count drops at once, and it never runs, though the worker keeps running other
    # work after its due time
    assert ops.producer.status().lanes[0].delayed == 0
    marker = ops.producer.dispatch("ops:job:note", delay_ms=3_500)
    wait_for(lambda: marker in ops.ran("ops:job:note"), timeout_s=30, what="a later message")
    assert delayed not in ops.ran("ops:job:note")
    (run,) = ops.producer.run_record(delayed)
    assert run.status == "cancelled"


def test_cancelling_a_running_job_changes_nothing(ops: Ops) -> None:
    ops.worker()
    running = ops.producer.dispatch("ops:job:block")
    wait_for(lambda: running in ops.ran("ops:job:block"), timeout_s=30, what="it to start")
    done = ops.kumiko("cancel", running)
    assert done.returncode == 1
    assert "running" in done.stderr
    ops.flag("release")
    wait_for(
        lambda: [r.status for r in ops.producer.run_record(running)] == ["completed"],
        what="it to complete",
    )


def test_a_sequential_waiter_gives_up_its_place_when_cancelled(ops: Ops) -> None:
    ops.worker()
    holder = ops.producer.dispatch("ops:job:seq")
    wait_for(lambda: holder in ops.ran("ops:job:seq"), timeout_s=30, what="the holder")
    waiter = ops.producer.dispatch("ops:job:seq")
    wait_for(
        lambda: (
            any(r["trigger"] == "requeue" for r in ops.json("runs", "--origin", waiter)["runs"])
            or ops.client.hlen(f"dramatiq:{ops.prefix}-worker.DQ.msgs") > 0
        ),
        timeout_s=30,
        what="the waiter to hand off",
    )
    (lock,) = ops.json("locks")["locks"]
    assert (lock["job_name"], lock["message_id"]) == ("ops:job:seq", holder)
    assert lock["worker"]
    assert 0 < lock["expires_in_ms"] <= 30_000
    assert ops.json("cancel", waiter)["cancelled"] is True
    ops.flag("release")
    wait_for(lambda: ops.json("locks")["locks"] == [], what="the lock released")
    assert ops.ran("ops:job:seq") == [holder]


# -- pause -----------------------------------------------------------------------------------------


def test_a_paused_job_holds_its_messages_until_resumed(ops: Ops, redis_client: redis.Redis) -> None:
    assert ops.json("pause", "ops:job:note")["paused"] is True
    ops.worker()
    ids = [ops.producer.dispatch("ops:job:note") for _ in range(3)]
    other = ops.producer.dispatch("ops:job:block")
    ops.flag("release")
    wait_for(lambda: other in ops.ran("ops:job:block"), timeout_s=30, what="other jobs run")
    wait_for(lambda: lanes(ops.json("status"))["worker"]["parked"] == 3, what="3 held back")
    assert ops.ran("ops:job:note") == []
    assert lanes(ops.json("status"))["worker"]["queued"] == 0  # parked, not spinning
    assert [j["paused"] for j in ops.json("jobs")["jobs"] if j["name"] == "ops:job:note"] == [True]
    # When it is resumed, Then every held-back message runs
    assert ops.json("resume", "ops:job:note")["requeued"] == 3
    wait_for(lambda: sorted(ops.ran("ops:job:note")) == sorted(ids), what="all 3 ran")
    assert ops.kumiko("resume", "ops:job:note").returncode == 1  # not paused any more


@pytest.mark.slow
def test_a_paused_cron_job_keeps_its_ticks_and_coalesces_them_on_resume(ops: Ops) -> None:
    ops.json("pause", "ops:job:tick")
    ops.worker()
    ops.scheduler()
    wait_for(
        lambda: lanes(ops.json("status"))["worker"]["parked"] >= 3,
        timeout_s=30,
        what="three ticks held back",
    )
    resumed = ops.json("resume", "ops:job:tick")
    assert resumed["requeued"] == 1
    assert resumed["dropped"] >= 2
    jobs = {j["name"]: j for j in ops.json("jobs")["jobs"]}
    assert jobs["ops:job:tick"]["last_fire"] is not None
    assert jobs["ops:job:tick"]["next_fire"] is not None


# -- bad input ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "status", "says"),
    [
        (["pause", "ops:job:nope"], 2, "unknown job"),
        (["cancel", "not an id!"], 2, "message_id"),
        (["runs", "--since", "yesterday"], 2, "--since must be an ISO-8601 time or a span"),
        (["runs", "--limit", "0"], 2, "must be from 1 to 1000"),
        (["runs", "--status", "exploded"], 2, "invalid choice"),
        (["retry"], 2, "give either MESSAGE_ID or --all"),
        (["cancel", "0f8d5e9a-missing"], 1, "not queued, delayed or running"),
        (["cancel", "0f8d5e9a-ab12-4c3d-9e8f-0123456789ab"], 1, "has no run record"),
        (["dedup", "--job", "ops:job:nope"], 2, "unknown job"),
        (["retry", "--all"], 1, "no dead letter"),
        (["bogus"], 2, "invalid choice"),
    ],
)
def test_bad_input_is_one_line_and_its_status(
    ops: Ops, args: list[str], status: int, says: str
) -> None:
    done = ops.kumiko(*args)
    assert done.returncode == status, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert says in done.stderr


def test_an_unreachable_redis_is_status_1(ops: Ops) -> None:
    ops.env["KUMIKO_REDIS_URL"] = "redis://127.0.0.1:1/0"
    done = ops.kumiko("status", "--json")
    assert done.returncode == 1
    assert len(done.stderr.strip().splitlines()) == 1
    assert done.stdout == ""


def test_listings_cut_only_free_text_to_fit_100_columns(ops: Ops) -> None:
    # Given a dedup key longer than any terminal
    ops.producer.dispatch("ops:job:note", dedup_key="k" * 300)
    # Then every listing fits 100 columns, the key cut ("...") and the full key in --json
    for command in ("status", "runs", "dead", "locks", "dedup"):
        done = ops.kumiko(command)
        assert done.returncode == 0, (command, done.stderr)
        assert all(len(line) <= 100 for line in done.stdout.splitlines()), command
    assert "k" * 20 + "..." in ops.kumiko("dedup").stdout
    assert ops.json("dedup")["dedup_keys"][0]["dedup_key"] == "k" * 300


def test_jobs_never_cuts_names_or_times(ops: Ops) -> None:
    done = ops.kumiko("jobs")
    assert done.returncode == 0, done.stderr
    long = "ops:job:reconcile_every_customer_invoice_against_the_general_ledger"
    (line,) = [line for line in done.stdout.splitlines() if long in line]
    assert "cron 0 3 * * * America/Argentina/Buenos_Aires" in line
    next_fire = {j["name"]: j["next_fire"] for j in ops.json("jobs")["jobs"]}[long]
    in_utc = datetime.fromisoformat(next_fire).astimezone(UTC)
    assert in_utc.strftime("%Y-%m-%d %H:%M:%S") in line  # whole, in UTC
    assert "..." not in done.stdout


def test_ids_are_printed_whole_and_what_is_printed_is_accepted_back(ops: Ops) -> None:
    # Given a run that completed and a keyed message waiting
    ops.worker()
    done_id = ops.producer.dispatch("ops:job:note")
    wait_for(lambda: done_id in ops.ran("ops:job:note"), timeout_s=30, what="it ran")
    ops.producer.pause("ops:job:block")
    keyed = ops.producer.dispatch("ops:job:block", dedup_key="nightly")
    wait_for(lambda: bool(ops.json("runs", "--message", done_id)["runs"]), what="its record")
    # Then the text listings carry the whole ids
    runs = ops.kumiko("runs").stdout
    assert done_id in runs
    assert keyed in ops.kumiko("dedup").stdout
    # and an id copied from them is taken back as it is
    printed = next(word for word in runs.split() if word.startswith(done_id[:8]))
    assert ops.json("runs", "--origin", printed)["runs"][0]["message_id"] == done_id


def test_a_unique_id_prefix_stands_for_its_id_and_an_ambiguous_one_is_bad_input(
    ops: Ops,
) -> None:
    ops.worker()
    done_id = ops.producer.dispatch("ops:job:note")
    wait_for(lambda: bool(ops.json("runs", "--message", done_id)["runs"]), timeout_s=30)
    # a unique prefix finds the message, in runs and in the actions
    (run,) = ops.json("runs", "--message", done_id[:8])["runs"]
    assert run["message_id"] == done_id
    cancel = ops.kumiko("cancel", done_id[:8])
    assert cancel.returncode == 1  # it completed: nothing to cancel
    assert done_id in cancel.stderr
    assert "has ended" in cancel.stderr
    # Given two recent run records whose ids share a prefix
    index = f"kumiko:{ops.prefix}:runs:status:completed"
    twins = ["abcd1234-0000-4000-8000-000000000001", "abcd1234-0000-4000-8000-000000000002"]
    ops.client.zadd(index, {f"{twin}:1": time.time() * 1000 for twin in twins})
    # Then that prefix is bad input naming both, and nothing is done
    for args in (["cancel", "abcd1234"], ["runs", "--origin", "abcd12"]):
        done = ops.kumiko(*args)
        assert done.returncode == 2, done.stderr
        assert len(done.stderr.strip().splitlines()) == 1
        assert all(twin in done.stderr for twin in twins)
        assert "ambiguous" in done.stderr


def test_since_and_before_take_a_span_before_now(ops: Ops) -> None:
    ops.worker()
    done_id = ops.producer.dispatch("ops:job:note")
    wait_for(lambda: bool(ops.json("runs", "--message", done_id)["runs"]), timeout_s=30)
    assert [r["message_id"] for r in ops.json("runs", "--since", "1h")["runs"]] == [done_id]
    assert [r["message_id"] for r in ops.json("runs", "--since", "2d")["runs"]] == [done_id]
    assert ops.json("runs", "--before", "30m")["runs"] == []
    assert ops.json("runs", "--since", "1h30m", "--before", "1h")["runs"] == []


def test_wide_characters_keep_the_columns_aligned(ops: Ops) -> None:
    # Given dedup keys in Japanese and in ASCII
    ids = [ops.producer.dispatch("ops:job:note", dedup_key=k) for k in ("請求書-2024", "inv-2024")]
    header, *lines = ops.kumiko("dedup").stdout.splitlines()
    # Then the message column starts at the same screen column on every line
    starts = {display_width(line[: line.index(i)]) for i in ids for line in lines if i in line}
    assert starts == {header.index("message")}, [header, *lines]


def test_a_closed_pipe_ends_the_command_quietly(ops: Ops) -> None:
    # as `kumiko runs --json | head -1` does once head has its line
    proc = subprocess.Popen(
        [sys.executable, "-m", "kumiko_dramatiq.ops.cli", "jobs", "--json"],
        cwd=ROOT,
        env=ops.env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert proc.stdout is not None
    assert proc.stderr is not None
    proc.stdout.close()
    status = proc.wait(timeout=60)
    stderr = proc.stderr.read().decode()
    proc.stderr.close()
    assert status == 0, stderr
    assert stderr == ""
    # and through a real shell pipeline
    shell = subprocess.run(
        f"{sys.executable} -m kumiko_dramatiq.ops.cli jobs --json | head -1",
        shell=True,
        cwd=ROOT,
        env=ops.env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert shell.stdout == "{\n"
    assert shell.stderr == ""


def test_a_server_that_is_not_redis_is_one_line_and_status_1(
    ops: Ops, not_redis_server: int
) -> None:
    ops.env["KUMIKO_REDIS_URL"] = f"redis://127.0.0.1:{not_redis_server}/0"
    done = ops.kumiko("status")
    assert done.returncode == 1
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert f"127.0.0.1:{not_redis_server}" in done.stderr
    assert "does not speak the Redis protocol" in done.stderr


def test_a_listing_that_stops_at_its_limit_says_more_exist(ops: Ops) -> None:
    ops.worker()
    for _ in range(3):
        ops.producer.dispatch("ops:job:flaky")
    wait_for(lambda: len(ops.json("dead")["dead_letters"]) == 3, timeout_s=60, what="3 dead")
    # dead: two of three, and a note
    done = ops.kumiko("dead", "--limit", "2", "--no-tracebacks")
    assert "2 dead letters shown; more exist" in done.stdout
    assert len(ops.json("dead", "--limit", "2")["dead_letters"]) == 2
    assert "more exist" not in ops.kumiko("dead", "--limit", "3").stdout
    # runs, dedup: the same
    assert "runs shown; more exist" in ops.kumiko("runs", "--limit", "2").stdout
    for key in ("a", "b"):
        ops.producer.dispatch("ops:job:block", dedup_key=key)
    assert "1 keys shown; more exist" in ops.kumiko("dedup", "--limit", "1").stdout


def test_tracebacks_show_in_the_text_output(ops: Ops) -> None:
    ops.worker()
    message_id = ops.producer.dispatch("ops:job:flaky")
    wait_for(lambda: bool(ops.json("dead")["dead_letters"]), timeout_s=30, what="a dead letter")
    dead = ops.kumiko("dead").stdout
    assert f"--- {message_id} ops:job:flaky" in dead
    assert "    Traceback" in dead or '    File "' in dead
    assert "RuntimeError: export failed on attempt 2: <disk full>" in dead
    runs = ops.kumiko("runs", "--message", message_id).stdout
    assert "RuntimeError: export failed on attempt 1" in runs
    assert "RuntimeError: export failed on attempt 2" in runs
    assert "--- " not in ops.kumiko("runs").stdout  # a plain listing: the table alone


def test_kumiko_runs_pages_with_a_cursor_over_shared_start_times(ops: Ops) -> None:
    # Given 40 records, 8 to each start instant
    runner = ops.producer
    start_ms = int(time.time() * 1000) - 60_000
    for n in range(40):
        message_id = f"0000{n:04d}-0000-4000-8000-000000000000"
        at = start_ms + n // 8
        fields: dict[str, Any] = {"j": "ops:job:note", "m": message_id, "o": message_id}
        fields.update(tr="manual", a=1, ma=1, st=at, en=at)
        when = datetime.fromtimestamp(at / 1000, UTC)
        runner.history.put(
            record_write(fields, "completed", runner.settings), when, runner.settings
        )

    # When `kumiko runs` is walked 7 at a time, each page after the last run_id of the one before
    seen: list[str] = []
    cursor: list[str] = []
    for _ in range(10):
        page = ops.json("runs", "--limit", "7", *cursor)["runs"]
        seen += [r["run_id"] for r in page]
        if len(page) < 7:
            break
        cursor = ["--cursor", page[-1]["run_id"]]

    # Then each record came once, in the API's order
    assert len(seen) == len(set(seen)) == 40
    assert seen == [r.run_id for r in runner.runs(limit=100)]
    # and a malformed cursor is bad input, an unknown one finds nothing
    assert ops.kumiko("runs", "--cursor", "no-attempt").returncode == 2
    unknown = ops.kumiko("runs", "--cursor", "0fffffff-0000-4000-8000-000000000000:1")
    assert unknown.returncode == 1
    assert "no run record" in unknown.stderr
