"""The module ``dramatiq kumiko_dramatiq.app`` loads.

It builds the app's runner from the environment (:mod:`kumiko_dramatiq.apps`) and exposes
its broker, with every actor declared and kumiko's middleware chain, as Dramatiq's global
broker: the same wiring ``JobRunner.start()`` uses, so there is no second one. Dramatiq then
runs a worker per process; kumiko's ``Lane`` middleware restricts it to ``KUMIKO_LANE`` and
``Boot`` runs boot gates and boot-once jobs in every process. A bad ``KUMIKO_APP`` exits with
one line on stderr, status 2.
"""

from __future__ import annotations

import sys

import dramatiq

from .apps import load_runner
from .errors import KumikoError
from .runner import check_lane_can_run

try:
    runner = load_runner()
    check_lane_can_run(runner.runtime)
except (KumikoError, ValueError) as exc:
    print(f"kumiko_dramatiq.app: {exc}", file=sys.stderr)
    raise SystemExit(2) from None

broker = runner.broker
dramatiq.set_broker(broker)
