"""The documented ACL rule set (kumiko_dramatiq.broker.acl) against a real Redis: a fresh user with
exactly those rules runs every main path without one refusal, and a user lacking any one of
its commands (or its keys) fails at start, in one line naming what is missing."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from kumiko_dramatiq import JobRunner
from kumiko_dramatiq.broker import acl
from kumiko_dramatiq.errors import RedisAccessError
from tests.deployment import (
    BOOT,
    DIES,
    FAN,
    GATE,
    ROOT,
    SEQ,
    TICK,
    WORK,
    cli_env,
    kumiko,
    main_paths_registry,
    run_main_paths,
)


@pytest.fixture
def acl_user(redis_client: redis.Redis, prefix: str) -> Iterator[str]:
    """A user name for this test (the user is deleted after it)."""
    name = f"kumiko-acl-{prefix}"
    yield name
    redis_client.acl_deluser(name)


def set_user(client: redis.Redis, name: str, rules: list[str]) -> None:
    client.execute_command(  # type: ignore[no-untyped-call]
        "ACL", "SETUSER", name, "reset", "on", ">pw", *rules
    )


def as_user(redis_url: str, name: str) -> str:
    scheme, _, rest = redis_url.partition("://")
    return f"{scheme}://{name}:pw@{rest}"


def runner_as(redis_url: str, name: str, prefix: str) -> JobRunner:
    return JobRunner(
        main_paths_registry(),
        redis_url=as_user(redis_url, name),
        queue_prefix=prefix,
        boot_redis_timeout_ms=2_000,
        get_active_tenant_ids=lambda: ["t1"],
    )


def refusals(client: redis.Redis, name: str) -> list[dict[str, Any]]:
    return [entry for entry in client.acl_log(count=1000) if entry.get("username") == name]


def test_a_user_with_exactly_the_rule_set_runs_every_main_path(
    redis_client: redis.Redis, redis_url: str, prefix: str, acl_user: str
) -> None:
    # Given a fresh user with the documented rules for this dataset, and nothing else
    set_user(redis_client, acl_user, acl.rules(prefix))
    url = as_user(redis_url, acl_user)

    # When a worker with a scheduler walks every main path, and `kumiko status` runs
    seen = run_main_paths(url, prefix)
    done = kumiko(cli_env(url, prefix), "status", "--json")

    # Then each path ended as it should, and Redis refused this user nothing
    assert seen.completed == {GATE: 1, BOOT: 1, WORK: 4, SEQ: 2, TICK: seen.completed[TICK], FAN: 3}
    assert seen.failed == {WORK: 1, DIES: 2}
    assert done.returncode == 0, done.stderr
    assert {lane["lane"] for lane in json.loads(done.stdout)["lanes"]} == {"worker", "api"}
    assert refusals(redis_client, acl_user) == []


@pytest.mark.parametrize("command", acl.commands())
def test_a_user_lacking_one_command_of_the_rule_set_fails_at_start_naming_it(
    command: str, redis_client: redis.Redis, redis_url: str, prefix: str, acl_user: str
) -> None:
    set_user(redis_client, acl_user, acl.rules(prefix, without=command))
    runner = runner_as(redis_url, acl_user, prefix)
    with pytest.raises(RedisAccessError) as caught:
        runner.start()
    runner.stop()
    message = str(caught.value)
    assert "\n" not in message
    assert command.replace("|", " ").upper() in message.upper().replace("|", " ")
    assert ":pw@" not in message


def test_a_user_without_the_datasets_keys_fails_at_start_naming_them(
    redis_client: redis.Redis, redis_url: str, prefix: str, acl_user: str
) -> None:
    set_user(redis_client, acl_user, acl.rules("some_other_dataset"))
    runner = runner_as(redis_url, acl_user, prefix)
    with pytest.raises(RedisAccessError, match="access the key") as caught:
        runner.start()
    runner.stop()
    assert "\n" not in str(caught.value)


def test_a_user_without_the_namespace_key_fails_at_start_naming_it(
    redis_client: redis.Redis, redis_url: str, prefix: str, acl_user: str
) -> None:
    rules = [rule for rule in acl.rules(prefix) if rule != "~dramatiq"]
    set_user(redis_client, acl_user, rules)
    runner = runner_as(redis_url, acl_user, prefix)
    with pytest.raises(RedisAccessError, match="~dramatiq") as caught:
        runner.start()
    runner.stop()
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize("pattern", acl.key_patterns("PREFIX"))
def test_a_user_lacking_one_key_pattern_fails_at_start_naming_it(
    pattern: str, redis_client: redis.Redis, redis_url: str, prefix: str, acl_user: str
) -> None:
    missing = pattern.replace("PREFIX", prefix)
    set_user(redis_client, acl_user, [r for r in acl.rules(prefix) if r != f"~{missing}"])
    runner = runner_as(redis_url, acl_user, prefix)
    with pytest.raises(RedisAccessError) as caught:
        runner.start()
    runner.stop()
    message = str(caught.value)
    assert "\n" not in message
    assert f"add ~{missing} to its key patterns" in message
    assert ":pw@" not in message


def test_a_cli_worker_lacking_the_heartbeats_key_stops_in_one_line_naming_url_and_pattern(
    redis_client: redis.Redis, redis_url: str, prefix: str, acl_user: str
) -> None:
    set_user(
        redis_client, acl_user, [r for r in acl.rules(prefix) if r != "~dramatiq:__heartbeats__"]
    )
    url = as_user(redis_url, acl_user)
    done = subprocess.run(
        [sys.executable, "-m", "dramatiq", "kumiko_dramatiq.app", "-p", "1", "-t", "1"],
        cwd=ROOT,
        env=cli_env(url, prefix),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 3, done.stderr
    [line] = [line for line in done.stderr.splitlines() if "did not start" in line]
    assert "CRITICAL" in line
    assert f"redis://{acl_user}:***@" in line
    assert "~dramatiq:__heartbeats__" in line
    assert "Traceback" not in done.stderr


def test_kumiko_status_lacking_the_acks_key_is_one_line(
    redis_client: redis.Redis, redis_url: str, prefix: str, acl_user: str
) -> None:
    acks = f"~dramatiq:__acks__.*.{prefix}-*"
    set_user(redis_client, acl_user, [r for r in acl.rules(prefix) if r != acks])
    done = kumiko(cli_env(as_user(redis_url, acl_user), prefix), "status")
    assert done.returncode == 1, done.stderr
    [line] = done.stderr.strip().splitlines()
    assert acks in line


def test_an_async_producer_needs_no_rule_beyond_the_rule_set(
    redis_client: redis.Redis, redis_url: str, prefix: str, acl_user: str
) -> None:
    # Given a fresh user with the documented rules for this dataset, and nothing else
    set_user(redis_client, acl_user, acl.rules(prefix))
    runner = runner_as(redis_url, acl_user, prefix)

    async def produce() -> tuple[str, str, str]:
        # When it connects from a loop (HELLO 3 with AUTH, SELECT) and dispatches every way
        one = await runner.adispatch(WORK, {})
        await runner.adispatch(WORK, {}, idempotency_key="k1")
        await runner.adispatch_many(WORK, [{}, {}])
        batch = await runner.adispatch_batch([(WORK, {}), (WORK, {})])
        state = await runner.ajob_state(one)
        status = await runner.abatch(batch)
        await runner.aclose()
        return one, state, status.state

    with runner:
        _, state, batch_state = asyncio.run(produce())
    # Then each call did its work, and Redis refused this user nothing
    assert state == "queued"
    assert batch_state == "running"
    assert refusals(redis_client, acl_user) == []
