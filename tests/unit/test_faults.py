"""``RedisUnavailableError.maybe_enqueued``: what a failed write's error says of whether the
command reached Redis (:func:`kumiko_dramatiq.broker.faults.kumiko_error`)."""

from __future__ import annotations

import pytest
import redis

from kumiko_dramatiq.broker.faults import kumiko_error
from kumiko_dramatiq.errors import RedisUnavailableError

URL = "redis://127.0.0.1:6379/0"


@pytest.mark.parametrize(
    ("error", "maybe"),
    [
        (
            redis.ConnectionError("Error 111 connecting to 127.0.0.1:6379. Connection refused."),
            False,
        ),
        (redis.TimeoutError("Timeout connecting to server"), False),
        (
            redis.ConnectionError(
                "Redis refuses writes for now: You can't write against a read only replica."
            ),
            False,
        ),
        (
            redis.ConnectionError(
                "mymaster at 10.0.0.1:6379: a fail-over away from it is in progress: "
                "not writing to it"
            ),
            False,
        ),
        (redis.TimeoutError("Timeout reading from 127.0.0.1:6379"), True),
        (redis.ConnectionError("Connection to 127.0.0.1:6379 lost"), True),
    ],
)
def test_a_write_may_have_been_enqueued_only_if_it_was_sent(
    error: redis.RedisError, maybe: bool
) -> None:
    found = kumiko_error(URL, "dispatching app:job:x", error)
    assert isinstance(found, RedisUnavailableError)
    assert found.maybe_enqueued is maybe
    assert ("may have been enqueued" in str(found)) is maybe


def test_a_read_never_says_it_may_have_been_enqueued() -> None:
    found = kumiko_error(URL, "reading a result", redis.TimeoutError("Timeout reading from x"))
    assert isinstance(found, RedisUnavailableError)
    assert found.maybe_enqueued is False
