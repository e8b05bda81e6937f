"""``python -m examples.fastapi``: the example service on port 8000, with a worker."""

from __future__ import annotations

import logging
import os

import uvicorn

from examples.fastapi.app import create_api

if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    os.environ.setdefault("KUMIKO_REDIS_URL", "redis://127.0.0.1:6379/0")
    os.environ.setdefault("KUMIKO_QUEUE_PREFIX", "fastapi-example")
    uvicorn.run(create_api(worker=True), host="127.0.0.1", port=int(os.environ.get("PORT", "8000")))
