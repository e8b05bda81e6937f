"""The dashboard (``kumiko_dramatiq.dashboard.create_app``, ``kumiko dashboard``) against a
real Redis and an in-process worker, through Starlette's TestClient."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.routing import Mount
from starlette.testclient import TestClient

from kumiko_dramatiq import Cron, Feature, JobConfigError, JobContext, JobRunner, Registry
from kumiko_dramatiq.dashboard import create_app
from kumiko_dramatiq.dashboard.chart import minute_edges
from kumiko_dramatiq.dashboard.security import new_session
from tests.conftest import Recorder, RunnerFactory, wait_for

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "a-dashboard-token-for-tests"
HTML = '<script>alert("pwned")</script><b>bold</b>'
CSRF = re.compile(r'name="csrf" value="([0-9a-f]+)"')


@dataclass
class Dataset:
    """One test's app: a registry whose handlers take cues from the payload."""

    registry: Registry
    release: threading.Event


def make_dataset() -> Dataset:
    release = threading.Event()
    shop = Feature("shop")

    @shop.job("explode")
    def explode(payload: dict[str, Any], ctx: JobContext) -> None:
        if payload.get("fail"):
            raise RuntimeError(payload.get("message", HTML))

    @shop.job("other")
    def other(payload: dict[str, Any], ctx: JobContext) -> None:
        raise ValueError("other failed")

    @shop.job("ledger", concurrency="sequential")
    def ledger(payload: dict[str, Any], ctx: JobContext) -> None:
        release.wait(30)

    @shop.job("per_tenant_ledger", concurrency="sequential", per_tenant=True)
    def per_tenant_ledger(payload: dict[str, Any], ctx: JobContext) -> None:
        release.wait(30)

    @shop.job("api_explode", run_in="api")
    def api_explode(payload: dict[str, Any], ctx: JobContext) -> None:
        raise RuntimeError("api lane failure")

    @shop.job("nightly", trigger=Cron("0 3 * * *"))
    def nightly(payload: dict[str, Any], ctx: JobContext) -> None:
        return None

    @shop.job("warm", run_on_boot=True)
    def warm(payload: dict[str, Any], ctx: JobContext) -> None:
        return None

    return Dataset(Registry([shop]), release)


@pytest.fixture
def dataset() -> Iterator[Dataset]:
    data = make_dataset()
    yield data
    data.release.set()


def worker(
    make_runner: RunnerFactory, dataset: Dataset, recorder: Recorder, **options: Any
) -> JobRunner:
    runner = make_runner(
        dataset.registry,
        idle_wait_ms=50,
        get_active_tenant_ids=lambda: ["acme"],
        **recorder.hooks(),
        **options,
    )
    runner.start()
    return runner


def kill(runner: JobRunner, job: str, count: int, **payload: Any) -> list[str]:
    """Dispatch ``count`` runs of ``job`` that fail for good; wait until they are dead
    letters (the settle after the last hook writes them)."""
    ids = [runner.dispatch(job, {"fail": 1, **payload}) for _ in range(count)]
    wait_for(
        lambda: set(ids) <= {d.message_id for d in runner.dead_letters(limit=1_000)},
        what=f"{count} dead letters of {job}",
    )
    return ids


def sign_in(client: TestClient) -> str:
    """Sign ``client`` in; return the CSRF token of its session."""
    response = client.post("/login", data={"token": TOKEN, "next": "/dead"})
    assert response.status_code in (200, 303), response.text
    found = CSRF.search(client.get("/dead").text)
    assert found is not None
    return found.group(1)


def test_every_page_renders_what_the_dataset_holds(
    make_runner: RunnerFactory, dataset: Dataset, recorder: Recorder
) -> None:
    # Given a worker with a dead run, a held lock, a waiting dedup key and a boot job
    runner = worker(make_runner, dataset, recorder)
    (dead_id,) = kill(runner, "shop:job:explode", 1, message="disk full")
    ledger_id = runner.dispatch("shop:job:ledger")
    recorder.wait_until(lambda r: bool(r.of("start", "shop:job:ledger")), what="the ledger runs")
    runner.pause("shop:job:other")
    runner.dispatch("shop:job:other", dedup_key="nightly-export")
    recorder.wait_until(lambda r: bool(r.of("complete", "shop:job:warm")), what="the boot job")
    client = TestClient(create_app(runner, token=TOKEN))
    sign_in(client)

    # When every page is asked for, Then each answers 200 with what it is about
    expected = {
        "/": ["worker lane", "Last hour", "1 alive", "disk full", "shop:job:other"],
        "/jobs": ["shop:job:nightly", "cron 0 3 * * * UTC", "paused", "run on boot"],
        "/runs": [dead_id[:8], "completed", "dead"],
        "/runs?job=shop:job:explode&status=dead": [dead_id[:8]],
        f"/runs/{dead_id}": ["Attempt 1 of 1", "RuntimeError", "Traceback", "dead letter"],
        "/dead": [dead_id[:8], "disk full"],
        "/locks": ["shop:job:ledger", ledger_id[:8]],
        "/dedup?job=shop:job:other&key=nightly-export": ["nightly-export", "queued"],
        "/schedules": ["shop:job:nightly", "0 3 * * *", "No scheduler is alive"],
        "/boot": ["shop:job:warm", "set"],
    }
    for path, texts in expected.items():
        response = client.get(path)
        assert response.status_code == 200, (path, response.text)
        for text in texts:
            assert text in response.text, (path, text)
    assert 'class="chart"' in client.get("/").text
    # the dedup page lists the live key from its index, first page, whatever else Redis holds
    assert "nightly-export" in client.get("/dedup").text


def test_an_html_payload_in_an_error_shows_as_text(
    make_runner: RunnerFactory, dataset: Dataset, recorder: Recorder, monkeypatch: Any
) -> None:
    monkeypatch.delenv("KUMIKO_DASHBOARD_TOKEN", raising=False)
    runner = worker(make_runner, dataset, recorder)
    (dead_id,) = kill(runner, "shop:job:explode", 1)
    client = TestClient(create_app(runner))

    for path in ("/", "/runs", f"/runs/{dead_id}", "/dead"):
        page = client.get(path).text
        assert "&lt;script&gt;alert(" in page, path
        assert "<script>alert(" not in page, path
        assert "<b>bold</b>" not in page, path
    # what a query reflects is escaped too
    page = client.get("/runs", params={"tenant": '"><script>x()</script>'}).text
    assert "<script>x()" not in page
    assert "&lt;script&gt;x()" in page


def test_a_read_only_dashboard_shows_no_action_and_refuses_every_post(
    make_runner: RunnerFactory, dataset: Dataset, recorder: Recorder, monkeypatch: Any
) -> None:
    # Given no token anywhere
    monkeypatch.delenv("KUMIKO_DASHBOARD_TOKEN", raising=False)
    runner = worker(make_runner, dataset, recorder)
    (dead_id,) = kill(runner, "shop:job:explode", 1)
    client = TestClient(create_app(runner))

    # Then pages show no action form and say read-only
    for path in ("/", "/jobs", "/dead", f"/runs/{dead_id}"):
        page = client.get(path).text
        assert "/actions/" not in page, path
        assert "read-only" in page, path
    # and every action is refused, changing nothing
    for action, field in (("retry", {"message_id": dead_id}), ("pause", {"job": "shop:job:other"})):
        response = client.post(f"/actions/{action}", data=field)
        assert response.status_code == 403
        assert "read-only" in response.text
    assert [d.message_id for d in runner.dead_letters()] == [dead_id]
    assert runner.status().paused == []
    assert client.post("/login", data={"token": "anything at all!!"}).status_code == 403
    # and the browser is told to run no script but the dashboard's own
    headers = client.get("/").headers
    assert "script-src 'self'" in headers["content-security-policy"]
    assert headers["cache-control"] == "no-store"


def test_with_a_token_every_page_needs_a_sign_in(
    make_runner: RunnerFactory, dataset: Dataset, monkeypatch: Any
) -> None:
    # Given a token from the environment
    monkeypatch.setenv("KUMIKO_DASHBOARD_TOKEN", TOKEN)
    runner = make_runner(dataset.registry)
    client = TestClient(create_app(runner), follow_redirects=False)

    # Then a page sends a stranger to the sign-in, with the way back
    response = client.get("/dead?job=shop:job:explode")
    assert response.status_code == 303
    assert response.headers["location"] == "/login?next=%2Fdead%3Fjob%3Dshop%3Ajob%3Aexplode"
    # a wrong token is refused; the right one lets in and goes back
    assert client.post("/login", data={"token": "wrong-token-wrong-token"}).status_code == 403
    response = client.post("/login", data={"token": TOKEN, "next": "/dead"})
    assert (response.status_code, response.headers["location"]) == (303, "/dead")
    assert "httponly" in response.headers["set-cookie"].lower()
    assert "samesite=strict" in response.headers["set-cookie"].lower()
    assert client.get("/dead").status_code == 200
    # a "next" leading to another site leads home instead
    response = client.post("/login", data={"token": TOKEN, "next": "//evil.example/x"})
    assert response.headers["location"] == "/"


def test_signing_out_ends_the_session_even_for_a_copied_cookie(
    make_runner: RunnerFactory, dataset: Dataset, redis_client: Any
) -> None:
    runner = make_runner(dataset.registry)
    client = TestClient(create_app(runner, token=TOKEN), follow_redirects=False)
    csrf = sign_in(client)
    cookie = client.cookies["kumiko-dashboard"]
    # the session is stored by the SHA-256 of its cookie, for the session's lifetime
    (stored,) = redis_client.scan_iter(match=f"kumiko:{runner.queue_prefix}:dashboard:session:*")
    assert 12 * 3600 * 1000 - 60_000 < redis_client.pttl(stored) <= 12 * 3600 * 1000
    assert cookie.encode() not in redis_client.get(stored)
    # Given a copy of the cookie in another browser
    thief = TestClient(create_app(runner, token=TOKEN), follow_redirects=False)
    thief.cookies.set("kumiko-dashboard", cookie)
    assert thief.get("/jobs").status_code == 200
    # When the owner signs out
    response = client.post("/logout", data={"csrf": csrf})
    assert (response.status_code, response.headers["location"]) == (303, "/login")
    # Then the copy no longer opens a page nor acts
    assert thief.get("/jobs").status_code == 303
    response = thief.post("/actions/pause", data={"job": "shop:job:other", "csrf": csrf})
    assert response.status_code == 403
    assert runner.status().paused == []
    assert not redis_client.exists(stored)


def test_the_sign_in_page_shows_a_stranger_nothing_of_the_deployment(
    make_runner: RunnerFactory, dataset: Dataset, redis_url: str
) -> None:
    runner = make_runner(dataset.registry)
    client = TestClient(create_app(runner, token=TOKEN), follow_redirects=False)
    host = redis_url.split("://", 1)[1].split("/", 1)[0]
    for response in (
        client.get("/login"),
        client.get("/no-such-page"),
        client.post("/login", data={"token": "wrong-token-wrong-token"}),
    ):
        page = response.text
        assert host not in page
        assert runner.queue_prefix not in page
        assert "/jobs" not in page  # no navigation
        assert "kumiko_dramatiq 0" not in page  # no version
    # signed in, the same page shows where it is
    sign_in(client)
    assert runner.queue_prefix in client.get("/login").text


def test_sign_ins_are_limited_per_client_address(
    make_runner: RunnerFactory, dataset: Dataset, redis_client: Any
) -> None:
    runner = make_runner(dataset.registry)
    client = TestClient(create_app(runner, token=TOKEN), follow_redirects=False)
    # Given ten wrong tokens from one address
    for _ in range(10):
        assert client.post("/login", data={"token": "wrong-token-wrong-token"}).status_code == 403
    # Then the next attempt is refused without a look at the token, the right one included
    response = client.post("/login", data={"token": TOKEN})
    assert response.status_code == 429
    assert "Too many sign-in attempts" in response.text
    assert "kumiko-dashboard" not in response.headers.get("set-cookie", "")
    # the count lives in Redis, one key per address, expiring with its window
    (counter,) = redis_client.scan_iter(match=f"kumiko:{runner.queue_prefix}:dashboard:signins:*")
    assert 0 < redis_client.pttl(counter) <= 300_000
    # another address is not held back
    other = TestClient(
        create_app(runner, token=TOKEN), follow_redirects=False, client=("10.1.2.3", 5)
    )
    assert other.post("/login", data={"token": TOKEN}).status_code == 303


def test_an_action_needs_the_sessions_csrf_token(
    make_runner: RunnerFactory, dataset: Dataset, recorder: Recorder
) -> None:
    runner = worker(make_runner, dataset, recorder)
    (dead_id,) = kill(runner, "shop:job:explode", 1)
    client = TestClient(create_app(runner, token=TOKEN), follow_redirects=False)
    csrf = sign_in(client)

    # Without the CSRF token, or with another session's, the retry is refused
    assert client.post("/actions/retry", data={"message_id": dead_id}).status_code == 403
    other = TestClient(create_app(runner, token=TOKEN), follow_redirects=False)
    other_csrf = sign_in(other)
    assert other_csrf != csrf
    response = client.post("/actions/retry", data={"message_id": dead_id, "csrf": other_csrf})
    assert response.status_code == 403
    # signed out, with a CSRF token, too
    stranger = TestClient(create_app(runner, token=TOKEN), follow_redirects=False)
    response = stranger.post("/actions/retry", data={"message_id": dead_id, "csrf": csrf})
    assert response.status_code == 403
    assert [d.message_id for d in runner.dead_letters()] == [dead_id]

    # With it, the dead letter runs again and the way back shows the outcome once
    response = client.post(
        "/actions/retry", data={"message_id": dead_id, "csrf": csrf, "back": "/dead"}
    )
    assert (response.status_code, response.headers["location"]) == (303, "/dead")
    recorder.wait_until(lambda r: len(r.of("failed", "shop:job:explode")) == 2, what="the retry")
    page = client.get("/dead").text
    assert "re-enqueued" in page
    assert "re-enqueued" not in client.get("/dead").text


def test_retry_all_of_a_job_re_enqueues_only_its_dead_letters(
    make_runner: RunnerFactory, dataset: Dataset, recorder: Recorder
) -> None:
    runner = worker(make_runner, dataset, recorder)
    kill(runner, "shop:job:explode", 3, message="fails again")
    (other_id,) = kill(runner, "shop:job:other", 1)
    client = TestClient(create_app(runner, token=TOKEN), follow_redirects=False)
    csrf = sign_in(client)

    response = client.post("/actions/retry-all", data={"job": "shop:job:explode", "csrf": csrf})

    assert response.status_code == 303
    recorder.wait_until(lambda r: len(r.of("failed", "shop:job:explode")) == 6, what="3 retries")
    assert "3 dead letter(s) of shop:job:explode re-enqueued" in client.get("/").text
    letters = runner.dead_letters()
    assert other_id in {d.message_id for d in letters}
    assert len([d for d in letters if d.job_name == "shop:job:explode"]) == 3


def test_cancel_pause_and_resume_act_through_the_dashboard(
    make_runner: RunnerFactory, dataset: Dataset, recorder: Recorder
) -> None:
    runner = worker(make_runner, dataset, recorder)
    client = TestClient(create_app(runner, token=TOKEN), follow_redirects=False)
    csrf = sign_in(client)

    # pause and resume
    client.post("/actions/pause", data={"job": "shop:job:other", "csrf": csrf})
    assert runner.status().paused == ["shop:job:other"]
    assert "Resume" in client.get("/jobs").text
    client.post("/actions/resume", data={"job": "shop:job:other", "csrf": csrf})
    assert runner.status().paused == []

    # cancel a delayed message: its record says cancelled, and it offers no Cancel any more
    delayed = runner.dispatch("shop:job:explode", delay_ms=600_000)
    assert 'data-action="cancel"' in client.get(f"/runs/{delayed}").text
    client.post("/actions/cancel", data={"message_id": delayed, "csrf": csrf})
    assert [run.status for run in runner.run_record(delayed)] == ["cancelled"]
    page = client.get(f"/runs/{delayed}").text
    assert "cancelled" in page
    assert 'data-action="cancel"' not in page
    # an id no message has shows no Cancel either
    assert 'data-action="cancel"' not in client.get("/runs/0f8d5e9a-no-such-message").text

    # bad input is one line naming the field and value, nothing done
    client.post("/actions/pause", data={"job": "shop:job:nope", "csrf": csrf, "back": "/jobs"})
    assert "job &#39;shop:job:nope&#39; is not a declared job" in client.get("/jobs").text


def test_the_chart_counts_the_last_hours_runs_per_minute(
    make_runner: RunnerFactory, dataset: Dataset, recorder: Recorder
) -> None:
    # Given the boot job and three more runs completed, and one dead
    runner = worker(make_runner, dataset, recorder)
    for _ in range(3):
        runner.dispatch("shop:job:explode")
    kill(runner, "shop:job:explode", 1)
    wait_for(lambda: len(runner.runs(status="completed")) == 4, what="four completed run records")

    # When the last hour is counted, as the overview does
    now_ms = int(time.time() * 1000)
    counts = runner.history.counts(("completed", "failed", "dead"), minute_edges(now_ms))

    # Then every run is in its minute, and the page says so
    assert (sum(counts["completed"]), sum(counts["failed"]), sum(counts["dead"])) == (4, 0, 1)
    assert all(len(per_minute) == 60 for per_minute in counts.values())
    page = TestClient(create_app(runner, token=TOKEN))
    sign_in(page)
    assert "4 completed · 1 failed attempts" in page.get("/").text


def test_dead_letter_pages_neither_repeat_nor_skip_across_lanes(
    make_runner: RunnerFactory, dataset: Dataset, recorder: Recorder
) -> None:
    # Given dead letters in both lanes
    runner = worker(make_runner, dataset, recorder)
    worker(make_runner, dataset, recorder, lane="api")
    kill(runner, "shop:job:explode", 4)
    kill(runner, "shop:job:api_explode", 3)
    kill(runner, "shop:job:other", 2)
    everything = runner.admin.dead_letter_page(limit=100)[0]
    assert len(everything) == 9

    # When read three at a time, with or without a job filter
    for job, expected in ((None, 9), ("shop:job:explode", 4), ("shop:job:api_explode", 3)):
        seen, cursor = [], None
        while True:
            page, cursor = runner.admin.dead_letter_page(job, after=cursor, limit=3, max_read=3)
            seen += page
            if cursor is None:
                break
        # Then every letter comes once, newest first
        assert len(seen) == expected
        assert len({d.message_id for d in seen}) == expected
        assert [d.dead_at for d in seen] == sorted((d.dead_at for d in seen), reverse=True)
        assert all(job is None or d.job_name == job for d in seen)


def test_the_runs_pages_older_link_walks_every_run_once(
    make_runner: RunnerFactory, dataset: Dataset, recorder: Recorder
) -> None:
    # Given more completed runs than a page holds
    runner = worker(make_runner, dataset, recorder)
    for _ in range(45):
        runner.dispatch("shop:job:explode")
    wait_for(lambda: len(runner.runs(status="completed", limit=100)) >= 46, what="46 runs")
    expected = {r.run_id for r in runner.runs(status="completed", limit=100)}
    page = TestClient(create_app(runner, token=TOKEN))
    sign_in(page)

    # When the pages of 20 are followed by their "Older" link (a cursor)
    seen: list[str] = []
    params: dict[str, str] = {"status": "completed", "limit": "20"}
    for _ in range(10):
        html = page.get("/runs", params=params).text
        seen += re.findall(r'href="[^"]*/runs/([0-9a-f-]{36})" title', html)
        cursor = re.search(r"cursor=([0-9a-f-]{36}(?:%3A|:)\d+)", html)
        if cursor is None:
            break
        params = {
            "status": "completed",
            "limit": "20",
            "cursor": cursor.group(1).replace("%3A", ":"),
        }

    # Then every run was on exactly one page
    assert len(seen) == len(set(seen))
    assert set(seen) == {run_id.rpartition(":")[0] for run_id in expected}


def test_locks_are_listed_off_their_index_with_holder_and_held_since(
    make_runner: RunnerFactory, dataset: Dataset, recorder: Recorder
) -> None:
    runner = worker(make_runner, dataset, recorder)
    ledger = runner.dispatch("shop:job:ledger")
    runner.dispatch("shop:job:per_tenant_ledger")
    recorder.wait_until(
        lambda r: (
            bool(r.of("start", "shop:job:ledger"))
            and any(e.meta.tenant_id == "acme" for e in r.of("start", "shop:job:per_tenant_ledger"))
        ),
        what="both sequential jobs hold their locks",
    )

    locks = runner.locks()

    assert [(lock.job_name, lock.tenant_id) for lock in locks] == [
        ("shop:job:ledger", None),
        ("shop:job:per_tenant_ledger", "acme"),
    ]
    ledger_lock = locks[0]
    assert (ledger_lock.message_id, ledger_lock.origin_id) == (ledger, ledger)
    assert ledger_lock.worker is not None
    assert ledger_lock.worker_alive
    assert ledger_lock.held_since is not None
    assert ledger_lock.held_since <= datetime.now(UTC)
    # and the page shows them, with when each was taken
    page = TestClient(create_app(runner)).get("/locks")
    assert "held since" in page.text
    assert "shop:job:per_tenant_ledger" in page.text


def test_dedup_keys_are_paged_off_their_index_and_looked_up_by_key(
    make_runner: RunnerFactory, dataset: Dataset
) -> None:
    # Given a producer (no worker) with keyed messages waiting, in one batch (one expiry)
    runner = make_runner(dataset.registry)
    keys = ["a", "b", "c:d", "e", "f"]
    ids = dict(
        zip(keys, runner.dispatch_many("shop:job:other", [{}] * 5, dedup_keys=keys), strict=True)
    )

    # When they are paged through two at a time
    seen: list[str] = []
    cursor = None
    while True:
        page, cursor = runner.admin.dedup_page("shop:job:other", after=cursor, limit=2)
        seen += [info.dedup_key for info in page]
        assert {info.dedup_key: info.message_id for info in page}.items() <= ids.items()
        if cursor is None:
            break

    # Then each key shows once; one lookup reads one
    assert sorted(seen) == sorted(keys)
    record = runner.admin.dedup_record(runner.job("shop:job:other"), "c:d")
    assert record is not None
    assert (record.message_id, record.state) == (ids["c:d"], "queued")
    assert runner.admin.dedup_record(runner.job("shop:job:other"), "zzz") is None


def test_mounted_under_a_path_its_links_redirects_and_cookies_follow_the_path(
    make_runner: RunnerFactory, dataset: Dataset
) -> None:
    # Given the dashboard mounted in a host app, as in FastAPI's app.mount(...)
    runner = make_runner(dataset.registry)
    host = Starlette(routes=[Mount("/ops/kumiko", app=create_app(runner, token=TOKEN))])
    client = TestClient(host, follow_redirects=False)

    # Then the sign-in, its cookie and every link stay under the mount path
    response = client.get("/ops/kumiko/jobs")
    assert response.headers["location"] == "/ops/kumiko/login?next=%2Fjobs"
    response = client.post("/ops/kumiko/login", data={"token": TOKEN, "next": "/jobs"})
    assert response.headers["location"] == "/ops/kumiko/jobs"
    assert "path=/ops/kumiko" in response.headers["set-cookie"].lower()
    page = client.get("/ops/kumiko/jobs").text
    assert 'href="/ops/kumiko/runs?job=shop%3Ajob%3Aledger"' in page
    assert 'action="/ops/kumiko/actions/pause"' in page
    assert 'href="/ops/kumiko/static/dashboard.css' in page
    assert client.get("/ops/kumiko/static/dashboard.js").status_code == 200


def test_an_unreachable_redis_is_a_503_page_naming_it_to_a_signed_in_operator(
    dataset: Dataset,
) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]  # nothing listens there once closed
    runner = JobRunner(
        dataset.registry, redis_url=f"redis://127.0.0.1:{port}/0", boot_redis_timeout_ms=500
    )
    client = TestClient(create_app(runner, token=TOKEN))
    try:
        # to someone not signed in, a 503 that names nothing
        response = client.post("/login", data={"token": TOKEN, "next": "/dead"})
        assert response.status_code == 503
        assert f"127.0.0.1:{port}" not in response.text
        # to a signed-in operator (a well-signed cookie: no session can be read), the Redis
        client.cookies.set("kumiko-dashboard", new_session(TOKEN, int(time.time())))
        response = client.get("/")
        assert response.status_code == 503
        assert f"127.0.0.1:{port}" in response.text
    finally:
        runner.stop()


def test_a_token_too_short_to_guard_anything_is_refused(
    make_runner: RunnerFactory, dataset: Dataset
) -> None:
    runner = make_runner(dataset.registry)
    with pytest.raises(JobConfigError, match="token must be at least 16 characters"):
        create_app(runner, token="short")


def cli_env(redis_url: str, prefix: str, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KUMIKO_")}
    env.update(
        PYTHONPATH=str(ROOT),
        KUMIKO_APP="tests.apps.ops_app:registry",
        KUMIKO_REDIS_URL=redis_url,
        KUMIKO_QUEUE_PREFIX=prefix,
        **extra,
    )
    return env


def test_the_cli_refuses_a_non_loopback_host_without_a_token(redis_url: str, prefix: str) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "kumiko_dramatiq.ops.cli", "dashboard", "--host", "0.0.0.0"],
        env=cli_env(redis_url, prefix),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1
    assert "refusing to serve on 0.0.0.0 without a token" in done.stderr


def test_the_cli_says_in_one_line_when_the_extra_is_missing(redis_url: str, prefix: str) -> None:
    # starlette made unimportable, as in an install without the extra
    script = (
        "import sys; sys.modules['starlette'] = None; "
        "from kumiko_dramatiq.ops.cli import main; sys.exit(main(['dashboard']))"
    )
    done = subprocess.run(
        [sys.executable, "-c", script],
        env=cli_env(redis_url, prefix),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "kumiko dashboard: the dashboard needs its extra: pip install "
        "'kumiko_dramatiq[dashboard]' (missing module starlette)"
    ]


def test_the_cli_serves_the_dashboard(redis_url: str, prefix: str) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = subprocess.Popen(
        [sys.executable, "-m", "kumiko_dramatiq.ops.cli", "dashboard", "--port", str(port)],
        env=cli_env(redis_url, prefix),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    pages: list[str] = []

    def answers() -> bool:
        assert server.poll() is None, "kumiko dashboard exited"
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/jobs", timeout=5) as reply:
                pages.append(reply.read().decode())
                return True
        except OSError:
            return False

    try:
        wait_for(answers, timeout_s=30, what="kumiko dashboard answers")
        assert "ops:job:flaky" in pages[0]
        assert "read-only" in pages[0]
    finally:
        server.terminate()
        assert server.wait(timeout=30) == 0
