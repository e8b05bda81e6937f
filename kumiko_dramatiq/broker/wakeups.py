"""Wakeups: which of a broker's consumers wait on a doorbell, and ending those waits.

An idle lane consumer waits on its queue's doorbell (``BLPOP`` on a connection of its own,
:class:`~kumiko_dramatiq.broker.consumer.KumikoConsumer`). Two things end such a wait early:

- a settle that claimed messages for the consumer (:meth:`Wakeups.wake`): the consumer's
  thread has deliveries to hand out, not a doorbell to wait for;
- the broker's workers shutting down (:meth:`Wakeups.stop`): no consumer waits out an idle
  wait, and none blocks again until a worker boots (:meth:`Wakeups.resume`).

A wait is registered before its ``BLPOP`` is sent, under the same lock a waker takes, so a
wake that comes first finds it and is sent again until the ``BLPOP`` has reached Redis. The
consumer hands in a check (``unless``) that runs under that lock: a claim that filled its
cache just before it blocked keeps it from blocking at all.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import redis

logger = logging.getLogger("kumiko_dramatiq")


class Wakeups:
    """The doorbell waits of one broker's consumers (see the module docstring); ``client``
    sends the ``CLIENT UNBLOCK`` commands."""

    def __init__(self, client: redis.Redis) -> None:
        self._client = client
        self._lock = threading.Lock()
        #: Redis client id of each waiting consumer's doorbell connection, by consumer key
        self._blocked: dict[int, int] = {}
        self._stopping = False

    @property
    def stopping(self) -> bool:
        """Whether the broker's workers are shutting down (nothing blocks, nothing claims)."""
        return self._stopping

    def resume(self) -> None:
        """A worker boots: waits may block again."""
        with self._lock:
            self._stopping = False

    def stop(self) -> None:
        """The workers shut down: end every wait, and block none until :meth:`resume`."""
        with self._lock:
            self._stopping = True
            client_ids = list(self._blocked.values())
        for client_id in client_ids:
            self.unblock(client_id)

    def block(self, key: int, client_id: int, unless: Callable[[], bool]) -> bool:
        """Register the wait of consumer ``key`` on connection ``client_id``, about to be
        sent: ``False`` (nothing registered, do not block) when the broker stops or
        ``unless()`` is true (checked under the wakers' lock)."""
        with self._lock:
            if self._stopping or unless():
                return False
            self._blocked[key] = client_id
            return True

    def waits(self, key: int) -> bool:
        """Whether consumer ``key`` waits on its doorbell now (registered its wait)."""
        with self._lock:
            return key in self._blocked

    def unblocked(self, key: int) -> None:
        """Consumer ``key``'s wait ended."""
        with self._lock:
            self._blocked.pop(key, None)

    def wake(self, key: int, within_s: float) -> None:
        """End consumer ``key``'s wait, if it waits: its ``CLIENT UNBLOCK`` sent again until
        it lands (the ``BLPOP`` may not have reached Redis yet) or ``within_s`` passed."""
        deadline = time.monotonic() + within_s
        while time.monotonic() < deadline:
            with self._lock:
                client_id = self._blocked.get(key)
            if client_id is None:
                return
            try:
                if self._client.client_unblock(client_id):
                    return
            except redis.RedisError as exc:
                logger.debug("could not unblock a consumer's wait (%s)", exc)
                return
            time.sleep(0.001)

    def unblock(self, client_id: int) -> None:
        """End the blocking wait of Redis client ``client_id`` now (a no-op if it is not
        blocked; a Redis error is logged: the wait ends by its timeout)."""
        try:
            self._client.client_unblock(client_id)
        except redis.RedisError as exc:
            logger.debug("could not unblock a consumer's wait (%s)", exc)
