"""Tests of the FastAPI example through HTTP (Starlette's ``TestClient``, on httpx), against a
real Redis and the in-process worker the app starts. Run them with
``.venv/bin/pytest examples/fastapi`` (CI does)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from starlette.testclient import TestClient

from examples.fastapi.app import WELCOME, create_api, registry
from kumiko_dramatiq import JobRunner


@pytest.fixture
def runner(kumiko_redis_url: str, kumiko_queue_prefix: str) -> JobRunner:
    return JobRunner(
        registry, redis_url=kumiko_redis_url, queue_prefix=kumiko_queue_prefix, worker_threads=2
    )


@pytest.fixture
def client(runner: JobRunner) -> Iterator[TestClient]:
    with TestClient(create_api(runner, worker=True)) as client:
        yield client


def test_a_signup_queues_the_mail_and_its_state_and_result_can_be_read(
    client: TestClient, runner: JobRunner
) -> None:
    accepted = client.post("/signups", json={"email": "ada@example.com"})
    assert accepted.status_code == 202
    message_id = accepted.json()["id"]
    # the worker ran it: wait for its end, not for a while
    assert runner.result(message_id, timeout_s=30) == {"sent_to": "ada@example.com", "attempt": 1}
    found = client.get(f"/jobs/{message_id}")
    assert found.status_code == 200
    assert found.json() == {
        "id": message_id,
        "state": "completed",
        "result": {"sent_to": "ada@example.com", "attempt": 1},
    }


def test_a_retried_signup_with_its_idempotency_key_sends_one_mail(
    client: TestClient, runner: JobRunner
) -> None:
    headers = {"Idempotency-Key": "signup-ada-1"}
    first = client.post("/signups", json={"email": "ada@example.com"}, headers=headers)
    again = client.post("/signups", json={"email": "ada@example.com"}, headers=headers)
    assert first.json()["id"] == again.json()["id"]
    runner.drain(timeout_s=30)
    runs = runner.runs(job=WELCOME)
    assert [run.message_id for run in runs] == [first.json()["id"]]


def test_bad_input_is_a_422_naming_the_field_and_queues_nothing(
    client: TestClient, runner: JobRunner
) -> None:
    refused = client.post("/signups", json={"email": "not-an-address"})
    assert refused.status_code == 422
    assert "payload.email" in refused.json()["error"]
    assert runner.job_counts()[WELCOME]["queued"] == 0


def test_an_unknown_id_is_a_404(client: TestClient) -> None:
    missing = client.get("/jobs/9f1c2a9e-0000-4000-8000-000000000000")
    assert missing.status_code == 404
    assert missing.json()["state"] == "unknown"


def test_a_redis_that_cannot_be_reached_is_a_503_saying_nothing_was_enqueued() -> None:
    down = JobRunner(
        registry, redis_url="redis://127.0.0.1:1/0", queue_prefix="x", boot_redis_timeout_ms=300
    )
    with TestClient(create_api(down)) as client:
        refused = client.post("/signups", json={"email": "ada@example.com"})
    assert refused.status_code == 503
    assert refused.json()["maybe_enqueued"] is False
    assert refused.headers["retry-after"] == "1"


def test_the_dashboard_is_mounted(client: TestClient) -> None:
    page = client.get("/kumiko/")
    assert page.status_code == 200
    assert "kumiko" in page.text
