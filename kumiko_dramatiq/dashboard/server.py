"""Serving the dashboard with uvicorn, for ``kumiko dashboard``."""

from __future__ import annotations

import signal
import threading
from types import FrameType

import uvicorn

from kumiko_dramatiq.dashboard.app import create_app
from kumiko_dramatiq.runner import JobRunner

_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def serve(runner: JobRunner, *, host: str, port: int, token: str | None) -> None:
    """Serve :func:`~kumiko_dramatiq.dashboard.create_app` of ``runner`` on ``host:port``
    until SIGINT or SIGTERM, then return (the caller checked the address).

    uvicorn shuts down gracefully on those signals and then raises them again for the
    handlers it found; the ones set here take them, so the caller can close the runner and
    exit 0, as ``kumiko-scheduler`` does.
    """
    app = create_app(runner, token=token)
    config = uvicorn.Config(
        app, host=host, port=port, log_level="info", access_log=False, server_header=False
    )
    in_main = threading.current_thread() is threading.main_thread()
    previous = {sig: signal.signal(sig, _stopped) for sig in _STOP_SIGNALS} if in_main else {}
    try:
        uvicorn.Server(config).run()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _stopped(signum: int, frame: FrameType | None) -> None:
    """Takes the stop signal uvicorn raises again once it has shut down."""
