"""Set this run's broker up, as a producer process of the app does: :mod:`.plain`, or
``kumiko_dramatiq.app`` (``KUMIKO_APP`` naming :mod:`.app`). Used by the driver and the
scheduler processes."""

from __future__ import annotations

import importlib
import sys
from types import ModuleType

from tests.compat.apps.common import APP, BROKER


def load_app() -> ModuleType:
    """Set the broker up; return the app's module, its actors bound to that broker."""
    importlib.import_module(
        "tests.compat.apps.plain" if BROKER == "plain" else "kumiko_dramatiq.app"
    )
    return sys.modules[f"tests.compat.apps.{APP}"]
