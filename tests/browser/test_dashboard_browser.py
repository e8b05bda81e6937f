"""The dashboard in a real browser: headless Chromium (Debian's ``chromium`` and
``chromium-driver``, which ``.ci/run`` installs) driven by Selenium with the system
chromedriver, against a real Redis, an in-process worker and the dashboard served by uvicorn.

These tests fail, never skip, when the browser is missing.
"""

from __future__ import annotations

import shutil
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import uvicorn
from selenium import webdriver
from selenium.common.exceptions import NoAlertPresentException
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By

from kumiko_dramatiq import Feature, JobContext, JobRunner, Registry
from kumiko_dramatiq.dashboard import create_app
from tests.conftest import Recorder, RunnerFactory, wait_for

TOKEN = "browser-test-token-0123456789"
PAYLOAD = '<script>alert("pwned")</script><img src=x onerror=alert(2)>'
JOB = "shop:job:charge"


def executable(name: str) -> str:
    path = shutil.which(name)
    assert path is not None, (
        f"{name} is not installed: apt-get install chromium chromium-driver (.ci/run does it)"
    )
    return path


@pytest.fixture
def browser() -> Iterator[webdriver.Chrome]:
    options = webdriver.ChromeOptions()
    # Both paths given: Selenium Manager has nothing to find, so it downloads nothing.
    options.binary_location = executable("chromium")
    for argument in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"):
        options.add_argument(argument)
    options.add_argument("--window-size=1280,900")
    driver = webdriver.Chrome(service=Service(executable("chromedriver")), options=options)
    driver.set_page_load_timeout(30)
    yield driver
    driver.quit()


@contextmanager
def served(app: Any) -> Iterator[str]:
    """Serve ``app`` with uvicorn in a thread on a free loopback port; yield its base URL."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(
        uvicorn.Config(app, log_level="warning", lifespan="off", ws="none", access_log=False)
    )
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        wait_for(lambda: server.started, what="uvicorn serving the dashboard")
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()


@pytest.fixture
def shop() -> tuple[Registry, threading.Event]:
    fixed = threading.Event()
    feature = Feature("shop")

    @feature.job("charge")
    def charge(payload: dict[str, Any], ctx: JobContext) -> None:
        if not fixed.is_set():
            raise RuntimeError(f"card declined: {PAYLOAD}")

    return Registry([feature]), fixed


def shown(browser: webdriver.Chrome, css: str) -> Any:
    """The element ``css`` selects once the page shows it (a click's navigation, or a page
    whose URL changed before its body was parsed, may still be under way)."""
    wait_for(lambda: bool(browser.find_elements(By.CSS_SELECTOR, css)), what=css)
    return browser.find_element(By.CSS_SELECTOR, css)


def dead_letter(runner: JobRunner) -> str:
    """Dispatch a run that fails for good; wait until it is a dead letter."""
    message_id = runner.dispatch(JOB)
    wait_for(
        lambda: message_id in {d.message_id for d in runner.dead_letters()},
        what="the dead letter",
    )
    return message_id


def no_alert(driver: webdriver.Chrome) -> bool:
    try:
        text = driver.switch_to.alert.text
    except NoAlertPresentException:
        return True
    raise AssertionError(f"an alert opened: {text!r}")


def test_an_operator_retries_a_dead_letter_and_sees_it_complete(
    browser: webdriver.Chrome,
    make_runner: RunnerFactory,
    recorder: Recorder,
    shop: tuple[Registry, threading.Event],
) -> None:
    # Given a worker whose job failed for good, and the dashboard with a token
    registry, fixed = shop
    runner = make_runner(registry, idle_wait_ms=50, **recorder.hooks())
    runner.start()
    dead_id = dead_letter(runner)

    with served(create_app(runner, token=TOKEN)) as base:
        # When the operator opens the dead letters, signs in with the token on the way
        browser.get(f"{base}/dead")
        assert "/login" in browser.current_url
        browser.find_element(By.ID, "token").send_keys(TOKEN)
        browser.find_element(By.ID, "sign-in").click()
        wait_for(lambda: browser.current_url == f"{base}/dead", what="the dead letters page")

        # Then the error, HTML and all, is shown as text, never run
        error = shown(browser, "table.dead .error")
        assert PAYLOAD in error.text
        assert browser.find_elements(By.CSS_SELECTOR, "main script, main img") == []
        assert no_alert(browser)

        # When the cause is fixed and the operator clicks Retry on that letter
        fixed.set()
        row_form = browser.find_element(
            By.XPATH, f"//form[input[@name='message_id' and @value='{dead_id}']]"
        )
        row_form.find_element(By.CSS_SELECTOR, "button[data-action='retry']").click()

        # Then the page says it was re-enqueued, as which message
        flash = shown(browser, ".flash.ok").text
        assert f"Dead letter {dead_id} re-enqueued" in flash
        new_id = flash.rsplit(" as ", 1)[1].split(".")[0]
        recorder.wait_until(
            lambda r: any(e.message_id == new_id for e in r.of("complete", JOB)),
            what="the retried run completes",
        )
        # written by the ack right after the hook
        wait_for(lambda: [r.status for r in runner.run_record(new_id)] == ["completed"])

        # and the runs page shows it completed
        browser.get(f"{base}/runs?job={JOB}")
        row = browser.find_element(By.XPATH, f"//tr[.//a[@title='{new_id}']]")
        assert "completed" in row.find_element(By.CSS_SELECTOR, ".badge").text
        assert dead_id not in {d.message_id for d in runner.dead_letters()}


def test_a_read_only_dashboard_shows_no_action_buttons(
    browser: webdriver.Chrome,
    make_runner: RunnerFactory,
    shop: tuple[Registry, threading.Event],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("KUMIKO_DASHBOARD_TOKEN", raising=False)
    registry, _ = shop
    runner = make_runner(registry, idle_wait_ms=50)
    runner.start()
    dead_id = dead_letter(runner)
    runner.pause(JOB)

    with served(create_app(runner)) as base:
        for path in ("/dead", "/jobs", f"/runs/{dead_id}", "/"):
            browser.get(base + path)
            assert browser.find_elements(By.TAG_NAME, "main"), path
            assert browser.find_elements(By.CSS_SELECTOR, "form[method='post']") == [], path
            assert browser.find_elements(By.CSS_SELECTOR, "button[data-action]") == [], path
            assert browser.find_element(By.CSS_SELECTOR, "header .badge").text == "read-only"
        # the dead letter is listed, with its error as text
        browser.get(f"{base}/dead")
        assert dead_id[:8] in browser.find_element(By.CSS_SELECTOR, "table.dead").text
        assert PAYLOAD in browser.find_element(By.CSS_SELECTOR, "table.dead .error").text
        assert no_alert(browser)


def test_signing_out_ends_the_session_for_a_copy_of_its_cookie_too(
    browser: webdriver.Chrome,
    make_runner: RunnerFactory,
    shop: tuple[Registry, threading.Event],
) -> None:
    registry, _ = shop
    runner = make_runner(registry)
    with served(create_app(runner, token=TOKEN)) as base:
        # Given an operator signed in, whose cookie someone copied
        browser.get(f"{base}/login")
        assert browser.find_elements(By.CSS_SELECTOR, "nav a") == []  # a stranger sees no map
        assert runner.queue_prefix not in browser.page_source
        browser.find_element(By.ID, "token").send_keys(TOKEN)
        browser.find_element(By.ID, "sign-in").click()
        wait_for(lambda: browser.current_url == f"{base}/", what="the overview, signed in")
        copied = browser.get_cookie("kumiko-dashboard")
        assert copied is not None
        assert runner.queue_prefix in browser.page_source  # signed in: where it is
        # When the operator signs out
        browser.find_element(By.XPATH, "//button[normalize-space()='Sign out']").click()
        wait_for(lambda: browser.current_url == f"{base}/login", what="the sign-in page")
        # Then the copied cookie opens nothing
        browser.add_cookie({"name": copied["name"], "value": copied["value"], "path": "/"})
        browser.get(f"{base}/jobs")
        assert "/login" in browser.current_url
        assert no_alert(browser)
