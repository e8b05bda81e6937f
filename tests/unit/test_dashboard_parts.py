"""The dashboard's pure parts: the chart's geometry, sessions and CSRF tokens, safe
redirects, the loopback check of ``kumiko dashboard``."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from kumiko_dramatiq.dashboard.app import _safe_back
from kumiko_dramatiq.dashboard.chart import MINUTE_MS, bar_chart, minute_edges, nice_ceiling
from kumiko_dramatiq.dashboard.security import (
    SESSION_S,
    check_token,
    csrf_token,
    csrf_valid,
    new_session,
    session_digest,
    session_valid,
)
from kumiko_dramatiq.errors import JobConfigError
from kumiko_dramatiq.ops.cli import is_loopback

TOKEN = "0123456789abcdef-token"
NOW_S = 1_800_000_000


def test_minute_edges_cover_the_last_hour_in_whole_minutes_up_to_now() -> None:
    now_ms = int(datetime(2026, 12, 1, 10, 30, 15, tzinfo=UTC).timestamp() * 1000)
    edges = minute_edges(now_ms)
    assert len(edges) == 61
    assert edges[-2] == now_ms - 15_000  # this minute's start
    assert edges[0] == edges[-2] - 59 * MINUTE_MS
    assert edges[-1] == now_ms + 1


@pytest.mark.parametrize(
    ("value", "ceiling"), [(0, 1), (1, 1), (3, 5), (7, 10), (11, 20), (99, 100)]
)
def test_the_scale_tops_at_a_round_number(value: int, ceiling: int) -> None:
    assert nice_ceiling(value) == ceiling


def test_bars_stack_failures_on_completed_runs_on_one_scale() -> None:
    edges = [0, MINUTE_MS, 2 * MINUTE_MS, 3 * MINUTE_MS]
    chart = bar_chart(edges, [10, 0, 4], [0, 3, 1], width=300, height=120)
    assert (chart.scale_max, chart.completed_total, chart.failed_total) == (10, 14, 4)
    full = chart.baseline - chart.top
    first, second, third = chart.bars
    assert first.ok_height == pytest.approx(full)
    assert second.ok_height == 0
    assert second.failed_height == pytest.approx(full * 0.3)
    assert third.failed_y + third.failed_height == pytest.approx(third.ok_y)
    assert first.title == "00:00 UTC: 10 completed, 0 failed"
    assert [anchor for _, _, anchor in chart.labels] == ["start", "end"]
    with pytest.raises(ValueError, match="one completed and one failed count"):
        bar_chart(edges, [1], [1])


def test_a_session_is_valid_for_its_token_and_its_lifetime_only() -> None:
    session = new_session(TOKEN, NOW_S)
    assert session_valid(TOKEN, session, NOW_S + SESSION_S)
    assert not session_valid(TOKEN, session, NOW_S + SESSION_S + 1)
    assert not session_valid(TOKEN, session, NOW_S - 1)
    assert not session_valid(TOKEN + "x", session, NOW_S)
    issued, nonce, mac = session.split(".")
    assert not session_valid(TOKEN, f"{int(issued) + 60}.{nonce}.{mac}", NOW_S)
    for forged in (None, "", "1.2", "x.y.z", f"{issued}.{nonce}.{'0' * 64}"):
        assert not session_valid(TOKEN, forged, NOW_S)


def test_a_session_is_stored_under_a_digest_that_is_not_its_cookie() -> None:
    one, other = new_session(TOKEN, NOW_S), new_session(TOKEN, NOW_S)
    assert session_digest(one) == session_digest(one)
    assert session_digest(one) != session_digest(other)
    assert one not in session_digest(one)
    assert len(session_digest(one)) == 64


def test_a_csrf_token_belongs_to_one_session() -> None:
    one, other = new_session(TOKEN, NOW_S), new_session(TOKEN, NOW_S)
    assert csrf_valid(TOKEN, one, csrf_token(TOKEN, one))
    assert not csrf_valid(TOKEN, one, csrf_token(TOKEN, other))
    assert not csrf_valid(TOKEN, one, None)
    assert not csrf_valid(TOKEN, one, "")


def test_a_token_must_be_long_enough_and_is_never_shown() -> None:
    assert check_token(None) is None
    assert check_token("") is None
    assert check_token(TOKEN) == TOKEN
    with pytest.raises(JobConfigError, match="at least 16 characters") as caught:
        check_token("tiny-secret", "KUMIKO_DASHBOARD_TOKEN")
    assert "tiny-secret" not in str(caught.value)
    assert "KUMIKO_DASHBOARD_TOKEN" in str(caught.value)


@pytest.mark.parametrize(
    ("given", "kept"),
    [
        ("/dead?job=a:job:b", "/dead?job=a:job:b"),
        ("/", "/"),
        ("//evil.example/x", "/"),
        ("/\\evil.example", "/"),
        ("https://evil.example/", "/"),
        ("dead", "/"),
        (None, "/"),
    ],
)
def test_after_an_action_the_way_back_stays_on_the_dashboard(given: str | None, kept: str) -> None:
    assert _safe_back(given) == kept


@pytest.mark.parametrize(
    ("host", "loopback"),
    [
        ("127.0.0.1", True),
        ("127.1.2.3", True),
        ("::1", True),
        ("[::1]", True),
        ("localhost", True),
        ("0.0.0.0", False),
        ("::", False),
        ("192.168.1.5", False),
        ("example.com", False),
    ],
)
def test_loopback_hosts_are_told_apart(host: str, loopback: bool) -> None:
    assert is_loopback(host) is loopback
