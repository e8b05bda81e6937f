"""Caps as options and as message options: what decodes, what does not, and the Lua's bounds."""

from __future__ import annotations

import re
from typing import Any

import pytest

from kumiko_dramatiq import Feature, JobContext, RateLimit, Registry, build_message_options
from kumiko_dramatiq.broker.lua import source
from kumiko_dramatiq.codec import MAX_CAP_RUNNING, MAX_RATE_COUNT, KumikoOptions, OptionsError
from kumiko_dramatiq.limits import MAX_DURATION_MS


def noop(payload: dict[str, Any], ctx: JobContext) -> None:
    return None


def options_of(**caps: Any) -> dict[str, Any]:
    feature = Feature("caps")
    feature.job("work", **caps)(noop)
    job = Registry([feature]).jobs["caps:job:work"]
    return {**build_message_options(job), "kumiko_trigger": "manual"}


def test_caps_round_trip_through_the_codec() -> None:
    options = options_of(max_running=3, rate_limit=RateLimit(7, 250))
    decoded = KumikoOptions.decode(options)
    assert decoded.caps is not None
    assert (decoded.caps.max_running, decoded.caps.rate_limit) == (3, (7, 250, False))
    assert decoded.encode() == options


def test_a_job_without_caps_carries_no_caps_key() -> None:
    assert "kumiko_caps" not in options_of()
    assert KumikoOptions.decode(options_of()).caps is None


@pytest.mark.parametrize(
    "caps",
    [
        {},
        {"max_running": 0},
        {"max_running": True},
        {"max_running": None},
        {"max_running": MAX_CAP_RUNNING + 1},
        {"rate_limit": [0, 1_000, False]},
        {"rate_limit": [1, 0, False]},
        {"rate_limit": [1, MAX_DURATION_MS + 1, False]},
        {"rate_limit": [MAX_RATE_COUNT + 1, 1_000, False]},
        {"rate_limit": [1, 1_000]},
        {"rate_limit": [1, 1_000, "yes"]},
        {"rate_limit": None},
        {"other": 1},
        [1],
    ],
)
def test_forged_caps_do_not_decode(caps: Any) -> None:
    with pytest.raises(OptionsError, match="kumiko_caps"):
        KumikoOptions.decode({**options_of(), "kumiko_caps": caps})


def test_the_fetch_takes_no_cap_outside_what_a_declaration_can_give() -> None:
    text = source("fetch_lane")
    assert f"caps_int(caps.max_running, 1, {MAX_CAP_RUNNING})" in text
    assert f"caps_int(rate[1], 1, {MAX_RATE_COUNT})" in text
    assert f"caps_int(rate[2], 1, {MAX_DURATION_MS})" in text
    assert re.search(r'string\.sub\(actor, -7\) == ":fanout"', text)
