"""One run of one app on one broker: ``python -m tests.compat.apps.drive`` (the harness runs it).

Sets the broker up as the app's producers do (:func:`.setup_broker.load_app`), then calls the
app module's ``drive(context)``, which starts CLI workers, sends messages and returns what
happened as JSON values; that goes to the file ``COMPAT_OUTCOME`` names, as
``{"outcome": ...}`` or ``{"error": "...", "trace": "..."}``.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path

from tests.compat.apps.common import BROKER, Context
from tests.compat.apps.setup_broker import load_app


def main() -> int:
    target = Path(os.environ["COMPAT_OUTCOME"])
    try:
        app = load_app()
        outcome = app.drive(Context(BROKER, Path(os.environ["COMPAT_LOGS"])))
        target.write_text(json.dumps({"outcome": outcome}, sort_keys=True))
    except BaseException as exc:  # the harness reports it, whatever it is
        detail = "".join(traceback.format_exception(exc))
        target.write_text(json.dumps({"error": f"{type(exc).__name__}: {exc}", "trace": detail}))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
