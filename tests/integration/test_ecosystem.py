"""Dramatiq's ecosystem on kumiko's broker, set up as docs/dramatiq.md says ("Django and
periodiq"): django_dramatiq's ``rundramatiq`` workers and its task admin, and periodiq's
scheduler, each with real subprocesses and a real Redis."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import redis

from tests.conftest import wait_for

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


@pytest.fixture
def plain_queue(prefix: str, redis_client: redis.Redis) -> Iterator[str]:
    """The plain actors' queue (not a lane), cleaned up after the test."""
    name = f"{prefix}_plain"
    yield name
    stale = list(redis_client.scan_iter(match=f"dramatiq:*{name}*", count=1000))
    if stale:
        redis_client.delete(*stale)


def environment(redis_url: str, prefix: str, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KUMIKO_")}
    env.update(
        PYTHONPATH=str(ROOT),
        PATH=os.pathsep.join([str(BIN), os.environ.get("PATH", "")]),
        KUMIKO_REDIS_URL=redis_url,
        KUMIKO_QUEUE_PREFIX=prefix,
        **extra,
    )
    return env


@contextmanager
def running(command: list[str], env: dict[str, str]) -> Iterator[subprocess.Popen[str]]:
    process = subprocess.Popen(
        command, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    try:
        yield process
    finally:
        process.terminate()
        try:
            process.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.communicate()


def django(env: dict[str, str], *args: str) -> str:
    """``python -m django ARGS`` in the test project; its stdout."""
    done = subprocess.run(
        [sys.executable, "-m", "django", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.mark.slow
def test_django_dramatiq_runs_plain_actors_and_jobs_on_kumikos_broker(
    redis_url: str, prefix: str, plain_queue: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    # Given a Django project whose DRAMATIQ_BROKER is the factory docs/dramatiq.md shows,
    # with django_dramatiq's middleware only, migrated
    env = environment(
        redis_url,
        prefix,
        DJANGO_SETTINGS_MODULE="tests.apps.django_site.settings",
        DJANGO_SITE_DB=str(tmp_path / "site.sqlite3"),
    )
    django(env, "migrate", "--verbosity", "0")
    # When a Django process sends a plain actor's message and dispatches a kumiko job, and
    # `manage.py rundramatiq` runs the workers (started after the sends: django_dramatiq's
    # AdminMiddleware writes "enqueued" after the enqueue, which a worker already waiting
    # could overtake, leaving "enqueued" as the record's last word)
    django(
        env,
        "shell",
        "--no-imports",
        "-c",
        "from tests.apps.django_site.shop.tasks import record\n"
        "from tests.apps.django_site.kumiko import runner\n"
        "import dramatiq\n"
        "assert dramatiq.get_broker() is runner.broker\n"
        "record.send('actor')\n"
        "runner.dispatch('shop:job:note', {'text': 'job'})\n",
    )
    statuses = (
        "from django_dramatiq.models import Task\n"
        "print(sorted((t.actor_name, t.status) for t in Task.tasks.all()))"
    )
    queued = "[('record', 'enqueued'), ('shop:job:note', 'enqueued')]"
    assert django(env, "shell", "--no-imports", "-c", statuses).strip() == queued
    with running([sys.executable, "-m", "django", "rundramatiq", "-p", "1", "-t", "2"], env):
        # Then the workers run both
        seen = f"kumiko:{prefix}:test:seen"
        wait_for(lambda: redis_client.llen(seen) == 2, timeout_s=60, what="both messages ran")
        assert sorted(redis_client.lrange(seen, 0, -1)) == [b"actor", b"job"]
        # And django_dramatiq's admin middleware recorded them as done
        done = "[('record', 'done'), ('shop:job:note', 'done')]"
        last: list[str] = []

        def recorded() -> bool:
            last[:] = [django(env, "shell", "--no-imports", "-c", statuses).strip()]
            return last[0] == done

        try:
            wait_for(recorded, timeout_s=60, what=f"the admin's records {done}")
        except AssertionError as exc:
            raise AssertionError(f"{exc}; last read: {last}") from None


@pytest.mark.slow
def test_periodiq_schedules_a_periodic_actor_on_kumikos_broker(
    redis_url: str, prefix: str, plain_queue: str, redis_client: redis.Redis
) -> None:
    # Given an app that declares a periodic actor and adds PeriodiqMiddleware to its
    # runner's broker, with CLI workers and periodiq's scheduler on it
    env = environment(redis_url, prefix, KUMIKO_APP="tests.apps.periodiq_app:runner")
    worker = [sys.executable, "-m", "dramatiq", "kumiko_dramatiq.app", "-p", "1", "-t", "2"]
    scheduler = [str(BIN / "periodiq"), "kumiko_dramatiq.app"]
    with running(worker, env) as workers, running(scheduler, env) as periodiq:
        # Then the scheduler sends the every-minute actor as it starts, and a worker runs it
        seen = f"kumiko:{prefix}:test:seen"
        wait_for(lambda: redis_client.llen(seen) >= 1, timeout_s=60, what="the periodic run")
        assert redis_client.lrange(seen, 0, 0) == [b"tick"]
        assert workers.poll() is None
        assert periodiq.poll() is None
