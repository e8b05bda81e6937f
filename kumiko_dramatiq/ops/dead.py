"""The dead letters (``kumiko dead``, ``runner.dead_letters()``, ``retry_dead``, ``delete_dead``).

Dead letters are read a page at a time (:meth:`DeadAdmin.dead_letter_page`), never all of
them. A retry (``lua/retry_dead.lua``) takes the letter out of the dead letters and enqueues a
new message in one step, with a fresh attempt budget, a new message id, the original origin
id and, for a per-tenant child, its tenant; the dedup key is not carried (the key's job ended
when it died). A letter is found through its dead letter note, else by the redis ids kumiko
derives from its id, else among the newest :data:`~kumiko_dramatiq.ops.lookup.PREFIX_WINDOW`
dead letters of each lane.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from typing import Any

from dramatiq.message import Message, generate_unique_id

from kumiko_dramatiq.broker import keys
from kumiko_dramatiq.broker.keys import (
    dead_letter_messages,
    dead_letters,
    queue_list,
    queue_messages,
)
from kumiko_dramatiq.broker.replies import text
from kumiko_dramatiq.codec import (
    DEDUP_KEY,
    FAILURES,
    ORIGIN_ID,
    TRIGGER,
    KumikoOptions,
    OptionsError,
)
from kumiko_dramatiq.ops.lookup import PREFIX_WINDOW, LookupAdmin


@dataclass(frozen=True)
class DeadLetter:
    message_id: str
    job_name: str
    queue: str
    redis_message_id: str
    dead_at: datetime
    attempts: int | None
    tenant_id: str | None
    origin_id: str | None
    error_type: str | None
    error_message: str | None
    traceback: str | None

    def to_json(self) -> dict[str, Any]:
        out = dict(self.__dict__)
        out["dead_at"] = self.dead_at.isoformat()
        return out


#: A position in the dead letters, newest first: (dead-letter time in epoch ms, redis id).
DeadCursor = tuple[float, str]
#: How many pages :meth:`Admin.dead_letters` reads at most (each bounded, see
#: :meth:`Admin.dead_letter_page`).
DEAD_LIST_PAGES = 20


def dead_page(
    found: list[tuple[DeadCursor, DeadLetter]], floors: list[DeadCursor], limit: int
) -> tuple[list[DeadLetter], DeadCursor | None]:
    """One page of what several sources read (:meth:`DeadAdmin.dead_letters_read`: the lanes
    of a dataset, or those of its shards), newest first, and the cursor of the next page."""
    # A source that stopped early has unread letters below its floor, which may outrank
    # what other sources found there: keep only what is complete.
    floor = max(floors, default=None)
    found = sorted(found, key=lambda item: item[0], reverse=True)
    if floor is not None:
        found = [item for item in found if item[0] >= floor]
    page = found[:limit]
    next_cursor: DeadCursor | None = None
    if len(found) > limit or (page and len(found) == limit and floor is not None):
        next_cursor = page[-1][0]
    elif floor is not None:
        next_cursor = floor
    return [letter for _, letter in page], next_cursor


class DeadAdmin(LookupAdmin):
    """The dead letters: pages of them, retrying and discarding them."""

    def dead_letters(self, job: str | None = None, *, limit: int = 100) -> list[DeadLetter]:
        """Dead-lettered kumiko messages, newest first, with their last error: the first
        ``limit`` (``job``'s only, when given), read a page at a time
        (:meth:`dead_letter_page`), at most :data:`DEAD_LIST_PAGES` pages."""
        found: list[DeadLetter] = []
        cursor: DeadCursor | None = None
        for _ in range(DEAD_LIST_PAGES):
            page, cursor = self.dead_letter_page(job, after=cursor, limit=limit - len(found))
            found += page
            if cursor is None or len(found) >= limit:
                break
        return found[:limit]

    def _dead_letter(
        self, queue: str, rid: str, score: float, body: Any, *, read_note: bool = True
    ) -> DeadLetter | None:
        if body is None:
            return None
        try:
            message = Message.decode(body)
        except Exception:
            message = None
        message_id = rid if message is None else str(message.message_id)
        actor = "?" if message is None else str(message.actor_name)
        entry = self.registry.actor(actor)
        job_name = entry[0].qualified_name if entry is not None else actor
        options: KumikoOptions | None = None
        if message is not None and isinstance(message.options, dict):
            try:
                options = KumikoOptions.decode(message.options)
            except OptionsError:
                options = None
        note = self.history.dead_note(message_id) if message is not None and read_note else None
        return DeadLetter(
            message_id=message_id,
            job_name=job_name,
            queue=queue,
            redis_message_id=rid,
            dead_at=datetime.fromtimestamp(score / 1000, UTC),
            attempts=None if note is None else note.get("a"),
            tenant_id=None if options is None else options.tenant_id,
            origin_id=(None if options is None else options.origin_id) or message_id,
            error_type=None if note is None else note.get("et"),
            error_message=None if note is None else note.get("em"),
            traceback=None if note is None else note.get("tb"),
        )

    def dead_letter_page(
        self,
        job: str | None = None,
        *,
        after: DeadCursor | None = None,
        limit: int = 50,
        max_read: int = 5_000,
        notes: bool = True,
    ) -> tuple[list[DeadLetter], DeadCursor | None]:
        """One page of dead letters, newest first, starting just after ``after``: at most
        ``limit`` of them (only ``job``'s when given), and the cursor of the next page
        (``None`` at the end). Each lane's dead letters are read newest first, a batch at a
        time (``ZREVRANGEBYSCORE ... LIMIT``, never the whole set), at most ``max_read``
        entries per lane and call, so a job whose letters are rare among many may take
        several pages, some of them empty. Pages are ordered by (time, redis id): they neither
        repeat nor skip a letter, however many share a millisecond. With ``notes`` each letter
        carries its last error (one more round trip for the page)."""
        found, floors = self.dead_letters_read(job, after=after, limit=limit, max_read=max_read)
        letters, next_cursor = dead_page(found, floors, limit)
        return (self._with_notes(letters) if notes else letters), next_cursor

    def dead_letters_read(
        self, job: str | None, *, after: DeadCursor | None, limit: int, max_read: int
    ) -> tuple[list[tuple[DeadCursor, DeadLetter]], list[DeadCursor]]:
        """What each lane read for a page (:meth:`dead_letter_page`): the letters with their
        place, and the floor of each lane that stopped with letters left below it."""
        found: list[tuple[DeadCursor, DeadLetter]] = []
        floors: list[DeadCursor] = []
        for queue in self.lane_queues:
            matched, floor = self._read_dead(queue, job, after, limit, max_read)
            found += matched
            if floor is not None:
                floors.append(floor)
        return found, floors

    def _read_dead(
        self, queue: str, job: str | None, after: DeadCursor | None, limit: int, max_read: int
    ) -> tuple[list[tuple[DeadCursor, DeadLetter]], DeadCursor | None]:
        """``queue``'s dead letters (``job``'s) after ``after``, newest first, until ``limit``
        match or ``max_read`` were read; and the last entry read when more remain."""
        batch = limit if job is None else max(limit, min(200, max_read))
        high: float | str = "+inf" if after is None else after[0]
        offset = 0
        matched: list[tuple[DeadCursor, DeadLetter]] = []
        while True:
            entries: list[tuple[Any, float]] = self.client.zrevrangebyscore(  # type: ignore[assignment]
                dead_letters(queue), high, "-inf", start=offset, num=batch, withscores=True
            )
            offset += len(entries)
            fresh = [(float(score), text(rid)) for rid, score in entries]
            fresh = [key for key in fresh if after is None or key < after]
            if fresh:
                bodies = self.client.hmget(dead_letter_messages(queue), [rid for _, rid in fresh])
                for key, body in zip(fresh, bodies, strict=True):
                    letter = self._dead_letter(queue, key[1], key[0], body, read_note=False)
                    if letter is not None and (job is None or letter.job_name == job):
                        matched.append((key, letter))
            if len(entries) < batch:
                return matched, None
            # stop early only past the cursor (a read of nothing but entries at or above it,
            # ties of its score, must go on, or the next page would start at the same place)
            if len(matched) >= limit or (offset >= max_read and fresh):
                return matched, (float(entries[-1][1]), text(entries[-1][0]))

    def _with_notes(self, letters: Sequence[DeadLetter]) -> list[DeadLetter]:
        """``letters`` with their last error from their dead letter notes (one round trip)."""
        if not letters:
            return []
        pipe = self.client.pipeline(transaction=False)
        for letter in letters:
            pipe.get(keys.dead_note(self.prefix, letter.message_id))
        out = []
        for letter, raw in zip(letters, pipe.execute(), strict=True):
            note = None if raw is None else json.loads(raw)
            out.append(
                letter
                if not isinstance(note, dict)
                else replace(
                    letter,
                    attempts=note.get("a"),
                    error_type=note.get("et"),
                    error_message=note.get("em"),
                    traceback=note.get("tb"),
                )
            )
        return out

    def retry_dead(self, message_id: str) -> str | None:
        """Re-enqueue dead letter ``message_id``; the new message id, or ``None`` when it is
        not (or no longer) a dead letter. Found through its dead letter note (a few key reads)
        when it has one, else by the redis ids kumiko derives from its id, else among the
        newest :data:`PREFIX_WINDOW` dead letters of each lane: never a read of them all."""
        letter = self._noted_dead_letter(message_id) or self._found_dead_letter(message_id)
        return None if letter is None else self._retry(letter)

    def retry_all_dead(self, job: str | None = None) -> list[tuple[str, str]]:
        """Re-enqueue every dead letter (``job``'s, when given), newest first, each as
        :meth:`retry_dead` does; ``(dead message id, new message id)`` of each one retried.
        Letters that die again meanwhile are newer than the sweep and are not retried again."""
        retried: list[tuple[str, str]] = []
        cursor: DeadCursor | None = None
        while True:
            letters, cursor = self.dead_letter_page(
                job, after=cursor, limit=500, max_read=10_000, notes=False
            )
            for letter in letters:
                new_id = self._retry(letter)
                if new_id is not None:
                    retried.append((letter.message_id, new_id))
            if cursor is None:
                return retried

    def _noted_dead_letter(self, message_id: str) -> DeadLetter | None:
        """Dead letter ``message_id`` found where its note says it is (``None`` if it has no
        note, or is not there)."""
        note = self.history.dead_note(message_id)
        if note is None:
            return None
        queue, rid = note.get("q"), note.get("r")
        if not isinstance(queue, str) or not isinstance(rid, str) or queue not in self.lane_queues:
            return None
        pipe = self.client.pipeline(transaction=False)
        pipe.zscore(dead_letters(queue), rid)
        pipe.hget(dead_letter_messages(queue), rid)
        score, body = pipe.execute()
        if score is None:
            return None
        letter = self._dead_letter(queue, rid, float(score), body, read_note=False)
        return letter if letter is not None and letter.message_id == message_id else None

    def _found_dead_letter(self, message_id: str) -> DeadLetter | None:
        """Dead letter ``message_id`` without a note: by its derived redis ids, then among
        the newest dead letters of each lane."""
        candidates = self.redis_id_candidates(message_id)
        pipe = self.client.pipeline(transaction=False)
        for queue in self.lane_queues:
            for rid in candidates:
                pipe.zscore(dead_letters(queue), rid)
        scores = iter(pipe.execute())
        for queue in self.lane_queues:
            for rid in candidates:
                score = next(scores)
                if score is not None:
                    body = self.client.hget(dead_letter_messages(queue), rid)
                    letter = self._dead_letter(queue, rid, float(score), body, read_note=False)
                    if letter is not None and letter.message_id == message_id:
                        return letter
        for queue in self.lane_queues:
            entries: list[tuple[Any, float]] = self.client.zrevrange(  # type: ignore[assignment]
                dead_letters(queue), 0, PREFIX_WINDOW - 1, withscores=True
            )
            rids = [text(rid) for rid, _ in entries]
            bodies = self.client.hmget(dead_letter_messages(queue), rids) if rids else []
            for rid, (_, score), body in zip(rids, entries, bodies, strict=True):
                letter = self._dead_letter(queue, rid, float(score), body, read_note=False)
                if letter is not None and letter.message_id == message_id:
                    return letter
        return None

    def _retry(self, letter: DeadLetter) -> str | None:
        queue = letter.queue
        body = self.client.hget(dead_letter_messages(queue), letter.redis_message_id)
        if body is None:
            return None
        message = Message.decode(body if isinstance(body, bytes) else body.encode())
        options = {k: v for k, v in message.options.items() if k not in ("eta", "redis_message_id")}
        options.pop(FAILURES, None)
        if TRIGGER in options:  # a kumiko message: a new id that keeps its origin
            options[ORIGIN_ID] = options.get(ORIGIN_ID) or letter.message_id
            options.pop(DEDUP_KEY, None)
        new_id = generate_unique_id()
        fresh: Message[Any] = Message(
            queue_name=queue,
            actor_name=message.actor_name,
            args=message.args,
            kwargs=message.kwargs,
            options=options,
            message_id=new_id,
        )
        prepared = self.broker.prepare(fresh, None)
        rid = prepared.options["redis_message_id"]
        self.broker.emit_before("enqueue", prepared, None)
        done = self.broker.lua.retry_dead(
            keys=[
                dead_letters(queue),
                dead_letter_messages(queue),
                queue_messages(queue),
                queue_list(queue),
                keys.dead_note(self.prefix, letter.message_id),
            ],
            args=[letter.redis_message_id, rid, prepared.encode()],
        )
        if done != 1:
            return None
        self.broker.emit_after("enqueue", prepared, None)
        return new_id

    def delete_dead(self, message_id: str) -> bool | None:
        """Discard dead letter ``message_id`` (``lua/delete_dead.lua``): ``True``; ``None``
        when it is not (or no longer) a dead letter. Found as :meth:`retry_dead` finds it."""
        letter = self._noted_dead_letter(message_id) or self._found_dead_letter(message_id)
        if letter is None:
            return None
        done = self.broker.lua.delete_dead(
            keys=[
                dead_letters(letter.queue),
                dead_letter_messages(letter.queue),
                keys.dead_note(self.prefix, message_id),
            ],
            args=[letter.redis_message_id],
        )
        return True if done == 1 else None
