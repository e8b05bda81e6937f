"""Settings of the test project: django_dramatiq with kumiko's broker (docs/dramatiq.md)."""

from __future__ import annotations

import os

SECRET_KEY = "test-only"
USE_TZ = True
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
INSTALLED_APPS = ["django_dramatiq", "tests.apps.django_site.shop"]
DATABASES = {
    # Two worker threads and the test's own reads share one SQLite file. django_dramatiq's
    # update_or_create reads, then writes, in one transaction: begun DEFERRED, two such
    # transactions deadlock on the lock upgrade and SQLite fails one at once with "database is
    # locked" (no busy wait), leaving that task's row at "running". IMMEDIATE takes the write
    # lock at BEGIN, so the other waits (up to the timeout) instead.
    "default": {
        "ENGINE": "django.db.backends.sqlite3",
        "NAME": os.environ["DJANGO_SITE_DB"],
        "OPTIONS": {"timeout": 60, "transaction_mode": "IMMEDIATE"},
    }
}

KUMIKO_REDIS_URL = os.environ["KUMIKO_REDIS_URL"]
KUMIKO_QUEUE_PREFIX = os.environ["KUMIKO_QUEUE_PREFIX"]

DRAMATIQ_BROKER = {
    # a factory, not a broker class: it returns the kumiko runner's broker
    "BROKER": "tests.apps.django_site.kumiko.broker",
    "OPTIONS": {},
    # Dramatiq's default middleware are already in kumiko's chain: only django_dramatiq's
    "MIDDLEWARE": [
        "django_dramatiq.middleware.DbConnectionsMiddleware",
        "django_dramatiq.middleware.AdminMiddleware",
    ],
}
