"""One run of one app on one broker: ``python -m tests.compat.apps.drive`` (the harness runs it).

Sets the broker up as the app's producers do (:mod:`.plain`, or ``kumiko_dramatiq.app`` with
``KUMIKO_APP`` naming :mod:`.app`), then calls the app module's ``drive(context)``, which
starts CLI workers, sends messages and returns what happened as JSON values; that goes to
the file ``COMPAT_OUTCOME`` names, as ``{"outcome": ...}`` or ``{"error": "..."}``.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import traceback
from pathlib import Path

from tests.compat.apps.common import APP, BROKER, Context


def main() -> int:
    target = Path(os.environ["COMPAT_OUTCOME"])
    try:
        importlib.import_module(
            "tests.compat.apps.plain" if BROKER == "plain" else "kumiko_dramatiq.app"
        )
        app = sys.modules[f"tests.compat.apps.{APP}"]
        outcome = app.drive(Context(BROKER, Path(os.environ["COMPAT_LOGS"])))
        target.write_text(json.dumps({"outcome": outcome}, sort_keys=True))
    except BaseException as exc:  # the harness reports it, whatever it is
        detail = "".join(traceback.format_exception(exc))
        target.write_text(json.dumps({"error": f"{type(exc).__name__}: {exc}", "trace": detail}))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
