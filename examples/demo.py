"""End-to-end demo of the billing example: a real worker, real Redis, visible retries.

``python -m examples.demo`` (from the repository root). Without
``KUMIKO_REDIS_URL`` it starts a private ``redis-server`` on a free port in a
temporary directory and removes it afterwards. It starts ``dramatiq
kumiko_dramatiq.app`` for ``examples.billing.app:registry``, dispatches
invoices and an event, streams the worker's log and stops once every
outcome has shown up.
"""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from kumiko_dramatiq import JobRunner

from .billing.app import registry
from .redis_server import private_redis

ROOT = Path(__file__).resolve().parent.parent
EXPECTED = {
    "INV-1001 sent": "invoice INV-1001 sent",
    "INV-1002 sent after retries": "invoice INV-1002 sent to",
    "payment recorded": "payment of 120.0 recorded",
    "pdf timed out twice, dead-lettered": "render_pdf",
}


@contextmanager
def demo_redis() -> Iterator[str]:
    """The Redis ``KUMIKO_REDIS_URL`` names, else a private throwaway one."""
    url = os.environ.get("KUMIKO_REDIS_URL")
    if url:
        yield url
        return
    with private_redis() as url:
        print(f"demo: private Redis on {url}")
        yield url


def stream(process: subprocess.Popen[str], lines: queue.Queue[str]) -> None:
    assert process.stderr is not None
    for line in process.stderr:
        lines.put(line.rstrip("\n"))


def main() -> int:
    prefix = f"demo-{uuid.uuid4().hex[:6]}"
    with demo_redis() as url:
        env = {
            **os.environ,
            "KUMIKO_APP": "examples.billing.app:registry",
            "KUMIKO_REDIS_URL": url,
            "KUMIKO_QUEUE_PREFIX": prefix,
            "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
        }
        worker = subprocess.Popen(
            [sys.executable, "-m", "dramatiq", "kumiko_dramatiq.app", "-p", "1", "-t", "4"],
            cwd=ROOT,
            env=env,
            stderr=subprocess.PIPE,
            text=True,
        )
        lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=stream, args=(worker, lines), daemon=True).start()
        try:
            with JobRunner(registry, redis_url=url, queue_prefix=prefix) as producer:
                producer.dispatch(
                    "billing:job:send_invoice", {"invoice": "INV-1001", "email": "ada@example.com"}
                )
                producer.dispatch(
                    "billing:job:send_invoice",
                    {"invoice": "INV-1002", "email": "bob@example.com", "gateway_failures": 2},
                )
                producer.handle_event("invoice.paid", {"invoice": "INV-1001", "amount": 120.0})
                producer.dispatch("billing:job:render_pdf", {"invoice": "INV-1001", "pages": 40})
                print("demo: dispatched 3 jobs and 1 event; worker log follows\n")
            return watch(worker, lines)
        finally:
            worker.send_signal(signal.SIGTERM)
            try:
                worker.wait(timeout=30)
            except subprocess.TimeoutExpired:
                worker.kill()


def watch(worker: subprocess.Popen[str], lines: queue.Queue[str]) -> int:
    pending = dict(EXPECTED)
    pdf_failures = 0
    deadline = time.monotonic() + 60
    while pending and time.monotonic() < deadline:
        try:
            line = lines.get(timeout=0.5)
        except queue.Empty:
            if worker.poll() is not None:
                print(f"demo: the worker exited early with status {worker.returncode}")
                return 1
            continue
        if "[kumiko_dramatiq]" in line or "[examples.billing]" in line:
            print("  " + line.split("] ", 3)[-1])
        if "render_pdf" in line and "failed for good" in line:
            pdf_failures += 1
        for name, needle in list(pending.items()):
            if name.startswith("pdf"):
                if pdf_failures:
                    del pending[name]
            elif needle in line and (name != "INV-1002 sent after retries" or "INV-1002" in line):
                del pending[name]
    if pending:
        print(f"\ndemo: FAILED, still waiting for: {', '.join(pending)}")
        return 1
    print("\ndemo: every outcome seen:")
    for name in EXPECTED:
        print(f"  ok  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
