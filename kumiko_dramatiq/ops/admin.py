"""Operating a dataset: what is queued, dead, locked, keyed, paused and alive, and actions on it.

:class:`Admin` answers the ``kumiko`` command, the dashboard and ``JobRunner``'s admin
methods (``status``, ``dead_letters``, ``retry_dead``, ``cancel``, ``pause``, ``resume``,
plus ``jobs``, ``locks`` and ``dedup_keys``). Every read and action costs Redis work bounded
by its page or its message, never by the size of the keyspace or of a queue: a status is two
pipelined round trips plus the liveness listing; dead letters are read a page at a time
(``dead_letter_page``); locks and live dedup keys are read off the indexes their Lua scripts
keep (``locks``: ``keys.locks_index``; ``dedup_page``: ``keys.dedup_index``); a message is
found by the few redis ids kumiko derives from its id (``redis_id_candidates``, used by
``cancel``, ``waiting_state`` and ``retry_dead``); an id prefix is looked up among the newest
run records (``ids_starting_with``). Every action that changes more than one key is one Lua
call, so it is all-or-nothing (``retry_all_dead`` is one such retry per letter, ``resume``
one call per :data:`RESUME_STEP` parked messages):

- **retry** (``lua/retry_dead.lua``): the dead letter leaves the dead letters and a new
  message is enqueued in one step, with a fresh attempt budget, a new message id, the
  original origin id (the id the caller first got back) and, for a per-tenant child, its
  tenant; the dedup key is not carried (the key's job ended when it died);
- **cancel** (``lua/cancel.lua``): a queued, delayed, backing-off, parked or waiting message
  never starts (its body is deleted and its redis id noted as withdrawn, so the fetch that
  meets it drops it: no search of the list); one held in a worker's memory until due is
  dropped by its move; a running one is not interrupted, nor one that ended (``False``,
  nothing changed);
- **pause** (``keys.paused``): a paused job's messages are not fetched but parked
  (``keys.parked``) when a fetch meets them: kept, never run, no busy loop, on every worker;
  **resume** (``lua/resume.lua``) puts them back at the head of their queue. Cron ticks parked
  meanwhile follow the job's misfire policy: ``coalesce`` runs the latest one, ``skip`` none.

:class:`Admin` is made of one class per subject, each in a module of its own on
:class:`~kumiko_dramatiq.ops.admin_base.AdminBase` (the shared state); the records they return
are importable from here as before:

- :mod:`~kumiko_dramatiq.ops.status`: ``status``, ``current_problems``, ``problems``
  (:class:`Status`, :class:`LaneStatus`);
- :mod:`~kumiko_dramatiq.ops.jobs`: ``jobs``, ``job_counts``, ``backfill_counts``,
  ``caps_fullness`` (:class:`JobInfo`);
- :mod:`~kumiko_dramatiq.ops.lookup`: ``redis_id_candidates``, ``ids_starting_with``,
  ``waiting_state``, ``known``, ``queued``, ``running``;
- :mod:`~kumiko_dramatiq.ops.dead`: ``dead_letters``, ``dead_letter_page``, ``retry_dead``,
  ``retry_all_dead``, ``delete_dead`` (:class:`DeadLetter`);
- :mod:`~kumiko_dramatiq.ops.guards`: ``locks``, ``slot_holders``, ``dedup_page``,
  ``dedup_keys``, ``dedup_record``, ``boot_markers`` (:class:`LockInfo`, :class:`DedupInfo`,
  :class:`BootMarker`);
- :mod:`~kumiko_dramatiq.ops.control`: ``cancel``, ``stop_run``, ``move_delayed_now``,
  ``run_now``, ``pause``, ``resume``;
- :mod:`~kumiko_dramatiq.ops.admin_base`: ``lane_queues``, ``capped_jobs``;
- here: ``purge`` (:data:`PURGE_WALKS`, its steps' bounds and :func:`purge_scan_count`).
"""

from __future__ import annotations

import logging
from datetime import UTC, datetime

from kumiko_dramatiq.broker import keys
from kumiko_dramatiq.broker.holds import new_request_id
from kumiko_dramatiq.broker.replies import text
from kumiko_dramatiq.ops.asking import Asking
from kumiko_dramatiq.ops.control import CANCEL_ROUNDS, RESUME_STEP, ControlAdmin
from kumiko_dramatiq.ops.dead import DEAD_LIST_PAGES, DeadAdmin, DeadCursor, DeadLetter
from kumiko_dramatiq.ops.guards import BootMarker, DedupCursor, DedupInfo, GuardsAdmin, LockInfo
from kumiko_dramatiq.ops.jobs import COUNT_STATES, JobInfo, JobsAdmin
from kumiko_dramatiq.ops.lookup import PREFIX_WINDOW
from kumiko_dramatiq.ops.status import LaneStatus, Status, StatusAdmin
from kumiko_dramatiq.registry import JobDefinition

__all__ = [
    "CANCEL_ROUNDS",
    "COUNT_STATES",
    "DEAD_LIST_PAGES",
    "PREFIX_WINDOW",
    "PURGE_STEP",
    "PURGE_STEP_BYTES",
    "PURGE_WALKS",
    "RESUME_STEP",
    "Admin",
    "BootMarker",
    "DeadCursor",
    "DeadLetter",
    "DedupCursor",
    "DedupInfo",
    "JobInfo",
    "LaneStatus",
    "LockInfo",
    "Status",
    "purge_scan_count",
]

logger = logging.getLogger("kumiko_dramatiq")


# The purge stays here, beside the bounds it reads as globals of this module: the tests set
# PURGE_STEP_BYTES on kumiko_dramatiq.ops.admin to walk in steps of one body.
#: Entries one purge step reads at most (``lua/purge_step.lua``), and bytes of message bodies
#: (it stops once the bodies it read reach them): 0.2 to 0.7 ms of Redis per step, median,
#: whatever the messages' size (``benchmarks/purge.py``).
PURGE_STEP = 25
PURGE_STEP_BYTES = 65_536
#: The states ``purge`` takes, and what it walks for each (``lua/purge_step.lua``'s modes).
PURGE_WALKS: dict[str, tuple[str, ...]] = {
    # queued: the queue's list, its order's lists (priorities, fair keys) and suspects, then
    # the lists of those waiting for a cap
    "queued": ("queued", "order", "suspects", "capwait"),
    "delayed": ("delayed",),
    "parked": ("parked",),
    "dead": ("dead",),
}


def purge_scan_count(count: int, spent: int, read: int) -> int:
    """The ``COUNT`` of a purge step's next ``HSCAN`` after one of ``count`` that read
    ``read`` bodies of ``spent`` bytes in all: as many bodies of that average size as fit
    :data:`PURGE_STEP_BYTES`, from 1 to :data:`PURGE_STEP` (``count`` again when it read
    none). A walk starts at 1: the first step learns the bodies' size from one body."""
    if read <= 0:
        return count
    return max(1, min(PURGE_STEP, PURGE_STEP_BYTES * read // max(1, spent)))


class Admin(StatusAdmin, JobsAdmin, GuardsAdmin, DeadAdmin, ControlAdmin):
    """The admin API over one dataset (``broker``'s Redis and queue prefix)."""

    def purge(self, job: JobDefinition, state: str, *, dry_run: bool = False) -> int:
        """Remove ``job``'s messages in ``state`` (:data:`PURGE_WALKS`), at most
        :data:`PURGE_STEP` entries and about :data:`PURGE_STEP_BYTES` of their bodies per Lua
        call (``lua/purge_step.lua``), so Redis is never blocked; the number
        removed (with ``dry_run``: found, nothing changed). Dedup keys they hold are freed; no
        run record is written; one WARNING line says how many went. A running message is
        never removed; messages enqueued while it runs may or may not be."""
        queue = job.queue_name(self.prefix)
        total = 0
        for walk in PURGE_WALKS[state]:
            cursor, count = "0", 1 if walk == "delayed" else PURGE_STEP
            while True:
                removed, cursor, spent, read = self.broker.lua.purge_step(
                    keys=[self.broker.namespace],
                    args=[
                        keys.root(self.prefix),
                        job.qualified_name,
                        walk,
                        queue,
                        cursor,
                        count,
                        int(datetime.now(UTC).timestamp() * 1000),
                        PURGE_STEP_BYTES,
                        "1" if dry_run else "0",
                    ],
                )
                total += int(removed)
                cursor = text(cursor)
                if cursor == "0":
                    break
                if walk == "delayed":
                    # HSCAN hands over the bodies it visits: size its next COUNT so that
                    # bodies like the ones just read stay within the step's bytes
                    count = purge_scan_count(count, int(spent), int(read))
        if state == "queued":
            # what workers hold ahead of their threads is queued too: asked last, so that what
            # they claimed off the queue while it was walked is held by then
            asking = Asking(self.broker)
            asks, held = asking.ask_job(
                queue, job.qualified_name, new_request_id(), "purge", dry_run=dry_run
            )
            if dry_run:
                total += held
            else:
                total += sum(1 for a in asking.wait(asks).values() if a == "dropped")
        if not dry_run:
            logger.warning("purged %d %s message(s) of %s", total, state, job.qualified_name)
        return total
