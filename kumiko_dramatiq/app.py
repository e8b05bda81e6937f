"""The module ``dramatiq kumiko_dramatiq.app`` loads.

It builds the app's runner from the environment (:mod:`kumiko_dramatiq.loader`) and exposes
its broker, with every actor declared and kumiko's middleware chain, as Dramatiq's global
broker: the same wiring ``JobRunner.start()`` uses, so there is no second one. Plain Dramatiq
actors declared while the app's module was imported are bound to that broker too. Dramatiq
then runs a worker per process, consuming the queue of every declared actor; kumiko's
broker keeps it off the dataset's other lane, and ``Boot`` runs boot gates and
boot-once jobs in every process. A bad ``KUMIKO_APP``, or a broker carrying Dramatiq's own
``Retries`` (refused here as by ``JobRunner.start()``), exits with one line on stderr,
status 2.
"""

from __future__ import annotations

import sys

import dramatiq

from kumiko_dramatiq.errors import KumikoError
from kumiko_dramatiq.loader import load_runner
from kumiko_dramatiq.middleware.retries import check_no_dramatiq_retries
from kumiko_dramatiq.runner import check_lane_can_run

try:
    runner = load_runner()
    check_no_dramatiq_retries(runner.broker.middleware)
    check_lane_can_run(runner.runtime)
except (KumikoError, ValueError) as exc:
    print(f"kumiko_dramatiq.app: {exc}", file=sys.stderr)
    raise SystemExit(2) from None

broker = runner.broker
dramatiq.set_broker(broker)
