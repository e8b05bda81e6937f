"""The dataset at a glance (``kumiko status``, ``runner.status()``, the dashboard's banner).

:meth:`StatusAdmin.status` counts each lane's messages by state, lists the live processes
and the paused jobs, and says what an operator must look at: two pipelined round trips plus
the liveness listing, whatever the dataset's size.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from dramatiq.common import dq_name

from kumiko_dramatiq.broker import keys
from kumiko_dramatiq.broker.counts import in_order
from kumiko_dramatiq.broker.keys import (
    consumer_acks,
    dead_letters,
    heartbeats,
    queue_list,
    queue_messages,
)
from kumiko_dramatiq.broker.replies import text
from kumiko_dramatiq.middleware.presence import ProcessInfo, live_processes
from kumiko_dramatiq.ops.admin_base import AdminBase
from kumiko_dramatiq.ops.health import problems, read_health
from kumiko_dramatiq.ops.history import is_held_entry
from kumiko_dramatiq.options import LANES


@dataclass(frozen=True)
class LaneStatus:
    """Message counts of one lane: waiting, waiting out a delay or backoff, claimed by a
    worker (running), dead-lettered, and held back because their job is paused."""

    lane: str
    queue: str
    queued: int
    delayed: int
    running: int
    dead: int
    parked: int

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass(frozen=True)
class Status:
    lanes: list[LaneStatus]
    workers: list[ProcessInfo]
    schedulers: list[ProcessInfo]
    paused: list[str]
    #: what an operator must look at, one line each; empty when healthy
    #: (:mod:`kumiko_dramatiq.ops.health`)
    problems: list[str] = field(default_factory=list)
    #: on a dataset of several shards (``shards=N``): each shard's own status, shard 0 first
    #: (the fields above are then the whole dataset's); empty on one shard
    shards: list[Status] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "lanes": [lane.to_json() for lane in self.lanes],
            "workers": [worker.to_json() for worker in self.workers],
            "schedulers": [scheduler.to_json() for scheduler in self.schedulers],
            "paused": self.paused,
            "problems": self.problems,
        }
        if self.shards:
            out["shards"] = [shard.to_json() for shard in self.shards]
        return out


class StatusAdmin(AdminBase):
    """The dataset at a glance: lanes, live processes, paused jobs, problems."""

    def status(self) -> Status:
        """Per lane: queued (its list and suspects, less the ids cancel withdrew, and what the
        workers hold ahead of their threads), delayed, running (in the live workers' ack sets,
        started), dead, and parked (every declared job's
        parked messages, a paused one's or what a resume cut short left); live processes;
        paused jobs. Two round trips plus the liveness listing, whatever the dataset's size."""
        processes = live_processes(self.client, self.prefix)
        workers = [p for p in processes if p.role == "worker"]
        paused = sorted(text(job) for job in self.client.smembers(keys.paused(self.prefix)))
        pipe = self.client.pipeline(transaction=False)
        worker_ids = [text(w) for w in self.client.zrange(heartbeats(self.broker.namespace), 0, -1)]
        for queue in self.lane_queues:
            pipe.hgetall(keys.queue_levels(queue))
        for queue in self.lane_queues:
            pipe.llen(queue_list(queue))
            pipe.llen(keys.suspects(self.prefix, queue))
            pipe.scard(keys.queue_withdrawn(queue))
            pipe.hlen(queue_messages(dq_name(queue)))
            pipe.zcard(dead_letters(queue))
            for worker in worker_ids:
                pipe.smembers(consumer_acks(worker, queue))
        # every job's parked list: a paused job's, and what a resume cut short left behind
        held = sorted(set(paused) | set(self.registry.jobs))
        for job in held:
            pipe.llen(keys.parked(self.prefix, job))
            pipe.scard(keys.parked_withdrawn(self.prefix, job))
        pipe.hgetall(keys.cap_waits(self.prefix))
        *counts, cap_waits = pipe.execute()
        replies = iter(counts)
        ordered = [in_order(next(replies)) for _ in self.lane_queues]
        # messages waiting for a cap (max_running, rate_limit) are queued, on their job's lane
        capped_by_lane: dict[str, int] = {}
        for job_name, count in cap_waits.items():
            declared = self.registry.jobs.get(text(job_name))
            lane_name = "worker" if declared is None else declared.options.run_in
            capped_by_lane[lane_name] = capped_by_lane.get(lane_name, 0) + max(0, int(count))
        lanes = []
        for n, (lane, queue) in enumerate(zip(LANES, self.lane_queues, strict=True)):
            # ids cancel withdrew stay in the lists until a fetch meets them: not counted
            listed = int(next(replies)) + int(next(replies)) + capped_by_lane.get(lane, 0)
            listed += ordered[n]
            queued = max(0, listed - int(next(replies)))
            delayed = int(next(replies))
            dead = int(next(replies))
            claimed = [text(rid) for _ in worker_ids for rid in next(replies)]
            # a message a worker holds ahead of its threads has not started: it is queued
            ahead = self._held_among(claimed)
            running = len(claimed) - ahead
            lanes.append(LaneStatus(lane, queue, queued + ahead, delayed, running, dead, 0))
        parked_by_job = {job: max(0, int(next(replies)) - int(next(replies))) for job in held}
        lanes = [
            LaneStatus(
                **{
                    **lane.__dict__,
                    "parked": sum(
                        count
                        for job, count in parked_by_job.items()
                        if job in self.registry.jobs
                        and self.registry.jobs[job].options.run_in == lane.lane
                    ),
                }
            )
            for lane in lanes
        ]
        schedulers = [p for p in processes if p.role == "scheduler"]
        return Status(
            lanes=lanes,
            workers=workers,
            schedulers=schedulers,
            paused=paused,
            problems=self.problems(workers, schedulers),
        )

    def _held_among(self, rids: list[str]) -> int:
        """How many of the claimed ``rids`` are held, not started (their in-flight entries;
        bounded by what the workers claim, twice their threads each)."""
        if not rids:
            return 0
        entries = self.client.hmget(keys.inflight(self.prefix), rids)
        return sum(1 for entry in entries if entry is not None and is_held_entry(entry))

    def current_problems(self) -> list[str]:
        """:attr:`Status.problems` alone (the liveness listing and two reads), for the
        dashboard's banner on every page."""
        processes = live_processes(self.client, self.prefix)
        return self.problems(
            [p for p in processes if p.role == "worker"],
            [p for p in processes if p.role == "scheduler"],
        )

    def problems(self, workers: list[ProcessInfo], schedulers: list[ProcessInfo]) -> list[str]:
        """The dataset's problems (:mod:`kumiko_dramatiq.ops.health`), one line each."""
        reading = read_health(self.client, self.prefix)
        shard = (self.settings.shard, self.settings.shards)
        return problems(reading, self.registry, workers, schedulers, datetime.now(UTC), shard)
