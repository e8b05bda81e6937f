"""Following a Sentinel fail-over: no process keeps writing to a primary being demoted.

Redis Sentinel promotes a replica by sending it ``REPLICAOF NO ONE``; the old primary, if it
still runs (a planned ``SENTINEL FAILOVER``, or a primary that was only cut off), keeps
accepting writes until the sentinels reconfigure it as a replica, about ten seconds later, and
then throws away everything written to it since the promotion. A client that keeps its
connections to the old primary (kumiko's threads each keep one) loses what it writes there,
and ``dispatch`` returns an id for a message that never runs.

:class:`PrimaryWatch` (one per Sentinel connection pool, in every process) closes that window:

- it **subscribes to every sentinel's events**. ``+failover-state-send-slaveof-noone``, which
  the sentinel leading a fail-over publishes just before it sends ``REPLICAOF NO ONE``, puts
  up a *barrier* on the old primary's address; ``+switch-master`` lifts it and marks that
  address *demoted*; ``-failover-abort-*`` lifts it. Each event bumps the pool's
  *generation*: every connection of the pool (pooled, a thread's own, a consumer's doorbell)
  checks it before it sends a command, and one made before the event reconnects first;
- a **connection** (:class:`~kumiko_dramatiq.broker.connection.KumikoSentinelConnection`)
  asks the sentinels for the primary whenever it (re)connects, refuses an address behind
  the barrier or demoted (:func:`primary_problem`: a ``ConnectionError``, so a producer's
  ``dispatch`` raises ``RedisUnavailableError`` and a worker retries), then checks with
  ``ROLE`` that the node it reached is a primary;
- a ``READONLY`` reply (a primary demoted under a connection) marks that address demoted and
  bumps the generation too, so every other connection of the process leaves it at once.

If events were missed (a sentinel connection down), a barrier or a demotion does not hold
for ever: an address is admitted again once every sentinel that answers names it as the
primary and none reports a fail-over in progress (asked at most every
:data:`RECHECK_S` while a connection waits at the barrier). Without Sentinel there is no
watch; a ``READONLY`` reply still drops its connection.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Final

import redis

logger = logging.getLogger("kumiko_dramatiq")

Address = tuple[str, int]

#: The sentinel events that move the watch (channels of a sentinel's pub/sub).
FAILOVER_START: Final = "+failover-state-send-slaveof-noone"
SWITCH_MASTER: Final = "+switch-master"
FAILOVER_ABORT: Final = "-failover-abort-*"
#: How often, at most, a connection waiting at the barrier asks the sentinels again.
RECHECK_S: Final = 0.5
#: How long a listener waits before it reconnects to a sentinel that failed (first, at most).
RECONNECT_S: Final = (0.1, 2.0)


@dataclass(frozen=True)
class SentinelEvent:
    """A fail-over event of one monitored primary: ``kind`` is ``"start"`` (``old`` is being
    demoted), ``"switch"`` (``old`` -> ``new``) or ``"abort"``."""

    kind: str
    master: str
    old: Address
    new: Address | None = None


def parse_event(channel: str, data: str) -> SentinelEvent | None:
    """The fail-over event in one sentinel message, or ``None`` (another event, or a message
    that does not parse). Pure.

    ``+failover-state-send-slaveof-noone slave <ip:port> <ip> <port> @ <master> <ip> <port>``,
    ``+switch-master <master> <old ip> <old port> <new ip> <new port>``,
    ``-failover-abort-<reason> master <master> <ip> <port>``."""
    parts = data.split()
    try:
        if channel == FAILOVER_START and "@" in parts:
            at = parts.index("@")
            return SentinelEvent("start", parts[at + 1], (parts[at + 2], int(parts[at + 3])))
        if channel == SWITCH_MASTER and len(parts) == 5:
            old, new = (parts[1], int(parts[2])), (parts[3], int(parts[4]))
            return SentinelEvent("switch", parts[0], old, new)
        if channel.startswith("-failover-abort-") and len(parts) >= 4 and parts[0] == "master":
            return SentinelEvent("abort", parts[1], (parts[2], int(parts[3])))
    except (IndexError, ValueError):
        return None
    return None


def primary_problem(
    address: Address,
    *,
    barrier: Address | None,
    demoted: frozenset[Address],
    reports: Sequence[tuple[Address | None, bool]] | None,
) -> str | None:
    """Why kumiko must not write to ``address`` now, or ``None``. ``reports``: what the
    sentinels that answered say (the primary they name, whether a fail-over is in progress),
    ``None`` when not asked. An address behind the barrier or demoted is admitted again only
    when every report names it and none has a fail-over in progress. Pure."""
    settled = (
        reports is not None
        and len(reports) > 0
        and all(named == address and not busy for named, busy in reports)
    )
    if address == barrier and not settled:
        return "a fail-over away from it is in progress: not writing to it"
    if address in demoted and not settled:
        return "a fail-over demoted it (the sentinels moved to another primary): not writing to it"
    return None


class PrimaryWatch:
    """The fail-over state of one Sentinel-monitored primary in this process (see the
    module docstring): ``generation``, the barrier, the demoted addresses, and the threads
    that listen to the sentinels. ``ask`` returns what each sentinel that answers says now
    (the primary's address or ``None``, and whether a fail-over is in progress). ``listen``:
    subscribe to the sentinels (a runner's pool); a one-off client (a start-up probe, a
    command-line tool) does not, and follows fail-overs by its replies only."""

    def __init__(
        self,
        master: str,
        sentinels: Sequence[Address],
        sentinel_kwargs: dict[str, Any],
        ask: Callable[[], list[tuple[Address | None, bool]]],
        *,
        listen: bool = True,
    ) -> None:
        self.master = master
        self.listen = listen
        self.sentinels = list(sentinels)
        self.sentinel_kwargs = dict(sentinel_kwargs)
        self._ask = ask
        #: bumped whenever connections must find the primary again
        self.generation = 0
        self._lock = threading.Lock()
        self._barrier: Address | None = None
        self._demoted: set[Address] = set()
        self._asked_at = 0.0
        self._reports: list[tuple[Address | None, bool]] | None = None
        self._current: Address | None = None
        self._pid = 0
        self._stop = threading.Event()
        self._listeners: list[threading.Thread] = []
        self._pubsubs: list[Any] = []

    # -- connections --------------------------------------------------------------------
    def check(self, address: Address) -> None:
        """Raise ``redis.ConnectionError`` if kumiko must not write to ``address`` now."""
        if self.barred(address):
            self.check_reported(address, self._recent_reports())

    def barred(self, address: Address) -> bool:
        """Whether ``address`` is behind the barrier or demoted (then :meth:`check_reported`
        decides, given what the sentinels say now). Never blocks."""
        with self._lock:
            return address == self._barrier or address in self._demoted

    def check_reported(
        self, address: Address, reports: list[tuple[Address | None, bool]] | None
    ) -> None:
        """:meth:`check` for a barred ``address`` with the sentinels' ``reports`` (what
        :meth:`KumikoSentinel.reports` gives; an asyncio caller asks on its loop)."""
        with self._lock:
            barrier, demoted = self._barrier, frozenset(self._demoted)
        problem = primary_problem(address, barrier=barrier, demoted=demoted, reports=reports)
        if problem is not None:
            raise redis.ConnectionError(f"{self.master} at {address[0]}:{address[1]}: {problem}")
        with self._lock:  # the sentinels agree: the fail-over ended without a switch
            if self._barrier == address:
                self._barrier = None
            self._demoted.discard(address)
        logger.info("%s at %s:%d is the primary again", self.master, *address)

    def connected(self, address: Address) -> None:
        """A connection reached the primary at ``address``; one elsewhere means the primary
        moved (found by discovery, not by an event): every connection finds it again."""
        with self._lock:
            moved = self._current is not None and self._current != address
            self._current = address
            if moved:
                self.generation += 1

    def demoted_reply(self, address: Address) -> None:
        """The node at ``address`` answered ``READONLY``: it is a replica now."""
        with self._lock:
            if address in self._demoted:
                return
            self._demoted.add(address)
            self.generation += 1
        logger.warning(
            "%s at %s:%d answers READONLY (demoted): every connection finds the primary again",
            self.master,
            *address,
        )

    def _recent_reports(self) -> list[tuple[Address | None, bool]] | None:
        now = time.monotonic()
        with self._lock:
            if now - self._asked_at < RECHECK_S:
                return self._reports
            self._asked_at = now
        try:
            reports = self._ask()
        except redis.RedisError:
            reports = []
        with self._lock:
            self._reports = reports
        return reports

    # -- events -------------------------------------------------------------------------
    def apply(self, event: SentinelEvent) -> None:
        """Move the state by one sentinel event (events of other primaries are ignored)."""
        if event.master != self.master:
            return
        with self._lock:
            if event.kind == "start":
                if self._barrier == event.old:
                    return
                self._barrier = event.old
            elif event.kind == "switch":
                if event.old in self._demoted and self._barrier is None:
                    return  # another sentinel's announcement of the same switch
                self._barrier = None
                self._demoted.add(event.old)
                if event.new is not None:
                    self._demoted.discard(event.new)
            elif self._barrier == event.old:
                self._barrier = None
            else:
                return
            self.generation += 1
            self._reports, self._asked_at = None, 0.0
        logger.warning(
            "%s: fail-over %s (%s:%d%s): connections follow",
            self.master,
            {"start": "starting", "switch": "done", "abort": "aborted"}[event.kind],
            *event.old,
            "" if event.new is None else f" -> {event.new[0]}:{event.new[1]}",
        )

    def ensure_listening(self) -> None:
        """Listen to every sentinel (one daemon thread each), once per process."""
        if not self.listen or (self._pid == os.getpid() and not self._stop.is_set()):
            return
        with self._lock:
            if self._pid == os.getpid() and not self._stop.is_set():
                return
            self._pid = os.getpid()
            self._stop = threading.Event()
            self._listeners = []
            self._pubsubs = []
        for host, port in self.sentinels:
            thread = threading.Thread(
                target=self._listen,
                args=(host, port, self._stop),
                name=f"kumiko-sentinel-{host}:{port}",
                daemon=True,
            )
            self._listeners.append(thread)
            thread.start()

    def close(self) -> None:
        """Stop listening (a later connection starts again)."""
        with self._lock:
            self._stop.set()
            pubsubs, self._pubsubs = self._pubsubs, []
        for pubsub in pubsubs:
            with contextlib.suppress(Exception):  # a connection that may be gone already
                pubsub.close()

    def _listen(self, host: str, port: int, stop: threading.Event) -> None:
        backoff = RECONNECT_S[0]
        while not stop.is_set():
            client = redis.Redis(host=host, port=port, **self.sentinel_kwargs)
            pubsub = client.pubsub(ignore_subscribe_messages=True)  # type: ignore[no-untyped-call, unused-ignore]
            with self._lock:
                self._pubsubs.append(pubsub)
            try:
                pubsub.subscribe(FAILOVER_START, SWITCH_MASTER)
                pubsub.psubscribe(FAILOVER_ABORT)
                backoff = RECONNECT_S[0]
                while not stop.is_set():
                    message = pubsub.get_message(timeout=1.0)
                    if message is None or message.get("type") not in ("message", "pmessage"):
                        continue
                    event = parse_event(_text(message["channel"]), _text(message["data"]))
                    if event is not None:
                        self.apply(event)
            except (redis.RedisError, OSError, ValueError, AttributeError) as exc:
                if not stop.is_set():
                    logger.debug("listening to sentinel %s:%d failed (%s)", host, port, exc)
            finally:
                with contextlib.suppress(Exception):  # a connection that may be gone already
                    pubsub.close()
                    client.close()
            stop.wait(backoff)
            backoff = min(backoff * 2, RECONNECT_S[1])


def _text(value: Any) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)
