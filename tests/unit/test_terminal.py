"""The ``kumiko`` command's tables and times (:mod:`kumiko_dramatiq.ops.terminal`)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta, timezone

import pytest

from kumiko_dramatiq.ops.terminal import display_width, fit, parse_when, table, without_frames_of

NOW = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)
PLUS_2 = timezone(timedelta(hours=2))


@pytest.mark.parametrize(
    ("text", "width"),
    [
        ("invoice", 7),
        ("請求書", 6),  # wide
        ("ｱｲｳ", 3),  # halfwidth katakana: narrow
        ("\uff21\uff22", 4),  # fullwidth A and B
        ("e\u0301", 1),  # e + combining acute
        ("a\u200bb", 2),  # zero-width space
        ("", 0),
    ],
)
def test_display_width_counts_terminal_columns(text: str, width: int) -> None:
    assert display_width(text) == width


def test_fit_cuts_by_columns_and_never_splits_a_wide_character_past_the_width() -> None:
    assert fit("請求書請求書", 7) == "請求..."
    assert display_width(fit("請求書請求書", 8)) <= 8
    assert fit("short", 10) == "short"
    assert fit("abcdef", 2) == ".."


def test_table_aligns_wide_characters_and_cuts_only_free_text() -> None:
    rows = [["請求書", "m-1", "x" * 200], ["inv", "m-2", "boom"]]
    lines = table(["key", "message", "error"], rows, cuttable=("error",)).splitlines()
    assert all(display_width(line) <= 100 for line in lines)
    starts = {
        display_width(line[: line.index(mid)])
        for line, mid in zip(lines[1:], ["m-1", "m-2"], strict=True)
    }
    assert starts == {lines[0].index("message")}
    assert lines[1].endswith("...")


def test_a_table_of_uncuttable_columns_is_wider_rather_than_cut() -> None:
    long_name = "billing:job:" + "n" * 120
    text = table(["job", "next fire"], [[long_name, "2026-12-02 03:00:00"]])
    assert long_name in text
    assert "2026-12-02 03:00:00" in text


def test_an_empty_table_is_empty_and_empty_columns_go() -> None:
    assert table(["a"], []) == ""
    assert table(["a", "b"], [["1", ""]]) == "a\n1"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("30m", NOW - timedelta(minutes=30)),
        ("1h", NOW - timedelta(hours=1)),
        ("2d", NOW - timedelta(days=2)),
        ("1w", NOW - timedelta(weeks=1)),
        ("90s", NOW - timedelta(seconds=90)),
        ("1h30m", NOW - timedelta(minutes=90)),
        (" 1H ", NOW - timedelta(hours=1)),
        ("2026-11-30T08:00:00", datetime(2026, 11, 30, 8, tzinfo=UTC)),
        (
            "2026-11-30T08:00:00+02:00",
            datetime(2026, 11, 30, 8, tzinfo=timezone(timedelta(hours=2))),
        ),
    ],
)
def test_a_time_is_iso_or_a_span_before_now(text: str, expected: datetime) -> None:
    assert parse_when("--since", text, NOW) == expected


@pytest.mark.parametrize("text", ["yesterday", "1y", "h1", "-1h", "1.5h", ""])
def test_anything_else_is_a_one_line_error_naming_the_option(text: str) -> None:
    with pytest.raises(ValueError, match="--since must be an ISO-8601 time or a span"):
        parse_when("--since", text, NOW)


def test_a_span_beyond_year_one_is_an_error_not_a_crash() -> None:
    with pytest.raises(ValueError, match="--before reaches before year 1"):
        parse_when("--before", "99999999d", NOW)


TRACEBACK = """Traceback (most recent call last):
  File "/venv/site-packages/dramatiq/worker.py", line 560, in process_message
    res = actor(*message.args, **message.kwargs)
          ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^
  File "/venv/site-packages/kumiko_dramatiq/worker/runtime.py", line 85, in call_handler
    return job.handler(payload, ctx)
  File "/app/shop.py", line 9, in send_invoice
    charge(payload)
  File "/venv/site-packages/kumiko_dramatiq/testing.py", line 3, in helper
    raise_it()
  File "/app/shop.py", line 20, in charge
    raise ConnectionError("451 try later")
ConnectionError: 451 try later
"""


def test_a_traceback_shown_as_text_leaves_the_workers_own_frames_out() -> None:
    shown = without_frames_of(
        TRACEBACK, ["/venv/site-packages/dramatiq/", "/venv/site-packages/kumiko_dramatiq/"]
    )
    assert shown.splitlines() == [
        "Traceback (most recent call last):",
        "  (2 frames of the worker left out)",
        '  File "/app/shop.py", line 9, in send_invoice',
        "    charge(payload)",
        "  (1 frame of the worker left out)",
        '  File "/app/shop.py", line 20, in charge',
        '    raise ConnectionError("451 try later")',
        "ConnectionError: 451 try later",
    ]
    assert without_frames_of(TRACEBACK, []) == TRACEBACK.rstrip()
