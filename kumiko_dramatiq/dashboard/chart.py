"""The overview's chart: runs per minute over the last hour, as inline SVG geometry.

Pure functions: :func:`minute_edges` picks the intervals (from ``now_ms``, never the clock),
:func:`bar_chart` turns per-interval counts into bars the template draws as ``<rect>``
elements with a ``<title>`` each (a tooltip without JavaScript). Completed runs stack under
failures (``failed`` + ``dead`` attempts), on one scale whose top is a round number.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Final

MINUTE_MS: Final = 60_000


def minute_edges(now_ms: int, minutes: int = 60) -> list[int]:
    """``minutes + 1`` edges (epoch ms) of whole-minute intervals, the last one open-ended at
    ``now_ms``: ``[start of the minute 59 minutes ago, ..., start of this minute, now_ms + 1]``.
    """
    this_minute = now_ms - now_ms % MINUTE_MS
    first = this_minute - (minutes - 1) * MINUTE_MS
    return [first + i * MINUTE_MS for i in range(minutes)] + [now_ms + 1]


def nice_ceiling(value: int) -> int:
    """The smallest of 1, 2, 5, 10, 20, 50, ... that is at least ``value`` (at least 1)."""
    step = 1
    while True:
        for factor in (1, 2, 5):
            if step * factor >= value:
                return step * factor
        step *= 10


@dataclass(frozen=True)
class Bar:
    x: float
    width: float
    #: the completed part, from the baseline up
    ok_y: float
    ok_height: float
    #: the failed part, stacked on top
    failed_y: float
    failed_height: float
    title: str


@dataclass(frozen=True)
class Chart:
    width: int
    height: int
    #: top of the plotting area and the baseline, in SVG units
    top: float
    baseline: float
    scale_max: int
    bars: list[Bar]
    completed_total: int
    failed_total: int
    #: x position, text and SVG ``text-anchor`` of the time labels under the bars
    labels: list[tuple[float, str, str]]


def bar_chart(
    edges_ms: Sequence[int],
    completed: Sequence[int],
    failed: Sequence[int],
    *,
    width: int = 960,
    height: int = 170,
) -> Chart:
    """Bars for intervals ``edges_ms[i]..edges_ms[i + 1]`` with ``completed[i]`` and
    ``failed[i]`` runs; a label under the first bar, every 15th and the last."""
    count = len(edges_ms) - 1
    if len(completed) != count or len(failed) != count:
        raise ValueError("one completed and one failed count per interval")
    top, baseline = 8.0, float(height - 20)
    scale_max = nice_ceiling(
        max((c + f for c, f in zip(completed, failed, strict=True)), default=0)
    )
    slot = width / max(count, 1)
    gap = min(2.0, slot / 4)
    per_unit = (baseline - top) / scale_max
    bars, labels = [], []
    for i in range(count):
        ok_height = completed[i] * per_unit
        failed_height = failed[i] * per_unit
        start = datetime.fromtimestamp(edges_ms[i] / 1000, UTC)
        bars.append(
            Bar(
                x=round(i * slot + gap / 2, 2),
                width=round(slot - gap, 2),
                ok_y=round(baseline - ok_height, 2),
                ok_height=round(ok_height, 2),
                failed_y=round(baseline - ok_height - failed_height, 2),
                failed_height=round(failed_height, 2),
                title=f"{start:%H:%M} UTC: {completed[i]} completed, {failed[i]} failed",
            )
        )
        if i == 0:
            labels.append((bars[-1].x, f"{start:%H:%M}", "start"))
        elif i == count - 1:
            labels.append((round(bars[-1].x + bars[-1].width, 2), f"{start:%H:%M}", "end"))
        elif i % 15 == 0:
            labels.append((round(i * slot + slot / 2, 2), f"{start:%H:%M}", "middle"))
    return Chart(
        width=width,
        height=height,
        top=top,
        baseline=baseline,
        scale_max=scale_max,
        bars=bars,
        completed_total=sum(completed),
        failed_total=sum(failed),
        labels=labels,
    )
