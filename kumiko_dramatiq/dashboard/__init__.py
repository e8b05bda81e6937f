"""The web dashboard of a kumiko dataset: ``kumiko dashboard`` or :func:`create_app`.

Needs the ``dashboard`` extra (``pip install 'kumiko_dramatiq[dashboard]'``: Starlette,
Jinja2 and uvicorn). :func:`create_app` returns an ASGI app to mount in FastAPI or
Starlette, or to serve with any ASGI server; :mod:`kumiko_dramatiq.dashboard.app` says what
it shows and who may act, :mod:`kumiko_dramatiq.dashboard.pages` how each page stays fast.
"""

from __future__ import annotations

from kumiko_dramatiq.dashboard.app import create_app

__all__ = ["create_app"]
