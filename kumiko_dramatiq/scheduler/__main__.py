"""``python -m kumiko_dramatiq.scheduler``: the same as ``kumiko-scheduler``."""

from __future__ import annotations

from kumiko_dramatiq.ops.cli import scheduler_main

raise SystemExit(scheduler_main())
