"""A ``JobRunner`` app with its own settings (``KUMIKO_APP=tests.apps.runner_app:runner``)."""

from __future__ import annotations

from typing import Any

from kumiko_dramatiq import Feature, JobContext, JobRunner, Registry

feature = Feature("runnerapp")


@feature.job("noop")
def noop(payload: dict[str, Any], ctx: JobContext) -> None: ...


runner = JobRunner(Registry([feature]), queue_prefix="runnerapp", lock_ttl_ms=5_000)
