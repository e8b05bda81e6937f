"""The cron job the benchmark's schedulers tick (``KUMIKO_APP=benchmarks.cron_app:registry``)."""

from __future__ import annotations

from typing import Any

from kumiko_dramatiq import Cron, Feature, JobContext, Registry

bench = Feature("bench")


@bench.job("tick", trigger=Cron("* * * * * *"))
def tick(payload: dict[str, Any], ctx: JobContext) -> None:
    return None


registry = Registry([bench])
