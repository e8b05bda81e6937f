"""A small billing app: the jobs a SaaS backend typically runs in the background.

Run its worker with::

    KUMIKO_APP=examples.billing.app:registry dramatiq kumiko_dramatiq.app

- ``billing:job:send_invoice``: talks to a flaky mail gateway; 3 retries with
  exponential backoff (200 ms, 400 ms, 800 ms). Typed: its payload is an ``Invoice``,
  validated by ``dispatch`` before anything is enqueued.
- ``billing:job:record_payment``: runs on the ``invoice.paid`` event; typed (``Payment``).
- ``billing:job:render_pdf``: may render for too long; ``timeout_ms`` cuts it
  off and the attempt counts as failed. Untyped: its handler takes the dict.
- ``reports:job:nightly_summary``: a cron job (02:00 Berlin time), async. A cron tick
  runs with the empty payload, so every field of its model has a default.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from pydantic import BaseModel

from kumiko_dramatiq import Backoff, Cron, Event, Feature, JobContext, Registry

log = logging.getLogger("examples.billing")

billing = Feature("billing")
reports = Feature("reports")


class MailGatewayError(Exception):
    """The mail gateway refused the message (the demo makes it fail on purpose)."""


class Invoice(BaseModel):
    invoice: str
    email: str
    #: The demo's gateway fails the first `gateway_failures` attempts of a message.
    gateway_failures: int = 0


class Payment(BaseModel):
    invoice: str
    amount: float


class Summary(BaseModel):
    currency: str = "EUR"


@billing.job("send_invoice", retries=3, backoff=Backoff("exponential", delay_ms=200))
def send_invoice(payload: Invoice, ctx: JobContext) -> None:
    if ctx.attempt <= payload.gateway_failures:
        raise MailGatewayError(f"gateway timeout sending {payload.invoice}")
    log.info("invoice %s sent to %s (attempt %d)", payload.invoice, payload.email, ctx.attempt)


@billing.job("record_payment", trigger=Event("invoice.paid"), retries=2, backoff="fixed")
def record_payment(payload: Payment, ctx: JobContext) -> None:
    log.info("payment of %s recorded for %s", payload.amount, payload.invoice)


@billing.job("render_pdf", timeout_ms=500, retries=1)
def render_pdf(payload: dict[str, Any], ctx: JobContext) -> None:
    for page in range(payload["pages"]):
        time.sleep(0.05)  # rendering one page
        if page == payload["pages"] - 1:
            log.info("pdf of %s rendered", payload["invoice"])


@reports.job("nightly_summary", trigger=Cron("0 2 * * *", timezone="Europe/Berlin"))
async def nightly_summary(payload: Summary, ctx: JobContext) -> None:
    await asyncio.sleep(0)
    log.info("nightly summary in %s for tick %s", payload.currency, ctx.scheduled_at)


registry = Registry([billing, reports])
