"""A FastAPI service on kumiko: ``async def`` endpoints that dispatch jobs without blocking the
event loop (docs/running.md, "From a web app").

- ``POST /signups`` queues the welcome mail with ``await runner.adispatch(...)``. A client that
  retries (it got a timeout, or a 503 saying the dispatch may have been enqueued) sends the same
  ``Idempotency-Key`` header and gets the first dispatch's id back: the mail goes out once.
- ``GET /jobs/{id}`` answers where a job is (``await runner.ajob_state(id)``) and, once it
  completed, what it returned (``await runner.aresult(id)``).
- kumiko's errors map to HTTP codes: bad input 422, an unknown id 404, Redis unavailable 503
  (with ``maybe_enqueued`` and ``Retry-After``).
- kumiko's dashboard is mounted at ``/kumiko``.

Run it with ``python -m examples.fastapi`` (``KUMIKO_REDIS_URL``, default
``redis://127.0.0.1:6379/0``; port 8000): it runs a worker in the same process so that the
demo is one command. In production the web app only dispatches (``create_api()``) and the
workers run beside it: ``dramatiq kumiko_dramatiq.app`` with ``KUMIKO_APP`` naming this
registry.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Annotated, Any

from fastapi import FastAPI, Header, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field

from kumiko_dramatiq import (
    Feature,
    JobContext,
    JobRunner,
    NotFoundError,
    PayloadError,
    RedisUnavailableError,
    Registry,
    UnknownJobError,
)
from kumiko_dramatiq.dashboard import create_app

logger = logging.getLogger("examples.fastapi")

accounts = Feature("accounts")
WELCOME = "accounts:job:send_welcome"


class Welcome(BaseModel):
    email: str = Field(pattern=r"^[^@\s]+@[^@\s]+$")


@accounts.job("send_welcome", retries=3, keep_result_s=3_600)
def send_welcome(payload: Welcome, ctx: JobContext) -> dict[str, Any]:
    logger.info("welcome mail sent to %s (attempt %d)", payload.email, ctx.attempt)
    return {"sent_to": payload.email, "attempt": ctx.attempt}


registry = Registry([accounts])


class Signup(BaseModel):
    email: str


def create_api(runner: JobRunner | None = None, *, worker: bool = False) -> FastAPI:
    """The service over ``runner`` (default: a runner of :data:`registry` configured from the
    environment). ``worker``: also run the jobs in this process (the demo; in production
    workers run beside the web app). The lifespan starts the worker and closes every
    connection at shutdown."""
    jobs = runner if runner is not None else JobRunner(registry)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if worker:
            await asyncio.to_thread(jobs.start)
        try:
            yield
        finally:
            await jobs.aclose()
            await asyncio.to_thread(jobs.stop)

    api = FastAPI(title="kumiko example", lifespan=lifespan)

    @api.post("/signups", status_code=202)
    async def signup(
        body: Signup, idempotency_key: Annotated[str | None, Header()] = None
    ) -> dict[str, str]:
        message_id = await jobs.adispatch(
            WELCOME, {"email": body.email}, idempotency_key=idempotency_key
        )
        return {"id": message_id}

    @api.get("/jobs/{message_id}")
    async def job(message_id: str) -> JSONResponse:
        state = await jobs.ajob_state(message_id)
        if state == "unknown":
            return JSONResponse({"id": message_id, "state": state}, status_code=404)
        found: dict[str, Any] = {"id": message_id, "state": state}
        if state == "completed":
            found["result"] = await jobs.aresult(message_id)
        return JSONResponse(found)

    @api.exception_handler(PayloadError)
    async def bad_input(request: Request, exc: PayloadError) -> JSONResponse:
        return JSONResponse({"error": str(exc)}, status_code=422)

    @api.exception_handler(UnknownJobError)
    @api.exception_handler(NotFoundError)
    async def not_found(request: Request, exc: Exception) -> JSONResponse:
        return JSONResponse({"error": str(exc)}, status_code=404)

    @api.exception_handler(RedisUnavailableError)
    async def unavailable(request: Request, exc: RedisUnavailableError) -> JSONResponse:
        # retry with the same Idempotency-Key: a dispatch that may have landed runs once
        return JSONResponse(
            {"error": str(exc), "maybe_enqueued": exc.maybe_enqueued},
            status_code=503,
            headers={"Retry-After": "1"},
        )

    api.mount("/kumiko", create_app(jobs))
    return api
