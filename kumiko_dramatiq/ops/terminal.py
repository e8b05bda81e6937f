"""What the ``kumiko`` command prints and reads, as pure functions: aligned tables whose
widths count what a terminal shows (a CJK character takes two columns, a combining mark
none), and times given as ISO-8601 or relative to now (``30m``, ``1h``, ``2d``).

Nothing here reads the clock or the terminal: the caller passes ``now`` and the width.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from typing import Any, Final

#: Tables aim at this many columns.
WIDTH: Final = 100

#: Units of a relative time, in seconds.
_UNITS: Final = {"s": 1, "m": 60, "h": 3600, "d": 86_400, "w": 604_800}
_RELATIVE: Final = re.compile(r"(?:\d+[smhdw])+")
_PART: Final = re.compile(r"(\d+)([smhdw])")


def display_width(text: str) -> int:
    """How many terminal columns ``text`` takes: East Asian wide and fullwidth characters
    two, combining marks and zero-width characters none, every other character one."""
    width = 0
    for char in text:
        if unicodedata.combining(char) or unicodedata.category(char) in ("Mn", "Me", "Cf"):
            continue
        width += 2 if unicodedata.east_asian_width(char) in ("W", "F") else 1
    return width


def fit(text: str, width: int) -> str:
    """``text`` cut to at most ``width`` columns, ending in ``...`` when cut."""
    if display_width(text) <= width:
        return text
    kept, used = [], 0
    for char in text:
        char_width = display_width(char)
        if used + char_width > max(0, width - 3):
            break
        kept.append(char)
        used += char_width
    return "".join(kept) + "..."[: max(0, width - used)]


def pad(text: str, width: int) -> str:
    """``text`` followed by spaces up to ``width`` columns."""
    return text + " " * max(0, width - display_width(text))


def table(
    headers: Sequence[str],
    rows: Sequence[Sequence[Any]],
    *,
    cuttable: Sequence[str] = (),
    width: int = WIDTH,
    floor: int = 12,
) -> str:
    """Rows aligned under ``headers`` (column widths in terminal columns). While a line is
    wider than ``width``, the widest column named in ``cuttable`` (free text: errors, keys)
    loses a column, down to ``floor``; every other column (names, ids, times) is never cut,
    so a table of them may be wider. A column empty in every row is left out. Empty without
    rows."""
    if not rows:
        return ""
    cells = [[str(cell) for cell in row] for row in rows]
    shown = [i for i in range(len(headers)) if any(row[i] for row in cells)]
    names = [headers[i] for i in shown]
    cells = [[row[i] for i in shown] for row in cells]
    widths = [
        max(display_width(name), *(display_width(row[i]) for row in cells))
        for i, name in enumerate(names)
    ]
    cut = [i for i, name in enumerate(names) if name in cuttable]
    while sum(widths) + 2 * (len(widths) - 1) > width:
        candidates = [i for i in cut if widths[i] > floor]
        if not candidates:
            break
        widest = max(candidates, key=lambda i: widths[i])
        widths[widest] -= 1

    def line(values: Sequence[str]) -> str:
        return "  ".join(
            pad(fit(value, column), column) for value, column in zip(values, widths, strict=True)
        ).rstrip()

    return "\n".join([line(names), *(line(row) for row in cells)])


def parse_when(option: str, text: str, now: datetime) -> datetime:
    """A time given on the command line: ISO-8601 (UTC when it has no offset), or a span
    before ``now`` (aware): a number and a unit, ``s``, ``m``, ``h``, ``d`` or ``w``, one or
    more (``90s``, ``30m``, ``1h30m``, ``2d``). Anything else is a ``ValueError`` naming
    ``option`` and the value."""
    spaced = text.strip().lower()
    if _RELATIVE.fullmatch(spaced):
        seconds = sum(int(n) * _UNITS[unit] for n, unit in _PART.findall(spaced))
        try:
            return now - timedelta(seconds=seconds)
        except OverflowError:
            raise ValueError(f"{option} reaches before year 1: {text!r}") from None
    try:
        value = datetime.fromisoformat(text)
    except ValueError:
        raise ValueError(
            f"{option} must be an ISO-8601 time or a span before now such as 30m, 1h or 2d, "
            f"got {text!r}"
        ) from None
    return value if value.tzinfo is not None else value.replace(tzinfo=UTC)


def without_frames_of(traceback: str, folders: Sequence[str]) -> str:
    """``traceback`` without the frames of code in ``folders`` (the worker's own machinery:
    Dramatiq's, kumiko's), each run of them replaced by one line saying how many frames were
    left out; the user's frames, the exception line and chained tracebacks stay as they are."""
    lines = traceback.rstrip().splitlines()
    kept: list[str] = []
    skipped = 0
    i = 0
    while i < len(lines):
        line = lines[i]
        frame = _FRAME.match(line)
        if frame is None:
            if skipped:
                kept.append(f"  ({skipped} frame{'s' * (skipped != 1)} of the worker left out)")
                skipped = 0
            kept.append(line)
            i += 1
            continue
        # a frame: its "File ..." line, then its source lines (indented deeper)
        end = i + 1
        while end < len(lines) and lines[end].startswith("    "):
            end += 1
        if any(frame.group(1).startswith(folder) for folder in folders):
            skipped += 1
        else:
            if skipped:
                kept.append(f"  ({skipped} frame{'s' * (skipped != 1)} of the worker left out)")
                skipped = 0
            kept += lines[i:end]
        i = end
    return "\n".join(kept)


_FRAME: Final = re.compile(r'  File "([^"]*)", line \d+')


def indented(block: str, prefix: str = "    ") -> str:
    """Every line of ``block`` behind ``prefix`` (a traceback under its heading)."""
    return "\n".join(prefix + line if line else line for line in block.rstrip().splitlines())
