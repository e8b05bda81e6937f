"""An app module that raises while it is imported (``KUMIKO_APP=tests.apps.broken_app:x``)."""

from __future__ import annotations

raise RuntimeError("the settings file is missing")
