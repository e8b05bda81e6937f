"""Serving kumiko's metrics: prometheus_client's multiprocess mode, one port per process group.

:mod:`kumiko_dramatiq.middleware.metrics` records; this module decides where the records go,
reads what Redis knows at scrape time, and serves the result. It imports ``prometheus_client``
only when :func:`load_prometheus` is called (a runner with ``metrics_port`` set), never at
import.
Process group
    The processes one parent started: the N worker processes of ``dramatiq
    kumiko_dramatiq.app -p N`` (or a ``multiprocessing`` pool of runners), or a process on its
    own (a ``JobRunner`` in a script, the scheduler). :func:`group_id` names it after the
    ``multiprocessing`` authentication key, which every ``multiprocessing`` child inherits
    from its parent and every new parent draws at random: siblings agree on it without
    talking, and a restarted ``dramatiq`` (a new parent, or the same one re-executed by
    ``SIGHUP``) is a new group.

Directory
    ``PROMETHEUS_MULTIPROC_DIR``, where every process of the group writes its values (one
    file per process and metric type, prometheus_client's format). Set by the application:
    kumiko uses it as it is and removes from it only the files prometheus_client says to
    remove for dead processes (below) and its own ``port-*.pid``. Unset (or inherited from another
    kumiko group, i.e. inside :func:`managed_root`): kumiko sets it, in each process, to
    ``{tmp}/kumiko_dramatiq-metrics-{uid}/{group}``, so a new group starts from empty files
    and counters of an earlier run never add to it. The binder removes sibling directories
    whose processes are all gone (and that are older than :data:`STALE_GROUP_S`).

Port (:class:`Exposition`)
    Each process of a group tries to bind ``metrics_port`` when its worker boots (the scheduler:
    :func:`kumiko_dramatiq.middleware.metrics.serving`). The first one binds and serves the
    merged view of the whole group: :class:`GroupCollector` (every process's files, summed) plus
    :class:`DatasetCollector` (what Redis knows). The others find the port taken by their group
    (the binder's pid in ``port-{port}.pid`` in the directory) and serve nothing. If the
    binder goes away while others live, one of them binds within :data:`BIND_RETRY_S`. A port
    held by anything else is logged once at WARNING.

Processes that die (:func:`sweep_dead_processes`, at every scrape)
    Counters and histograms of a dead process stay in the sum: a total never goes back when a
    process restarts, and a new process writes files of its own pid, so nothing counts twice.
    Its "live" gauges (``kumiko_workers``, ``kumiko_schedulers``, ``kumiko_cron_lag_seconds``)
    are dropped with ``prometheus_client.multiprocess.mark_process_dead``, as prometheus_client
    documents for dead processes.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import importlib
import logging
import multiprocessing
import os
import re
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any, Final

import redis
from dramatiq.common import dq_name

from kumiko_dramatiq.broker import keys
from kumiko_dramatiq.broker.broker import KumikoBroker
from kumiko_dramatiq.broker.counts import in_order
from kumiko_dramatiq.broker.keys import dead_letters, queue_list, queue_messages
from kumiko_dramatiq.broker.replies import text
from kumiko_dramatiq.environment import multiproc_dir, set_multiproc_dir
from kumiko_dramatiq.errors import JobConfigError
from kumiko_dramatiq.options import LANES, lane_queue
from kumiko_dramatiq.registry import Registry

logger = logging.getLogger("kumiko_dramatiq")

#: Every metric name kumiko exports starts with ``f"{NAMESPACE}_"``.
NAMESPACE: Final = "kumiko"
#: How often a process of a group whose port nobody serves tries to bind it.
BIND_RETRY_S: Final = 5.0
#: A directory of another group is removed once none of its processes lives and it has not
#: changed for this long (a group being born has no files yet).
STALE_GROUP_S: Final = 60.0
#: Queue states of ``kumiko_queue_messages`` (as ``kumiko status`` counts them).
QUEUE_STATES: Final = ("queued", "delayed", "running", "parked", "dead")
#: Run statuses the history indexes (running runs are not records yet).
RECORD_STATUSES: Final = ("completed", "failed", "dead", "cancelled")

_PID_FILE = re.compile(r"_(\d+)\.db$")
_LIVE_GAUGE_FILE = re.compile(r"^gauge_live[a-z]+_(\d+)\.db$")


def metric_name(name: str) -> str:
    """The exported name of kumiko metric ``name``: ``kumiko_{name}``."""
    return "_".join((NAMESPACE, name))


# -- the process group and its directory ---------------------------------------------------
def group_id(authkey: bytes | None = None) -> str:
    """The name of this process's group: a digest of its ``multiprocessing`` authkey."""
    key = multiprocessing.current_process().authkey if authkey is None else authkey
    return hashlib.blake2b(bytes(key), digest_size=8, person=b"kumiko-metrics").hexdigest()


def managed_root() -> Path:
    """Where kumiko keeps the directories of its groups (one tree per user)."""
    owner = os.getuid() if hasattr(os, "getuid") else "user"
    return Path(tempfile.gettempdir()) / f"kumiko_dramatiq-metrics-{owner}"


def choose_directory(given: str, root: Path, group: str) -> tuple[Path, bool]:
    """The multiprocess directory for ``group`` and whether kumiko manages it. Pure.

    ``given`` (``PROMETHEUS_MULTIPROC_DIR``, "" when unset) wins unless it lies in kumiko's
    ``root``: such a value was inherited from another kumiko group and is replaced.
    """
    if given and Path(given).parent != root:
        return Path(given), False
    return root / group, True


def pid_of(filename: str) -> int | None:
    """The pid of a prometheus_client multiprocess file (``counter_123.db`` -> 123)."""
    found = _PID_FILE.search(filename)
    return int(found.group(1)) if found else None


def is_alive(pid: int) -> bool:
    """Whether process ``pid`` exists (one owned by another user counts as alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True


def load_prometheus(port: int) -> tuple[ModuleType, Path, bool]:
    """Put this process in multiprocess mode and import ``prometheus_client``.

    Sets ``PROMETHEUS_MULTIPROC_DIR`` (see the module docs) BEFORE the import, creates the
    directory if it is missing, and if ``prometheus_client`` was imported earlier without
    the variable, makes the metrics created from now on write to it too. Raises
    ``JobConfigError`` (one line) when the ``metrics`` extra is not installed. Returns the
    module, the directory and whether kumiko manages it.
    """
    directory, managed = choose_directory(multiproc_dir(), managed_root(), group_id())
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    if managed:
        set_multiproc_dir(str(directory))
    try:
        prometheus = importlib.import_module("prometheus_client")
        values = importlib.import_module("prometheus_client.values")
    except ModuleNotFoundError as exc:
        if exc.name is None or not exc.name.startswith("prometheus_client"):
            raise
        raise JobConfigError(
            None,
            "metrics_port",
            f"is set ({port}) but prometheus_client is not installed: "
            "pip install 'kumiko_dramatiq[metrics]'",
        ) from None
    if values.ValueClass is values.MutexValue:
        # imported before the variable was set: the metrics made from now on (kumiko's
        # among them) write to the directory, as if it had been set before the import
        setattr(values, "ValueClass", values.MultiProcessValue())  # noqa: B010
    return prometheus, directory, managed


def sweep_dead_processes(directory: Path, prometheus: ModuleType) -> list[int]:
    """Drop the live gauges of every process of ``directory`` that no longer exists (their
    counters and histograms stay counted); return those pids."""
    dead = set()
    for path in directory.glob("gauge_live*.db"):
        found = _LIVE_GAUGE_FILE.match(path.name)
        if found and not is_alive(int(found.group(1))):
            dead.add(int(found.group(1)))
    multiprocess = importlib.import_module("prometheus_client.multiprocess")
    for pid in sorted(dead):
        multiprocess.mark_process_dead(pid, str(directory))
    return sorted(dead)


def remove_stale_groups(root: Path, keep: Path, *, now: float | None = None) -> list[Path]:
    """Remove the directories in ``root`` (other than ``keep``) whose processes are all gone
    and that did not change for :data:`STALE_GROUP_S`; return them."""
    now = time.time() if now is None else now
    removed = []
    with contextlib.suppress(OSError):
        for directory in root.iterdir():
            if directory == keep or not directory.is_dir():
                continue
            with contextlib.suppress(OSError):
                if now - directory.stat().st_mtime < STALE_GROUP_S:
                    continue
                pids = {pid_of(path.name) for path in directory.iterdir()}
                pids |= {_marker_pid(path) for path in directory.glob("port-*.pid")}
                if any(pid is not None and is_alive(pid) for pid in pids):
                    continue
                shutil.rmtree(directory)
                removed.append(directory)
    return removed


def _marker_pid(path: Path) -> int | None:
    return _read_marker(path)[0]


def _read_marker(path: Path) -> tuple[int | None, str]:
    """(pid, group) of a binder's file (``"{pid} {group}"``); ``(None, "")`` if unreadable."""
    try:
        pid, _, group = path.read_text().strip().partition(" ")
    except OSError:
        return None, ""
    return (int(pid), group) if pid.isdigit() else (None, "")


# -- what Redis knows, read at scrape time -------------------------------------------------
@dataclass(frozen=True)
class DatasetReading:
    """One scrape-time reading of a dataset: message counts by (lane, state), run records
    by status."""

    messages: dict[tuple[str, str], int]
    records: dict[str, int]
    #: per capped job: ``max_running`` (0: none), slots held, starts in its rate limit's
    #: window (a per-tenant one: not summed, 0), messages waiting for its caps
    caps: dict[str, tuple[int, int, int, int]] = field(default_factory=dict)
    #: batches and chains ended so far, by outcome (succeeded, failed, cancelled)
    batches: dict[str, int] = field(default_factory=dict)
    #: schedule ticks skipped so far (``overlap="skip"``, ``"buffer_one"``), by job
    cron_skipped: dict[str, int] = field(default_factory=dict)


def lane_counts(
    *,
    listed: int,
    suspects: int,
    stored: int,
    delayed: int,
    parked: int,
    dead: int,
    capped: int = 0,
) -> dict[str, int]:
    """The states of one lane's messages from its Redis counts. Pure.

    ``stored`` counts every message of the queue's hash: those listed (queued), those set
    aside as suspects (queued too, waiting to run alone), those waiting for a capped job's slot
    or rate window (``capped``: queued too), those parked (a paused job's) and
    the rest, which are out with a worker (running, or held by a dead worker until
    recovered)."""
    queued = listed + suspects + capped
    return {
        "queued": queued,
        "delayed": delayed,
        "running": max(0, stored - queued - parked),
        "parked": parked,
        "dead": dead,
    }


class DatasetCollector:
    """Scrape-time gauges of one dataset, read in ONE round trip (a ``MULTI`` pipeline, so
    the counts are one consistent snapshot): ``kumiko_queue_messages{lane,state}``,
    ``kumiko_run_history_records{status}``, ``kumiko_batches_total{outcome}``,
    ``kumiko_cron_skipped_total{job}``,
    ``kumiko_consumers_down`` and ``kumiko_redis_up``
    (0 when the read failed; the others are then left out). Never called on a message's path."""

    def __init__(
        self,
        broker: KumikoBroker,
        registry: Registry,
        consumers_down: Callable[[], int] | None = None,
    ) -> None:
        self.broker = broker
        self.prefix = broker.queue_prefix
        #: reads how many consumers of the live workers are down (Redis errors propagate)
        self.consumers_down = consumers_down
        self.jobs_by_lane = {
            lane: sorted(name for name, job in registry.jobs.items() if job.options.run_in == lane)
            for lane in LANES
        }
        self.capped = sorted(
            (job for job in registry.jobs.values() if job.is_capped),
            key=lambda job: job.qualified_name,
        )

    def read(self) -> DatasetReading:
        """Read the dataset now (one round trip)."""
        pipe = self.broker.client.pipeline(transaction=True)
        for lane in LANES:
            pipe.hgetall(keys.queue_levels(lane_queue(self.prefix, lane), self.broker.namespace))
        for lane in LANES:
            queue = lane_queue(self.prefix, lane)
            pipe.llen(queue_list(queue, self.broker.namespace))
            pipe.llen(keys.suspects(self.prefix, queue))
            pipe.hlen(queue_messages(queue, self.broker.namespace))
            pipe.hlen(queue_messages(dq_name(queue), self.broker.namespace))
            pipe.zcard(dead_letters(queue, self.broker.namespace))
            for job in self.jobs_by_lane[lane]:
                pipe.llen(keys.parked(self.prefix, job))
        for status in RECORD_STATUSES:
            pipe.zcard(keys.runs_by_status(self.prefix, status))
        now_ms = int(time.time() * 1000)  # the local clock: a gauge, not a decision
        for capped_job in self.capped:
            rate = capped_job.options.rate_limit
            name = capped_job.qualified_name
            pipe.zcount(keys.cap_slots(self.prefix, name), f"({now_ms}", "+inf")
            pipe.zcount(
                keys.cap_rate(self.prefix, name),
                f"({now_ms - (0 if rate is None else rate.per_ms)}",
                "+inf",
            )
        pipe.hgetall(keys.cap_waits(self.prefix))
        pipe.hgetall(keys.batch_outcomes(self.prefix))
        pipe.hgetall(keys.cron_skipped(self.prefix))
        *counts, waits, outcomes, skipped = pipe.execute()
        waiting = {text(name): max(0, int(count)) for name, count in waits.items()}
        ordered = [in_order(levels) for levels in counts[: len(LANES)]]
        replies = iter(int(reply) for reply in counts[len(LANES) :])
        messages: dict[tuple[str, str], int] = {}
        for n, lane in enumerate(LANES):
            listed, suspects, stored, delayed, dead = (next(replies) for _ in range(5))
            listed += ordered[n]
            parked = sum(next(replies) for _ in self.jobs_by_lane[lane])
            capped = sum(waiting.get(job, 0) for job in self.jobs_by_lane[lane])
            counts = lane_counts(
                listed=listed,
                suspects=suspects,
                stored=stored,
                delayed=delayed,
                parked=parked,
                dead=dead,
                capped=capped,
            )
            messages.update({(lane, state): count for state, count in counts.items()})
        records = {status: next(replies) for status in RECORD_STATUSES}
        caps = {
            capped_job.qualified_name: (
                capped_job.options.max_running or 0,
                next(replies),
                next(replies),
                waiting.get(capped_job.qualified_name, 0),
            )
            for capped_job in self.capped
        }
        batches = {text(outcome): int(n) for outcome, n in outcomes.items()}
        cron_skipped = {text(job): int(n) for job, n in skipped.items()}
        return DatasetReading(messages, records, caps, batches, cron_skipped)

    def collect(self) -> Iterator[Any]:
        core = importlib.import_module("prometheus_client.core")
        up = core.GaugeMetricFamily(
            metric_name("redis_up"), "1 if this scrape read the dataset from Redis, else 0"
        )
        try:
            reading = self.read()
        except redis.RedisError as exc:
            logger.warning("kumiko metrics: could not read the dataset from Redis (%s)", exc)
            up.add_metric([], 0)
            yield up
            return
        up.add_metric([], 1)
        yield up
        queues = core.GaugeMetricFamily(
            metric_name("queue_messages"),
            "Messages of the dataset by lane and state, read from Redis at scrape time",
            labels=["lane", "state"],
        )
        for (lane, state), count in reading.messages.items():
            queues.add_metric([lane, state], count)
        yield queues
        records = core.GaugeMetricFamily(
            metric_name("run_history_records"),
            "Run records the history keeps, by status (index entries, trimmed lazily)",
            labels=["status"],
        )
        for status, count in reading.records.items():
            records.add_metric([status], count)
        yield records
        batches = core.CounterMetricFamily(
            metric_name("batches"),
            "Batches and chains of the dataset ended so far, by outcome (kept in Redis)",
            labels=["outcome"],
        )
        for outcome in ("succeeded", "failed", "cancelled"):
            batches.add_metric([outcome], reading.batches.get(outcome, 0))
        yield batches
        skipped = core.CounterMetricFamily(
            metric_name("cron_skipped"),
            "Schedule ticks skipped so far because the last run was queued or running "
            "(overlap), by job (kept in Redis)",
            labels=["job"],
        )
        for job, count in sorted(reading.cron_skipped.items()):
            skipped.add_metric([job], count)
        yield skipped
        yield from self.collect_consumers_down(core)
        if not reading.caps:
            return
        families = [
            core.GaugeMetricFamily(metric_name(name), help_text, labels=["job"])
            for name, help_text in (
                ("cap_max_running", "A capped job's max_running (0: no concurrency cap)"),
                ("cap_running", "Slots of a capped job held now (runs under max_running)"),
                (
                    "cap_rate_window_starts",
                    "Starts in a rate-limited job's window now (0 for a per-tenant limit)",
                ),
                ("cap_waiting", "Messages waiting for a capped job's slot or rate window"),
            )
        ]
        for job, values in reading.caps.items():
            for family, value in zip(families, values, strict=True):
                family.add_metric([job], value)
        yield from families

    def collect_consumers_down(self, core: ModuleType) -> Iterator[Any]:
        """``kumiko_consumers_down``: consumer threads of the dataset's live workers that are
        down (ended and not restarted yet, or stuck), from their liveness records."""
        if self.consumers_down is None:
            return
        try:
            count = self.consumers_down()
        except redis.RedisError as exc:
            logger.warning("kumiko metrics: could not read the live workers (%s)", exc)
            return
        down = core.GaugeMetricFamily(
            metric_name("consumers_down"),
            "Consumer threads of the live workers that are down (ended, or stuck)",
        )
        down.add_metric([], count)
        yield down


class GroupCollector:
    """Every process's recorded metrics, merged (prometheus_client's
    ``MultiProcessCollector``), after dropping the live gauges of dead processes."""

    def __init__(self, prometheus: ModuleType, directory: Path) -> None:
        self.prometheus = prometheus
        self.directory = directory
        multiprocess = importlib.import_module("prometheus_client.multiprocess")
        self._merged = multiprocess.MultiProcessCollector(None, path=str(directory))

    def collect(self) -> Iterable[Any]:
        sweep_dead_processes(self.directory, self.prometheus)
        result: Iterable[Any] = self._merged.collect()
        return result


# -- the port ------------------------------------------------------------------------------
class Exposition:
    """Serves a group's merged metrics on ``port`` from whichever of its processes binds first
    (see the module docs). :meth:`start` returns at once; :meth:`close` is idempotent.

    The group elects its binder with the file ``port-{port}.pid`` in its directory, created
    exclusively (``O_EXCL``) and holding the binder's pid and group: a process binds only
    after creating it, and a file naming a dead process (or a pid reused since, seen by its
    group) is replaced.
    """

    def __init__(
        self,
        prometheus: ModuleType,
        directory: Path,
        port: int,
        dataset: DatasetCollector,
        *,
        managed: bool,
    ) -> None:
        self.prometheus = prometheus
        self.directory = directory
        self.port = port
        self.managed = managed
        self.marker = directory / f"port-{port}.pid"
        self.group = group_id()
        self.registry = prometheus.CollectorRegistry(auto_describe=False)
        self.registry.register(GroupCollector(prometheus, directory))
        self.registry.register(dataset)
        self._lock = threading.Lock()
        self._server: Any = None
        self._retry: threading.Thread | None = None
        self._stopping = threading.Event()
        self._warned = False

    @property
    def serving(self) -> bool:
        """Whether this process serves the port now."""
        return self._server is not None

    def start(self) -> None:
        """Bind the port if nobody of the group serves it; keep trying while it stays so."""
        with self._lock:
            if self._retry is not None:
                return
            self._stopping = threading.Event()
            self._try_bind()
            self._retry = threading.Thread(
                target=self._keep_trying,
                args=(self._stopping,),
                name=f"kumiko-metrics-{self.port}",
                daemon=True,
            )
            self._retry.start()

    def close(self) -> None:
        """Stop serving (if this process did) and stop trying to bind."""
        with self._lock:
            self._stopping.set()
            retry, self._retry = self._retry, None
            server, self._server = self._server, None
        if retry is not None and retry is not threading.current_thread():
            retry.join(timeout=BIND_RETRY_S * 2)
        if server is not None:
            server.shutdown()
            server.server_close()
            self._release()

    def _keep_trying(self, stopping: threading.Event) -> None:
        while not stopping.wait(BIND_RETRY_S):
            with self._lock:
                if not stopping.is_set() and self._server is None:
                    self._try_bind()

    def _try_bind(self) -> None:
        if not self._claim():
            return  # another process of the group serves the port
        try:
            server, _ = self.prometheus.start_wsgi_server(
                self.port, addr="0.0.0.0", registry=self.registry
            )
        except OSError as exc:
            self._release()
            if exc.errno != errno.EADDRINUSE:
                raise
            if not self._warned:
                self._warned = True
                logger.warning(
                    "kumiko metrics: port %d is taken by another program; this process group's "
                    "metrics are not served (set another KUMIKO_METRICS_PORT)",
                    self.port,
                )
            return
        self._server = server
        if self.managed:
            remove_stale_groups(self.directory.parent, self.directory)
        logger.info(
            "kumiko metrics: serving http://0.0.0.0:%d/metrics (pid %d, %s)",
            self.port,
            os.getpid(),
            self.directory,
        )

    def _claim(self) -> bool:
        """Create the binder's file with this pid; ``False`` if a live process holds it."""
        for _ in range(2):
            try:
                fd = os.open(self.marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
            except FileExistsError:
                holder, group = _read_marker(self.marker)
                if holder is None:
                    with contextlib.suppress(OSError):
                        if time.time() - self.marker.stat().st_mtime < BIND_RETRY_S:
                            return False  # being written by its creator
                elif holder == os.getpid():
                    if group == self.group:
                        return False  # another runner of this process serves it
                elif is_alive(holder):
                    return False
                with contextlib.suppress(OSError):
                    self.marker.unlink()  # its binder is gone
                continue
            with os.fdopen(fd, "w") as marker:
                marker.write(f"{os.getpid()} {self.group}")
            return True
        return False

    def _release(self) -> None:
        if _marker_pid(self.marker) == os.getpid():
            with contextlib.suppress(OSError):
                self.marker.unlink()
