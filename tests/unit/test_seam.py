"""The seam to Dramatiq's and redis-py's internals (kumiko_dramatiq.broker.seam): each test
pins one thing kumiko relies on, so that a release of the host library that changes it fails
here, by name, instead of somewhere deep in a worker."""

from __future__ import annotations

import inspect
import logging
import threading
import time
from typing import Any
from unittest import mock

import dramatiq
import pytest
import redis
from dramatiq.broker import Broker, MessageProxy
from dramatiq.brokers.redis import RedisBroker
from dramatiq.brokers.stub import StubBroker
from dramatiq.middleware import Middleware, MiddlewareError, TimeLimit
from dramatiq.worker import Worker
from redis.connection import AbstractConnection
from redis.exceptions import ReadOnlyError
from redis.sentinel import SentinelManagedConnection

from kumiko_dramatiq.broker.seam import (
    AnyActorOptions,
    HookTable,
    NoCommandFallback,
    argument_encoder,
    clear_pending_in_thread,
    consumed_queues,
    consumer_of,
    consumer_threads,
    copy_message,
    emit_after,
    emit_before,
    encode_message,
    error_reply,
    has_socket,
    name_interruptions,
    raise_in_thread,
    restart_consumer,
    set_consumed_queues,
    work_handoff,
)


class Noted(Middleware):
    """Notes the hooks it gets; raises what it is told to in before_ack."""

    def __init__(self, name: str, calls: list[str], raises: BaseException | None = None) -> None:
        self.name = name
        self.calls = calls
        self.raises = raises

    def before_ack(self, broker: Broker, message: Any) -> None:
        self.calls.append(f"{self.name}.before_ack")
        if self.raises is not None:
            raise self.raises

    def after_ack(self, broker: Broker, message: Any) -> None:
        self.calls.append(f"{self.name}.after_ack")


def _both(raises: BaseException | None) -> tuple[list[str], list[str], Any, Any]:
    """Dramatiq's emit loops and kumiko's over the same middleware: calls and outcome."""
    outcomes: list[Any] = []
    calls: list[list[str]] = []
    for ours in (False, True):
        seen: list[str] = []
        middleware: list[Middleware] = [Noted("a", seen, raises), Noted("b", seen)]
        broker = StubBroker(middleware=middleware)
        try:
            if ours:
                table = HookTable(broker.middleware, {id(m) for m in broker.middleware})
                emit_before(broker, table, "before_ack", None)
                emit_after(broker, table, "after_ack", None)
            else:
                broker.emit_before("ack", None)
                broker.emit_after("ack", None)
            outcomes.append(None)
        except BaseException as exc:
            outcomes.append(type(exc))
        calls.append(seen)
    return calls[0], calls[1], outcomes[0], outcomes[1]


@pytest.mark.parametrize(
    "raises", [None, ValueError("logged, loop goes on"), MiddlewareError("propagates")]
)
def test_kumikos_emit_loops_behave_as_dramatiqs(raises: BaseException | None) -> None:
    dramatiqs_calls, kumikos_calls, dramatiqs_outcome, kumikos_outcome = _both(raises)
    assert kumikos_calls == dramatiqs_calls
    assert kumikos_outcome == dramatiqs_outcome


def test_a_hook_a_middleware_does_not_override_is_the_base_classs_no_op() -> None:
    # The hook table skips hooks that are Middleware's own: they must be no-ops
    table = HookTable([Noted("a", [])], set())
    assert [hook for _, hook, _ in table("before_ack")]
    assert table("before_process_message") == ()
    for name, member in inspect.getmembers(Middleware, inspect.isfunction):
        if name.startswith(("before_", "after_")):
            parameters = list(inspect.signature(member).parameters.values())[1:]
            positional = [p for p in parameters if p.kind is p.POSITIONAL_OR_KEYWORD]
            assert member(Middleware(), *[None] * len(positional)) is None, name


def test_redis_broker_maps_unknown_names_onto_commands_and_kumikos_broker_does_not() -> None:
    # RedisBroker.__getattr__ turns do_<anything> into a dispatch call: kumiko turns it off
    assert "__getattr__" in RedisBroker.__dict__
    assert "do_" in inspect.getsource(RedisBroker.__getattr__)

    class Broker(NoCommandFallback, RedisBroker):
        pass

    broker = Broker.__new__(Broker)
    with pytest.raises(AttributeError, match="do_nothing"):
        broker.do_nothing  # noqa: B018


def test_a_workers_queues_are_its_consumer_whitelist() -> None:
    broker = StubBroker()
    assert consumed_queues(Worker(broker)) is None
    given = Worker(broker, queues={"a"})
    assert consumed_queues(given) == {"a"}
    set_consumed_queues(given, {"a", "b"})
    assert given.consumer_whitelist == {"a", "b"}
    # and the worker decides by it which queue gets a consumer
    assert "consumer_whitelist" in inspect.getsource(Worker._add_consumer)


def test_a_workers_consumer_thread_that_ended_can_be_replaced() -> None:
    broker = StubBroker()
    ran = threading.Event()

    @dramatiq.actor(broker=broker)
    def job() -> None:
        ran.set()

    worker = Worker(broker, worker_timeout=50, worker_threads=1)
    worker.start()
    try:
        old = worker.consumers["default"]
        assert consumer_threads(worker) == worker.consumers
        deadline = time.monotonic() + 10
        while consumer_of(old) is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert consumer_of(old) is not None
        # Given its consumer thread ended
        old.stop()
        old.join(10)
        assert not old.is_alive()
        # When it is replaced, Then the new one consumes the queue
        restart_consumer(worker, "default")
        new = worker.consumers["default"]
        assert new is not old
        assert new.is_alive()
        job.send()
        assert ran.wait(10)
        # and a paused consumer thread is not read as iterating
        new.pause()
        assert consumer_of(new) is None
        new.resume()
    finally:
        worker.stop(timeout=5_000)


def test_any_actor_options_lets_dramatiq_actor_accept_every_option() -> None:
    broker = StubBroker()
    with pytest.raises(ValueError, match="undefined"):
        dramatiq.actor(broker=broker, actor_name="refused", not_an_option=1)(_nothing)
    broker.actor_options = AnyActorOptions()
    dramatiq.actor(broker=broker, actor_name="anything", not_an_option=1)(_nothing)
    assert "anything" in broker.actors


def _nothing() -> None:
    return None


def test_the_time_limit_interruption_line_can_be_named(caplog: pytest.LogCaptureFixture) -> None:
    time_limit = TimeLimit(interval=1000)
    manager = time_limit.manager
    # Dramatiq's timer logs its interruption through the middleware's logger, in these words
    assert manager.logger is time_limit.logger
    assert "Time limit exceeded. Raising exception in worker thread %r." in inspect.getsource(
        type(manager)
    )
    name_interruptions(time_limit, lambda thread: f"job of thread {thread}" if thread else None)
    with caplog.at_level(logging.WARNING, logger=time_limit.logger.name):
        manager.logger.warning("Time limit exceeded. Raising exception in worker thread %r.", 7)
        manager.logger.warning("Time limit exceeded. Raising exception in worker thread %r.", 0)
    assert [r.getMessage() for r in caplog.records] == [
        "job of thread 7",
        "Time limit exceeded. Raising exception in worker thread 0.",
    ]
    assert {r.name for r in caplog.records} == {time_limit.logger.name}


def test_redis_pys_argument_encoder_encodes_as_the_connection_would() -> None:
    encode = argument_encoder("utf-8", "strict")
    assert encode("é") == "é".encode()
    assert encode(5) == b"5"
    assert encode(b"raw") == b"raw"


def _messages() -> list[dramatiq.Message[Any]]:
    return [
        dramatiq.Message(
            queue_name="q",
            actor_name="f:job:a",
            args=({"s": 'é "€" 😀 \n', "n": [1, 2.5, None, True]},),
            kwargs={"k": (1, 2)},
            options={"kumiko_trigger": "manual", "redis_message_id": "r1", "eta": 12},
        ),
        dramatiq.Message(queue_name="q", actor_name="a", args=(), kwargs={}, options={}),
    ]


def test_a_message_is_copied_as_its_copy_method_copies_it() -> None:
    for message in _messages():
        copied = copy_message(message, {"redis_message_id": "r2", "x": [1]})
        assert copied == message.copy(options={"redis_message_id": "r2", "x": [1]})
        assert copied.options is not message.options
        assert message.options.get("redis_message_id") != "r2"  # the original is left as it was


def test_a_message_is_encoded_as_its_encode_method_encodes_it() -> None:
    for message in _messages():
        assert encode_message(message) == message.encode()


def test_a_message_under_another_global_encoder_is_encoded_by_that_encoder() -> None:
    previous = dramatiq.get_encoder()
    dramatiq.set_encoder(dramatiq.PickleEncoder())
    try:
        message = _messages()[0]
        assert dramatiq.PickleEncoder().decode(encode_message(message)) == message.asdict()
    finally:
        dramatiq.set_encoder(previous)


class _Async(BaseException):
    pass


def _blocked_thread() -> tuple[threading.Thread, threading.Event, list[str]]:
    """A thread blocked in a C call (an event wait), then running Python code for a while."""
    blocked, release, seen = threading.Event(), threading.Event(), []

    def target() -> None:
        try:
            blocked.set()
            release.wait(10)
            deadline = time.monotonic() + 2
            while time.monotonic() < deadline:
                pass
            seen.append("ran on")
        except _Async:
            seen.append("interrupted")

    thread = threading.Thread(target=target)
    thread.start()
    blocked.wait(10)
    return thread, release, seen


def test_an_asynchronous_exception_lands_once_the_thread_runs_python_code() -> None:
    thread, release, seen = _blocked_thread()
    assert raise_in_thread(thread.ident or 0, _Async) is True
    release.set()
    thread.join(10)
    assert seen == ["interrupted"]


def test_a_pending_asynchronous_exception_can_be_cleared() -> None:
    thread, release, seen = _blocked_thread()
    raise_in_thread(thread.ident or 0, _Async)
    clear_pending_in_thread(thread.ident or 0)
    release.set()
    thread.join(10)
    assert seen == ["ran on"]


def test_no_thread_is_no_asynchronous_exception() -> None:
    thread = threading.Thread(target=lambda: None)
    thread.start()
    thread.join()
    assert raise_in_thread(thread.ident or 0, _Async) is False


def test_a_redis_connection_has_a_socket_only_while_connected() -> None:
    connection = redis.Connection(host="127.0.0.1", port=1)  # type: ignore[no-untyped-call]
    assert has_socket(connection) is False
    connection._sock = object()  # type: ignore[assignment]
    assert has_socket(connection) is True


# -- redis-py's Sentinel connection, which KumikoSentinelConnection builds on ----------------
class _MasterProxy:
    """Stands in for redis-py's pool proxy: a master pool whose primary is at port 1."""

    is_master = True
    check_connection = False
    service_name = "mymaster"

    def get_master_address(self) -> tuple[str, int]:
        return ("127.0.0.1", 1)


def test_a_sentinel_connection_connects_through_connect_to_with_the_primarys_address() -> None:
    seen: list[tuple[str, int]] = []

    class Noted(SentinelManagedConnection):
        def connect_to(self, address: tuple[str, int]) -> None:
            seen.append(address)

    Noted(connection_pool=_MasterProxy()).connect()  # type: ignore[no-untyped-call]
    assert seen == [("127.0.0.1", 1)]


def test_a_readonly_reply_on_a_sentinel_connection_is_a_connection_error_from_it() -> None:
    connection = SentinelManagedConnection(connection_pool=_MasterProxy())  # type: ignore[no-untyped-call]
    with (
        mock.patch.object(
            AbstractConnection, "read_response", side_effect=ReadOnlyError("READONLY replica")
        ),
        pytest.raises(redis.ConnectionError) as caught,
    ):
        connection.read_response()
    assert isinstance(caught.value.__context__, ReadOnlyError)


def test_a_consumer_thread_hands_messages_to_its_worker_threads_through_the_work_queue() -> None:
    handoffs: list[Any] = []

    class Recording(StubBroker):
        def consume(self, queue_name: str, prefetch: int = 1, timeout: int = 100) -> Any:
            handoffs.append(work_handoff())  # built in the consumer thread
            consumer = super().consume(queue_name, prefetch, timeout)
            # the handed message never was on the queue: its ack has nothing to count down
            consumer.ack = lambda message: None  # type: ignore[method-assign]
            return consumer

    broker = Recording()
    ran = threading.Event()

    @dramatiq.actor(broker=broker)
    def job() -> None:
        ran.set()

    worker = Worker(broker, worker_timeout=50, worker_threads=1)
    worker.start()
    try:
        deadline = time.monotonic() + 10
        while not handoffs and time.monotonic() < deadline:
            time.sleep(0.01)
        (put,) = handoffs[:1]
        assert put is not None
        # a message with an eta, or of an unknown actor, is left to the consumer thread
        delayed = job.message_with_options(eta=1)
        assert not put(broker, MessageProxy(delayed))
        unknown: dramatiq.Message[Any] = dramatiq.Message(
            queue_name="default", actor_name="nobody", args=(), kwargs={}, options={}
        )
        assert not put(broker, MessageProxy(unknown))
        # any other is run by a worker thread
        assert put(broker, MessageProxy(job.message()))
        assert ran.wait(10)
    finally:
        worker.stop(timeout=5_000)
    # and a thread that is not a consumer thread has no hand-off
    assert work_handoff() is None


def test_an_error_reply_becomes_the_exception_redis_py_raises_for_it() -> None:
    assert isinstance(error_reply("NOSCRIPT No matching script"), redis.exceptions.NoScriptError)
    assert isinstance(error_reply("READONLY You can't write"), redis.exceptions.ReadOnlyError)
    assert isinstance(error_reply("WRONGPASS invalid"), redis.exceptions.AuthenticationError)
    assert type(error_reply("ERR unknown command")) is redis.ResponseError
