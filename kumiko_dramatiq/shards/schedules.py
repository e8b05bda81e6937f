"""``runner.schedules`` on a dataset of several shards.

A schedule fires each tick in one Lua call that moves its score and enqueues the tick's
message (:mod:`kumiko_dramatiq.schedules.store`), so a schedule lives in the shard its
ticks' job lives in: a pinned job's shard (a capped or sequential job keeps its guarantee),
else the shard of its id. Each shard's schedulers fire the schedules stored there. A
code-declared cron job's schedule is its job's shard's.
"""

from __future__ import annotations

import builtins
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

from kumiko_dramatiq.errors import NotFoundError
from kumiko_dramatiq.schedules.model import Schedule, check_id
from kumiko_dramatiq.schedules.store import Schedules
from kumiko_dramatiq.shards.routing import pinned_shard, shard_of


class ShardedSchedules(Schedules):
    """The schedules of every shard behind one :class:`Schedules` (``stores``: shard 0's
    first); the schedulers' side (``due``, ``fire``) stays each shard's own."""

    def __init__(self, stores: Sequence[Schedules]) -> None:
        first = stores[0]
        super().__init__(
            first.broker,
            first.registry,
            max_payload_bytes=first.max_payload_bytes,
            guard_ttl_ms=first.guard_ttl_ms,
        )
        self.stores = tuple(stores)

    def upsert(self, schedule_id: str, job_name: str, **options: Any) -> Schedule:
        job = self.registry.jobs.get(job_name)
        if job is None or not isinstance(schedule_id, str):
            return self.stores[0].upsert(schedule_id, job_name, **options)  # its error
        home = self._home(schedule_id, job_name)
        for store in self.stores:  # a schedule whose job moved it to another shard
            if store is not home and store._stored_text(check_id(schedule_id)) is not None:
                store.remove(schedule_id)
        return home.upsert(schedule_id, job_name, **options)

    def get(self, schedule_id: str) -> Schedule:
        return self._holder(schedule_id).get(schedule_id)

    def list(self) -> builtins.list[Schedule]:
        found = [
            schedule
            for n, store in enumerate(self.stores)
            for schedule in store.list()
            if schedule.owner == "runtime" or self._shard_of_job(schedule.job_name) == n
        ]
        far = datetime.max.replace(tzinfo=UTC)
        return sorted(found, key=lambda s: (s.next_fire or far, s.id))

    def pause(self, schedule_id: str) -> bool:
        return self._holder(schedule_id).pause(schedule_id)

    def resume(self, schedule_id: str) -> bool:
        return self._holder(schedule_id).resume(schedule_id)

    def remove(self, schedule_id: str) -> bool:
        try:
            holder = self._holder(schedule_id)
        except NotFoundError:
            return self.stores[0].remove(schedule_id)  # False, or its error
        return holder.remove(schedule_id)

    def trigger(self, schedule_id: str) -> str:
        return self._holder(schedule_id).trigger(schedule_id)

    def _shard_of_job(self, job_name: str) -> int:
        job = self.registry.jobs.get(job_name)
        pinned = None if job is None else pinned_shard(job, len(self.stores))
        return 0 if pinned is None else pinned

    def _home(self, schedule_id: str, job_name: str) -> Schedules:
        """The shard a schedule of ``job_name`` lives in."""
        job = self.registry.jobs[job_name]
        pinned = pinned_shard(job, len(self.stores))
        if pinned is None:
            pinned = shard_of(f"schedule\n{schedule_id}", len(self.stores))
        return self.stores[pinned]

    def _holder(self, schedule_id: str) -> Schedules:
        """The shard that holds ``schedule_id`` (a code-declared one: its job's); the first
        shard when none does (it then answers as for an unknown schedule)."""
        if self._code_job(check_id(schedule_id)) is not None:
            return self.stores[self._shard_of_job(schedule_id)]
        for store in self.stores:
            if store._stored_text(schedule_id) is not None:
                return store
        return self.stores[0]
