"""The dashboard's job page, busy page, schedules and dead-letter deletes (issue 33) in a
real browser: headless Chromium driven by Selenium (see test_dashboard_browser.py), against
a real Redis, an in-process worker and the dashboard served by uvicorn. Each action is a
click on its button, its confirmation accepted."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from selenium import webdriver
from selenium.common.exceptions import StaleElementReferenceException
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import Select

from kumiko_dramatiq import Cron, Feature, JobContext, JobRunner, Registry
from kumiko_dramatiq.dashboard import create_app
from tests.browser.test_dashboard_browser import (
    TOKEN,
    browser,  # noqa: F401 (the fixture)
    no_alert,
    served,
)
from tests.conftest import Recorder, RunnerFactory, wait_for

SEND = "mail:job:send"
HOLD = "mail:job:hold"
DIGEST = "mail:job:digest"
FAIL = "mail:job:fail"
SECRET = '<b id="leak">card 4242</b>'
#: an action's result (the problems banner, also a .flash, is role="alert")
RESULT = '.flash[role="status"]'


@pytest.fixture
def mail() -> Iterator[Registry]:
    feature = Feature("mail")
    stop = threading.Event()

    @feature.job("send")
    def send(payload: dict[str, Any], ctx: JobContext) -> None:
        return None

    @feature.job("hold")
    def hold(payload: dict[str, Any], ctx: JobContext) -> None:
        while not ctx.stop_requested and not stop.is_set():
            time.sleep(0.01)

    @feature.job("digest", trigger=Cron("0 3 * * *"))
    def digest(payload: dict[str, Any], ctx: JobContext) -> None:
        return None

    @feature.job("fail")
    def fail(payload: dict[str, Any], ctx: JobContext) -> None:
        raise RuntimeError("bounced")

    yield Registry([feature])
    stop.set()


def sign_in(driver: webdriver.Chrome, base: str, path: str) -> None:
    driver.get(base + path)
    driver.find_element(By.ID, "token").send_keys(TOKEN)
    driver.find_element(By.ID, "sign-in").click()
    wait_for(lambda: driver.current_url == base + path, what=f"{path}, signed in")


def click(driver: webdriver.Chrome, action: str, message_id: str | None = None) -> None:
    """Click the ``action`` button (of ``message_id``'s form), accepting its confirmation."""
    if message_id is None:
        button = driver.find_element(By.CSS_SELECTOR, f"button[data-action='{action}']")
    else:
        form = driver.find_element(
            By.XPATH,
            f"//form[input[@name='message_id' and @value='{message_id}']]"
            f"[.//button[@data-action='{action}']]",
        )
        button = form.find_element(By.CSS_SELECTOR, "button")
    confirm = button.find_element(By.XPATH, "./ancestor::form").get_attribute("data-confirm")
    button.click()
    if confirm:
        wait_for(lambda: _alert(driver), what="the confirmation")
        driver.switch_to.alert.accept()
    wait_for(lambda: _gone(button), what="the page after the action")
    wait_for(lambda: bool(driver.find_elements(By.CSS_SELECTOR, RESULT)), what="the result")


def _gone(element: Any) -> bool:
    try:
        element.is_enabled()
    except StaleElementReferenceException:
        return True
    return False


def _alert(driver: webdriver.Chrome) -> bool:
    try:
        driver.switch_to.alert  # noqa: B018
    except Exception:
        return False
    return True


def count(driver: webdriver.Chrome, state: str) -> str:
    return str(driver.find_element(By.CSS_SELECTOR, f".count[data-state='{state}']").text)


def test_a_job_page_shows_waiting_payloads_runs_one_now_and_purges_the_rest(
    browser: webdriver.Chrome,  # noqa: F811
    make_runner: RunnerFactory,
    mail: Registry,
) -> None:
    runner = make_runner(mail)
    for n in range(3):
        runner.dispatch(SEND, {"to": f"user{n}@example.com", "note": SECRET})
    later = runner.dispatch(SEND, {"to": "later@example.com"}, delay_ms=600_000)
    with served(create_app(runner, token=TOKEN)) as base:
        sign_in(browser, base, f"/jobs/{SEND}")
        assert (count(browser, "queued"), count(browser, "delayed")) == ("3", "1")
        # the payloads are shown as text, never as markup
        rows = browser.find_elements(By.CSS_SELECTOR, "table.waiting tbody tr")
        assert len(rows) == 4
        table = browser.find_element(By.CSS_SELECTOR, "table.waiting")
        assert "user0@example.com" in str(table.get_attribute("textContent"))
        assert SECRET.replace('"', '\\"') in str(table.get_attribute("textContent"))
        assert browser.find_elements(By.ID, "leak") == []
        click(browser, "run-now", later)
        assert f"Message {later} queued now." in browser.find_element(By.CSS_SELECTOR, RESULT).text
        assert (count(browser, "queued"), count(browser, "delayed")) == ("4", "0")
        Select(browser.find_element(By.ID, "purge-state")).select_by_value("queued")
        click(browser, "purge")
        assert "4 queued message(s)" in browser.find_element(By.CSS_SELECTOR, RESULT).text
        assert count(browser, "queued") == "0"
        assert no_alert(browser)
    assert runner.job_counts()[SEND]["queued"] == 0


def test_the_busy_page_stops_a_running_attempt(
    browser: webdriver.Chrome,  # noqa: F811
    make_runner: RunnerFactory,
    mail: Registry,
) -> None:
    runner = make_runner(mail, idle_wait_ms=50)
    runner.start()
    held = runner.dispatch(HOLD)
    wait_for(lambda: bool(runner.running(HOLD)), what="the run")
    with served(create_app(runner, token=TOKEN)) as base:
        sign_in(browser, base, "/busy")
        busy = browser.find_element(By.CSS_SELECTOR, "table.busy")
        assert held in str(busy.get_attribute("innerHTML"))
        click(browser, "stop", held)
        assert f"Stop requested for {held}" in browser.find_element(By.CSS_SELECTOR, RESULT).text
        wait_for(lambda: [r.status for r in runner.run_record(held)] == ["cancelled"])
        browser.get(base + "/busy")
        assert "Nothing runs now." in browser.find_element(By.CSS_SELECTOR, "table.busy").text


def test_schedules_run_a_cron_job_now_and_show_its_tick(
    browser: webdriver.Chrome,  # noqa: F811
    make_runner: RunnerFactory,
    mail: Registry,
    recorder: Recorder,
) -> None:
    runner = make_runner(mail, idle_wait_ms=50, **recorder.hooks())
    runner.start()
    with served(create_app(runner, token=TOKEN)) as base:
        sign_in(browser, base, "/schedules")
        click(browser, "dispatch")
        assert f"{DIGEST} dispatched now" in browser.find_element(By.CSS_SELECTOR, RESULT).text
        recorder.wait_until(lambda r: bool(r.of("complete", DIGEST)), what="the run")
        wait_for(lambda: [r.status for r in runner.runs(DIGEST)] == ["completed"])
        browser.get(base + "/schedules")
        ticks = browser.find_element(By.CSS_SELECTOR, "td.ticks").text
        assert "completed" in ticks
        assert "manual" in ticks


def test_dead_letters_are_deleted_from_the_dead_letters_page(
    browser: webdriver.Chrome,  # noqa: F811
    make_runner: RunnerFactory,
    mail: Registry,
) -> None:
    runner: JobRunner = make_runner(mail, idle_wait_ms=50)
    runner.start()
    ids = [runner.dispatch(FAIL) for _ in range(3)]
    wait_for(lambda: len(runner.dead_letters()) == 3, what="three dead letters")
    with served(create_app(runner, token=TOKEN)) as base:
        sign_in(browser, base, "/dead")
        click(browser, "delete", ids[0])
        assert (
            f"Dead letter {ids[0]} deleted." in browser.find_element(By.CSS_SELECTOR, RESULT).text
        )
        browser.get(f"{base}/dead?job={FAIL}")
        click(browser, "purge")
        assert "2 dead message(s)" in browser.find_element(By.CSS_SELECTOR, RESULT).text
    assert runner.dead_letters() == []
