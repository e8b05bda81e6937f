"""An app whose module sends a message while it is imported: there is no kumiko broker yet.

``KUMIKO_APP=tests.apps.import_send_app:registry``: loading it fails with one line.
"""

from __future__ import annotations

import dramatiq

from kumiko_dramatiq import Registry


@dramatiq.actor
def ping() -> None:
    return None


ping.send()

registry = Registry([])
