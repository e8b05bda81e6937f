"""Prometheus metrics: kumiko's own counts of its runs, recorded from what the chain knows.

Setting: ``JobRunner(..., metrics_port=9191)`` or ``KUMIKO_METRICS_PORT=9191``; off by default.
It needs the ``metrics`` extra (``pip install 'kumiko_dramatiq[metrics]'``, i.e.
``prometheus_client``), imported only when the port is set: without it, constructing the
runner raises ``JobConfigError`` naming ``metrics_port``. Every worker process serves
``http://HOST:PORT/metrics``; the processes of one ``dramatiq kumiko_dramatiq.app -p N`` share
the port and one merged view, and the scheduler serves too (:func:`serving`); how, and what
happens when processes die, is :mod:`kumiko_dramatiq.ops.exposition`'s business.

Metrics (:data:`SPECS`; no tenant label: 10,000 tenants would be 10,000 series per job, so
per-tenant figures come from the run history, see docs/history.md)

========================================= ================================================
``kumiko_runs_total{job,status,trigger,   attempts that ended: ``completed``, ``failed``
lane}``                                   (a retry follows), ``dead``; the status the run
                                          record gets (History's end record)
``kumiko_run_duration_seconds{job,lane}`` histogram of those attempts' run time
``kumiko_handoffs_total{job}``            sequential hand-offs (the lock was held: no attempt)
``kumiko_lock_wait_seconds{job}``         histogram of each wait between a hand-off and its
                                          re-check: ``_sum`` is the time runs of the job spent
                                          waiting for its lock, ``_count`` the re-checks (waits
                                          of runs that already failed an attempt are left out)
``kumiko_fanout_children_total{job}``     per-tenant children a wrapper newly enqueued
``kumiko_dedup_total{job,outcome}``       dispatches with a dedup key: ``enqueued`` (a new
                                          run), ``follow_up`` (the first trigger while the
                                          job ran: its follow-up), ``deduplicated`` (joined a
                                          queued job or a pending follow-up); counted by the
                                          process that dispatches
``kumiko_dead_letters_total{lane,reason}`` messages dead-lettered: ``failed`` (last attempt
                                          failed), ``worker_died`` (a poison message,
                                          ``max_deliveries`` deaths), ``malformed``
``kumiko_cron_lag_seconds{job}``          enqueue time minus tick of the latest cron tick the
                                          scheduler enqueued
``kumiko_workers{lane}``                  worker processes running (0 when none is)
``kumiko_schedulers``                     scheduler processes running
``kumiko_queue_messages{lane,state}``     read from Redis at scrape time: ``queued``,
                                          ``delayed``, ``running``, ``parked``, ``dead``
``kumiko_run_history_records{status}``    read from Redis at scrape time
``kumiko_batches_total{outcome}``          batches and chains ended: ``succeeded``,
                                          ``failed``, ``cancelled`` (read from Redis)
``kumiko_redis_up``                       1 if that read worked
``kumiko_consumers_down``                 read from the live workers' liveness records at
                                          scrape time: consumer threads down (ended and
                                          being restarted, or stuck)
========================================= ================================================

Where the counts come from (no Redis round trip on a message's path): the
:class:`~kumiko_dramatiq.worker.execution.Execution` of each delivery (job, trigger, start time,
hand-off), the status History left on the delivery's settlement, the ``before_enqueue`` /
``after_enqueue`` signals (children, cron ticks), the outcome of the dedup dispatch
(:func:`count_dedup`), and, for messages the consumer dead-letters at fetch before any
middleware sees them, the broker's ``fetch_dead_letter_listeners``.

Place in the chain (:func:`kumiko_dramatiq.middleware.build_middleware`): right after
``Boot`` (every delivery's execution is opened at fetch), so ``after_process_message``
runs after History wrote the status. Reads message options ``kumiko_trigger``,
``kumiko_failures`` and ``kumiko_scheduled_at``; writes none; touches no Redis key on the
message path.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from types import ModuleType
from typing import TYPE_CHECKING, Any, Final, Literal

from dramatiq.broker import Broker, MessageProxy
from dramatiq.message import Message
from dramatiq.middleware import Middleware
from dramatiq.worker import Worker

from kumiko_dramatiq.broker.broker import KumikoBroker
from kumiko_dramatiq.broker.delivery import Delivery
from kumiko_dramatiq.codec import FAILURES, SCHEDULED_AT, TRIGGER
from kumiko_dramatiq.middleware.presence import consumers_down
from kumiko_dramatiq.ops.exposition import (
    NAMESPACE,
    DatasetCollector,
    Exposition,
    load_prometheus,
    metric_name,
)
from kumiko_dramatiq.registry import WRAPPER_SUFFIX
from kumiko_dramatiq.worker.execution import execution_of
from kumiko_dramatiq.worker.runtime import Runtime

if TYPE_CHECKING:
    from prometheus_client import Counter, Gauge, Histogram

logger = logging.getLogger("kumiko_dramatiq")

Kind = Literal["counter", "gauge", "histogram"]
DedupOutcome = Literal["enqueued", "follow_up", "deduplicated"]

#: Seconds: from a no-op to an hour.
DURATION_BUCKETS: Final = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, 900.0, 3600.0
)  # fmt: skip
#: Seconds: a hand-off waits ``sequential_retry_delay_ms`` (1 s by default) or more.
LOCK_WAIT_BUCKETS: Final = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, 900.0, 3600.0)


@dataclass(frozen=True)
class Spec:
    """One metric kumiko exports."""

    #: the name without the ``kumiko_`` namespace
    name: str
    kind: Kind
    labels: tuple[str, ...]
    help: str
    buckets: tuple[float, ...] = ()
    #: prometheus_client's multiprocess mode of a gauge
    mode: str = ""
    #: read from Redis at scrape time (:class:`~kumiko_dramatiq.ops.exposition.DatasetCollector`)
    scraped: bool = False

    @property
    def exported(self) -> str:
        return metric_name(self.name)

    @property
    def samples(self) -> tuple[str, ...]:
        """The sample names this metric shows in an exposition."""
        if self.kind == "histogram":
            return tuple(self.exported + suffix for suffix in ("_bucket", "_sum", "_count"))
        return (self.exported,)


#: Every metric kumiko exports (the catalogue the examples are checked against).
SPECS: Final[tuple[Spec, ...]] = (
    Spec(
        "runs_total",
        "counter",
        ("job", "status", "trigger", "lane"),
        "Attempts that ended, by the status of their run record",
    ),
    Spec(
        "run_duration_seconds",
        "histogram",
        ("job", "lane"),
        "Run time of attempts that ended",
        buckets=DURATION_BUCKETS,
    ),
    Spec("handoffs_total", "counter", ("job",), "Sequential hand-offs (the lock was held)"),
    Spec(
        "lock_wait_seconds",
        "histogram",
        ("job",),
        "Waits between a sequential hand-off and its re-check of the lock",
        buckets=LOCK_WAIT_BUCKETS,
    ),
    Spec(
        "fanout_children_total",
        "counter",
        ("job",),
        "Per-tenant children newly enqueued by wrappers",
    ),
    Spec("dedup_total", "counter", ("job", "outcome"), "Dispatches with a dedup key, by outcome"),
    Spec(
        "dead_letters_total",
        "counter",
        ("lane", "reason"),
        "Messages dead-lettered: failed (last attempt), worker_died (poison), malformed",
    ),
    Spec(
        "cron_lag_seconds",
        "gauge",
        ("job",),
        "Enqueue time minus tick of the latest cron tick enqueued",
        mode="livemostrecent",
    ),
    Spec("workers", "gauge", ("lane",), "Worker processes running", mode="livesum"),
    Spec("schedulers", "gauge", (), "Scheduler processes running", mode="livesum"),
    Spec(
        "queue_messages",
        "gauge",
        ("lane", "state"),
        "Messages of the dataset by lane and state, read from Redis at scrape time",
        scraped=True,
    ),
    Spec(
        "run_history_records",
        "gauge",
        ("status",),
        "Run records the history keeps, by status",
        scraped=True,
    ),
    Spec(
        "batches_total",
        "counter",
        ("outcome",),
        "Batches and chains of the dataset ended so far, by outcome (kept in Redis)",
        scraped=True,
    ),
    Spec("redis_up", "gauge", (), "1 if this scrape read the dataset from Redis", scraped=True),
    Spec(
        "consumers_down",
        "gauge",
        (),
        "Consumer threads of the live workers that are down (ended, or stuck)",
        scraped=True,
    ),
)


def exported_names() -> frozenset[str]:
    """Every metric and sample name kumiko exports."""
    return frozenset(name for spec in SPECS for name in (spec.exported, *spec.samples))


def dedup_outcome(*, enqueued: bool, returned_id: str, own_id: str) -> DedupOutcome:
    """What a dispatch under a dedup key did, from the dedup script's reply. Pure.

    Enqueued: a new run. Not enqueued but handed back its own id: it allocated the follow-up
    of a running job. Anything else: it joined a queued job or a pending follow-up.
    """
    if enqueued:
        return "enqueued"
    return "follow_up" if returned_id == own_id else "deduplicated"


# -- the instruments -----------------------------------------------------------------------
class Instruments:
    """kumiko's prometheus_client metrics in this process (one set per process: in
    multiprocess mode a value is a slot in this process's file, and two objects writing the
    same slot would overwrite each other's increments)."""

    def __init__(self, prometheus: ModuleType) -> None:
        made = {spec.name: _make(prometheus, spec) for spec in SPECS if not spec.scraped}
        self.runs: Counter = made["runs_total"]
        self.duration: Histogram = made["run_duration_seconds"]
        self.handoffs: Counter = made["handoffs_total"]
        self.lock_wait: Histogram = made["lock_wait_seconds"]
        self.children: Counter = made["fanout_children_total"]
        self.dedup: Counter = made["dedup_total"]
        self.dead_letters: Counter = made["dead_letters_total"]
        self.cron_lag: Gauge = made["cron_lag_seconds"]
        self.workers: Gauge = made["workers"]
        self.schedulers: Gauge = made["schedulers"]


def _make(prometheus: ModuleType, spec: Spec) -> Any:
    common: dict[str, Any] = {
        "name": spec.name,
        "namespace": NAMESPACE,
        "documentation": spec.help,
        "labelnames": spec.labels,
        "registry": None,  # served by the multiprocess collector, not the default registry
    }
    if spec.kind == "counter":
        return prometheus.Counter(**common)
    if spec.kind == "histogram":
        return prometheus.Histogram(**common, buckets=spec.buckets)
    return prometheus.Gauge(**common, multiprocess_mode=spec.mode)


#: This process's instruments, made by the first runner with metrics (see :class:`Instruments`:
#: the one piece of process-wide state, as prometheus_client's multiprocess files are).
_instruments: Instruments | None = None
_instruments_lock = threading.Lock()


def process_instruments(prometheus: ModuleType) -> Instruments:
    """This process's :class:`Instruments`, made on first use."""
    global _instruments
    with _instruments_lock:
        if _instruments is None:
            _instruments = Instruments(prometheus)
        return _instruments


# -- the middleware ------------------------------------------------------------------------
class Metrics(Middleware):
    """Records every kumiko attempt, hand-off, lock wait, fan-out, cron tick and dead letter
    of its runner (see the module docs) and serves them while a worker of the runner runs."""

    def __init__(self, runtime: Runtime, port: int) -> None:
        self.runtime = runtime
        self.port = port
        self.lane = runtime.lane
        self.prometheus, self.directory, self.managed = load_prometheus(port)
        self.instruments = process_instruments(self.prometheus)
        self._exposition: Exposition | None = None
        self._serving = 0
        self._serving_lock = threading.Lock()
        # label values -> prometheus_client child, so the hot path skips ``labels()``
        self._runs: dict[tuple[str, str, str], Any] = {}
        self._durations: dict[str, Any] = {}
        self._by_job: dict[tuple[int, str], Any] = {}

    # -- serving ---------------------------------------------------------------------------
    @property
    def serving(self) -> bool:
        """Whether this process serves the port now."""
        return self._exposition is not None and self._exposition.serving

    def serve(self) -> None:
        """Serve the metrics port (if no other process of the group does); counted: every
        :meth:`serve` needs its :meth:`stop_serving`."""
        with self._serving_lock:
            self._serving += 1
            if self._serving > 1:
                return
            if self._exposition is None:
                self._exposition = Exposition(
                    self.prometheus,
                    self.directory,
                    self.port,
                    DatasetCollector(
                        self.runtime.broker,
                        self.runtime.registry,
                        consumers_down=lambda: consumers_down(
                            self.runtime.broker.client, self.runtime.queue_prefix
                        ),
                    ),
                    managed=self.managed,
                )
            self._exposition.start()

    def stop_serving(self) -> None:
        with self._serving_lock:
            self._serving = max(0, self._serving - 1)
            if self._serving or self._exposition is None:
                return
            self._exposition.close()

    # -- worker ----------------------------------------------------------------------------
    def before_worker_boot(self, broker: Broker, worker: Worker) -> None:
        # before the worker's consumers start fetching
        if isinstance(broker, KumikoBroker):
            broker.fetch_dead_letter_listeners.append(self._fetch_dead_letter)

    def _fetch_dead_letter(self, queue_name: str, reason: str) -> None:
        if queue_name == self.runtime.queue_name:
            self.dead_letter(reason)

    def after_worker_boot(self, broker: Broker, worker: Worker) -> None:
        self.instruments.workers.labels(self.lane).inc()
        if self.runtime.settings.run_scheduler:
            self.instruments.schedulers.inc()
        self.serve()

    def after_worker_shutdown(self, broker: Broker, worker: Worker) -> None:
        self.instruments.workers.labels(self.lane).dec()
        if self.runtime.settings.run_scheduler:
            self.instruments.schedulers.dec()
        if isinstance(broker, KumikoBroker):
            with contextlib.suppress(ValueError):
                broker.fetch_dead_letter_listeners.remove(self._fetch_dead_letter)
        self.stop_serving()

    # -- messages --------------------------------------------------------------------------
    def before_process_message(self, broker: Broker, message: MessageProxy) -> None:
        execution = execution_of(message)
        if execution is None:
            return
        options = execution.options
        if options.trigger == "requeue" and options.failures == 0:
            waited_s = execution.started_at - message.message_timestamp / 1000
            self._job_child(self.instruments.lock_wait, execution.job.qualified_name).observe(
                max(0.0, waited_s)
            )

    def after_process_message(
        self,
        broker: Broker,
        message: MessageProxy,
        *,
        result: Any = None,
        exception: BaseException | None = None,
    ) -> None:
        self._ended(message)

    def after_skip_message(self, broker: Broker, message: MessageProxy) -> None:
        if execution_of(message) is not None:
            self._ended(message)

    def _ended(self, message: MessageProxy) -> None:
        execution = execution_of(message)
        if execution is None or not isinstance(message, Delivery):
            return
        job = execution.job.qualified_name
        if execution.handed_off:
            self._job_child(self.instruments.handoffs, job).inc()
            return
        run = message.settlement.run
        if run is None or not run.status:
            return
        key = (job, run.status, execution.meta.trigger)
        child = self._runs.get(key)
        if child is None:
            child = self._runs[key] = self.instruments.runs.labels(*key, self.lane)
        child.inc()
        duration = self._durations.get(job)
        if duration is None:
            duration = self._durations[job] = self.instruments.duration.labels(job, self.lane)
        duration.observe(max(0.0, time.time() - execution.started_at))
        if run.status == "dead":
            self.dead_letter("failed")

    def after_enqueue(self, broker: Broker, message: Message[Any], delay: int | None) -> None:
        options = message.options
        trigger = options.get(TRIGGER)
        if trigger is None or options.get(FAILURES):
            return  # not a kumiko message, or a retry
        if trigger == "fanout":
            execution = self.runtime.current()
            if (
                execution is not None
                and execution.is_wrapper
                and message.actor_name == execution.job.qualified_name
            ):
                self._job_child(self.instruments.children, execution.job.qualified_name).inc()
        elif trigger == "cron" and isinstance(options.get(SCHEDULED_AT), str):
            tick = datetime.fromisoformat(options[SCHEDULED_AT]).timestamp()
            job = str(message.actor_name).removesuffix(WRAPPER_SUFFIX)
            self.instruments.cron_lag.labels(job).set(max(0.0, time.time() - tick))

    # -- counted from outside the chain ------------------------------------------------------
    def dedup(self, job: str, outcomes: Iterable[DedupOutcome]) -> None:
        for outcome in outcomes:
            self.instruments.dedup.labels(job, outcome).inc()

    def dead_letter(self, reason: str, lane: str | None = None) -> None:
        self.instruments.dead_letters.labels(lane or self.lane, reason).inc()

    def _job_child(self, metric: Any, job: str) -> Any:
        key = (id(metric), job)
        child = self._by_job.get(key)
        if child is None:
            child = self._by_job[key] = metric.labels(job)
        return child


# -- wiring --------------------------------------------------------------------------------
def metrics_middleware(runtime: Runtime) -> list[Middleware]:
    """``[Metrics]`` when the runner's ``metrics_port`` is set, else ``[]`` (nothing of
    prometheus_client is imported then)."""
    port = runtime.settings.metrics_port
    return [] if port is None else [Metrics(runtime, port)]


def metrics_of(broker: Broker) -> Metrics | None:
    """The :class:`Metrics` middleware of ``broker``, if metrics are on."""
    for middleware in broker.middleware:
        if isinstance(middleware, Metrics):
            return middleware
    return None


def count_dedup(broker: Broker, job: str, outcomes: Sequence[DedupOutcome]) -> None:
    """Count the outcomes of dispatches of ``job`` under dedup keys (no-op without metrics)."""
    metrics = metrics_of(broker)
    if metrics is not None:
        metrics.dedup(job, outcomes)


@contextmanager
def serving(broker: Broker, *, scheduler: bool = False) -> Iterator[Metrics | None]:
    """Serve ``broker``'s metrics port while the block runs, for a process that runs no worker
    (``kumiko-scheduler``, which passes ``scheduler=True``; a producer that wants its dedup
    counts served). A no-op without metrics."""
    metrics = metrics_of(broker)
    if metrics is None:
        yield None
        return
    if scheduler:
        metrics.instruments.schedulers.inc()
    metrics.serve()
    try:
        yield metrics
    finally:
        metrics.stop_serving()
        if scheduler:
            metrics.instruments.schedulers.dec()
