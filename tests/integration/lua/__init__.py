"""State tables for every Lua script in ``kumiko_dramatiq/lua/``.

Each row is (Redis state before, KEYS, ARGV) -> (reply, Redis state after, TTLs). Rows
name their keys with templates (``LIST``, ``ACKS``, ``GUARD``, ...) that :class:`Env` fills
with the test's own prefix and worker ids, so every key is deleted by the ``prefix`` fixture.
:meth:`Env.state` reads back every key of the prefix, so a row's "after" is the WHOLE state:
a key a script should not touch, or should not create, fails the row when it does.

The broker commands (``lua/_dispatch.lua``) take the queue as ARGV[1] and one packed head
"<now ms> <worker id> <heartbeat timeout ms> <dead message TTL ms> <0|1 maintenance>" as
ARGV[2] (:meth:`Env.head`); their own arguments start at ARGV[3]. They all write the worker's
heartbeat to the shared ``dramatiq:__heartbeats__``: the tests use worker ids built from the
prefix, call the scripts with a fake ``now`` (:data:`NOW`, far older than any live worker's
heartbeat, so maintenance only ever sees this test's workers as dead) and remove their worker
ids from the heartbeats afterwards.

Kumiko's lane queues keep every message out with a worker in the in-flight hash
(``INFLIGHT``: redis id -> "<deliveries>|<claimed ms>|<host:pid>", :func:`entry`):
``fetch_lane`` counts each delivery there, ``settle`` removes the entry of a delivery still
its worker's (on every outcome; another worker's entry stays) and
``requeue`` undoes a delivery that never ran. The run history (:mod:`kumiko_dramatiq.history`:
``fetch_lane`` for a poison message, ``settle``, ``run_put``, ``cancel``; ``trim_runs`` in
``lua/_history.lua``) stores each record as JSON: rows name records with :class:`J`, equal to
any string that decodes to the same object (Lua's cjson orders keys as it likes), and check
the TTL of every key they leave (:meth:`Env.assert_expiry`).

Every write onto a queue rings the queue's doorbell (``lua/_bell.lua``): the list ``BELL``
("<queue list>:bell") gets one token "1", with a TTL of :data:`BELL_TTL`, unless a token
waits there already (then neither the token nor its TTL changes). :meth:`Env.assert_state`
checks that every bell left holds a TTL of at most :data:`BELL_TTL`; the bell's own rows
check it was set just now, or left as it was.
"""
