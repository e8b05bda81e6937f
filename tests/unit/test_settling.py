"""SettleBatcher: concurrent settles of one queue share one flush; each gets its own reply."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import pytest
import redis

from kumiko_dramatiq.broker.settling import SettleBatcher
from tests.conftest import wait_for


class Flushes:
    def __init__(self, error: BaseException | None = None) -> None:
        self.batches: list[list[Any]] = []
        self.error = error

    def __call__(
        self, queue: str, entries: Sequence[Sequence[Any]], client: Any, claimers: Any
    ) -> list[int]:
        self.batches.append([entry[0] for entry in entries])
        if self.error is not None:
            raise self.error
        return [int(entry[0]) * 10 for entry in entries]


def settle_all(batcher: SettleBatcher, count: int) -> list[Any]:
    """``count`` threads settle at once; what each got (a reply or the error it raised)."""
    results: list[Any] = [None] * count

    def one(i: int) -> None:
        try:
            results[i] = batcher.settle("q", [str(i)], None)
        except BaseException as exc:
            results[i] = exc

    threads = [threading.Thread(target=one, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    return results


def test_settles_expected_together_share_one_flush_and_get_their_own_replies() -> None:
    flushes = Flushes()
    # the leader waits for all 6 (a generous linger: only the count ends the wait)
    batcher = SettleBatcher(flushes, lambda queue: 6, linger_s=30)
    results = settle_all(batcher, 6)
    assert results == [i * 10 for i in range(6)]
    assert len(flushes.batches) == 1
    assert sorted(flushes.batches[0]) == [str(i) for i in range(6)]


def test_nothing_expected_means_each_settle_is_sent_at_once() -> None:
    flushes = Flushes()
    batcher = SettleBatcher(flushes, lambda queue: 0, linger_s=30)
    assert batcher.settle("q", ["3"], None) == 30
    assert batcher.settle("q", ["4"], None) == 40
    assert flushes.batches == [["3"], ["4"]]


@pytest.mark.parametrize(
    "error", [redis.ConnectionError("gone"), RuntimeError("interrupted")], ids=["redis", "other"]
)
def test_a_failed_flush_fails_every_settle_of_its_batch_as_a_connection_error(
    error: BaseException,
) -> None:
    batcher = SettleBatcher(Flushes(error), lambda queue: 3, linger_s=30)
    results = settle_all(batcher, 3)
    assert all(isinstance(result, Exception) for result in results)
    followers = [r for r in results if r is not error]
    assert all(isinstance(r, redis.ConnectionError) for r in followers)


def test_an_urgent_settle_sends_its_batch_without_waiting_for_more() -> None:
    # a capped run's settle gives its slot back: it waits for no other settle
    flushes = Flushes()
    batcher = SettleBatcher(flushes, lambda queue: 6, linger_s=30)
    assert batcher.settle("q", ["5"], None, urgent=True) == 50
    assert flushes.batches == [["5"]]


def test_the_flush_is_handed_each_entrys_claimer() -> None:
    seen: list[list[object | None]] = []

    def flush(
        queue: str, entries: Sequence[Sequence[Any]], client: Any, claimers: Any
    ) -> list[int]:
        seen.append(list(claimers))
        return [1 for _ in entries]

    batcher = SettleBatcher(flush, lambda queue: 0)
    consumer = object()
    assert batcher.settle("q", ["1"], None, claimer=consumer) == 1
    assert batcher.settle("q", ["2"], None) == 1
    assert seen == [[consumer], [None]]


class Gate:
    """A flush whose first call blocks until released (a call in flight), the rest answer."""

    def __init__(self) -> None:
        self.flushes = Flushes()
        self.entered = threading.Event()
        self.release = threading.Event()

    def __call__(
        self, queue: str, entries: Sequence[Sequence[Any]], client: Any, claimers: Any
    ) -> list[int]:
        replies = self.flushes(queue, entries, client, claimers)
        if len(self.flushes.batches) == 1:
            self.entered.set()
            assert self.release.wait(timeout=30)
        return replies


def settle_in_thread(batcher: SettleBatcher, rid: str, results: dict[str, Any]) -> threading.Thread:
    def one() -> None:
        results[rid] = batcher.settle("q", [rid], None)

    thread = threading.Thread(target=one, daemon=True)
    thread.start()
    return thread


def call_in_flight() -> tuple[Gate, SettleBatcher, dict[str, Any], threading.Thread]:
    """A batcher that sends each settle at once (nothing expected), its call of "1" in flight
    (held by the gate); the results of the settles made in threads."""
    gate = Gate()
    batcher = SettleBatcher(gate, lambda queue: 0, linger_s=30)
    results: dict[str, Any] = {}
    first = settle_in_thread(batcher, "1", results)
    assert gate.entered.wait(timeout=30)
    return gate, batcher, results, first


def test_settles_that_end_while_the_queues_call_is_in_flight_share_the_next_call() -> None:
    # nothing expected: each settle would go at once, but one call per queue is in flight
    gate, batcher, results, first = call_in_flight()
    others = [settle_in_thread(batcher, rid, results) for rid in ("2", "3", "4")]
    wait_for(
        lambda: "q" in batcher._open and len(batcher._open["q"].entries) == 3,
        what="the three settles to gather behind the call in flight",
    )
    assert gate.flushes.batches == [["1"]]  # nothing sent beside the call in flight
    gate.release.set()
    for thread in (first, *others):
        thread.join(timeout=30)
    assert results == {"1": 10, "2": 20, "3": 30, "4": 40}
    assert gate.flushes.batches[0] == ["1"]
    assert sorted(gate.flushes.batches[1]) == ["2", "3", "4"]
    assert len(gate.flushes.batches) == 2


def test_an_urgent_settle_goes_beside_the_queues_call_in_flight() -> None:
    gate, batcher, results, first = call_in_flight()
    assert batcher.settle("q", ["5"], None, urgent=True) == 50  # while "1" is still out
    gate.release.set()
    first.join(timeout=30)
    assert results == {"1": 10}
    assert gate.flushes.batches == [["1"], ["5"]]


def test_a_settle_made_by_a_flush_goes_alone_at_once() -> None:
    # a claim handed over by a flush may dead-letter a message that does not decode: a settle
    # of the same queue from inside the call in flight, while another settle waits behind it
    calls: list[list[str]] = []
    behind = threading.Event()
    nested: dict[str, int] = {}

    def flush(
        queue: str, entries: Sequence[Sequence[Any]], client: Any, claimers: Any
    ) -> list[int]:
        rids = [entry[0] for entry in entries]
        calls.append(rids)
        if rids == ["1"]:
            assert behind.wait(timeout=30)
            nested["9"] = batcher.settle("q", ["9"], None)
        return [int(rid) * 10 for rid in rids]

    batcher = SettleBatcher(flush, lambda queue: 0, linger_s=30)
    results: dict[str, Any] = {}
    first = settle_in_thread(batcher, "1", results)
    wait_for(lambda: calls == [["1"]], what="the first call to be in flight")
    second = settle_in_thread(batcher, "2", results)
    wait_for(
        lambda: "q" in batcher._open and len(batcher._open["q"].entries) == 1,
        what="the second settle to wait behind the call in flight",
    )
    behind.set()
    first.join(timeout=30)
    second.join(timeout=30)
    assert results == {"1": 10, "2": 20}
    assert nested == {"9": 90}
    assert calls == [["1"], ["9"], ["2"]]
