"""Tests of the billing example, in both styles of docs/testing.md.

Run them with ``.venv/bin/pytest examples/billing`` (CI does). The end-to-end tests need a
Redis: ``KUMIKO_TEST_REDIS_URL``, or a ``redis-server`` on ``PATH`` that the fixtures start.
"""

from __future__ import annotations

import logging
from datetime import UTC, datetime

import pytest
from freezegun import freeze_time

from examples.billing.app import MailGatewayError, registry
from kumiko_dramatiq import Cron, PayloadError
from kumiko_dramatiq.scheduler.ticks import plan_ticks
from kumiko_dramatiq.testing import RunnerFactory, run_job

INVOICE = {"invoice": "INV-7", "email": "ada@example.com"}


# -- unit style: the handler alone, in-process, no Redis ------------------------------------
def test_send_invoice_raises_while_the_gateway_fails_and_sends_after(
    caplog: pytest.LogCaptureFixture,
) -> None:
    payload = {**INVOICE, "gateway_failures": 1}
    with pytest.raises(MailGatewayError, match="gateway timeout sending INV-7"):
        run_job(registry, "billing:job:send_invoice", payload, attempt=1)
    with caplog.at_level(logging.INFO, logger="examples.billing"):
        run_job(registry, "billing:job:send_invoice", payload, attempt=2)
    assert "invoice INV-7 sent to ada@example.com (attempt 2)" in caplog.messages


def test_send_invoice_refuses_a_payload_its_model_refuses() -> None:
    with pytest.raises(PayloadError, match=r"send_invoice: payload\.email is invalid for Invoice"):
        run_job(registry, "billing:job:send_invoice", {"invoice": "INV-7"})


def test_record_payment_refuses_a_payload_that_dispatch_would_refuse() -> None:
    with pytest.raises(PayloadError, match=r"record_payment: payload\['amount'\] must be a finite"):
        run_job(
            registry, "billing:job:record_payment", {"invoice": "INV-7", "amount": float("inf")}
        )


def test_the_async_nightly_summary_runs(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="examples.billing"):
        run_job(registry, "reports:job:nightly_summary")
    assert caplog.messages == ["nightly summary in EUR for tick None"]


# -- schedules: pure functions that take `now` (freezegun only pins what "now" is) --------------
def test_the_nightly_summary_fires_at_2_am_berlin_time() -> None:
    cron = registry.jobs["reports:job:nightly_summary"].options.trigger
    assert isinstance(cron, Cron)
    with freeze_time("2024-05-10 12:00:00"):
        tick = cron.next_fire_time(datetime.now(UTC))
    assert tick.isoformat() == "2024-05-11T02:00:00+02:00"


def test_a_scheduler_back_after_three_missed_nights_runs_only_the_latest_within_grace() -> None:
    cron = Cron("0 2 * * *", timezone="Europe/Berlin", grace_s=3_600)
    last_run = datetime(2024, 5, 7, 0, 0, tzinfo=UTC)  # 02:00 Berlin
    now = datetime(2024, 5, 10, 0, 30, tzinfo=UTC)  # 02:30 Berlin, three nights later
    plan = plan_ticks(cron, last_run, now, catching_up=True)
    assert plan.enqueue is not None
    assert plan.enqueue.isoformat() == "2024-05-10T02:00:00+02:00"
    assert plan.skipped_first is not None
    assert plan.skipped_first.isoformat() == "2024-05-08T02:00:00+02:00"


# -- end to end: Redis, a worker, retries with their backoff, the run history ------------------
def test_an_invoice_is_sent_on_the_third_attempt_after_two_gateway_errors(
    kumiko_runner: RunnerFactory,
) -> None:
    runner = kumiko_runner(registry)
    runner.dispatch("billing:job:send_invoice", {**INVOICE, "gateway_failures": 2})
    runs = runner.drain()
    assert [(run.attempt, run.status, run.error_type) for run in runs] == [
        (1, "failed", "MailGatewayError"),
        (2, "failed", "MailGatewayError"),
        (3, "completed", None),
    ]


def test_a_paid_invoice_event_records_the_payment(kumiko_runner: RunnerFactory) -> None:
    runner = kumiko_runner(registry)
    (message_id,) = runner.handle_event("invoice.paid", {"invoice": "INV-7", "amount": 120})
    assert [(run.message_id, run.trigger, run.status) for run in runner.drain()] == [
        (message_id, "event", "completed")
    ]
