"""A cron app for scheduler subprocess tests.

``KUMIKO_APP=tests.apps.cron_app:registry``: one job that ticks every second.
The scheduler only enqueues, so the tests count the tick messages in the lane
queue; no worker runs them.
"""

from __future__ import annotations

from typing import Any

from kumiko_dramatiq import Cron, Feature, JobContext, Registry

JOB = "cronapp:job:every_second"

cronapp = Feature("cronapp")


@cronapp.job("every_second", trigger=Cron("* * * * * *"))
def every_second(payload: dict[str, Any], ctx: JobContext) -> None:
    pass


registry = Registry([cronapp])
