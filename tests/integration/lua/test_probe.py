"""The start-up permission check (``probe``): it runs each command on its own probe key under
both prefixes and deletes them after. With every command allowed, the reply is empty and no
key is left. A command without a probe is named (so the probe table must cover every command
kumiko's scripts run: the first row keeps it complete)."""

from __future__ import annotations

import pytest

from kumiko_dramatiq.broker import acl
from tests.integration.lua.tables import (
    PROBE_DRAMATIQ,
    PROBE_KUMIKO,
    Env,
    text,
)


@pytest.mark.parametrize(
    ("commands", "reply"),
    [
        pytest.param(acl.commands(), [], id="every-command-of-the-rule-set-has-a-probe"),
        pytest.param(["zadd", "flushall"], ["unknown", "flushall", ""], id="no-probe-named"),
        pytest.param([], [], id="nothing-to-probe"),
    ],
)
def test_probe(env: Env, commands: list[str], reply: list[str]) -> None:
    samples = "\n".join([env.key(PROBE_DRAMATIQ), env.key(PROBE_KUMIKO)])
    result = env.lua.probe(keys=[], args=[samples, *commands])

    assert text(result) == reply
    env.assert_state({})
