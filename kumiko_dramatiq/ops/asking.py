"""Asking the workers that hold messages: the requester's side of the hold protocol.

``cancel``, ``purge``, ``pause`` and ``stop_run`` meet messages that a worker claimed ahead
of its threads and has not started (*held*). They do not guess whether such a message will
start: they ask its worker (the asks are written by their own Lua calls, ``lua/cancel.lua``,
``lua/hold_ask_job.lua``, ``lua/hold_ask.lua``) and :meth:`Asking.wait` for the answers, one
``BLPOP`` on the request's answer list at a time, each answer ``"<redis id>\\t<answer>"``:

- ``"dropped"``: the message was held and never starts; the worker's answer call did what was
  asked (cancelled it, deleted it for a purge, put it back on its queue for a pause);
- ``"started"``: it had started (a cancel returns False, a stop_run asks it to stop);
- ``"held"``: a probe's answer: held, kept (stop_run: not running);
- ``"gone"``: no longer that worker's (it was settled, or its worker's claim was recovered).

A worker that does not answer (dead, frozen, cut off from Redis) cannot start the message any
more once :func:`~kumiko_dramatiq.broker.holds.takeover_after_s` has passed since the ask:
then the requester does what it asked for itself (``lua/hold_takeover.lua``), and the answer is
what that step found. So every wait ends within that bound (1.4 s) plus a few round trips.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass

import redis

from kumiko_dramatiq.broker import keys
from kumiko_dramatiq.broker.broker import KumikoBroker
from kumiko_dramatiq.broker.holds import takeover_after_s
from kumiko_dramatiq.broker.replies import text


@dataclass(frozen=True)
class Ask:
    """One ask about a held message: its lane ``queue``, its ``holder`` (broker id), its
    redis id, the request id whose answer list to wait on."""

    queue: str
    holder: str
    rid: str
    request: str


class Asking:
    """The asks of one requester on ``broker``'s dataset (see the module docstring)."""

    def __init__(self, broker: KumikoBroker) -> None:
        self.broker = broker
        self.client: redis.Redis = broker.client
        self.prefix = broker.queue_prefix

    def wait(self, asks: Iterable[Ask], *, asked_at: float | None = None) -> dict[str, str]:
        """The answer to each of ``asks`` (by redis id), waited for until the takeover bound
        after ``asked_at`` (monotonic s; default now), then taken over."""
        pending = {ask.rid: ask for ask in asks}
        answers: dict[str, str] = {}
        if not pending:
            return answers
        deadline = (time.monotonic() if asked_at is None else asked_at) + takeover_after_s()
        limit_s = self.client.connection_pool.connection_kwargs.get("socket_timeout")
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            if limit_s:
                left = min(left, max(0.05, limit_s - 0.2))
            names = sorted({keys.hold_answer(self.prefix, ask.request) for ask in pending.values()})
            popped = self.client.blpop(names, timeout=max(0.01, left))
            if popped is not None:
                self._take(text(popped[0]), text(popped[1]), pending, answers)
        for rid, ask in list(pending.items()):
            answer = text(
                self.broker.lua.hold_takeover(
                    keys=[self.broker.namespace],
                    args=[
                        ask.queue,
                        ask.holder,
                        keys.root(self.prefix),
                        ask.request,
                        rid,
                        self.broker.hold_ttls(),
                        int(time.time() * 1000),
                    ],
                )
            )
            if answer != "answered":
                answers[rid] = answer
                del pending[rid]
        # what was answered just before the takeover: in the answer lists by now
        for ask in list(pending.values()):
            name = keys.hold_answer(self.prefix, ask.request)
            while ask.rid in pending:
                value = self.client.lpop(name)
                if value is None:
                    answers[ask.rid] = "gone"
                    del pending[ask.rid]
                    break
                self._take(name, text(value), pending, answers)
        return answers

    def _take(
        self, name: str, value: str, pending: dict[str, Ask], answers: dict[str, str]
    ) -> None:
        """One answer popped off ``name``: ours, or put back for the requester it is for (two
        requesters asking about one message share its answer list)."""
        rid, _, answer = value.partition("\t")
        if rid in pending:
            answers[rid] = answer
            del pending[rid]
        else:
            self.client.rpush(name, value)

    def ask_job(
        self, queue: str, job: str, request: str, kind: str, *, dry_run: bool = False
    ) -> tuple[list[Ask], int]:
        """Ask the holders of ``job``'s held messages on ``queue`` for ``kind``
        (``lua/hold_ask_job.lua``, a step at a time over the in-flight hash): the asks, and
        how many are held (a dry run asks nothing)."""
        found: list[Ask] = []
        counted = 0
        cursor = "0"
        while True:
            step = self.broker.lua.hold_ask_job(
                keys=[self.broker.namespace],
                args=[
                    keys.root(self.prefix),
                    job,
                    queue,
                    cursor,
                    ASK_STEP,
                    request,
                    kind,
                    "1" if dry_run else "0",
                ],
            )
            cursor = text(step[0])
            if dry_run:
                counted += int(step[1])
            else:
                asked = step[1]
                for i in range(0, len(asked), 3):
                    found.append(Ask(queue, text(asked[i]), text(asked[i + 1]), text(asked[i + 2])))
                counted = len(found)
            if cursor == "0":
                return found, counted

    def ask(
        self, queue: str, rids: list[str], request: str, kind: str
    ) -> tuple[list[Ask], list[str]]:
        """Ask the holders of any of ``rids`` on ``queue`` (``lua/hold_ask.lua``): the asks
        about the held ones, and the ids that run there."""
        reply = self.broker.lua.hold_ask(
            keys=[self.broker.namespace],
            args=[keys.root(self.prefix), queue, request, kind, *rids],
        )
        asks, running = [], []
        for i in range(0, len(reply), 3):
            holder, rid, waited = text(reply[i]), text(reply[i + 1]), text(reply[i + 2])
            if holder:
                asks.append(Ask(queue, holder, rid, waited))
            else:
                running.append(rid)
        return asks, running


#: How many in-flight entries one ``hold_ask_job`` step reads (HSCAN's COUNT).
ASK_STEP = 500
