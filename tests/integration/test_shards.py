"""``JobRunner(..., shards=N)``: one dataset spread over N shards (here on one Redis: each
shard is a dataset of its own prefix, as it is a slot of its own on a cluster; the cluster
case is in ``test_cluster.py``). Each message lives in the shard its guarantees need, the
workers consume every shard, and the admin reads and actions see the whole dataset.
"""

from __future__ import annotations

import threading
from collections import Counter
from typing import Any

import pytest
import redis

from kumiko_dramatiq import (
    Cron,
    Feature,
    JobConfigError,
    JobContext,
    JobRunner,
    NotFoundError,
    PayloadError,
    Registry,
)
from kumiko_dramatiq.broker import keys
from kumiko_dramatiq.ops import cli
from kumiko_dramatiq.shards.routing import pinned_shard, shard_of_id, shard_prefix
from tests.conftest import RunnerFactory

SHARDS = 3


class Seen:
    """Runs by job, the most that ran at once per job, and what each run saw."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.runs: Counter[str] = Counter()
        self.ids: Counter[str] = Counter()
        self.now: Counter[str] = Counter()
        self.most: Counter[str] = Counter()
        self.gate = threading.Event()
        self.gate.set()

    def work(self, name: str) -> Any:
        def handler(payload: dict[str, Any], ctx: JobContext) -> dict[str, Any]:
            with self.lock:
                self.runs[name] += 1
                self.ids[ctx.message_id] += 1
                self.now[name] += 1
                self.most[name] = max(self.most[name], self.now[name])
            try:
                self.gate.wait(30)
                return {"ran": name, **payload}
            finally:
                with self.lock:
                    self.now[name] -= 1

        return handler


def registry_of(seen: Seen) -> Registry:
    feature = Feature("sh")
    feature.job("plain", keep_result_s=600)(seen.work("plain"))
    feature.job("capped", max_running=1)(seen.work("capped"))
    feature.job("seq", concurrency="sequential")(seen.work("seq"))
    feature.job("tick", trigger=Cron("0 0 1 1 *"))(seen.work("tick"))
    feature.job("boot", run_on_boot=True)(seen.work("boot"))
    feature.job("done")(seen.work("done"))

    def boom(payload: dict[str, Any], ctx: JobContext) -> None:
        raise RuntimeError(f"boom {payload['i']}")

    feature.job("boom")(boom)
    return Registry([feature])


def queued_per_shard(runner: JobRunner) -> list[int]:
    return [sum(lane.queued for lane in status.lanes) for status in runner.status().shards]


def test_each_message_lives_in_the_shard_its_guarantees_need(
    make_runner: RunnerFactory,
) -> None:
    # Given a dataset of 3 shards
    runner = make_runner(registry_of(Seen()), shards=SHARDS)
    registry = runner.registry
    # When spread, pinned and keyed messages are dispatched (no worker runs)
    spread = [runner.dispatch("sh:job:plain", {"i": i}) for i in range(30)]
    spread += runner.dispatch_many("sh:job:plain", [{"i": i} for i in range(30)])
    # Then a spread message's id names its shard, and they spread evenly over all shards
    for message_id in spread:
        holder = runner.shard_runners[shard_of_id(message_id, SHARDS)]
        assert holder.job_state(message_id) == "queued"
    assert queued_per_shard(runner) == [20, 20, 20]
    # And every message of a capped or sequential job lives in its job's shard
    for name in ("sh:job:capped", "sh:job:seq"):
        before = queued_per_shard(runner)
        for _ in range(6):
            runner.dispatch(name, {})
        home = pinned_shard(registry.jobs[name], SHARDS)
        assert home is not None
        after = queued_per_shard(runner)
        assert [b - a for a, b in zip(before, after, strict=True)] == [
            6 if i == home else 0 for i in range(SHARDS)
        ]
    # And a dedup key stands for its message whichever shard it lives in
    first = runner.dispatch("sh:job:plain", {}, dedup_key="invoice-7")
    assert runner.dispatch("sh:job:plain", {}, dedup_key="invoice-7") == first
    assert runner.dispatch_many("sh:job:plain", [{}], dedup_keys=["invoice-7"]) == [first]
    # And the whole dataset's counts add the shards up
    assert runner.job_counts()["sh:job:plain"]["queued"] == 61
    assert sum(lane.queued for lane in runner.status().lanes) == 73


def test_workers_consume_every_shard_and_the_caps_hold_across_them(
    make_runner: RunnerFactory,
) -> None:
    # Given a dataset of 3 shards with a capped and a sequential job
    seen = Seen()
    runner = make_runner(registry_of(seen), shards=SHARDS, worker_threads=4)
    spread = runner.dispatch_many("sh:job:plain", [{"i": i} for i in range(45)])
    for _ in range(8):
        runner.dispatch("sh:job:capped", {})
        runner.dispatch("sh:job:seq", {})
    # When its worker starts and the dataset drains
    runner.start()
    runner.drain(timeout_s=60)
    # Then every message ran once, on every shard, the boot job once
    assert seen.runs == Counter({"plain": 45, "capped": 8, "seq": 8, "boot": 1})
    assert all(count == 1 for count in seen.ids.values())
    # And the capped and the sequential job never ran twice at once
    assert seen.most["capped"] == 1
    assert seen.most["seq"] == 1
    # And the admin reads see the whole dataset
    assert {runner.job_state(message_id) for message_id in spread} == {"completed"}
    assert len(runner.runs(job="sh:job:plain", limit=1000)) == 45
    assert (
        runner.runs(limit=5)
        == sorted(runner.runs(limit=1000), key=lambda run: run.order_key, reverse=True)[:5]
    )
    completed = {row.job_name: row.completed for row in runner.stats()}
    assert completed["sh:job:plain"] == 45
    assert runner.result(spread[-1], timeout_s=5) == {"ran": "plain", "i": 44}
    # And one worker process is listed once, live on every shard
    status = runner.status()
    assert len(status.workers) == 1
    assert [len(shard.workers) for shard in status.shards] == [1, 1, 1]


def test_single_message_actions_find_the_message_on_its_shard(
    make_runner: RunnerFactory,
) -> None:
    # Given delayed messages spread over 3 shards (no worker runs)
    runner = make_runner(registry_of(Seen()), shards=SHARDS)
    ids = [runner.dispatch("sh:job:plain", {"i": i}, delay_ms=600_000) for i in range(6)]
    assert {shard_of_id(message_id, SHARDS) for message_id in ids} == {0, 1, 2}
    # When each is acted on through the one runner
    assert runner.run_now(ids[0]) is True
    assert runner.job_state(ids[0]) == "queued"
    assert runner.cancel(ids[1]) is True
    assert runner.job_state(ids[1]) == "cancelled"
    assert runner.stop_run(ids[2]) is False
    # Then the others still wait, and an unknown id is unknown everywhere
    assert {runner.job_state(message_id) for message_id in ids[2:]} == {"delayed"}
    with pytest.raises(NotFoundError):
        runner.cancel("00000000-0000-4000-8000-000000000000")
    assert runner.job_state("00000000-0000-4000-8000-000000000000") == "unknown"
    # And the waiting messages are listed from every shard, each once over the pages
    pages: list[str] = []
    after = None
    while page := runner.queued(limit=2, after=after):
        pages += [message.message_id for message in page]
        after = page[-1]
    assert sorted(pages) == sorted([ids[0], *ids[2:]])
    # And a purge removes them on every shard
    assert runner.purge("sh:job:plain", state="delayed") == 4
    assert runner.job_counts()["sh:job:plain"]["delayed"] == 0


def test_pause_and_resume_hold_every_shard(make_runner: RunnerFactory) -> None:
    # Given a paused spread job on a running dataset of 3 shards
    seen = Seen()
    runner = make_runner(registry_of(seen), shards=SHARDS)
    runner.pause("sh:job:plain")
    runner.start()
    runner.dispatch_many("sh:job:plain", [{} for _ in range(9)])
    # Then its messages are parked on every shard and none runs
    assert runner.job_counts()["sh:job:plain"]["parked"] == 9
    assert runner.status().paused == ["sh:job:plain"]
    # When it is resumed, every shard runs its part
    runner.resume("sh:job:plain")
    runner.drain(timeout_s=60)
    assert seen.runs["plain"] == 9


def test_a_batch_lives_with_its_children_in_one_shard(make_runner: RunnerFactory) -> None:
    # Given a dataset of 3 shards
    seen = Seen()
    runner = make_runner(registry_of(seen), shards=SHARDS)
    runner.start()
    # When a batch of spread jobs with a callback is dispatched
    batch_id = runner.dispatch_batch(
        [("sh:job:plain", {"i": i}) for i in range(5)], on_complete=("sh:job:done", {})
    )
    runner.drain(timeout_s=60)
    # Then it ran whole in one shard, and is found through the one runner
    assert runner.batch(batch_id).state == "succeeded"
    assert seen.runs["plain"] == 5
    assert seen.runs["done"] == 1
    holder = runner.shard_runners[shard_of_id(batch_id, SHARDS)]
    assert holder.batch(batch_id).total == 5
    assert [batch.id for batch in runner.batches()] == [batch_id]
    # And a batch whose pinned jobs live in different shards is refused, nothing written
    registry = runner.registry
    homes = {pinned_shard(registry.jobs[name], SHARDS) for name in ("sh:job:capped", "sh:job:tick")}
    assert len(homes) == 2  # (the names' CRCs: shards 2 and 0)
    counts = runner.job_counts()
    with pytest.raises(PayloadError, match="different shards"):
        runner.dispatch_batch([("sh:job:capped", {}), ("sh:job:tick", {})])
    assert runner.job_counts() == counts
    # And a batch of one pinned job lives in that job's shard
    pinned = runner.dispatch_batch([("sh:job:capped", {}), ("sh:job:plain", {})])
    assert runner.shard_runners[2].batch(pinned).total == 2


def test_every_process_of_a_dataset_uses_the_same_number_of_shards(
    make_runner: RunnerFactory,
) -> None:
    # Given a running worker of a dataset of 3 shards
    make_runner(registry_of(Seen()), shards=SHARDS).start()
    # When a process with 2 shards starts on it
    other = make_runner(registry_of(Seen()), shards=2)
    # Then it is refused, naming the setting and the live process
    with pytest.raises(JobConfigError, match=r"shards.*must be 3 like the live worker"):
        other.start()


def test_the_cron_and_boot_jobs_run_on_their_own_shard_only(
    make_runner: RunnerFactory, redis_client: redis.Redis, prefix: str
) -> None:
    # Given a dataset of 3 shards
    seen = Seen()
    runner = make_runner(registry_of(seen), shards=SHARDS)
    registry = runner.registry
    # When its worker starts
    runner.start()
    runner.drain(timeout_s=60)
    # Then the boot job ran once, its marker is in its own shard only
    boot_home = pinned_shard(registry.jobs["sh:job:boot"], SHARDS)
    assert seen.runs["boot"] == 1
    for shard in range(SHARDS):
        marker = keys.boot_marker(shard_prefix(prefix, shard), "sh:job:boot")
        assert redis_client.exists(marker) == (1 if shard == boot_home else 0)
    # And a status names the cron job's missing scheduler once, on the cron job's shard
    problems = [p for p in runner.status().problems if "no scheduler is alive" in p]
    assert len(problems) == 1


def test_kumiko_status_shows_each_shard(
    make_runner: RunnerFactory, capsys: pytest.CaptureFixture[str]
) -> None:
    # Given a dataset of 3 shards with messages on each
    runner = make_runner(registry_of(Seen()), shards=SHARDS)
    runner.dispatch_many("sh:job:plain", [{} for _ in range(6)])
    # When `kumiko status` runs
    document, text, code = cli._status(runner, cli.build_parser().parse_args(["status"]))
    # Then it shows a row per shard, and the JSON each shard's status
    assert code == 0
    assert "shards:" in text
    for shard in range(SHARDS):
        assert shard_prefix(runner.queue_prefix, shard) in text
    assert [sum(lane["queued"] for lane in s["lanes"]) for s in document["shards"]] == [2, 2, 2]


def test_a_schedule_lives_in_the_shard_of_its_ticks_job(
    make_runner: RunnerFactory, redis_client: redis.Redis, prefix: str
) -> None:
    # Given a dataset of 3 shards
    runner = make_runner(registry_of(Seen()), shards=SHARDS)
    schedules = runner.schedules
    # When runtime schedules of a capped and of a spread job are created
    schedules.upsert("nightly-capped", "sh:job:capped", every_ms=60_000)
    for n in range(6):
        schedules.upsert(f"spread-{n}", "sh:job:plain", every_ms=60_000)
    # Then the capped job's lives in that job's shard, and the others spread
    capped_home = pinned_shard(runner.registry.jobs["sh:job:capped"], SHARDS)
    assert capped_home is not None
    holders = {
        name: [
            n
            for n in range(SHARDS)
            if redis_client.hexists(keys.schedules(shard_prefix(prefix, n)), name)
        ]
        for name in ("nightly-capped", *(f"spread-{n}" for n in range(6)))
    }
    assert holders["nightly-capped"] == [capped_home]
    assert all(len(found) == 1 for found in holders.values())
    assert len({found[0] for found in holders.values()}) > 1
    # And the listing has each schedule once, the code-declared cron job's too
    listed = [schedule.id for schedule in schedules.list()]
    assert sorted(listed) == sorted([*holders, "sh:job:tick"])
    # And each is read, paused, triggered and removed through the one runner
    assert schedules.pause("spread-3") is True
    assert schedules.get("spread-3").paused is True
    assert schedules.pause("sh:job:tick") is True
    assert schedules.get("sh:job:tick").paused is True
    message_id = schedules.trigger("nightly-capped")
    assert runner.shard_runners[capped_home].job_state(message_id) == "queued"
    assert schedules.remove("spread-3") is True
    assert schedules.remove("spread-3") is False
    with pytest.raises(NotFoundError):
        schedules.get("spread-3")


def test_the_admin_api_pages_over_every_shard(make_runner: RunnerFactory) -> None:
    # Given dead letters and live dedup keys on every shard of a dataset of 3
    runner = make_runner(registry_of(Seen()), shards=SHARDS)
    dead = runner.dispatch_many("sh:job:boom", [{"i": i} for i in range(9)])
    runner.start()
    runner.drain(timeout_s=60)
    keyed = [
        runner.dispatch("sh:job:plain", {}, dedup_key=f"k{i}", delay_ms=600_000) for i in range(9)
    ]
    assert {shard_of_id(message_id, SHARDS) for message_id in dead} == {0, 1, 2}
    admin = runner.admin
    # When the dead letters are read a page of 2 at a time
    letters: list[str] = []
    cursor = None
    while True:
        page, cursor = admin.dead_letter_page(limit=2, after=cursor)
        letters += [letter.message_id for letter in page]
        assert all(letter.error_type == "RuntimeError" for letter in page)
        if cursor is None:
            break
    # Then every one comes once, newest first over the shards
    assert sorted(letters) == sorted(dead)
    # And the dedup keys walk every shard, each key once
    found: list[str] = []
    after = None
    while True:
        records, after = admin.dedup_page("sh:job:plain", after=after, limit=2)
        found += [record.message_id for record in records]
        if after is None:
            break
    assert sorted(found) == sorted(keyed)
    # And one message's reads find it on its shard, id prefixes on every shard
    assert admin.waiting_state(keyed[0]) == "delayed"
    assert admin.known(dead[0])
    assert set(admin.ids_starting_with(dead[4][:6])) >= {dead[4]}
    assert runner.history.dead_note(dead[5]) is not None
    assert runner.history.find(f"{dead[5]}:1") is not None
    # And a pause through the admin API holds the job on every shard
    assert admin.pause(runner.job("sh:job:plain")) is True
    assert runner.status().paused == ["sh:job:plain"]
    assert all(shard.status().paused == ["sh:job:plain"] for shard in runner.shard_runners)
    assert admin.resume(runner.job("sh:job:plain")) is not None
    # And retrying every dead letter retries them on their shards
    assert len(admin.retry_all_dead("sh:job:boom")) == 9


def test_an_empty_dispatch_many_enqueues_nothing(make_runner: RunnerFactory) -> None:
    runner = make_runner(registry_of(Seen()), shards=SHARDS)
    assert runner.dispatch_many("sh:job:plain", [], dedup_keys=[]) == []
    assert runner.dispatch_many("sh:job:plain", []) == []
    assert runner.job_counts()["sh:job:plain"]["queued"] == 0
