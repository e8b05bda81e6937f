"""Batches and chains: ``dispatch_batch``, ``dispatch_chain``, callbacks, ``ctx.batch``,
``cancel_batch``, ``runner.batch``, on a real Redis with real workers.

Waits synchronise on ``drain`` (a callback is enqueued in the same Lua call that counts the
last child's end, so a drained lane has run it) or on ``result(timeout_s=...)``; no sleeps.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
import redis

from kumiko_dramatiq import (
    BatchResult,
    Feature,
    JobConfigError,
    JobContext,
    JobFailedError,
    JobRunner,
    NotFoundError,
    PayloadError,
    Registry,
)
from kumiko_dramatiq.broker import keys
from kumiko_dramatiq.ops import cli
from kumiko_dramatiq.ops.exposition import DatasetCollector
from tests.conftest import RunnerFactory


class Seen:
    """What the callbacks and steps saw, thread-safe."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.calls: list[tuple[str, Any]] = []

    def add(self, kind: str, value: Any) -> None:
        with self.lock:
            self.calls.append((kind, value))

    def of(self, kind: str) -> list[Any]:
        with self.lock:
            return [value for each, value in self.calls if each == kind]


def registry_of(seen: Seen, gate: threading.Event | None = None) -> Registry:
    billing = Feature("billing")

    @billing.job("render")
    def render(payload: dict[str, Any], ctx: JobContext) -> Any:
        if gate is not None:
            gate.wait(30)
        return {"invoice": payload["invoice"]}

    @billing.job("broken")
    def broken(payload: dict[str, Any], ctx: JobContext) -> None:
        raise ValueError(f"cannot render {payload['invoice']}")

    @billing.job("grow")
    def grow(payload: dict[str, Any], ctx: JobContext) -> int:
        assert ctx.batch is not None
        for n in range(payload["more"]):
            ctx.batch.add("billing:job:render", {"invoice": f"ADDED-{n}"})
        return int(payload["more"])

    @billing.job("mail_all")
    def mail_all(payload: dict[str, Any], ctx: JobContext) -> None:
        assert ctx.batch is not None
        seen.add("success", (payload, ctx.batch.id, ctx.batch.results()))

    @billing.job("report")
    def report(payload: dict[str, Any], ctx: JobContext) -> None:
        assert ctx.batch is not None
        seen.add("complete", (payload, ctx.batch.id, ctx.batch.results()))

    etl = Feature("etl")

    @etl.job("extract")
    def extract(payload: dict[str, Any], ctx: JobContext) -> Any:
        seen.add("extract", ctx.previous_result)
        return {"rows": 3, "day": payload["day"]}

    @etl.job("load")
    def load(payload: dict[str, Any], ctx: JobContext) -> Any:
        seen.add("load", ctx.previous_result)
        return payload["part"] * 10

    @etl.job("fail")
    def fail(payload: dict[str, Any], ctx: JobContext) -> None:
        raise RuntimeError("step failed")

    @etl.job("publish")
    def publish(payload: dict[str, Any], ctx: JobContext) -> Any:
        seen.add("publish", ctx.previous_result)
        return {"published": ctx.previous_result}

    return Registry([billing, etl])


def renders(*invoices: str) -> list[tuple[str, dict[str, Any]]]:
    return [("billing:job:render", {"invoice": each}) for each in invoices]


def test_every_child_completed_runs_both_callbacks_once_with_the_results_in_order(
    make_runner: RunnerFactory,
) -> None:
    seen = Seen()
    runner = make_runner(registry_of(seen))
    runner.start()

    batch_id = runner.dispatch_batch(
        renders("INV-1", "INV-2", "INV-3"),
        on_success=("billing:job:mail_all", {"month": "2026-11"}),
        on_complete=("billing:job:report", {"month": "2026-11"}),
    )
    runner.drain(timeout_s=30)

    [(payload, got_id, results)] = seen.of("success")
    assert payload == {"month": "2026-11"}
    assert got_id == batch_id
    assert [r.value for r in results] == [{"invoice": f"INV-{n}"} for n in (1, 2, 3)]
    assert all(isinstance(r, BatchResult) and r.status == "completed" for r in results)
    assert [r.job_name for r in results] == ["billing:job:render"] * 3
    [(payload, got_id, again)] = seen.of("complete")
    assert again == results
    status = runner.batch(batch_id)
    assert (status.kind, status.state) == ("batch", "succeeded")
    assert (status.total, status.pending, status.completed, status.dead) == (3, 0, 3, 0)
    assert status.ended_at is not None
    assert status.ended_at >= status.created_at
    # and kumiko_batches_total{outcome} counts it
    reading = DatasetCollector(runner.broker, runner.registry).read()
    assert reading.batches == {"succeeded": 1}


def test_a_dead_child_runs_on_complete_only_and_the_batch_failed(
    make_runner: RunnerFactory,
) -> None:
    seen = Seen()
    runner = make_runner(registry_of(seen))
    runner.start()

    batch_id = runner.dispatch_batch(
        [*renders("INV-1"), ("billing:job:broken", {"invoice": "INV-2"})],
        on_success=("billing:job:mail_all", {}),
        on_complete=("billing:job:report", {}),
    )
    runner.drain(timeout_s=30)

    assert seen.of("success") == []
    [(_, _, results)] = seen.of("complete")
    assert [r.status for r in results] == ["completed", "dead"]
    assert results[1].error_type == "ValueError"
    assert results[1].error_message == "cannot render INV-2"
    assert results[1].value is None
    status = runner.batch(batch_id)
    assert (status.state, status.completed, status.dead) == ("failed", 1, 1)


def test_a_bad_item_is_refused_naming_its_index_and_nothing_is_enqueued(
    make_runner: RunnerFactory, redis_client: redis.Redis, prefix: str
) -> None:
    runner = make_runner(registry_of(Seen()))

    with pytest.raises(PayloadError, match=r"items\[1\]\[1\]"):
        runner.dispatch_batch([*renders("INV-1"), ("billing:job:render", ["not", "a", "dict"])])  # type: ignore[list-item]
    with pytest.raises(PayloadError, match=r"items\[0\]\[0\] names no declared job"):
        runner.dispatch_batch([("billing:job:nope", {})])
    with pytest.raises(PayloadError, match="on_success"):
        runner.dispatch_batch(renders("INV-1"), on_success=("billing:job:render", 3))  # type: ignore[arg-type]
    with pytest.raises(PayloadError, match="non-empty"):
        runner.dispatch_batch([])

    assert runner.job_counts()["billing:job:render"]["queued"] == 0
    assert list(redis_client.scan_iter(f"{keys.root(prefix)}batch*")) == []


def test_a_batch_whose_writer_stopped_before_it_opened_never_runs(
    make_runner: RunnerFactory, redis_client: redis.Redis, prefix: str
) -> None:
    # Given a batch written but never opened (the producer died between the two steps)
    seen = Seen()
    runner = make_runner(registry_of(seen))
    batches = runner.runtime.batches
    children = batches._children("abandoned", renders("INV-1", "INV-2"), "items")
    batches._write("abandoned", children, {"kind": "batch"})

    # Then none of its children is on a queue, and its records expire
    runner.start()
    runner.drain(timeout_s=30)
    assert runner.job_counts()["billing:job:render"]["queued"] == 0
    assert runner.runs("billing:job:render") == []
    key = keys.batch(prefix, "abandoned")
    assert 0 < redis_client.pttl(key) <= 3_600_000
    assert 0 < redis_client.pttl(f"{key}:staged") <= 3_600_000
    with pytest.raises(NotFoundError):
        runner.batch("abandoned")


def test_a_batch_opened_then_left_is_moved_on_by_its_children_s_ends(
    make_runner: RunnerFactory,
) -> None:
    # Given a batch of 1,200 children opened with only its first 500 moved onto the queue
    seen = Seen()
    runner = make_runner(registry_of(seen), worker_threads=8)
    batches = runner.runtime.batches
    children = batches._children("left", renders(*(f"INV-{n}" for n in range(1200))), "items")
    batches._write(
        "left",
        children,
        {
            "kind": "batch",
            "on_complete": batches._entry(
                batches._callback("left", ("billing:job:report", {}), "on_complete")
            ),
        },
    )
    runner.broker.lua.batch_commit(
        keys=[keys.batch(runner.queue_prefix, "left")],
        args=[keys.root(runner.queue_prefix), "left", 0, 500],
    )
    assert runner.job_counts()["billing:job:render"]["queued"] == 500

    # When the workers run what is queued
    runner.start()
    for _ in range(10):
        runner.drain(timeout_s=60)
        if seen.of("complete"):
            break

    # Then every child ran and the callback once
    [(_, _, results)] = seen.of("complete")
    assert len(results) == 1200
    assert {r.status for r in results} == {"completed"}
    assert runner.batch("left").state == "succeeded"


def test_a_child_adds_children_and_the_batch_waits_for_them(make_runner: RunnerFactory) -> None:
    seen = Seen()
    runner = make_runner(registry_of(seen))
    runner.start()

    batch_id = runner.dispatch_batch(
        [("billing:job:grow", {"more": 2}), *renders("INV-1")],
        on_success=("billing:job:mail_all", {}),
    )
    runner.drain(timeout_s=30)

    [(_, _, results)] = seen.of("success")
    assert [r.job_name for r in results] == ["billing:job:grow", *["billing:job:render"] * 3]
    # in dispatch order: the children given, then those added, as they were added
    assert [r.value for r in results] == [
        2,
        {"invoice": "INV-1"},
        {"invoice": "ADDED-0"},
        {"invoice": "ADDED-1"},
    ]
    assert runner.batch(batch_id).total == 4


def test_cancel_batch_stops_what_has_not_started_and_runs_on_complete_only(
    make_runner: RunnerFactory,
) -> None:
    # Given a batch queued while no worker runs
    seen = Seen()
    runner = make_runner(registry_of(seen))
    batch_id = runner.dispatch_batch(
        renders("INV-1", "INV-2"),
        on_success=("billing:job:mail_all", {}),
        on_complete=("billing:job:report", {}),
    )

    # When it is cancelled
    assert runner.cancel_batch(batch_id) == 2
    runner.start()
    runner.drain(timeout_s=30)

    # Then no child ran, on_complete ran once, on_success never
    assert runner.runs("billing:job:render", status="completed") == []
    assert seen.of("success") == []
    [(_, _, results)] = seen.of("complete")
    assert [r.status for r in results] == ["cancelled", "cancelled"]
    status = runner.batch(batch_id)
    assert (status.state, status.cancelled, status.pending) == ("cancelled", 2, 0)
    with pytest.raises(NotFoundError):
        runner.cancel_batch("no-such-batch")


def test_a_purged_child_counts_as_cancelled(make_runner: RunnerFactory) -> None:
    seen = Seen()
    runner = make_runner(registry_of(seen))
    batch_id = runner.dispatch_batch(renders("INV-1"), on_complete=("billing:job:report", {}))

    runner.purge("billing:job:render")
    runner.start()
    runner.drain(timeout_s=30)

    [(_, _, results)] = seen.of("complete")
    assert [r.status for r in results] == ["cancelled"]
    status = runner.batch(batch_id)
    assert (status.state, status.cancelled) == ("failed", 1)


def test_a_chain_runs_its_steps_in_order_with_the_previous_result(
    make_runner: RunnerFactory,
) -> None:
    seen = Seen()
    runner = make_runner(registry_of(seen))
    runner.start()

    chain_id = runner.dispatch_chain(
        [
            ("etl:job:extract", {"day": "2026-12-05"}),
            [("etl:job:load", {"part": 1}), ("etl:job:load", {"part": 2})],
            ("etl:job:publish", {}),
        ]
    )

    assert runner.result(chain_id, timeout_s=30) == {"published": [10, 20]}
    assert seen.of("extract") == [None]
    assert seen.of("load") == [{"rows": 3, "day": "2026-12-05"}] * 2
    assert seen.of("publish") == [[10, 20]]
    status = runner.batch(chain_id)
    assert (status.kind, status.state, status.total, status.completed) == (
        "chain",
        "succeeded",
        4,
        4,
    )


def test_a_failing_step_stops_the_chain(make_runner: RunnerFactory) -> None:
    seen = Seen()
    runner = make_runner(registry_of(seen))
    runner.start()

    chain_id = runner.dispatch_chain(
        [("etl:job:extract", {"day": "d"}), ("etl:job:fail", {}), ("etl:job:publish", {})]
    )

    with pytest.raises(JobFailedError):
        runner.result(chain_id, timeout_s=30)
    runner.drain(timeout_s=30)
    assert seen.of("publish") == []
    status = runner.batch(chain_id)
    assert (status.state, status.completed, status.dead, status.cancelled) == ("failed", 1, 1, 1)


def test_the_cli_shows_lists_and_cancels_batches(
    make_runner: RunnerFactory,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    redis_url: str,
    prefix: str,
) -> None:
    runner: JobRunner = make_runner(registry_of(Seen()))
    runner.start()
    batch_id = runner.dispatch_batch(renders("INV-1"))
    runner.drain(timeout_s=30)
    monkeypatch.setenv("KUMIKO_APP", "tests.integration.test_batches:APP")
    monkeypatch.setenv("KUMIKO_REDIS_URL", redis_url)
    monkeypatch.setenv("KUMIKO_QUEUE_PREFIX", prefix)

    assert cli.main(["batch", batch_id]) == 0
    shown = capsys.readouterr().out
    assert batch_id in shown
    assert "succeeded" in shown
    assert "[####################] 1/1" in shown
    assert cli.main(["batches", "--state", "succeeded", "--json"]) == 0
    assert batch_id in capsys.readouterr().out
    assert cli.main(["cancel-batch", batch_id]) == 0
    assert "0 children will never start" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exited:
        cli.main(["batch", "no-such-batch"])
    assert exited.value.code == 1
    assert "no such batch" in capsys.readouterr().err


APP = registry_of(Seen())


def tenant_registry(seen: Seen) -> Registry:
    nightly = Feature("nightly")

    @nightly.job("export", per_tenant=True)
    def export(payload: dict[str, Any], ctx: JobContext) -> Any:
        return {"tenant": ctx.tenant_id, "day": payload["day"]}

    @nightly.job("export_then_mail", per_tenant=True, on_complete="nightly:job:summary",
                 on_success="nightly:job:mail")  # fmt: skip
    def export_then_mail(payload: dict[str, Any], ctx: JobContext) -> Any:
        return ctx.tenant_id

    @nightly.job("summary")
    def summary(payload: dict[str, Any], ctx: JobContext) -> None:
        assert ctx.batch is not None
        seen.add("summary", (payload, ctx.batch.id, ctx.batch.results()))

    @nightly.job("mail")
    def mail(payload: dict[str, Any], ctx: JobContext) -> None:
        seen.add("mail", payload)

    return Registry([nightly])


def test_a_per_tenant_child_ends_when_every_tenant_child_ended(
    make_runner: RunnerFactory,
) -> None:
    seen = Seen()
    runner = make_runner(tenant_registry(seen), get_active_tenant_ids=lambda: ["acme", "globex"])
    runner.start()

    batch_id = runner.dispatch_batch(
        [("nightly:job:export", {"day": "2026-12-06"})],
        on_complete=("nightly:job:summary", {"all": True}),
    )
    runner.drain(timeout_s=30)

    [(payload, got_id, results)] = seen.of("summary")
    assert (payload, got_id) == ({"all": True}, batch_id)
    assert sorted((r.tenant_id, r.value["tenant"]) for r in results) == [
        ("acme", "acme"),
        ("globex", "globex"),
    ]
    status = runner.batch(batch_id)
    assert status.state == "succeeded"
    # the wrapper counts as a child too, with one per tenant
    assert (status.total, status.completed) == (3, 3)


def test_a_per_tenant_job_with_on_complete_makes_each_dispatch_a_batch(
    make_runner: RunnerFactory,
) -> None:
    seen = Seen()
    runner = make_runner(tenant_registry(seen), get_active_tenant_ids=lambda: ["acme", "globex"])
    runner.start()

    wrapper_id = runner.dispatch("nightly:job:export_then_mail", {"day": "2026-12-06"})
    runner.drain(timeout_s=30)

    [(payload, got_id, results)] = seen.of("summary")
    assert (payload, got_id) == ({"day": "2026-12-06"}, wrapper_id)
    assert sorted(r.value for r in results) == ["acme", "globex"]
    assert seen.of("mail") == [{"day": "2026-12-06"}]
    assert runner.batch(wrapper_id).state == "succeeded"


def test_callbacks_must_name_declared_jobs_of_a_per_tenant_job() -> None:
    feature = Feature("f")
    with pytest.raises(JobConfigError, match="on_complete needs per_tenant=True"):
        feature.job("plain", on_complete="f:job:plain")

    other = Feature("g")

    @other.job("fan", per_tenant=True, on_success="g:job:nope")
    def fan(payload: dict[str, Any], ctx: JobContext) -> None: ...

    with pytest.raises(JobConfigError, match="on_success names no declared job"):
        Registry([other])


def test_the_dashboard_lists_batches_with_their_progress_and_children(
    make_runner: RunnerFactory,
) -> None:
    pytest.importorskip("starlette")
    from starlette.testclient import TestClient

    from kumiko_dramatiq.dashboard.app import create_app

    runner = make_runner(registry_of(Seen()))
    runner.start()
    batch_id = runner.dispatch_batch(
        [*renders("INV-1"), ("billing:job:broken", {"invoice": "INV-2"})]
    )
    runner.drain(timeout_s=30)
    [dead] = [r for r in runner.runtime.batches.results(batch_id) if r.status == "dead"]
    client = TestClient(create_app(runner))

    listed = client.get("/batches")
    assert listed.status_code == 200
    assert batch_id[:8] in listed.text
    assert 'aria-valuenow="2"' in listed.text
    assert "failed" in listed.text
    shown = client.get(f"/batches/{batch_id}")
    assert shown.status_code == 200
    assert "cannot render INV-2" in shown.text
    assert dead.message_id[:8] in shown.text
    run = client.get(f"/runs/{dead.message_id}")
    assert f"/batches/{batch_id}" in run.text
    unknown = client.get("/batches/00000000-0000-4000-8000-000000000000")
    assert unknown.status_code == 400  # the dashboard's answer to any lookup that finds nothing
    assert "no such batch" in unknown.text
