"""The dashboard's job page, busy page and schedules actions (issue 33), through Starlette's
TestClient against a real Redis and an in-process worker."""

from __future__ import annotations

from starlette.testclient import TestClient

from kumiko_dramatiq.broker import keys
from kumiko_dramatiq.dashboard import create_app
from tests.conftest import Recorder, RunnerFactory, wait_for
from tests.integration.test_dashboard import (
    TOKEN,
    Dataset,
    dataset,  # noqa: F401 (the fixture)
    kill,
    sign_in,
    worker,
)

LEDGER = "shop:job:ledger"
EXPLODE = "shop:job:explode"


def test_a_job_page_shows_counts_waiting_messages_and_payloads_only_when_signed_in(
    make_runner: RunnerFactory,
    dataset: Dataset,  # noqa: F811
    monkeypatch: object,
) -> None:
    runner = make_runner(dataset.registry)
    queued = runner.dispatch(EXPLODE, {"card": "4242-secret"})
    later = runner.dispatch(EXPLODE, {"card": "later"}, delay_ms=600_000)
    # read-only: counts and ids, never a payload
    page = TestClient(create_app(runner, token="")).get(f"/jobs/{EXPLODE}").text
    assert queued in page
    assert later in page
    assert "4242-secret" not in page
    assert 'data-state="queued">1<' in page
    assert 'data-state="delayed">1<' in page
    # signed in: the payloads, run-now on the delayed one, purge
    client = TestClient(create_app(runner, token=TOKEN), follow_redirects=False)
    csrf = sign_in(client)
    page = client.get(f"/jobs/{EXPLODE}").text
    assert "4242-secret" in page
    assert 'data-action="run-now"' in page
    assert 'data-action="purge"' in page
    client.post("/actions/run-now", data={"message_id": later, "csrf": csrf})
    assert runner.job_counts()[EXPLODE]["queued"] == 2
    client.post("/actions/purge", data={"job": EXPLODE, "state": "queued", "csrf": csrf})
    assert runner.job_counts()[EXPLODE]["queued"] == 0
    # the jobs page shows the counts too; bad input is a 400
    assert client.get(f"/jobs/{EXPLODE}?state=running").status_code == 400
    assert client.get("/jobs/shop:job:nope").status_code == 400


def test_the_busy_page_lists_what_runs_and_stops_it(
    make_runner: RunnerFactory,
    dataset: Dataset,  # noqa: F811
    recorder: Recorder,
) -> None:
    runner = worker(make_runner, dataset, recorder)
    client = TestClient(create_app(runner, token=TOKEN), follow_redirects=False)
    csrf = sign_in(client)
    held = runner.dispatch(LEDGER)
    wait_for(lambda: held in client.get("/busy").text, what="the run on the busy page")
    assert 'data-action="stop"' in client.get("/busy").text
    client.post("/actions/stop", data={"message_id": held, "csrf": csrf, "back": "/busy"})
    # the handler blocks in a C call (Event.wait): the stop lands when it returns, as a
    # timeout's interruption would
    stop_key = keys.stop_request(runner.queue_prefix, held)
    wait_for(lambda: not runner.broker.client.exists(stop_key), what="the stop delivered")
    dataset.release.set()
    wait_for(lambda: [r.status for r in runner.run_record(held)] == ["cancelled"])
    client.get("/busy")  # the flash, shown once
    assert held not in client.get("/busy").text


def test_schedules_run_now_dispatches_and_each_tick_shows_its_run(
    make_runner: RunnerFactory,
    dataset: Dataset,  # noqa: F811
    recorder: Recorder,
) -> None:
    runner = worker(make_runner, dataset, recorder)
    client = TestClient(create_app(runner, token=TOKEN), follow_redirects=False)
    csrf = sign_in(client)
    assert "no run yet" in client.get("/schedules").text
    client.post(
        "/actions/dispatch", data={"job": "shop:job:nightly", "csrf": csrf, "back": "/schedules"}
    )
    recorder.wait_until(lambda r: bool(r.of("complete", "shop:job:nightly")), what="the run")
    (event,) = recorder.of("complete", "shop:job:nightly")
    assert event.meta.trigger == "manual"
    wait_for(lambda: event.message_id[:8] in client.get("/schedules").text, what="its tick")


def test_dead_letters_can_be_deleted_one_by_one_or_all_of_a_job(
    make_runner: RunnerFactory,
    dataset: Dataset,  # noqa: F811
    recorder: Recorder,
) -> None:
    runner = worker(make_runner, dataset, recorder)
    client = TestClient(create_app(runner, token=TOKEN), follow_redirects=False)
    csrf = sign_in(client)
    first, *_ = kill(runner, EXPLODE, 3)
    assert 'data-action="delete"' in client.get("/dead").text
    client.post("/actions/delete", data={"message_id": first, "csrf": csrf})
    assert first not in {d.message_id for d in runner.dead_letters()}
    client.post("/actions/purge", data={"job": EXPLODE, "state": "dead", "csrf": csrf})
    assert runner.dead_letters(EXPLODE) == []
    # a read-only dashboard refuses them
    read_only = TestClient(create_app(runner, token=""), follow_redirects=False)
    assert read_only.post("/actions/purge", data={"job": EXPLODE}).status_code == 403
    assert read_only.post("/actions/stop", data={"message_id": first}).status_code == 403


def test_a_run_page_offers_run_now_while_delayed(
    make_runner: RunnerFactory,
    dataset: Dataset,  # noqa: F811
) -> None:
    runner = make_runner(dataset.registry)
    later = runner.dispatch(EXPLODE, {}, delay_ms=600_000)
    client = TestClient(create_app(runner, token=TOKEN), follow_redirects=False)
    csrf = sign_in(client)
    assert 'data-action="run-now"' in client.get(f"/runs/{later}").text
    client.post("/actions/run-now", data={"message_id": later, "csrf": csrf})
    page = client.get(f"/runs/{later}").text
    assert 'data-action="run-now"' not in page
    assert "it waits in its queue" in page


def test_the_schedules_page_pauses_resumes_and_triggers_schedules(
    make_runner: RunnerFactory,
    dataset: Dataset,  # noqa: F811
    recorder: Recorder,
) -> None:
    runner = worker(make_runner, dataset, recorder)
    runner.schedules.upsert("ledger-poll", LEDGER, every_ms=3_600_000, payload={"n": 1})
    client = TestClient(create_app(runner, token=TOKEN), follow_redirects=False)
    csrf = sign_in(client)
    page = client.get("/schedules").text
    assert "ledger-poll" in page
    assert "every 3600000 ms" in page
    assert 'data-action="schedule-pause"' in page
    assert "skipped (its job)" in page
    read_only = TestClient(create_app(runner, token=""), follow_redirects=False)
    refused = read_only.post("/actions/schedule-pause", data={"schedule": "ledger-poll"})
    assert refused.status_code == 403
    client.post("/actions/schedule-pause", data={"schedule": "ledger-poll", "csrf": csrf})
    assert runner.schedules.get("ledger-poll").paused
    client.post("/actions/schedule-pause", data={"schedule": "shop:job:nightly", "csrf": csrf})
    assert runner.schedules.get("shop:job:nightly").paused
    client.post("/actions/schedule-resume", data={"schedule": "ledger-poll", "csrf": csrf})
    assert not runner.schedules.get("ledger-poll").paused
    client.post("/actions/schedule-trigger", data={"schedule": "ledger-poll", "csrf": csrf})
    recorder.wait_until(lambda r: bool(r.of("start", LEDGER)), what="the triggered run")
