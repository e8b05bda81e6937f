"""Enqueueing: how a message is written onto a queue, kumiko's way (mixed into the broker).

Every enqueue path (dispatch, events, cron ticks, boot-once jobs, per-tenant wrappers and
children, hand-offs, retries) builds its message with :func:`kumiko_dramatiq.messages.build_message`
and writes it through one of these methods of
:class:`~kumiko_dramatiq.broker.broker.KumikoBroker`:

- :meth:`Enqueueing.prepare` gives it its redis id (derived from its message id for a kumiko
  message written the first time, :func:`~kumiko_dramatiq.ids.redis_message_id`) and, if
  delayed, its delay queue and eta, as Dramatiq's enqueue does;
- :meth:`Enqueueing.enqueue` is Dramatiq's enqueue made idempotent (``lua/guarded_enqueue.lua``,
  ``include/guarded.lua``): a command the pool re-sends after a dropped connection writes
  nothing twice;
- :meth:`Enqueueing.enqueue_step` and :meth:`Enqueueing.enqueue_batch` write messages
  together with a guard or record in one Lua call (fan-out children, cron ticks, boot-once
  jobs, dedup keys);
- :meth:`Enqueueing.encode` is what a delayed message looks like on its queue's schedule, and
  :meth:`Enqueueing.move_due` moves due ones onto the queue (``lua/move.lua``).

Each message passes the broker's ``before_enqueue`` and (once written) ``after_enqueue``
hooks, as on Dramatiq's own brokers. A retry or a sequential hand-off is not enqueued here:
the settle of the delivery it follows writes it (:mod:`kumiko_dramatiq.broker.settling`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple
from uuid import UUID, uuid4, uuid5

import redis
from dramatiq.common import current_millis, dq_name, q_name
from dramatiq.message import Message
from redis.commands.core import Script

from kumiko_dramatiq.broker import keys
from kumiko_dramatiq.broker.keys import queue_list, queue_messages
from kumiko_dramatiq.broker.replies import as_list, text
from kumiko_dramatiq.broker.seam import copy_message, encode_message
from kumiko_dramatiq.codec import TRIGGER
from kumiko_dramatiq.ids import redis_message_id as derived_redis_id

if TYPE_CHECKING:
    from kumiko_dramatiq.broker.lua import LuaScripts

_MOVED_NAMESPACE = UUID("9d4b7e0c-2f5a-5c8e-b1d3-7a6f4c2e9b01")


class Enqueueing:
    """The enqueue commands of :class:`~kumiko_dramatiq.broker.broker.KumikoBroker` (see the
    module docstring). The attributes below are the broker's."""

    namespace: str
    queue_prefix: str
    resend_window_ms: int
    lua: LuaScripts
    _counts_keys: dict[str, tuple[str, str]]

    if TYPE_CHECKING:

        def emit_before(self, signal: str, *args: Any, **kwargs: Any) -> None: ...

        def emit_after(self, signal: str, *args: Any, **kwargs: Any) -> None: ...

        def thread_client(self) -> redis.Redis: ...

        def is_lane(self, queue_name: str) -> bool: ...

        def command_head(self, queue_name: str, *, maintenance: bool = True) -> list[Any]: ...

        def call(
            self, script: Any, client: redis.Redis | None, *, keys: list[str], args: list[Any]
        ) -> Any: ...

    def prepare(
        self, message: Message[Any], delay: int | None, *, redis_message_id: str | None = None
    ) -> Message[Any]:
        """Give ``message`` a redis message id and, if delayed, its delay queue and eta: what
        Dramatiq's enqueue does before it writes. The id is ``redis_message_id`` if given;
        for a kumiko message written the first time (one that carries kumiko's options and
        no redis id yet), the one its message id derives
        (:func:`~kumiko_dramatiq.ids.redis_message_id`: ``cancel`` finds it without a
        search); else a random one, as Dramatiq draws."""
        if redis_message_id is not None:
            rid = redis_message_id
        elif TRIGGER in message.options and "redis_message_id" not in message.options:
            rid = derived_redis_id(str(message.message_id))
        else:
            rid = str(uuid4())
        message = copy_message(message, {"redis_message_id": rid})
        if delay is not None:
            message = message.copy(
                queue_name=dq_name(message.queue_name),
                options={"eta": current_millis() + delay},
            )
        return message

    def enqueue(self, message: Message[Any], *, delay: int | None = None) -> Message[Any]:
        """Dramatiq's enqueue, made idempotent: the pool re-sends a command once when a
        connection drops, and if the first send had executed, Dramatiq's enqueue would store
        the message twice. On a lane queue the message is written unless its body is there
        already or its "sent" key (``keys.sent``) holds the tombstone its end left for
        :attr:`resend_window_ms` (``lua/include/guarded.lua``): no key of its own on the hot
        path. Elsewhere (a delay queue, a plain actor's queue) it is written behind that key,
        set for the window. A delayed message goes on its queue's schedule
        (:meth:`encode`)."""
        prepared = self.prepare(message, delay)
        self.emit_before("enqueue", prepared, delay)
        command_keys, args = self._guarded_call(message, prepared, delay)
        self.call(self.lua.guarded_enqueue, self.thread_client(), keys=command_keys, args=args)
        self.emit_after("enqueue", prepared, delay)
        return prepared

    def _guarded_call(
        self, message: Message[Any], prepared: Message[Any], delay: int | None
    ) -> tuple[list[Any], list[Any]]:
        """The keys and arguments of ``lua/guarded_enqueue.lua`` for ``prepared`` (which
        ``lua/idempotent_enqueue.lua`` extends): queue, "sent" guard, counts."""
        rid = prepared.options["redis_message_id"]
        counts, kind = self._counts_of(prepared.queue_name)
        return (
            [*self._queue_keys(prepared), keys.sent(self.queue_prefix, rid), counts],
            [
                rid,
                self.encode(prepared, delay),
                self._sent_ttl(message.queue_name, delay),
                "1",
                f"{kind}:{prepared.actor_name}",
            ],
        )

    def enqueue_idempotent(
        self, message: Message[Any], record: str, ttl_ms: int, *, delay: int | None = None
    ) -> str:
        """:meth:`enqueue` behind an idempotency key's ``record`` (``keys.idempotency``): the
        message and the record (its id, for ``ttl_ms``) in one Lua call, unless the record
        exists: then nothing is written and the first dispatch's id comes back."""
        prepared = self.prepare(message, delay)
        self.emit_before("enqueue", prepared, delay)
        command_keys, args = self._guarded_call(message, prepared, delay)
        enqueued, message_id = as_list(
            self.call(
                self.lua.idempotent_enqueue,
                self.thread_client(),
                keys=[*command_keys, record],
                args=[*args, str(message.message_id), ttl_ms],
            )
        )
        if enqueued == 1:
            self.emit_after("enqueue", prepared, delay)
        return text(message_id)

    def enqueue_idempotent_many(
        self,
        messages: Sequence[Message[Any]],
        records: Sequence[str],
        ttl_ms: int,
        *,
        delay: int | None = None,
    ) -> list[str]:
        """:meth:`enqueue_idempotent` for many new messages of ONE queue, one Lua call:
        the id each dispatch stands for (its own, or the first dispatch's of its key)."""
        reply = self.enqueue_batch(
            messages,
            self.lua.idempotent_enqueue_batch,
            args=[
                self._sent_ttl(messages[0].queue_name if messages else "", delay),
                "1",
                ttl_ms,
                keys.root(self.queue_prefix),
            ],
            leads=lambda message: keys.sent(self.queue_prefix, message.options["redis_message_id"]),
            tails=[
                (record, str(message.message_id))
                for message, record in zip(messages, records, strict=True)
            ],
            delay=delay,
        )
        return [text(each) for each in reply[1::2]]

    @staticmethod
    def encode(prepared: Message[Any], delay: int | None) -> bytes:
        """What an enqueue script is handed for ``prepared`` (a message from :meth:`prepare`):
        its encoding, or for a delayed one ``b"<delay ms> "`` and the encoding of the message
        as it will wait on its queue once due (its queue's name, no ``eta``), which
        ``lua/include/enqueue.lua`` puts on the queue's schedule at Redis's clock plus the
        delay. Dramatiq's worker would hold a fetched message that has an ``eta`` in memory
        until due: the stored form has none, so a due message's move rewrites nothing."""
        if delay is None or not keys.is_delay_queue(prepared.queue_name):
            return encode_message(prepared)
        waiting = prepared.copy(queue_name=q_name(prepared.queue_name))
        waiting.options.pop("eta", None)
        return b"%d " % max(0, int(delay)) + encode_message(waiting)

    def move_due(self, queue_name: str, limit: int) -> MoveResult:
        """Move up to ``limit`` due delayed messages of delay queue ``queue_name``
        (``<queue>.DQ``) onto ``<queue>`` in one atomic step (``lua/move.lua``), by Redis's
        clock, on the calling thread's client."""
        moved, next_due, now, legacy = self.call(
            self.lua.move,
            self.thread_client(),
            keys=[self.namespace],
            args=[*self.command_head(queue_name), limit],
        )
        return MoveResult(
            int(moved), None if int(next_due) < 0 else int(next_due), int(now), int(legacy)
        )

    def schedule_legacy(self, queue_name: str, limit: int) -> int:
        """Move up to ``limit`` messages from the head of Dramatiq's own list of delay queue
        ``queue_name`` (written by an older version or a plain ``RedisBroker``) onto the
        queue's schedule, at their ``eta`` (``lua/schedule_legacy.lua``); returns how many it
        took off the list (a cancelled one, whose body is gone, is dropped). Each
        is re-encoded here in the form it takes on its queue (Lua could not re-encode a message
        without changing it); one that does not decode is scheduled as it is, due now: the
        queue's consumer dead-letters it with a logged reason."""
        client = self.thread_client()
        rids = [
            text(rid)
            for rid in client.lrange(keys.queue_list(queue_name, self.namespace), 0, limit - 1)
        ]
        if not rids:
            return 0
        bodies = client.hmget(keys.queue_messages(queue_name, self.namespace), rids)
        args: list[Any] = []
        now = current_millis()
        for rid, body in zip(rids, bodies, strict=True):
            if body is None:
                args += [rid, now, b""]  # cancelled: the step drops its id
                continue
            if not isinstance(body, bytes):
                body = str(body).encode()
            try:
                message = Message.decode(body)
                eta = message.options.get("eta")
                due = int(eta) if isinstance(eta, int | float) else now
                waiting = message.copy(queue_name=q_name(queue_name))
                waiting.options.pop("eta", None)
                args += [rid, due, waiting.encode()]
            except Exception:
                args += [rid, now, body]
        scheduled = self.call(
            self.lua.schedule_legacy,
            client,
            keys=[self.namespace],
            args=[*self.command_head(queue_name, maintenance=False), *args],
        )
        return int(scheduled)

    def enqueue_step(
        self,
        message: Message[Any],
        script: Script,
        *,
        keys: Sequence[str] = (),
        args: Sequence[Any] = (),
        delay: int | None = None,
    ) -> tuple[Message[Any], list[Any]]:
        """Run enqueue step ``script`` (see :mod:`kumiko_dramatiq.broker.lua`) for ``message``: one
        Lua call that writes the message together with the step's own ``keys``/``args``.

        Returns the prepared message and the script's reply as a list; the script's first
        reply item is 1 iff it enqueued the message (``after_enqueue`` runs only then).
        """
        prepared = self.prepare(message, delay)
        self.emit_before("enqueue", prepared, delay)
        reply = as_list(
            self.call(
                script,
                self.thread_client(),
                keys=[*self._queue_keys(prepared), *keys],
                args=[prepared.options["redis_message_id"], self.encode(prepared, delay), *args],
            )
        )
        if reply[0] == 1:
            self.emit_after("enqueue", prepared, delay)
        return prepared, reply

    def enqueue_batch(
        self,
        messages: Sequence[Message[Any]],
        script: Script,
        *,
        args: Sequence[Any],
        leads: Sequence[Any] | Callable[[Message[Any]], Any],
        tails: Sequence[Sequence[Any]] | None = None,
        delay: int | None = None,
    ) -> list[Any]:
        """Run batch enqueue step ``script`` for ``messages`` (all on ONE queue): one Lua call
        with ``KEYS`` = the queue's hash and list, ``ARGV`` = ``args``, then per message its
        ``leads[i]`` (or ``leads(prepared message)``), redis message id, encoded message and
        ``tails[i]``. The script returns
        the same number of items per message, the first 1 iff it enqueued the message. Every
        message passes ``before_enqueue``; those enqueued pass ``after_enqueue``. Returns the
        script's reply."""
        if not messages:
            return []
        prepared = [self.prepare(message, delay) for message in messages]
        queue_names = {message.queue_name for message in prepared}
        if len(queue_names) != 1:
            raise ValueError(f"a batch targets one queue, got {sorted(queue_names)}")
        argv: list[Any] = list(args)
        for i, message in enumerate(prepared):
            self.emit_before("enqueue", message, delay)
            lead = leads(message) if callable(leads) else leads[i]
            argv += (lead, message.options["redis_message_id"], self.encode(message, delay))
            if tails is not None:
                argv += tails[i]
        reply = as_list(script(keys=list(self._queue_keys(prepared[0])), args=argv))
        step = len(reply) // len(prepared)
        for i, message in enumerate(prepared):
            if reply[i * step] == 1:
                self.emit_after("enqueue", message, delay)
        return reply

    def enqueue_guarded_batch(
        self,
        messages: Sequence[Message[Any]],
        guard_keys: Sequence[str] | Callable[[Message[Any]], str],
        *,
        guard_ttl_ms: int,
        guard_value: str,
        delay: int | None = None,
    ) -> list[bool]:
        """Enqueue each message (all on ONE queue) unless its guard exists, writing guard and
        message together: one Lua call for the whole batch. Returns, per message, whether it
        was enqueued."""
        reply = self.enqueue_batch(
            messages,
            self.lua.guarded_enqueue_batch,
            args=[guard_ttl_ms, guard_value],
            leads=guard_keys,
            delay=delay,
        )
        return [flag == 1 for flag in reply]

    def enqueue_many(self, messages: Sequence[Message[Any]], *, delay: int | None = None) -> None:
        """:meth:`enqueue` for many new messages of ONE queue: one Lua call, each message
        guarded by its own "sent" key as :meth:`enqueue` writes it."""
        self.enqueue_guarded_batch(
            messages,
            lambda message: keys.sent(self.queue_prefix, message.options["redis_message_id"]),
            guard_ttl_ms=self._sent_ttl(messages[0].queue_name if messages else "", delay),
            guard_value="1",
            delay=delay,
        )

    def _sent_ttl(self, queue_name: str, delay: int | None) -> int:
        """The guard TTL of the "sent" key of a new message for ``queue_name``: 0 if it goes
        straight onto a lane queue (the key is only read there: the tombstone a body's end
        leaves, see ``lua/include/guarded.lua``), else the resend window."""
        return 0 if delay is None and self.is_lane(queue_name) else self.resend_window_ms

    def _counts_of(self, queue_name: str) -> tuple[str, str]:
        """The per-job counts hash of the queue a message is written to (its delay queue's
        goes to its queue's) and the kind of its field there: "d" on a delay queue, else
        "q" (``lua/include/counts.lua``)."""
        found = self._counts_keys.get(queue_name)
        if found is None:
            queue = q_name(queue_name)
            kind = "d" if queue_name == dq_name(queue) else "q"
            found = (keys.queue_counts(queue, self.namespace), kind)
            self._counts_keys[queue_name] = found
        return found

    def _queue_keys(self, message: Message[Any]) -> tuple[str, str]:
        return (
            queue_messages(message.queue_name, self.namespace),
            queue_list(message.queue_name, self.namespace),
        )


class MoveResult(NamedTuple):
    """What one ``lua/move.lua`` step did: ``moved`` messages onto the queue; the ``next_due``
    time left on the schedule (ms, Redis's clock; ``None``: none); Redis's clock ``now`` (ms);
    ``legacy``: the length of Dramatiq's own delay queue list (work for
    :meth:`KumikoBroker.schedule_legacy`)."""

    moved: int
    next_due: int | None
    now: int
    legacy: int


def moved_redis_id(delayed_redis_id: str, queue_name: str) -> str:
    """The redis id a delayed message took on ``queue_name`` when an older version's worker
    moved it there from Dramatiq's delay queue list (derived, so that a second move of the
    same delayed copy was a no-op); ``cancel`` still looks there, for a rolling deploy."""
    return str(uuid5(_MOVED_NAMESPACE, f"{delayed_redis_id}>{queue_name}"))
