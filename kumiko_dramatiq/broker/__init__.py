"""Dramatiq's Redis broker, kumiko's way.

:class:`KumikoBroker` (:mod:`.broker`) writes Dramatiq's Redis layout with kumiko's Lua
(:mod:`.lua`), its consumer (:mod:`.consumer`) fetches and settles deliveries
(:mod:`.delivery`); every Redis key is built in :mod:`.keys`; connections come from a URL
(:mod:`.urls`, :mod:`.connection`, :mod:`.packer`, :mod:`.tls`), permissions are checked by
:mod:`.acl`, and what leans on Dramatiq's or redis-py's internals is in :mod:`.seam`.
"""

from __future__ import annotations

from kumiko_dramatiq.broker.broker import KumikoBroker
from kumiko_dramatiq.broker.consumer import KumikoConsumer
from kumiko_dramatiq.broker.delivery import Delivery, RunWrite, Settlement

__all__ = ["Delivery", "KumikoBroker", "KumikoConsumer", "RunWrite", "Settlement"]
