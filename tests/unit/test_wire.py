"""The RESP3 reader of the asyncio connection (:func:`kumiko_dramatiq.aio.wire.parse`): every
reply type as redis-py's sync reader gives it, errors as redis-py's exception classes, and a
reply split across reads waits for the rest."""

from __future__ import annotations

from typing import Any

import pytest
import redis

from kumiko_dramatiq.aio.wire import Push, _Short, parse


@pytest.mark.parametrize(
    ("raw", "value"),
    [
        (b"+OK\r\n", b"OK"),
        (b":42\r\n", 42),
        (b"(12345678901234567890\r\n", 12345678901234567890),
        (b"$5\r\nhello\r\n", b"hello"),
        (b"$0\r\n\r\n", b""),
        (b"$-1\r\n", None),
        (b"_\r\n", None),
        (b"#t\r\n", True),
        (b"#f\r\n", False),
        (b",1.5\r\n", 1.5),
        (b"=9\r\ntxt:hello\r\n", b"hello"),
        (b"*2\r\n:1\r\n$1\r\na\r\n", [1, b"a"]),
        (b"*-1\r\n", None),
        (b"~2\r\n:1\r\n:2\r\n", [1, 2]),
        (b"%1\r\n$1\r\nk\r\n:7\r\n", {b"k": 7}),
        (b"|1\r\n+ttl\r\n:3\r\n:9\r\n", 9),  # an attribute describes the reply after it
        (b"$4\r\na\r\nb\r\n", b"a\r\nb"),  # a bulk string holds CRLF
    ],
)
def test_each_reply_type_reads_as_redis_py_gives_it(raw: bytes, value: Any) -> None:
    assert parse(raw, 0) == (value, len(raw))


def test_an_error_reply_is_redis_pys_exception_returned_in_its_place() -> None:
    error, at = parse(b"-NOSCRIPT No matching script\r\n", 0)
    assert isinstance(error, redis.exceptions.NoScriptError)
    assert at == len(b"-NOSCRIPT No matching script\r\n")
    inside, _ = parse(b"*2\r\n:1\r\n-READONLY You can't write\r\n", 0)
    assert inside[0] == 1
    assert isinstance(inside[1], redis.exceptions.ReadOnlyError)
    blob, _ = parse(b"!9\r\nERR boom!\r\n", 0)
    assert type(blob) is redis.ResponseError
    assert str(blob) == "boom!"


def test_a_push_is_told_from_a_reply() -> None:
    push, _ = parse(b">2\r\n$7\r\nmessage\r\n$1\r\nx\r\n", 0)
    assert type(push) is Push
    assert push == [b"message", b"x"]


@pytest.mark.parametrize(
    "raw", [b"*2\r\n:1\r\n$3\r\nabc\r\n", b"%1\r\n$1\r\nk\r\n:7\r\n", b"$10\r\n0123456789\r\n"]
)
def test_a_reply_cut_anywhere_waits_for_the_rest(raw: bytes) -> None:
    for cut in range(len(raw)):
        with pytest.raises(_Short):
            parse(raw[:cut], 0)
    assert parse(raw, 0)[1] == len(raw)


def test_replies_follow_each_other_in_one_buffer() -> None:
    raw = b"+OK\r\n:1\r\n$1\r\nx\r\n"
    first, at = parse(raw, 0)
    second, at = parse(raw, at)
    third, at = parse(raw, at)
    assert (first, second, third, at) == (b"OK", 1, b"x", len(raw))
