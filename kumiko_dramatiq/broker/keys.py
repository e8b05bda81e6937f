"""Every Redis key, one function each: kumiko's under ``kumiko:{queue_prefix}:``, Dramatiq's.

A dataset is one Redis database plus one queue prefix: runners with different prefixes
never touch each other's keys. Dramatiq's own layout (``dramatiq:{queue}``, ``.msgs``,
``.DQ``, ``.XQ``, ack sets, heartbeats), which kumiko's broker writes as Dramatiq does, is
built here too (at the end). No module but this one spells a key
(``tests/unit/test_structure.py``).
"""

from __future__ import annotations

from dramatiq.common import dq_name, q_name


class ClusterPrefix(str):
    """The queue prefix of a dataset on a Redis Cluster: it is the same string (queue names,
    ``f"{prefix}-{lane}"``, stay as Dramatiq allows them), but every key built from it
    carries its hash tag, ``kumiko:{prefix}:...`` and ``dramatiq:{prefix}:...``
    (:func:`namespace`), so that the dataset lives in one slot
    (:mod:`kumiko_dramatiq.broker.cluster`). ``Settings`` makes one from the queue prefix
    when the URL is a ``redis+cluster://`` one."""

    __slots__ = ()

    def __new__(cls, value: str) -> ClusterPrefix:
        _CLUSTER_PREFIXES.add(str(value))
        return super().__new__(cls, value)


#: The prefixes this process made a :class:`ClusterPrefix` of: a key function given only a
#: lane queue's name (``f"{prefix}-{lane}"``) finds the namespace of its dataset here. A
#: process uses one prefix either on a cluster or off one, never both.
_CLUSTER_PREFIXES: set[str] = set()


def _namespace_of(queue_name: str) -> str:
    base = queue_name.removesuffix(".DQ").removesuffix(".XQ")
    prefix = base.rpartition("-")[0]
    if prefix in _CLUSTER_PREFIXES:
        return f"{NAMESPACE}:{{{prefix}}}"
    return NAMESPACE


def _root(queue_prefix: str) -> str:
    if isinstance(queue_prefix, ClusterPrefix):
        return f"kumiko:{{{queue_prefix}}}"
    return f"kumiko:{queue_prefix}"


def namespace(queue_prefix: str) -> str:
    """Dramatiq's key namespace of the dataset: :data:`NAMESPACE`, or on a cluster
    ``dramatiq:{prefix}`` (the queues' keys then carry the dataset's hash tag too)."""
    if isinstance(queue_prefix, ClusterPrefix):
        return f"{NAMESPACE}:{{{queue_prefix}}}"
    return NAMESPACE


def root(queue_prefix: str) -> str:
    """``kumiko:{queue_prefix}:``, the root of every key of the dataset's own. Lua scripts
    that are handed only the root build a few keys from it: those of :func:`run_record`,
    the ``runs_*`` indexes, :func:`job_stats`, :func:`dead_note`, :func:`paused`, :func:`parked`,
    :func:`result` and :func:`results_channel`
    (``tests/integration/lua`` checks they spell them as here)."""
    return f"{_root(queue_prefix)}:"


def sent(queue_prefix: str, redis_message_id: str) -> str:
    """Set when a redis message id was written: a re-sent write finds it."""
    return f"{_root(queue_prefix)}:sent:{redis_message_id}"


def boot_generation(queue_prefix: str, job_name: str) -> str:
    """Persistent: how many times boot-once job ``job_name`` was reset (its message id's
    generation, :func:`kumiko_dramatiq.ids.boot_message_id`); absent = 0."""
    return f"{_root(queue_prefix)}:bootgen:{job_name}"


def enqueue_guard(queue_prefix: str, message_id: str) -> str:
    """Set when a deterministic message id was enqueued (fan-out children, cron ticks)."""
    return f"{_root(queue_prefix)}:enqueued:{message_id}"


def boot_marker(queue_prefix: str, job_name: str) -> str:
    """Persistent: the boot-once job ``job_name`` was enqueued in this dataset."""
    return f"{_root(queue_prefix)}:boot:{job_name}"


def sequential_lock(queue_prefix: str, job_name: str, tenant_id: str | None) -> str:
    """The lease of a sequential job (per tenant for per-tenant jobs)."""
    scope = "" if tenant_id is None else f":tenant:{len(tenant_id)}:{tenant_id}"
    return f"{_root(queue_prefix)}:lock:{job_name}{scope}"


def parse_sequential_lock(queue_prefix: str, key: str) -> tuple[str, str | None]:
    """(job name, tenant or ``None``) of a :func:`sequential_lock` key."""
    rest = key[len(sequential_lock(queue_prefix, "", None)) :]
    job, sep, scope = rest.partition(":tenant:")
    if not sep:
        return job, None
    _, _, tenant = scope.partition(":")
    return job, tenant if tenant else None


def locks_index(queue_prefix: str) -> str:
    """Sorted set of the held sequential locks: member the part of a :func:`sequential_lock`
    key after ``lock:``, scored by its lease's expiry (ms, Redis's clock); written by the lock
    scripts, which build it from the lock's key (``lua/include/lock_index.lua``)."""
    return f"{_root(queue_prefix)}:locks"


def locks_since(queue_prefix: str) -> str:
    """Hash: the members of :func:`locks_index` -> when each lock was taken (ms)."""
    return f"{locks_index(queue_prefix)}:since"


def dedup(queue_prefix: str, job_name: str, dedup_key: str) -> str:
    """The record of the live job behind ``dedup_key``."""
    return f"{_root(queue_prefix)}:dedup:{job_name}:{dedup_key}"


def dedup_index(queue_prefix: str, job_name: str) -> str:
    """Sorted set of ``job_name``'s live dedup records: member the dedup key, scored by its
    record's expiry (ms, Redis's clock; ``lua/include/dedup_index.lua``)."""
    return f"{_root(queue_prefix)}:dedupidx:{job_name}"


def idempotency(queue_prefix: str, job_name: str, key: str) -> str:
    """String: the message id the first dispatch of ``job_name`` with idempotency key
    ``key`` returned, kept ``idempotency_ttl_s`` (``lua/idempotent_enqueue.lua``)."""
    return f"{_root(queue_prefix)}:idem:{job_name}:{key}"


def completed(queue_prefix: str, message_id: str) -> str:
    """ "Already completed" marker of a message id, kept the resend window (a minute; see
    :mod:`kumiko_dramatiq.middleware.history`)."""
    return f"{_root(queue_prefix)}:done:{message_id}"


def schedules(queue_prefix: str) -> str:
    """Hash: runtime schedule id -> its spec (JSON; kumiko_dramatiq/schedules/model.py)."""
    return f"{_root(queue_prefix)}:schedules"


def schedules_due(queue_prefix: str) -> str:
    """Sorted set: runtime schedule id -> its next tick (ms); absent while paused. Every
    scheduler reads the due ones (``ZRANGEBYSCORE``), and a tick fires only while its score
    is the one read (``lua/schedule_fire_batch.lua``)."""
    return f"{_root(queue_prefix)}:schedules:due"


def schedules_last(queue_prefix: str) -> str:
    """Hash: runtime schedule id -> its last tick enqueued (ms)."""
    return f"{_root(queue_prefix)}:schedules:last"


def cron_skipped(queue_prefix: str) -> str:
    """Hash: job -> schedule ticks skipped so far by their overlap
    (``kumiko_cron_skipped_total``)."""
    return f"{_root(queue_prefix)}:cron-skipped"


def schedules_paused(queue_prefix: str) -> str:
    """Set: the code-declared cron jobs whose schedule is paused (their ticks are not
    enqueued, ``lua/cron_tick.lua``); a runtime schedule's pause is in its spec."""
    return f"{_root(queue_prefix)}:schedules:paused"


def cron_last_tick(queue_prefix: str, job_name: str) -> str:
    """The latest tick of cron job ``job_name`` enqueued in this dataset
    (UTC epoch seconds); the scheduler's misfire catch-up starts after it."""
    return f"{_root(queue_prefix)}:cron:last:{job_name}"


def inflight(queue_prefix: str) -> str:
    """Hash: redis id of a message out with a worker -> ``"<deliveries>|<ms>|<worker>"`` while
    it runs, ``"h<deliveries>|<ms>|<worker>"`` while it is held, claimed ahead of the
    worker's threads (``lua/include/inflight.lua``; deliveries without an outcome count
    crashes; the run history reads running runs here)."""
    return f"{_root(queue_prefix)}:inflight"


def hold_asks(queue_prefix: str, broker_id: str) -> str:
    """Hash: redis id of a message the worker ``broker_id`` holds -> what a requester asks
    of it, ``"<request id>\t<kind>\t<waiters>"`` (``lua/include/holds.lua``)."""
    return f"{_root(queue_prefix)}:asks:{broker_id}"


def hold_bell(queue_prefix: str, broker_id: str) -> str:
    """List: a token while asks wait for the worker ``broker_id``; its keeper waits on it."""
    return f"{_root(queue_prefix)}:askbell:{broker_id}"


def hold_answer(queue_prefix: str, request_id: str) -> str:
    """List: the answer to an ask, once per requester waiting (``lua/include/holds.lua``)."""
    return f"{_root(queue_prefix)}:answer:{request_id}"


def suspects(queue_prefix: str, queue_name: str) -> str:
    """List: redis ids of ``queue_name`` whose worker died while holding them, waiting to run
    alone."""
    return f"{_root(queue_prefix)}:suspects:{queue_name}"


def probe(queue_prefix: str) -> str:
    """Base of the keys the start-up permission probe writes and deletes at once."""
    return f"{_root(queue_prefix)}:probe"


def cancelled(queue_prefix: str, message_id: str) -> str:
    """Set by ``cancel`` for a delayed message a worker holds in memory: its move drops it."""
    return f"{_root(queue_prefix)}:cancel:{message_id}"


def stop_request(queue_prefix: str, message_id: str) -> str:
    """Set by ``stop_run`` for a running message (TTL :data:`STOP_REQUEST_TTL_MS`): the
    worker running it reads it within its stop poll (:mod:`kumiko_dramatiq.worker.stops`)
    and deletes it once it has interrupted the run."""
    return f"{_root(queue_prefix)}:stop:{message_id}"


#: How long a stop request waits for the worker running its message (ms).
STOP_REQUEST_TTL_MS = 60_000


def progress(queue_prefix: str, message_id: str, attempt: int) -> str:
    """The latest ``ctx.progress`` of a running attempt (JSON ``{"v", "n", "w"}``: value,
    note, the worker's ``host:pid``; TTL :data:`PROGRESS_TTL_MS`, refreshed by its writes),
    written by its worker's :mod:`~kumiko_dramatiq.worker.progress` writer and deleted at the
    attempt's end; ``runner.running()`` reads them in one ``MGET``."""
    return f"{_root(queue_prefix)}:progress:{message_id}:{attempt}"


#: How long a progress key outlives its last write (ms): three of its refreshes
#: (:data:`kumiko_dramatiq.progress.REFRESH_S`), so a dead worker's expires by itself.
PROGRESS_TTL_MS = 180_000


def paused(queue_prefix: str) -> str:
    """Set of the names of paused jobs."""
    return f"{_root(queue_prefix)}:paused"


def parked(queue_prefix: str, job_name: str) -> str:
    """List: redis ids of a paused job's messages, held back until it is resumed."""
    return f"{_root(queue_prefix)}:parked:{job_name}"


def parked_withdrawn(queue_prefix: str, job_name: str) -> str:
    """Set: redis ids in :func:`parked` whose message was cancelled (its body deleted; the id
    stays in the list until resume drops it), so counts leave them out."""
    return f"{_root(queue_prefix)}:parked-withdrawn:{job_name}"


def dashboard_session(queue_prefix: str, digest: str) -> str:
    """A signed-in dashboard session, by the SHA-256 of its cookie (TTL: the session's
    lifetime; signing out deletes it, so a copied cookie stops working)."""
    return f"{_root(queue_prefix)}:dashboard:session:{digest}"


def dashboard_sign_ins(queue_prefix: str, address: str) -> str:
    """How many sign-ins one client address tried in the current window (TTL: the window)."""
    return f"{_root(queue_prefix)}:dashboard:signins:{address}"


def process(queue_prefix: str, identity: str) -> str:
    """A live worker's or scheduler's registration (JSON, TTL: its heartbeat timeout)."""
    return f"{_root(queue_prefix)}:proc:{identity}"


def processes(queue_prefix: str) -> str:
    """Sorted set of registered process ids by last refresh (ms)."""
    return f"{_root(queue_prefix)}:procs"


def dataset_marker(queue_prefix: str) -> str:
    """Persistent: a token written by the first live process of the dataset; it vanishing (or
    changing) under a running process means the dataset was reset (Redis restarted without
    persistence, or flushed)."""
    return f"{_root(queue_prefix)}:dataset"


def dataset_reset(queue_prefix: str) -> str:
    """A note (JSON, with a TTL) that a running process found the dataset reset."""
    return f"{_root(queue_prefix)}:dataset-reset"


def run_record(queue_prefix: str, message_id: str) -> str:
    """Hash attempt -> run record (JSON) of one message id (written in Lua, see
    :mod:`kumiko_dramatiq.ops.history`)."""
    return f"{_root(queue_prefix)}:run:{message_id}"


def runs_by_status(queue_prefix: str, status: str) -> str:
    """Sorted set indexing the run records of one status (written in Lua; the metrics count
    it)."""
    return f"{_root(queue_prefix)}:runs:status:{status}"


def runs_by_job(queue_prefix: str, job_name: str, status: str) -> str:
    """Sorted set indexing the run records of one job and status (written in Lua)."""
    return f"{_root(queue_prefix)}:runs:job:{job_name}:{status}"


def runs_by_tenant(queue_prefix: str, tenant_id: str) -> str:
    """Sorted set indexing the run records of one tenant (written in Lua)."""
    return f"{_root(queue_prefix)}:runs:tenant:{tenant_id}"


def runs_by_origin(queue_prefix: str, origin_id: str) -> str:
    """Sorted set indexing the run records of one origin id (written in Lua)."""
    return f"{_root(queue_prefix)}:runs:origin:{origin_id}"


def job_stats(queue_prefix: str, job_name: str, hour: int) -> str:
    """Hash of one job's counters in one hour (``hour``: hours since the epoch, UTC; written
    in Lua with the run records, see :mod:`kumiko_dramatiq.ops.stats`)."""
    return f"{_root(queue_prefix)}:stats:{job_name}:{hour}"


def dead_note(queue_prefix: str, message_id: str) -> str:
    """What kumiko noted when ``message_id`` was dead-lettered (JSON, kept as long as dead
    letters; written in Lua)."""
    return f"{_root(queue_prefix)}:dead:{message_id}"


def result(queue_prefix: str, message_id: str) -> str:
    """The value the completed run of ``message_id`` returned (JSON), kept its job's
    ``keep_result_s`` (written in Lua by the settle: ``root .. "result:" .. id``)."""
    return f"{_root(queue_prefix)}:result:{message_id}"


def results_channel(queue_prefix: str) -> str:
    """Pub/sub channel on which a settle announces the id of each ended message whose job
    keeps results (``root .. "results"``): ``runner.result`` waiters wake on it."""
    return f"{_root(queue_prefix)}:results"


def batch(queue_prefix: str, batch_id: str) -> str:
    """Hash: the record of a batch, chain or chain step (``lua/include/batch.lua``: its
    state and counts; ``:children``, ``:ended`` and ``:staged`` beside it); built in Lua
    from the root as ``root .. "batch:" .. id``."""
    return f"{_root(queue_prefix)}:batch:{batch_id}"


def batches(queue_prefix: str) -> str:
    """Sorted set of batch and chain ids by creation time (ms): ``kumiko batches``."""
    return f"{_root(queue_prefix)}:batches"


def batch_outcomes(queue_prefix: str) -> str:
    """Hash: outcome -> batches and chains ended so (``kumiko_batches_total``)."""
    return f"{_root(queue_prefix)}:batch-outcomes"


def channel_patterns(queue_prefix: str | None) -> list[str]:
    """ACL channel patterns covering every pub/sub channel of one dataset (or of all)."""
    if queue_prefix is None:
        return [f"{_root('')}*"]
    return [results_channel(queue_prefix)]


def cap_slots(queue_prefix: str, job_name: str) -> str:
    """Sorted set of the slots of a job with ``max_running``: member a holder's owner token
    (``"<redis id>#<delivery>"``), scored by its lease's expiry (ms, Redis's clock). Written
    by ``lua/include/caps.lua`` (fetch_lane takes, settle and slot_release give back,
    lock_renew renews); a lease that ran out is reclaimed by the next fetch that looks."""
    return f"{_root(queue_prefix)}:slots:{job_name}"


def cap_group(job_name: str, tenant_id: str | None) -> str:
    """The name of a waiting group: a job (its slot waiters and its rate limit's), or a job's
    tenant (a per-tenant rate limit's waiters), spelled as :func:`sequential_lock` scopes
    (with the tenant's length in UTF-8 bytes, as Lua counts)."""
    if tenant_id is None:
        return job_name
    return f"{job_name}:tenant:{len(tenant_id.encode())}:{tenant_id}"


def cap_group_job(group: str) -> str:
    """The job a waiting group (:func:`cap_group`) belongs to (``lua/include/caps.lua``'s
    ``caps_job_of``)."""
    job, sep, _ = group.partition(":tenant:")
    if sep:
        return job
    job, sep, digest = group.rpartition(":fair:")
    return job if sep and all(c in "0123456789abcdef" for c in digest) else group


def cap_rate(queue_prefix: str, group: str) -> str:
    """Sorted set of the starts in a rate limit's window (:func:`cap_group`): member a start's
    owner token, scored by when it started (ms, Redis's clock)."""
    return f"{_root(queue_prefix)}:rate:{group}"


def cap_wait(queue_prefix: str, group: str) -> str:
    """List: redis ids of the messages waiting for a cap of :func:`cap_group`, oldest first
    (their bodies stay in the queue's message hash)."""
    return f"{_root(queue_prefix)}:capwait:{group}"


def cap_waiting(queue_prefix: str, queue_name: str) -> str:
    """Sorted set of a lane queue's waiting groups that hold messages, scored by when its
    fetch should look at them next (ms, Redis's clock; 0 = now: a slot was given back)."""
    return f"{_root(queue_prefix)}:capwaiting:{queue_name}"


def cap_waits(queue_prefix: str) -> str:
    """Hash: job name -> how many of its messages wait for a cap (all its groups)."""
    return f"{_root(queue_prefix)}:capwaits"


def patterns(queue_prefix: str | None) -> list[str]:
    """Glob patterns covering every key of one dataset (``queue_prefix``: kumiko's own, its
    Dramatiq queues, their ack sets, Dramatiq's shared worker heartbeats), or of both
    namespaces whole without one; and the key ``dramatiq`` itself, which the broker's
    scripts name first (Dramatiq's namespace, from which they build the queues' keys)."""
    if queue_prefix is None:
        return [f"{_root('')}*", NAMESPACE, f"{NAMESPACE}:*"]
    if isinstance(queue_prefix, ClusterPrefix):
        return [f"{root(queue_prefix)}*", namespace(queue_prefix), f"{namespace(queue_prefix)}:*"]
    return [
        f"{root(queue_prefix)}*",
        NAMESPACE,
        f"{NAMESPACE}:{queue_prefix}-*",
        f"{NAMESPACE}:__acks__.*.{queue_prefix}-*",
        heartbeats(),
    ]


# Dramatiq's Redis layout (kumiko writes it the way Dramatiq's RedisBroker does; see
# tests/integration/test_layout.py)
#: Dramatiq's key namespace.
NAMESPACE = "dramatiq"


def queue_list(queue_name: str, namespace: str | None = None) -> str:
    """The list of redis message ids of ``queue_name`` (consumers pop from the left)."""
    return f"{namespace or _namespace_of(queue_name)}:{queue_name}"


def queue_messages(queue_name: str, namespace: str | None = None) -> str:
    """The hash redis message id -> encoded message of ``queue_name``."""
    return f"{namespace or _namespace_of(queue_name)}:{queue_name}.msgs"


def consumer_acks(worker_id: str, queue_name: str, namespace: str | None = None) -> str:
    """The set of redis ids one worker fetched from ``queue_name`` and has not acked."""
    return f"{namespace or _namespace_of(queue_name)}:__acks__.{worker_id}.{queue_name}"


def is_delay_queue(queue_name: str) -> bool:
    """Whether ``queue_name`` is a delay queue (Dramatiq's ``<queue>.DQ``)."""
    return queue_name.endswith(".DQ")


def heartbeats(namespace: str = NAMESPACE) -> str:
    """The sorted set of worker ids by last heartbeat (ms)."""
    return f"{namespace}:__heartbeats__"


def queue_bell(queue_name: str, namespace: str | None = None) -> str:
    """The doorbell of a queue (kumiko's, beside Dramatiq's layout): a list holding at most
    one token, pushed by every write onto the queue, that idle consumers wait on."""
    return f"{queue_list(queue_name, namespace)}:bell"


def queue_counts(queue_name: str, namespace: str | None = None) -> str:
    """Hash (kumiko's, beside Dramatiq's layout): how many message bodies of each actor the
    queue's message hash, its delay queue's and its dead letters' hold (``q:<actor>``,
    ``d:<actor>``, ``x:<actor>``), kept by every script that writes or deletes a body
    (``lua/include/counts.lua``, which builds it from the message hash's key:
    ``<namespace>:<queue>`` + ``":counts"``), and ``~mode`` (see there); filled in for data
    written before by ``lua/counts_backfill.lua``. Beside it, while that runs,
    ``:counts:fresh`` and ``:counts:seen`` (sets)."""
    return f"{queue_list(queue_name, namespace)}:counts"


def queue_schedule(queue_name: str, namespace: str | None = None) -> str:
    """Sorted set (kumiko's, beside Dramatiq's layout): the redis ids of ``queue_name``'s
    delayed messages, scored by due time (ms, Redis's clock). Their bodies wait in the delay
    queue's message hash (``<queue>.DQ.msgs``), already in the form they take on the queue
    (no ``eta``); ``lua/move.lua`` moves due ones onto the queue. Lua builds it from the delay
    queue's list key (``<namespace>:<queue>.DQ`` + ``":schedule"``, see
    ``lua/include/enqueue.lua``); queue names cannot contain ``":"``, so no queue's keys
    collide with it. Dramatiq's own ``<queue>.DQ`` list is read only to move what an older
    writer left there onto this schedule (``lua/schedule_legacy.lua``)."""
    return f"{queue_list(dq_name(q_name(queue_name)), namespace)}:schedule"


def queue_withdrawn(queue_name: str, namespace: str | None = None) -> str:
    """Set (kumiko's, beside Dramatiq's layout): redis ids still in the queue's list or its
    suspects list whose message was cancelled while it waited (``cancel`` deletes its body
    instead of searching the list); the fetch that meets one drops it silently, and counts of
    queued messages leave them out."""
    return f"{queue_list(queue_name, namespace)}:withdrawn"


def queue_order(queue_name: str, namespace: str | None = None) -> str:
    """Sorted set (kumiko's, beside Dramatiq's layout): the priority levels ("0".."9", scored
    by level) that have messages with a route waiting (``lua/include/route.lua``)."""
    return f"{queue_list(queue_name, namespace)}:order"


def queue_levels(queue_name: str, namespace: str | None = None) -> str:
    """Hash: priority level -> how many redis ids wait in the lists of the queue's order
    (ids that ``cancel`` withdrew included until a claim meets them, as on the queue's list)."""
    return f"{queue_list(queue_name, namespace)}:levels"


def queue_ring(queue_name: str, level: int | str, namespace: str | None = None) -> str:
    """List: the fair key digests of ``level`` with messages waiting, in turn order."""
    return f"{queue_list(queue_name, namespace)}:ring:{level}"


def queue_at(queue_name: str, level: int | str, digest: str, namespace: str | None = None) -> str:
    """List: the redis ids waiting at ``level`` under the fair key of ``digest``
    (:func:`~kumiko_dramatiq.codec.fair_digest`; "" for none), oldest first."""
    return f"{queue_list(queue_name, namespace)}:at:{level}:{digest}"


def dead_letters(queue_name: str, namespace: str | None = None) -> str:
    """The sorted set of dead-lettered redis ids of ``queue_name`` (its ``.XQ``), by time."""
    return f"{namespace or _namespace_of(queue_name)}:{q_name(queue_name)}.XQ"


def dead_letter_messages(queue_name: str, namespace: str | None = None) -> str:
    """The hash redis id -> encoded message of ``queue_name``'s dead letters."""
    return f"{dead_letters(queue_name, namespace)}.msgs"
