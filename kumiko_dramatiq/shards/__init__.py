"""One dataset spread over N slots (``JobRunner(..., shards=N)``): on a Redis Cluster, over
N primaries.

Shard ``i`` is a whole kumiko dataset of its own (its queue prefix
:func:`~kumiko_dramatiq.shards.routing.shard_prefix`, so its own hash tag on a cluster),
served by a ``JobRunner`` of its own; the runner the app builds serves shard 0 and fronts
the others (:class:`~kumiko_dramatiq.shards.fleet.Fleet`). Each message lives in one shard,
the one its guarantees need (:mod:`kumiko_dramatiq.shards.routing`), and every enqueue that
follows from it (a retry, a hand-off, a per-tenant child, a batch's callback) stays there,
so every guarantee holds within a shard exactly as on one Redis.
"""
