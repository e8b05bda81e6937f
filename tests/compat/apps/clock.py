"""The scheduler process of :mod:`.scheduling`: APScheduler sends ``print_current_date``
every second through this run's broker."""

from __future__ import annotations

from datetime import datetime

from apscheduler.schedulers.blocking import BlockingScheduler
from apscheduler.triggers.cron import CronTrigger

from tests.compat.apps.setup_broker import load_app


def main() -> None:
    app = load_app()
    scheduler = BlockingScheduler()

    def tick() -> None:
        app.print_current_date.send(datetime.now().replace(microsecond=0).isoformat())

    scheduler.add_job(tick, CronTrigger(second="*"))
    scheduler.start()


if __name__ == "__main__":
    main()
