"""``ctx.progress`` without Redis: the coalescing rule (times handed in, no clock, no sleeps),
what a report accepts, how ``kumiko busy`` words it, and ``testing.run_job``'s memory."""

from __future__ import annotations

import itertools
import math
from typing import Any

import pytest

from kumiko_dramatiq import Feature, JobContext, JobMeta, PayloadError, Registry
from kumiko_dramatiq.progress import (
    MAX_NOTE_CHARS,
    REFRESH_S,
    WRITE_INTERVAL_S,
    Coalescer,
    InMemoryProgress,
    check_progress,
    merged,
    progress_label,
)
from kumiko_dramatiq.testing import run_job


def writes_at(reports_ms: list[int], until_ms: int) -> list[int]:
    """The times (ms) a writer checking every millisecond writes, given reports at
    ``reports_ms``: the real writer wakes at each report and each due time, which this
    samples."""
    coalescer = Coalescer()
    reports = set(reports_ms)
    written = []
    for ms in range(until_ms + 1):
        if ms in reports:
            coalescer.offer()
        if coalescer.take(ms / 1000):
            written.append(ms)
    return written


def test_the_first_report_is_due_at_once() -> None:
    coalescer = Coalescer()
    assert coalescer.due_at() is None  # nothing reported: nothing to write
    assert coalescer.offer() is True
    assert coalescer.take(100.0) is True
    assert coalescer.last_write_s == 100.0


def test_a_report_soon_after_a_write_waits_for_the_interval() -> None:
    coalescer = Coalescer()
    coalescer.offer()
    coalescer.take(10.0)
    coalescer.offer()
    assert coalescer.take(10.0 + WRITE_INTERVAL_S / 2) is False
    assert coalescer.due_at() == 10.0 + WRITE_INTERVAL_S
    assert coalescer.take(10.0 + WRITE_INTERVAL_S) is True


def test_only_the_first_report_after_a_write_wakes_the_writer() -> None:
    coalescer = Coalescer()
    assert coalescer.offer() is True
    assert [coalescer.offer() for _ in range(1_000)] == [False] * 1_000
    coalescer.take(0.0)
    assert coalescer.offer() is True


def test_a_tight_loop_costs_one_write_per_interval_and_the_last_lands_within_one() -> None:
    # Given 10,000 reports a millisecond apart (10 s)
    reports = list(range(10_000))
    written = writes_at(reports, until_ms=15_000)
    interval_ms = round(WRITE_INTERVAL_S * 1000)
    # Then the first is written at once, then one write per interval at most: 2 a second
    assert written[0] == 0
    assert all(b - a >= interval_ms for a, b in itertools.pairwise(written))
    assert len(written) <= 1 + 10_000 // interval_ms + 1
    # And a write follows the last report within an interval (the trailing write), then
    # none until the refresh
    last = reports[-1]
    assert [t for t in written if t >= last] != []
    assert min(t for t in written if t >= last) <= last + interval_ms
    assert [t for t in written if t > last + interval_ms] == []


def test_a_quiet_attempt_is_written_again_every_refresh() -> None:
    coalescer = Coalescer()
    coalescer.offer()
    coalescer.take(0.0)
    assert coalescer.due_at() == REFRESH_S
    assert coalescer.take(REFRESH_S - 1) is False
    assert coalescer.take(REFRESH_S) is True
    assert coalescer.due_at() == 2 * REFRESH_S


def test_a_write_that_failed_is_taken_again_an_interval_later() -> None:
    coalescer = Coalescer()
    coalescer.offer()
    coalescer.take(5.0)
    coalescer.failed()
    assert coalescer.due_at() == 5.0 + WRITE_INTERVAL_S


def test_none_keeps_what_was_reported_before() -> None:
    assert merged((None, None), 0.5, None) == (0.5, None)
    assert merged((0.5, None), None, "upload") == (0.5, "upload")
    assert merged((0.5, "upload"), 0.75, None) == (0.75, "upload")
    assert merged((0.5, "upload"), None, "") == (0.5, "")


@pytest.mark.parametrize(
    ("value", "note"),
    [(0, None), (1, None), (0.5, "half"), (None, "x" * MAX_NOTE_CHARS), (None, None), (0.0, "")],
)
def test_good_reports_are_kept_as_floats(value: Any, note: Any) -> None:
    kept = check_progress("j:job:x", value, note)
    assert kept == (None if value is None else float(value), note)
    assert kept[0] is None or isinstance(kept[0], float)


@pytest.mark.parametrize(
    ("value", "note", "match"),
    [
        (1.01, None, r"^j:job:x: progress value must be a number from 0\.0 to 1\.0, got 1\.01$"),
        (-1, None, r"progress value must be a number from 0\.0 to 1\.0, got -1$"),
        (math.inf, None, r"progress value must be a number .*, got inf$"),
        (math.nan, None, r"progress value must be a number .*, got nan$"),
        (False, None, r"progress value must be a number .*\(or None\), got False$"),
        ("0.5", None, r"progress value .*\(or None\), got '0\.5'$"),
        (None, "x" * (MAX_NOTE_CHARS + 1), r"progress note must be at most 200 characters"),
        (None, b"bytes", r"progress note must be a str \(or None\), got b'bytes'$"),
        (None, "\ud800", r"progress note must be valid Unicode"),
        (None, "tab\there", r"progress note must not contain control characters"),
    ],
)
def test_bad_reports_are_a_payload_error_naming_the_job_and_the_value(
    value: Any, note: Any, match: str
) -> None:
    with pytest.raises(PayloadError, match=match) as raised:
        check_progress("j:job:x", value, note)
    assert isinstance(raised.value, ValueError)
    assert "\n" not in str(raised.value)


def test_kumiko_busy_words_progress_as_a_percentage_and_the_note() -> None:
    assert progress_label(0.42, "parsing") == "42% parsing"
    assert progress_label(0.999, None) == "99%"  # 100% means done
    assert progress_label(1.0, None) == "100%"
    assert progress_label(None, "waiting") == "waiting"
    assert progress_label(None, None) == ""


def _registry() -> Registry:
    etl = Feature("etl")

    @etl.job("load")
    def load(payload: dict[str, Any], ctx: JobContext) -> str:
        ctx.progress(note="reading")
        for i in range(1, 5):
            ctx.progress(i / 4)
        return "done"

    @etl.job("bad")
    def bad(payload: dict[str, Any], ctx: JobContext) -> None:
        ctx.progress(2)

    return Registry([etl])


def test_run_job_keeps_every_report_in_memory() -> None:
    progress = InMemoryProgress()
    assert run_job(_registry(), "etl:job:load", progress=progress) == "done"
    assert progress.reports == [
        (None, "reading"),
        (0.25, "reading"),
        (0.5, "reading"),
        (0.75, "reading"),
        (1.0, "reading"),
    ]
    assert (progress.value, progress.note) == (1.0, "reading")


def test_run_job_checks_reports_as_a_worker_does() -> None:
    with pytest.raises(PayloadError, match=r"^etl:job:bad: progress value .*, got 2$"):
        run_job(_registry(), "etl:job:bad")


def test_a_context_without_a_sink_checks_and_drops_reports() -> None:
    ctx = JobContext(
        job_name="etl:job:x",
        message_id="m",
        meta=JobMeta(attempt=1, max_attempts=1, tenant_id=None, trigger="manual"),
        app=None,
    )
    ctx.progress(0.5, "fine")
    with pytest.raises(PayloadError, match="progress value"):
        ctx.progress(7)
