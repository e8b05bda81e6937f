"""How a purge sizes its steps over a delay queue's bodies: a pure function."""

from __future__ import annotations

from kumiko_dramatiq.ops.admin import PURGE_STEP, PURGE_STEP_BYTES, purge_scan_count


def test_a_step_that_read_nothing_keeps_its_count() -> None:
    assert purge_scan_count(1, 0, 0) == 1
    assert purge_scan_count(7, 0, 0) == 7


def test_the_next_count_fits_bodies_like_the_last_ones_in_the_step_bytes() -> None:
    assert PURGE_STEP_BYTES // 20_000 < PURGE_STEP
    assert purge_scan_count(1, 20_000, 1) == PURGE_STEP_BYTES // 20_000
    assert purge_scan_count(1, 300, 1) == PURGE_STEP  # small bodies: the entry cap
    assert purge_scan_count(50, 5_000_000, 5) == 1  # large ones: one at a time
