"""Packing commands into the Redis protocol for kumiko's connections."""

from __future__ import annotations

from typing import Any

from redis.connection import (
    PythonRespSerializer,
)

from kumiko_dramatiq.broker.seam import argument_encoder


class RespPacker:
    """Packs a command into the Redis protocol in one buffer, for kumiko's connections when
    ``hiredis`` (whose packer is C) is not installed. redis-py's pure-Python packer encodes
    argument by argument through a chain of type checks and rebuilds its buffer for each one:
    on kumiko's Lua calls (10 to 13 arguments) that was a tenth of a worker's CPU per
    message. Same output and errors: ``bytes``, ``str`` (in the connection's encoding) and
    ``int`` are packed here; anything else (a command name of several words such as
    ``"CLIENT SETNAME"``, a float, a memoryview, a bool or another type, which redis-py
    refuses) goes to redis-py's packer."""

    def __init__(self, encoding: str, errors: str, buffer_cutoff: int) -> None:
        self._encoding = encoding
        self._errors = errors
        self._redis_py = PythonRespSerializer(
            buffer_cutoff,
            argument_encoder(encoding, errors),
        )

    def pack(self, *args: Any) -> list[bytes]:
        name = args[0]
        if (b" " if type(name) is bytes else " ") in name:
            return self._redis_py.pack(*args)  # type: ignore[no-any-return,no-untyped-call]
        parts = [b"*%d\r\n" % len(args)]
        for arg in args:
            kind = type(arg)
            if kind is str:
                arg = arg.encode(self._encoding, self._errors)
            elif kind is int:
                arg = b"%d" % arg
            elif kind is not bytes:
                return self._redis_py.pack(*args)  # type: ignore[no-any-return,no-untyped-call]
            parts.append(b"$%d\r\n%b\r\n" % (len(arg), arg))
        return [b"".join(parts)]
