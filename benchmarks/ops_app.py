"""The app ``benchmarks/operating.py`` operates (``KUMIKO_APP=benchmarks.ops_app:registry``):
a plain job, a keyed one, a failing one, a sequential one and a cron job."""

from __future__ import annotations

from typing import Any

from kumiko_dramatiq import Cron, Feature, JobContext, Registry

shop = Feature("shop")


@shop.job("send_invoice")
def send_invoice(payload: dict[str, Any], ctx: JobContext) -> None:
    return None


@shop.job("sync_customer")
def sync_customer(payload: dict[str, Any], ctx: JobContext) -> None:
    return None


@shop.job("charge", retries=1)
def charge(payload: dict[str, Any], ctx: JobContext) -> None:
    raise RuntimeError(f"card declined for order {payload.get('n')}")


@shop.job("close_books", concurrency="sequential")
def close_books(payload: dict[str, Any], ctx: JobContext) -> None:
    return None


@shop.job("nightly", trigger=Cron("0 3 * * *"))
def nightly(payload: dict[str, Any], ctx: JobContext) -> None:
    return None


registry = Registry([shop])
