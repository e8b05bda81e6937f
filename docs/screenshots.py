"""Screenshots of the dashboard for the README: ``.venv/bin/python docs/screenshots.py``.

Starts a private redis-server, fills a demo dataset (an hour of run history written with
``RunHistory.put``, plus real runs on an in-process worker: dead letters with tracebacks, a
held sequential lock and one whose worker is gone, a paused job with dedup keys waiting, a
delayed message), serves the dashboard with
uvicorn on a free loopback port and photographs its main pages with headless Chromium
(Debian's ``chromium`` and ``chromium-driver``, driven by Selenium) into ``docs/*.png``.
"""

from __future__ import annotations

import logging
import math
import socket
import sys
import threading
import time
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import uvicorn  # noqa: E402
from selenium import webdriver  # noqa: E402
from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402

from examples.redis_server import private_redis  # noqa: E402
from kumiko_dramatiq import Cron, Feature, JobContext, JobMeta, JobRunner, Registry  # noqa: E402
from kumiko_dramatiq.broker import keys  # noqa: E402
from kumiko_dramatiq.dashboard import create_app  # noqa: E402
from kumiko_dramatiq.ops.history import RunStatus, record_write  # noqa: E402

TOKEN = "screenshot-token-0123456789"
OUT = ROOT / "docs"
release = threading.Event()
ledger_running = threading.Event()
died = threading.Semaphore(0)

billing = Feature("billing")
reports = Feature("reports")
setup = Feature("setup")


@billing.job("send_invoice", retries=2, backoff="fixed")
def send_invoice(payload: dict[str, Any], ctx: JobContext) -> None:
    if payload.get("fail"):
        raise ConnectionError(f"SMTP relay refused invoice {payload['invoice']}: 451 try later")


@billing.job("render_pdf", timeout_ms=30_000)
def render_pdf(payload: dict[str, Any], ctx: JobContext) -> None:
    return None


@billing.job("sync_ledger", concurrency="sequential")
def sync_ledger(payload: dict[str, Any], ctx: JobContext) -> None:
    ledger_running.set()
    release.wait(60)


@billing.job("close_books", concurrency="sequential", per_tenant=True)
def close_books(payload: dict[str, Any], ctx: JobContext) -> None:
    return None


@reports.job("nightly", trigger=Cron("0 3 * * *", timezone="Europe/Berlin"))
def nightly(payload: dict[str, Any], ctx: JobContext) -> None:
    return None


@reports.job("digest", trigger=Cron("*/15 * * * *"), retries=1)
def digest(payload: dict[str, Any], ctx: JobContext) -> None:
    return None


@setup.job("warm_cache", run_on_boot=True)
def warm_cache(payload: dict[str, Any], ctx: JobContext) -> None:
    return None


@setup.job("check_schema", boot_gate=True)
def check_schema(payload: dict[str, Any], ctx: JobContext) -> None:
    return None


registry = Registry([billing, reports, setup])


def fill_history(runner: JobRunner, now: datetime) -> None:
    """An hour of synthetic runs, a few dozen a minute, with a burst of failures."""
    history = runner.history
    jobs = ["billing:job:send_invoice", "billing:job:render_pdf", "reports:job:digest"]
    for minute in range(60):
        at_minute = now - timedelta(minutes=60 - minute)
        busy = 20 + int(14 * math.sin(minute / 7) + 10 * math.sin(minute / 2.3) + 14)
        failing = 6 if 38 <= minute <= 41 else minute % 9 == 0
        for n in range(busy + int(failing)):
            status: RunStatus = "failed" if n < int(failing) else "completed"
            at = at_minute + timedelta(seconds=n * 60 / (busy + 1))
            at_ms = int(at.timestamp() * 1000)
            message_id = str(uuid.uuid4())
            fields: dict[str, Any] = {
                "j": jobs[n % len(jobs)],
                "m": message_id,
                "o": message_id,
                "tr": "manual",
                "a": 1,
                "ma": 3,
                "q": at_ms - 40,
                "st": at_ms - 25,
                "en": at_ms,
                "d": 25,
                "w": "web-1:4242",
            }
            if status == "failed":
                fields |= {"et": "TimeoutError", "em": "payment gateway timed out after 10 s"}
            history.put(record_write(fields, status, runner.settings), at, runner.settings)


def serve(app: Any) -> tuple[uvicorn.Server, threading.Thread, str]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        if time.monotonic() > deadline:
            raise SystemExit("the dashboard did not start")
        time.sleep(0.02)
    return server, thread, f"http://127.0.0.1:{port}"


def browser() -> webdriver.Chrome:
    options = webdriver.ChromeOptions()
    options.binary_location = "/usr/bin/chromium"
    for argument in ("--headless=new", "--no-sandbox", "--disable-gpu", "--hide-scrollbars"):
        options.add_argument(argument)
    options.add_argument("--window-size=1360,900")
    options.add_argument("--force-device-scale-factor=1")
    return webdriver.Chrome(service=Service("/usr/bin/chromedriver"), options=options)


def shoot(driver: webdriver.Chrome, url: str, name: str) -> None:
    driver.get(url)
    bottom = driver.execute_script(
        "return document.querySelector('footer').getBoundingClientRect().bottom"
    )
    driver.set_window_size(1360, 900)
    inner = driver.execute_script("return window.innerHeight")
    # the window's chrome is the difference between its size and the viewport
    driver.set_window_size(1360, min(int(bottom) + 12 + 900 - int(inner), 1500))
    driver.save_screenshot(str(OUT / f"dashboard-{name}.png"))
    print(f"docs/dashboard-{name}.png")


def main() -> int:
    logging.getLogger("kumiko_dramatiq").setLevel(logging.CRITICAL)  # the planned failures
    with private_redis() as url:
        prefix = "shop"

        def on_failed(job: str, message_id: str, meta: JobMeta, exc: BaseException) -> None:
            if meta.final_attempt:
                died.release()

        runner = JobRunner(
            registry,
            redis_url=url,
            queue_prefix=prefix,
            worker_threads=4,
            idle_wait_ms=50,
            on_job_failed=on_failed,
            get_active_tenant_ids=lambda: ["acme-gmbh"],
        )
        producer = JobRunner(registry, redis_url=url, queue_prefix=prefix)
        fill_history(runner, datetime.now(UTC))
        for tenant, zone in (("acme", "Europe/Berlin"), ("globex", "America/New_York")):
            producer.schedules.upsert(
                f"report:{tenant}",
                "reports:job:nightly",
                cron=Cron("0 6 * * mon", timezone=zone),
                overlap="skip",
            )
        producer.schedules.upsert("poll-ledger", "billing:job:sync_ledger", every_ms=300_000)
        producer.schedules.pause("report:globex")
        runner.start()
        try:
            for n in range(3):
                producer.dispatch("billing:job:send_invoice", {"invoice": f"INV-10{n}", "fail": 1})
            for n in range(12):
                producer.dispatch("billing:job:render_pdf", {"invoice": f"INV-20{n}"})
            producer.dispatch("billing:job:sync_ledger")
            for _ in range(3):
                if not died.acquire(timeout=30):
                    raise SystemExit("the failing invoices did not die in time")
            ledger_running.wait(30)
            producer.pause("reports:job:digest")
            producer.dispatch("reports:job:digest", dedup_key="tenant-acme:2026-W48")
            for week in (47, 46):
                producer.dispatch("reports:job:digest", dedup_key=f"tenant-globex:2026-W{week}")
            waiting = producer.dispatch(
                "billing:job:render_pdf", {"invoice": "INV-301"}, delay_ms=3_600_000
            )
            for n, minutes in enumerate((5, 20, 45)):
                producer.dispatch(
                    "billing:job:render_pdf",
                    {"invoice": f"INV-40{n}", "copies": n + 1},
                    delay_ms=minutes * 60_000,
                )
            producer.dispatch("reports:job:nightly")  # a run now, outside its schedule
            # a lock whose worker was killed mid-run: held until its lease runs out
            producer.broker.lua.lock_acquire(
                keys=[keys.sequential_lock(prefix, "billing:job:close_books", "acme-gmbh")],
                args=[f"{uuid.uuid4()}:lease", 25_000],
            )
            dead = producer.dead_letters(limit=1)
            app = create_app(producer, token=TOKEN)
            server, thread, base = serve(app)
            driver = browser()
            try:
                shoot(driver, base + "/login", "login")
                driver.get(base + "/login")
                driver.find_element(By.ID, "token").send_keys(TOKEN)
                driver.find_element(By.ID, "sign-in").click()
                shoot(driver, base + "/", "overview")
                shoot(driver, base + "/runs", "runs")
                shoot(driver, base + "/dead", "dead-letters")
                if dead:
                    shoot(driver, f"{base}/runs/{dead[0].message_id}", "run")
                shoot(driver, base + "/jobs", "jobs")
                shoot(driver, base + "/locks", "locks")
                shoot(driver, base + "/dedup", "dedup")
                shoot(driver, f"{base}/runs/{waiting}", "run-waiting")
                shoot(driver, f"{base}/jobs/billing:job:render_pdf", "job")
                shoot(driver, base + "/busy", "busy")
                shoot(driver, base + "/schedules", "schedules")
            finally:
                driver.quit()
                server.should_exit = True
                thread.join(10)
        finally:
            release.set()
            runner.stop(timeout_s=10)
            producer.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
