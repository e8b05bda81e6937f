"""Measuring helpers: a private Redis, round-trip counting, alternating rounds, medians."""

from __future__ import annotations

import os
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis
import redis.connection


class RoundTrips:
    """Counts client->server sends (one per command, one per pipeline) in this process."""

    def __init__(self) -> None:
        self.count = 0
        self._lock = threading.Lock()
        self._original: Any = None

    def __enter__(self) -> RoundTrips:
        original: Callable[..., None] = redis.connection.AbstractConnection.send_packed_command
        self._original = original
        counter = self

        def counted(conn: Any, command: Any, check_health: bool = True) -> None:
            with counter._lock:
                counter.count += 1
            original(conn, command, check_health)

        redis.connection.AbstractConnection.send_packed_command = counted  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: object) -> None:
        redis.connection.AbstractConnection.send_packed_command = self._original  # type: ignore[method-assign]


def command_stats(client: redis.Redis) -> dict[str, int]:
    """Calls per command from ``INFO commandstats`` (includes commands Lua scripts run)."""
    info = client.info("commandstats")
    return {name.removeprefix("cmdstat_"): int(stats["calls"]) for name, stats in info.items()}


def stats_delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    keys = set(before) | set(after)
    delta = {k: after.get(k, 0) - before.get(k, 0) for k in keys}
    return {k: v for k, v in sorted(delta.items()) if v and k not in {"info", "ping"}}


class Countdown:
    """Set once ``n`` events were counted; handlers call :meth:`hit`."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.seen = 0
        self.done = threading.Event()
        self._lock = threading.Lock()
        if n == 0:
            self.done.set()

    def hit(self) -> None:
        with self._lock:
            self.seen += 1
            if self.seen >= self.n:
                self.done.set()

    def wait(self, timeout_s: float = 300) -> None:
        if not self.done.wait(timeout_s):
            raise TimeoutError(f"only {self.seen} of {self.n} events after {timeout_s}s")


@dataclass
class Timing:
    wall_s: float
    cpu_s: float


@contextmanager
def timed() -> Iterator[list[Timing]]:
    out: list[Timing] = []
    wall, cpu = time.perf_counter(), time.process_time()
    yield out
    out.append(Timing(time.perf_counter() - wall, time.process_time() - cpu))


@dataclass
class Comparison:
    """Alternating rounds of kumiko and plain Dramatiq: rates (units/s) per round."""

    name: str
    unit: str
    baseline: str = "plain Dramatiq"
    kumiko: list[float] = field(default_factory=list)
    plain: list[float] = field(default_factory=list)
    kumiko_cpu_us: list[float] = field(default_factory=list)
    plain_cpu_us: list[float] = field(default_factory=list)

    @property
    def ratio(self) -> float:
        return statistics.median(self.kumiko) / statistics.median(self.plain)

    def row(self) -> str:
        cpu = ""
        if self.kumiko_cpu_us and self.plain_cpu_us:
            cpu = (
                f" | {statistics.median(self.kumiko_cpu_us):.0f}"
                f" | {statistics.median(self.plain_cpu_us):.0f}"
            )
        else:
            cpu = " | - | -"
        digits = 1 if self.unit == "ms" else 0  # latencies: tenths of a millisecond
        return (
            f"| {self.name} | {statistics.median(self.kumiko):,.{digits}f} {self.unit}"
            f" | {statistics.median(self.plain):,.{digits}f} {self.unit} ({self.baseline})"
            f" | {self.ratio:.2f}x{cpu}"
            f" | {len(self.kumiko)} |"
        )


def alternate(rounds: int, kumiko: Callable[[], None], plain: Callable[[], None]) -> None:
    """Run ``kumiko`` and ``plain`` alternately, starting with a different one each round."""
    for index in range(rounds):
        order = (kumiko, plain) if index % 2 == 0 else (plain, kumiko)
        for run in order:
            run()


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index]


def cli_environment(kind: str, url: str, app_module: str) -> dict[str, str]:
    """The environment of a benchmark's ``dramatiq`` CLI worker or producer of ``kind``
    (``"kumiko"`` or ``"plain"``) on ``url``: no inherited ``KUMIKO_*``, the repository on
    ``PYTHONPATH``, this venv first on ``PATH``, and for kumiko ``KUMIKO_APP`` =
    ``<app_module>:runner``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KUMIKO_")}
    env.update(
        PYTHONPATH=str(Path(__file__).resolve().parents[1]),
        PATH=os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]),
        BENCH_BROKER=kind,
        BENCH_REDIS_URL=url,
    )
    if kind == "kumiko":
        env["KUMIKO_APP"] = f"{app_module}:runner"
    return env
