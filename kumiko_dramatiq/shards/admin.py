"""``runner.admin`` and ``runner.history`` on a dataset of several shards: the reads the
``kumiko`` command and the dashboard make off them, over every shard.

- one message (``waiting_state``, ``known``, ``find``, ``dead_note``): the shard its id
  names first, then the others;
- listings and counts (``ids_starting_with``, ``locks``, ``boot_markers``, ``counts``,
  ``current_problems``): every shard's, merged;
- actions on a job (``pause``, ``resume``, ``retry_all_dead``): on every shard;
- pages: dead letters merge over the shards as over the lanes of one (by time and redis id,
  :func:`~kumiko_dramatiq.ops.dead.dead_page`); dedup keys walk the shards in turn, the
  cursor's last number carrying the shard (``tie * MAX_SHARDS + shard``).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any, TypeVar

from kumiko_dramatiq.ops.admin import Admin
from kumiko_dramatiq.ops.dead import DeadCursor, DeadLetter, dead_page
from kumiko_dramatiq.ops.guards import BootMarker, DedupCursor, DedupInfo, LockInfo
from kumiko_dramatiq.ops.history import JobRun, RunHistory, RunStatus
from kumiko_dramatiq.registry import JobDefinition
from kumiko_dramatiq.settings import MAX_SHARDS
from kumiko_dramatiq.shards.routing import keyed_shard, shard_of_id

T = TypeVar("T")


def by_id(items: Sequence[T], message_id: str) -> list[T]:
    """``items`` (one per shard), the one of the shard ``message_id`` names first."""
    named = shard_of_id(message_id, len(items))
    return [items[named], *(item for n, item in enumerate(items) if n != named)]


class ShardedHistory(RunHistory):
    """The run history of every shard (``histories``: shard 0's first)."""

    def __init__(self, histories: Sequence[RunHistory]) -> None:
        first = histories[0]
        super().__init__(first.client, first.lua, first.prefix)
        self.histories = tuple(histories)

    def run_record(self, message_id: str) -> list[JobRun]:
        for history in by_id(self.histories, message_id):
            if found := history.run_record(message_id):
                return list(found)
        return []

    def running(self) -> list[JobRun]:
        return [run for history in self.histories for run in history.running()]

    def runs(self, job: str | None = None, **filters: Any) -> list[JobRun]:
        limit = int(filters.get("limit", 50))
        pages = [history.runs(job, **filters) for history in self.histories]
        merged = itertools.islice(
            sorted(itertools.chain(*pages), key=lambda run: run.order_key, reverse=True), limit
        )
        return list(merged)

    def counts(
        self, statuses: Sequence[RunStatus], edges_ms: Sequence[int]
    ) -> dict[str, list[int]]:
        total: dict[str, list[int]] = {}
        for history in self.histories:
            for status, counts in history.counts(statuses, edges_ms).items():
                into = total.setdefault(status, [0] * len(counts))
                total[status] = [a + b for a, b in zip(into, counts, strict=True)]
        return total

    def dead_note(self, message_id: str) -> dict[str, Any] | None:
        for history in by_id(self.histories, message_id):
            if (note := history.dead_note(message_id)) is not None:
                return note
        return None


class ShardedAdmin(Admin):
    """The admin API of every shard (``admins``: shard 0's first); what it does not
    override is shard 0's."""

    def __init__(self, admins: Sequence[Admin]) -> None:
        first = admins[0]
        super().__init__(first.broker, first.registry, first.settings)
        self.admins = tuple(admins)
        self.history = ShardedHistory([admin.history for admin in admins])

    # -- one message -------------------------------------------------------
    def waiting_state(self, message_id: str) -> str | None:
        for admin in by_id(self.admins, message_id):
            if (state := admin.waiting_state(message_id)) is not None:
                return state
        return None

    def known(self, message_id: str) -> bool:
        return any(admin.known(message_id) for admin in by_id(self.admins, message_id))

    def job_state(self, message_id: str) -> str:
        state = "unknown"
        for admin in by_id(self.admins, message_id):
            if (state := admin.job_state(message_id)) != "unknown":
                break
        return state

    def dedup_record(self, job: JobDefinition, dedup_key: str) -> DedupInfo | None:
        return self.admins[keyed_shard(job, dedup_key, len(self.admins))].dedup_record(
            job, dedup_key
        )

    # -- listings ------------------------------------------------------------
    def ids_starting_with(self, prefix: str, *, limit: int = 10) -> list[str]:
        found = {i for admin in self.admins for i in admin.ids_starting_with(prefix, limit=limit)}
        return sorted(found)[:limit]

    def locks(self, *, limit: int = 1_000) -> list[LockInfo]:
        return [lock for admin in self.admins for lock in admin.locks(limit=limit)][:limit]

    def boot_markers(self) -> list[BootMarker]:
        return [marker for admin in self.admins for marker in admin.boot_markers()]

    def current_problems(self) -> list[str]:
        return [
            problem if n == 0 else f"shard {n}: {problem}"
            for n, admin in enumerate(self.admins)
            for problem in admin.current_problems()
        ]

    def dead_letter_page(
        self,
        job: str | None = None,
        *,
        after: DeadCursor | None = None,
        limit: int = 50,
        max_read: int = 5_000,
        notes: bool = True,
    ) -> tuple[list[DeadLetter], DeadCursor | None]:
        found: list[tuple[DeadCursor, DeadLetter]] = []
        floors: list[DeadCursor] = []
        holder: dict[str, Admin] = {}
        for admin in self.admins:
            read, admin_floors = admin.dead_letters_read(
                job, after=after, limit=limit, max_read=max_read
            )
            found += read
            floors += admin_floors
            holder.update((letter.message_id, admin) for _, letter in read)
        letters, next_cursor = dead_page(found, floors, limit)
        if notes:
            noted = {
                letter.message_id: letter
                for admin in self.admins
                for letter in admin._with_notes(
                    [x for x in letters if holder[x.message_id] is admin]
                )
            }
            letters = [noted[letter.message_id] for letter in letters]
        return letters, next_cursor

    def dedup_page(
        self, job: str | None = None, *, after: DedupCursor | None = None, limit: int = 100
    ) -> tuple[list[DedupInfo], DedupCursor | None]:
        start, inner = 0, after
        if after is not None:
            start, inner = after[2] % MAX_SHARDS, (after[0], after[1], after[2] // MAX_SHARDS)
        found: list[DedupInfo] = []
        for n in range(start, len(self.admins)):
            page, cursor = self.admins[n].dedup_page(job, after=inner, limit=limit - len(found))
            found += page
            inner = None
            if cursor is not None:
                return found, (cursor[0], cursor[1], cursor[2] * MAX_SHARDS + n)
            if len(found) >= limit and n + 1 < len(self.admins):  # the next shard's start
                return found, (job or "", float("inf"), n + 1)
        return found, None

    # -- actions on a job ------------------------------------------------------
    def pause(self, job: JobDefinition) -> bool:
        changed = [admin.pause(job) for admin in self.admins]  # every shard, not the first
        return any(changed)

    def resume(self, job: JobDefinition) -> tuple[int, int] | None:
        outcomes = [admin.resume(job) for admin in self.admins]
        done = [outcome for outcome in outcomes if outcome is not None]
        if not done:
            return None
        return sum(r for r, _ in done), sum(d for _, d in done)

    def retry_all_dead(self, job: str | None = None) -> list[tuple[str, str]]:
        return [pair for admin in self.admins for pair in admin.retry_all_dead(job)]
