"""Settings of the test project: django_dramatiq with kumiko's broker (docs/dramatiq.md)."""

from __future__ import annotations

import os

SECRET_KEY = "test-only"
USE_TZ = True
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
INSTALLED_APPS = ["django_dramatiq", "tests.apps.django_site.shop"]
DATABASES = {
    # two worker threads and the test's own reads share one SQLite file: wait for its lock
    # instead of failing a write with "database is locked" (SQLite's default is 5 s)
    "default": {
        "ENGINE": "django.db.backends.sqlite3",
        "NAME": os.environ["DJANGO_SITE_DB"],
        "OPTIONS": {"timeout": 60},
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
