"""Redis instructions per job: kumiko's scripts vs plain Dramatiq's, counted, not timed (issue 32).

``python -m benchmarks.redis_instructions [--jobs 800] [--batch 8] [--lua-dir DIR ...]
[--keep DIR]``

The server's CPU per job (``benchmarks.redis_cost``) moves by ±15% between rounds on a shared
machine, more than most single changes to a script save. This counts instead: a private
``redis-server`` runs under valgrind's callgrind, instrumentation on only while the measured
calls run, and the instructions the server executed (user space: request parsing, the Lua
scripts, the commands, the replies; not the kernel's socket work) are divided by the jobs.
Repeatable to 1-2% whatever the load.

The calls are the ones each broker makes per job, replayed from one client (kumiko's three
hot scripts as the broker runs them: ``FCALL`` of the function library; an export from before
the library, by ``EVALSHA``):

- enqueue: kumiko's ``guarded_enqueue`` (the message unless its body or its "sent" key is
  there, its per-job count, the doorbell) vs Dramatiq's ``enqueue`` (``dispatch.lua``), a
  typical no-op job's body each;
- drain: kumiko's ``fetch_lane`` of ``--batch`` messages then one ``settle`` of them all
  (completed, run record and marker, counts ready) vs Dramatiq's ``fetch`` of ``--batch`` then
  one ``ack`` per message;
- settle: kumiko's ``settle`` alone, per delivery in calls of ``--batch``.

``--lua-dir`` (repeatable) counts kumiko's scripts from other directories too (for example an
export of the previous commit's ``kumiko_dramatiq/broker/lua``), in the same run: the A/B of a
script change. Needs ``valgrind`` (``callgrind_control``, ``callgrind_annotate``).

Where the instructions go: ``--keep DIR`` keeps each count's callgrind output
(``DIR/<scripts>-<case>.callgrind``) for ``callgrind_annotate --inclusive=yes`` (or
``--tree=caller``). Debian's ``redis-server`` is stripped, so the Lua VM's functions show as
addresses; a server built from the same source with symbols names them (``apt-get source
redis`` with a ``deb-src`` line, ``make`` in it, then this with ``PATH=<its src>:$PATH``):
counts on that build run 1-2 % lower than on Debian's.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any

import dramatiq
import redis

from kumiko_dramatiq.broker.lua import FUNCTIONS, library

LUA = Path(__file__).resolve().parent.parent / "kumiko_dramatiq" / "broker" / "lua"
DRAMATIQ_LUA = Path(dramatiq.__file__).parent / "brokers" / "redis" / "dispatch.lua"
_INCLUDE = re.compile(r"^-- @include ([a-z_]+)\s*$", re.MULTILINE)
_TOTAL = re.compile(r"^([\d,]+) \(100.0%\)\s+PROGRAM TOTALS", re.MULTILINE)

NOW = 1_796_163_511_657
WORKER = "6f75e8a3-9611-4e0a-9c6d-348c2fad40e7"
ROOT = "kumiko:bench:"
QUEUE = "bench-worker"
JOB = "bench:job:noop"
HEAD = f"{NOW} {WORKER} 60000 604800000 0"
KUMIKO_BODY = (
    '{"queue_name":"bench-worker","actor_name":"bench:job:noop","args":[{"i":%d}],"kwargs":{},'
    '"options":{"kumiko_retries":0,"kumiko_backoff":null,"kumiko_backoff_delay_ms":null,'
    '"kumiko_trigger":"manual","redis_message_id":"%s"},"message_id":"%s",'
    '"message_timestamp":1796163432548}'
)
DRAMATIQ_BODY = (
    '{"queue_name":"plain","actor_name":"noop","args":[{"i":%d}],"kwargs":{},'
    '"options":{"redis_message_id":"%s"},"message_id":"%s","message_timestamp":1796163432548}'
)


def source(lua_dir: Path, name: str) -> str:
    """Script ``name`` from ``lua_dir`` with its includes, as ``kumiko_dramatiq.broker.lua``
    assembles it."""
    seen: list[str] = []

    def collect(path: str) -> None:
        for included in _INCLUDE.findall((lua_dir / f"{path}.lua").read_text()):
            piece = f"include/{included}"
            if piece not in seen:
                collect(piece)
                seen.append(piece)

    collect(name)
    return "\n".join((lua_dir / f"{p}.lua").read_text() for p in [*seen, name])


@contextmanager
def counted_server(
    keep: Path | None = None,
) -> Iterator[tuple[redis.Redis, Callable[[bool], None], list[int]]]:
    """A private redis-server under callgrind: (client, instrument(on), a list that holds the
    instructions counted once the server stopped). ``keep``: where to copy callgrind's output
    (for ``callgrind_annotate --inclusive=yes``)."""
    base = Path(tempfile.mkdtemp(prefix="kumiko-cg"))
    sock, out = base / "redis.sock", base / "callgrind.out"
    process = subprocess.Popen(
        [
            *("valgrind", "--tool=callgrind", "--instr-atstart=no"),
            f"--callgrind-out-file={out}",
            *("redis-server", "--port", "0", "--unixsocket", str(sock)),
            *("--save", "", "--appendonly", "no", "--dir", str(base)),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    client = redis.Redis(unix_socket_path=str(sock))
    deadline = time.monotonic() + 60
    while True:
        try:
            client.ping()
            break
        except (redis.ConnectionError, FileNotFoundError):
            if time.monotonic() > deadline:
                process.kill()
                raise
            time.sleep(0.1)

    def instrument(on: bool) -> None:
        subprocess.run(
            ["callgrind_control", "-i", "on" if on else "off", str(process.pid)],
            check=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )

    totals: list[int] = []
    try:
        yield client, instrument, totals
    finally:
        with contextlib.suppress(redis.ConnectionError):
            client.shutdown(nosave=True)
        process.wait(timeout=120)
        annotated = subprocess.run(
            ["callgrind_annotate", str(out)], capture_output=True, text=True, check=False
        ).stdout
        found = _TOTAL.search(annotated)
        totals.append(int(found.group(1).replace(",", "")) if found else 0)
        if keep is not None and out.exists():
            shutil.copyfile(out, keep)
        shutil.rmtree(base, ignore_errors=True)


def ids(n: int, offset: int = 0) -> list[str]:
    return [str(uuid.UUID(int=offset + i + 1)) for i in range(n)]


def settle_entry(rid: str, message_id: str, fields: int = 11, compact: bool = True) -> list[str]:
    """One completed delivery's settle arguments: ``compact``, the layout since the header's
    fields are arguments of their own and the rare ones extras (the root once per call);
    else the older layout of ``fields`` arguments, the header one tab-separated argument."""
    record = json.dumps(
        {"d": 0, "j": JOB, "m": message_id, "o": message_id, "tr": "manual", "a": 1, "ma": 1}
        | {"s": "completed", "q": NOW - 700, "st": NOW, "en": NOW, "w": "host:1"},
        separators=(",", ":"),
    )
    marker = f"{ROOT}done:{message_id}"
    if compact:
        header_fields = [message_id, "1", JOB, "completed", str(NOW)]
        return [rid, "completed", marker, *header_fields, record, JOB, ""]
    header = "\t".join((ROOT, message_id, "1", JOB, "completed", "", message_id, str(NOW)))
    entry = [rid, "completed", marker, header, record, "", "", "", ""]
    # the actor, then the dedup key ended: not in exports from before they were
    return entry + [JOB, ""][: fields - len(entry)]


def settle_args(entries: list[list[str]], compact: bool = True, vouching: bool = True) -> list[str]:
    """A settle call's arguments; ``vouching``: the head ends with the resend window and "1"
    (the broker refreshed the job's and status's indexes less than a minute ago, as it has
    for nearly every settle of a steady stream), for scripts that know it."""
    head = f"{len(entries)} 60000 86400000 604800000 100000 0"
    args = [QUEUE, HEAD, head + (" 60000 1" if vouching else "")]
    if compact:
        args.append(ROOT)
    for entry in entries:
        args += entry
    return args


class Kumiko:
    """kumiko's calls per job, its scripts from ``lua_dir``."""

    def __init__(self, client: redis.Redis, lua_dir: Path, jobs: int, batch: int) -> None:
        self.client, self.jobs, self.batch = client, jobs, batch
        self.run: dict[str, Callable[..., Any]] = {}
        if "@per-call" in (lua_dir / "include" / "dispatch.lua").read_text():
            # the hot scripts as kumiko runs them: functions of one library (FCALL)
            lib = library(FUNCTIONS, lambda path: (lua_dir / f"{path}.lua").read_text())
            client.function_load(lib.code, replace=True)
            for name, function in lib.functions.items():
                self.run[name] = partial(client.fcall, function)
        else:  # an older export: every script by EVALSHA
            for name in FUNCTIONS:
                self.run[name] = partial(client.evalsha, client.script_load(source(lua_dir, name)))
        client.hset(f"dramatiq:{QUEUE}:counts", "~mode", "r")
        self.message_ids: dict[str, str] = {}
        settle = (lua_dir / "settle.lua").read_text()
        found = re.search(r"^local FIELDS = (\d+)$", settle, re.M)
        self.fields = int(found.group(1)) if found else 9
        self.compact = "local FIELDS, EXTRAS = " in settle
        self.vouching = "tombstone_ttl, vouched =" in settle
        # the count's names, as the broker passes them (not in an export before it did)
        counted = "KEYS[4]" in (lua_dir / "guarded_enqueue.lua").read_text()
        self.counts_key = [f"dramatiq:{QUEUE}:counts"] if counted else []
        self.counts_field = [f"q:{JOB}"] if counted else []
        # a lane message's "sent" key only read (guard TTL 0), as the broker sends it since
        # the scripts knew it; before, set for the resend window
        guarded = (lua_dir / "include" / "guarded.lua").read_text()
        self.sent_ttl = 0 if 'guard_ttl_ms == "0"' in guarded else 60000

    def enqueue(self, n: int, offset: int) -> None:
        for i, (rid, mid) in enumerate(zip(ids(n, offset), ids(n, 10**9 + offset), strict=True)):
            self.message_ids[rid] = mid
            self.run["guarded_enqueue"](
                3 + len(self.counts_key),
                *(f"dramatiq:{QUEUE}.msgs", f"dramatiq:{QUEUE}", f"{ROOT}sent:{rid}"),
                *self.counts_key,
                *(rid, KUMIKO_BODY % (i, rid, mid), self.sent_ttl, "1"),
                *self.counts_field,
            )

    def drain(self, n: int) -> None:
        done = 0
        while done < n:
            fetched = self.run["fetch_lane"](
                3,
                *("dramatiq", f"{ROOT}inflight", f"{ROOT}suspects:{QUEUE}"),
                *(QUEUE, HEAD, f"{self.batch} 0 5 86400000 604800000", f"{ROOT}done:", ROOT),
                "host:1",
            )[0]
            rids = [fetched[i].decode() for i in range(0, len(fetched), 2)]
            if not rids:
                raise RuntimeError("the queue ran dry")
            entries = [
                settle_entry(rid, self.message_ids[rid], self.fields, self.compact) for rid in rids
            ]
            self.settle(entries)
            done += len(rids)

    def settle(self, entries: list[list[str]]) -> None:
        keys = ("dramatiq", f"{ROOT}inflight", f"{ROOT}suspects:{QUEUE}")
        replies = self.run["settle"](3, *keys, *settle_args(entries, self.compact, self.vouching))
        if replies != [1] * len(entries):
            raise RuntimeError(f"settle replied {replies}")

    def claimed(self, n: int, offset: int) -> list[list[list[str]]]:
        """``n`` deliveries claimed by this worker as fetch_lane leaves them, in batches."""
        pipe = self.client.pipeline(transaction=False)
        entries = []
        for i, (rid, mid) in enumerate(zip(ids(n, offset), ids(n, 10**9 + offset), strict=True)):
            pipe.hset(f"dramatiq:{QUEUE}.msgs", rid, KUMIKO_BODY % (i, rid, mid))
            pipe.hincrby(f"dramatiq:{QUEUE}:counts", f"q:{JOB}", 1)
            pipe.sadd(f"dramatiq:__acks__.{WORKER}.{QUEUE}", rid)
            pipe.hset(f"{ROOT}inflight", rid, f"1|{NOW}|host:1")
            entries.append(settle_entry(rid, mid, self.fields, self.compact))
        pipe.execute()
        return [entries[i : i + self.batch] for i in range(0, n, self.batch)]


class Plain:
    """plain Dramatiq's calls per job (its ``dispatch.lua``)."""

    def __init__(self, client: redis.Redis, jobs: int, batch: int) -> None:
        self.client, self.jobs, self.batch = client, jobs, batch
        self.sha = client.script_load(DRAMATIQ_LUA.read_text())

    def call(self, command: str, *args: Any) -> Any:
        head = (command, NOW, "plain", WORKER, 60000, 604800000, 0, 7999)
        return self.client.evalsha(self.sha, 1, "dramatiq", *head, *args)

    def enqueue(self, n: int, offset: int) -> None:
        for i, (rid, mid) in enumerate(zip(ids(n, offset), ids(n, 10**9 + offset), strict=True)):
            self.call("enqueue", rid, DRAMATIQ_BODY % (i, rid, mid))

    def drain(self, n: int) -> None:
        done = 0
        while done < n:
            bodies = self.call("fetch", self.batch)
            if not bodies:
                raise RuntimeError("the queue ran dry")
            for body in bodies:
                self.call("ack", json.loads(body)["options"]["redis_message_id"])
            done += len(bodies)


def count(measure: Callable[[redis.Redis], Callable[[], None]], keep: Path | None = None) -> int:
    """Instructions of the server while the callable ``measure(client)`` returns runs;
    callgrind's output copied to ``keep`` if given."""
    with counted_server(keep) as (client, instrument, totals):
        run = measure(client)
        instrument(True)
        run()
        instrument(False)
    return totals[0]


def suite(
    jobs: int, batch: int, lua_dirs: list[Path], keep: Path | None = None
) -> dict[str, dict[str, float]]:
    """Instructions per job of each case; with ``keep`` (a directory), each count's callgrind
    output is kept there as ``<scripts>-<case>.callgrind`` (scripts: "plain" or the index of
    the ``lua_dirs`` entry)."""

    def kept(name: str) -> Path | None:
        return None if keep is None else keep / f"{name}.callgrind"

    warm = 10 * batch
    results: dict[str, dict[str, float]] = {}

    def plain_enqueue(client: redis.Redis) -> Callable[[], None]:
        plain = Plain(client, jobs, batch)
        plain.enqueue(warm, 0)
        return lambda: plain.enqueue(jobs, warm)

    def plain_drain(client: redis.Redis) -> Callable[[], None]:
        plain = Plain(client, jobs, batch)
        plain.enqueue(jobs + warm, 0)
        plain.drain(warm)
        return lambda: plain.drain(jobs)

    results["plain Dramatiq"] = {
        "enqueue": count(plain_enqueue, kept("plain-enqueue")) / jobs,
        "drain": count(plain_drain, kept("plain-drain")) / jobs,
    }
    for index, lua_dir in enumerate(lua_dirs):

        def enqueue(client: redis.Redis, lua_dir: Path = lua_dir) -> Callable[[], None]:
            kumiko = Kumiko(client, lua_dir, jobs, batch)
            kumiko.enqueue(warm, 0)
            return lambda: kumiko.enqueue(jobs, warm)

        def drain(client: redis.Redis, lua_dir: Path = lua_dir) -> Callable[[], None]:
            kumiko = Kumiko(client, lua_dir, jobs, batch)
            kumiko.enqueue(jobs + warm, 0)
            kumiko.drain(warm)
            return lambda: kumiko.drain(jobs)

        def settle(client: redis.Redis, lua_dir: Path = lua_dir) -> Callable[[], None]:
            kumiko = Kumiko(client, lua_dir, jobs, batch)
            for entries in kumiko.claimed(warm, 0):
                kumiko.settle(entries)
            batches = kumiko.claimed(jobs, warm)

            def run() -> None:
                for entries in batches:
                    kumiko.settle(entries)

            return run

        results[f"kumiko ({lua_dir})"] = {
            "enqueue": count(enqueue, kept(f"{index}-enqueue")) / jobs,
            "drain": count(drain, kept(f"{index}-drain")) / jobs,
            "settle": count(settle, kept(f"{index}-settle")) / jobs,
        }
    return results


def table(results: dict[str, dict[str, float]], batch: int) -> str:
    plain = results["plain Dramatiq"]
    base = plain["enqueue"] + plain["drain"]
    lines = [
        f"| scripts | enqueue | drain (batches of {batch}) | both | vs plain Dramatiq |"
        f" settle alone, per delivery |",
        "|---|---|---|---|---|---|",
    ]
    for name, row in results.items():
        both = row["enqueue"] + row["drain"]
        settle = f"{row['settle'] / 1000:.1f}k" if "settle" in row else "-"
        lines.append(
            f"| {name} | {row['enqueue'] / 1000:.1f}k | {row['drain'] / 1000:.1f}k |"
            f" {both / 1000:.1f}k | {both / base:.2f}x | {settle} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--jobs", type=int, default=800)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--lua-dir", type=Path, action="append", default=[])
    parser.add_argument(
        "--keep",
        type=Path,
        help="a directory to keep each count's callgrind output in (see the module docstring)",
    )
    args = parser.parse_args(argv)
    if shutil.which("valgrind") is None:
        print("needs valgrind (callgrind)", file=sys.stderr)
        return 2
    lua_dirs = [LUA, *args.lua_dir]
    if args.keep is not None:
        args.keep.mkdir(parents=True, exist_ok=True)
    results = suite(args.jobs, args.batch, lua_dirs, args.keep)
    print(f"Redis instructions per job (callgrind), {args.jobs:,} jobs, {os.cpu_count()} cores")
    print()
    print(table(results, args.batch))
    return 0


if __name__ == "__main__":
    sys.exit(main())
