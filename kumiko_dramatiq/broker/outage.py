"""Outage: one activity's view of a Redis fault (see :mod:`kumiko_dramatiq.worker.supervision`).

The first failure is logged at WARNING, once per outage, not once per attempt; the retry
waits a backoff (:func:`backoff_ms`) that doubles from :data:`FIRST_BACKOFF_MS` up to
:data:`MAX_BACKOFF_MS`, so the activity resumes within about a second of Redis answering
again; the first success after failures is logged at INFO with how long the outage lasted.
"""

from __future__ import annotations

import logging
import time
from typing import Final

logger = logging.getLogger("kumiko_dramatiq")

#: First wait after a failed Redis call of a supervised activity, and the cap of the doubling.
FIRST_BACKOFF_MS: Final = 50
MAX_BACKOFF_MS: Final = 1_000
#: A new outage this soon after the last one logged is logged at DEBUG (a flapping Redis).
QUIET_S: Final = 60.0


def backoff_ms(failures: int) -> int:
    """The wait after ``failures`` failed attempts in a row (1, 2, ...). Pure."""
    if failures < 1:
        return 0
    return int(min(MAX_BACKOFF_MS, FIRST_BACKOFF_MS * 2 ** min(failures - 1, 16)))


class Outage:
    """One activity's Redis faults: logged once per outage, retried with a backoff.

    A Redis that flaps (some commands refused at ``maxmemory``, others going through) would
    start an outage at every refusal: a new one within :data:`QUIET_S` of the last one
    logged is logged at DEBUG only."""

    def __init__(self, what: str) -> None:
        self.what = what
        self.failures = 0
        self._since = 0.0
        self._logged_at: float | None = None

    @property
    def ongoing(self) -> bool:
        return self.failures > 0

    def failed(self, exc: BaseException) -> float:
        """Note a failed attempt; return how long to wait (s) before the next one."""
        self.failures += 1
        if self.failures == 1:
            self._since = now = time.monotonic()
            loud = self._logged_at is None or now - self._logged_at >= QUIET_S
            if loud:
                self._logged_at = now
            logger.log(
                logging.WARNING if loud else logging.DEBUG,
                "%s: Redis fails (%s: %s); retrying until it answers",
                self.what,
                type(exc).__name__,
                " ".join(str(exc).split())[:200],
            )
        return backoff_ms(self.failures) / 1000

    def succeeded(self) -> None:
        """Note a successful attempt (logs the end of an outage)."""
        if self.failures:
            logger.log(
                logging.INFO if self._logged_at == self._since else logging.DEBUG,
                "%s: Redis answers again; resumed after %.1f s (%d failed attempts)",
                self.what,
                time.monotonic() - self._since,
                self.failures,
            )
            self.failures = 0
