"""One configuration surface: JobRunner arguments, KUMIKO_* variables, defaults."""

from __future__ import annotations

import pytest

from kumiko_dramatiq import JobConfigError, JobRunner, Registry
from kumiko_dramatiq.environment import VARIABLES, resolve_settings
from kumiko_dramatiq.errors import AppLoadError
from kumiko_dramatiq.loader import check_runner_agrees
from kumiko_dramatiq.settings import UNSET, Settings


def test_an_argument_beats_its_variable_which_beats_the_default() -> None:
    env = {"KUMIKO_HEARTBEAT_TIMEOUT_MS": "2000", "KUMIKO_QUEUE_PREFIX": "from_env"}
    settings = resolve_settings({"queue_prefix": "given", "lock_ttl_ms": UNSET}, env)
    assert settings.queue_prefix == "given"
    assert settings.heartbeat_timeout_ms == 2_000
    assert settings.lock_ttl_ms == Settings().lock_ttl_ms == 30_000


def test_every_variable_maps_onto_a_setting() -> None:
    assert {setting for setting, _ in VARIABLES.values()} <= set(Settings.names())


@pytest.mark.parametrize(
    ("env", "match"),
    [
        ({"KUMIKO_HEARTBEAT_TIMEOUT_MS": "soon"}, "KUMIKO_HEARTBEAT_TIMEOUT_MS must be an integer"),
        ({"KUMIKO_MAINTENANCE_CHANCE": "2000000"}, "KUMIKO_MAINTENANCE_CHANCE must be an integer"),
        ({"KUMIKO_LANE": "batch"}, 'KUMIKO_LANE must be "worker" or "api"'),
        ({"KUMIKO_QUEUE_PREFIX": "a b"}, "KUMIKO_QUEUE_PREFIX must match"),
    ],
)
def test_a_bad_variable_is_a_config_error_naming_the_variable(
    env: dict[str, str], match: str
) -> None:
    with pytest.raises(JobConfigError, match=match):
        resolve_settings({}, env)


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("lock_ttl_ms", 50),
        ("idle_wait_ms", 0),
        ("heartbeat_timeout_ms", True),
        ("maintenance_chance", -1),
        ("worker_threads", 2.0),
        ("queue_prefix", None),
    ],
)
def test_a_bad_argument_is_a_config_error_naming_it(name: str, value: object) -> None:
    with pytest.raises(JobConfigError, match=name):
        resolve_settings({name: value}, {})


def test_a_variable_that_disagrees_with_a_runner_app_is_refused_naming_both() -> None:
    runner = JobRunner(Registry([]), lock_ttl_ms=5_000, queue_prefix="app")
    env = {"KUMIKO_APP": "app.jobs:runner", "KUMIKO_LOCK_TTL_MS": "600"}
    with pytest.raises(AppLoadError) as caught:
        check_runner_agrees(runner, env)
    message = str(caught.value)
    assert "KUMIKO_LOCK_TTL_MS=600" in message
    assert "lock_ttl_ms=5000" in message
    assert "\n" not in message


def test_variables_that_agree_with_a_runner_app_are_fine() -> None:
    runner = JobRunner(Registry([]), lock_ttl_ms=5_000, queue_prefix="app")
    check_runner_agrees(runner, {"KUMIKO_LOCK_TTL_MS": "5000", "KUMIKO_QUEUE_PREFIX": "app"})
