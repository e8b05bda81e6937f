"""Redis memory per job: what completed jobs leave behind, right after a drain and later.

``N`` no-op jobs (``--memory-jobs``, default 1,000,000) go through one runner with the
production windows (a minute for "sent" and "already completed" markers). Measured on the
private server: the per-message keys (kind, count, bytes by ``MEMORY USAGE``) right after the
drain, the bytes they hold per job, and so the memory per job/s of sustained throughput
(bytes per job x how long each kind lives). Then the windows pass and the same count is taken
again (it must be under 1 MB: nothing per message is left but the capped run history, which
is reported on its own).
"""

from __future__ import annotations

import time
import uuid
from typing import TYPE_CHECKING, Any

from kumiko_dramatiq import Feature, JobContext, JobRunner, Registry
from kumiko_dramatiq.broker.broker import RESEND_WINDOW_MS

from .harness import Countdown

if TYPE_CHECKING:
    from .run import Bench

#: kinds kept for their own lifetime, not per message
HISTORY = {"run", "runs"}
#: measured before this change: 331 bytes per job kept completed_age_s (24 h)
BEFORE_BYTES_PER_JOB_PER_S = 331 * 86_400


class MemoryBench:
    def __init__(self, bench: Bench, jobs: int) -> None:
        self.bench = bench
        self.jobs = jobs

    def __call__(self) -> None:
        countdown = Countdown(self.jobs)
        feature = Feature("mem")

        @feature.job("noop")
        def noop(payload: dict[str, Any], ctx: JobContext) -> None:
            countdown.hit()

        prefix = f"bm{uuid.uuid4().hex[:6]}"
        runner = JobRunner(Registry([feature]), redis_url=self.bench.redis_url, queue_prefix=prefix)
        for start in range(0, self.jobs, 10_000):
            runner.dispatch_many("mem:job:noop", [{}] * min(10_000, self.jobs - start))
        began = time.monotonic()
        runner.start()
        countdown.wait()
        drained_s = time.monotonic() - began
        runner.stop()
        after_drain = self.per_message(prefix)
        time.sleep(RESEND_WINDOW_MS / 1000 + 5)
        later = self.per_message(prefix)
        history = self.kinds(prefix, HISTORY)
        self.bench.flush(prefix)
        per_job = {kind: held / self.jobs for kind, (_, held) in after_drain.items()}
        steady = sum(per_job.values()) * RESEND_WINDOW_MS / 1000
        self.bench.extra["memory: jobs"] = self.jobs
        self.bench.extra["memory: drain msg/s"] = round(self.jobs / drained_s)
        self.bench.extra["memory: per-message keys right after the drain (count, bytes)"] = (
            after_drain
        )
        self.bench.extra["memory: bytes per job right after the drain"] = {
            kind: round(value, 1) for kind, value in per_job.items()
        }
        self.bench.extra["memory: steady state, bytes per job/s of throughput"] = round(steady)
        self.bench.extra["memory: vs before (331 B kept 24 h per job)"] = (
            f"1/{BEFORE_BYTES_PER_JOB_PER_S / max(steady, 1):.0f}"
        )
        self.bench.extra["memory: per-message keys once the windows passed (bytes)"] = sum(
            held for _, held in later.values()
        )
        self.bench.extra["memory: run history (capped; count, bytes)"] = history

    def per_message(self, prefix: str) -> dict[str, tuple[int, int]]:
        root = f"kumiko:{prefix}:"
        kinds = {
            key.decode()[len(root) :].split(":", 1)[0]
            for key in self.bench.client.scan_iter(match=f"{root}*", count=10_000)
        }
        return self.kinds(prefix, kinds - HISTORY)

    def kinds(self, prefix: str, kinds: set[str]) -> dict[str, tuple[int, int]]:
        """(count, bytes) of the keys of each kind."""
        found: dict[str, tuple[int, int]] = {}
        client = self.bench.client
        for kind in sorted(kinds):
            keys = list(client.scan_iter(match=f"kumiko:{prefix}:{kind}*", count=10_000))
            pipe = client.pipeline(transaction=False)
            for key in keys:
                pipe.memory_usage(key)
            sizes = [int(size or 0) for size in pipe.execute()] if keys else []
            found[kind] = (len(keys), sum(sizes))
        return found
