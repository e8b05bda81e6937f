"""The pure parts of metrics and tracing: outcomes, counts, directories, the trace option."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from kumiko_dramatiq import JobConfigError
from kumiko_dramatiq.codec import TRACE, KumikoOptions, OptionsError, TraceContext, encode_trace
from kumiko_dramatiq.environment import resolve_settings
from kumiko_dramatiq.middleware.metrics import SPECS, dedup_outcome, exported_names
from kumiko_dramatiq.ops.exposition import (
    choose_directory,
    group_id,
    lane_counts,
    pid_of,
    remove_stale_groups,
)
from kumiko_dramatiq.settings import UNSET

BASE = {"kumiko_retries": 0, "kumiko_trigger": "manual"}


# -- metrics ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("enqueued", "returned", "outcome"),
    [(True, "own", "enqueued"), (False, "own", "follow_up"), (False, "other", "deduplicated")],
)
def test_a_dedup_dispatch_outcome_follows_the_scripts_reply(
    enqueued: bool, returned: str, outcome: str
) -> None:
    assert dedup_outcome(enqueued=enqueued, returned_id=returned, own_id="own") == outcome


def test_running_messages_are_those_stored_and_neither_waiting_nor_parked() -> None:
    counts = lane_counts(listed=3, suspects=1, stored=10, delayed=2, parked=2, dead=5)
    assert counts == {"queued": 4, "delayed": 2, "running": 4, "parked": 2, "dead": 5}


def test_running_never_goes_below_zero() -> None:
    assert lane_counts(listed=3, suspects=0, stored=2, delayed=0, parked=0, dead=0)["running"] == 0


def test_every_metric_is_namespaced_and_histograms_export_their_samples() -> None:
    names = exported_names()
    assert all(name.startswith("kumiko_") for name in names)
    assert {
        "kumiko_runs_total",
        "kumiko_run_duration_seconds_bucket",
        "kumiko_run_duration_seconds_sum",
        "kumiko_run_duration_seconds_count",
        "kumiko_queue_messages",
        "kumiko_cron_lag_seconds",
    } <= names
    assert len({spec.name for spec in SPECS}) == len(SPECS)


def test_no_metric_has_a_tenant_label() -> None:
    assert all("tenant" not in label for spec in SPECS for label in spec.labels)


@pytest.mark.parametrize(
    ("port", "ok"), [(None, True), (1, True), (65535, True), (0, False), (65536, False),
                     (True, False), ("9191", False), (9191.0, False)]
)  # fmt: skip
def test_the_metrics_port_is_a_port_number_or_none(port: Any, ok: bool) -> None:
    if ok:
        assert resolve_settings({"metrics_port": port}, environ={}).metrics_port == port
    else:
        with pytest.raises(JobConfigError, match="metrics_port must be a port number"):
            resolve_settings({"metrics_port": port}, environ={})


def test_the_metrics_port_comes_from_its_variable() -> None:
    settings = resolve_settings({"metrics_port": UNSET}, environ={"KUMIKO_METRICS_PORT": "9191"})
    assert settings.metrics_port == 9191
    with pytest.raises(JobConfigError, match="KUMIKO_METRICS_PORT must be an integer"):
        resolve_settings({}, environ={"KUMIKO_METRICS_PORT": "nine"})


# -- the multiprocess directory --------------------------------------------------------------
def test_a_directory_the_application_set_is_used_as_it_is(tmp_path: Path) -> None:
    root = tmp_path / "kumiko_dramatiq-metrics-0"
    assert choose_directory("/srv/metrics", root, "g1") == (Path("/srv/metrics"), False)


def test_a_directory_inherited_from_another_kumiko_group_is_replaced(tmp_path: Path) -> None:
    root = tmp_path / "kumiko_dramatiq-metrics-0"
    assert choose_directory(str(root / "g0"), root, "g1") == (root / "g1", True)
    assert choose_directory("", root, "g1") == (root / "g1", True)


def test_a_group_is_named_after_the_authkey_its_processes_share() -> None:
    assert group_id(b"a" * 32) == group_id(b"a" * 32) != group_id(b"b" * 32)
    assert len(group_id()) == 16


def test_pids_are_read_from_prometheus_client_file_names() -> None:
    assert pid_of("counter_123.db") == 123
    assert pid_of("gauge_livesum_77.db") == 77
    assert pid_of("port-9191.pid") is None


def test_only_directories_of_dead_groups_older_than_a_minute_are_removed(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)  # fmt: skip
    dead_pid = int(done.stdout)
    ours, dead, alive, young = (tmp_path / name for name in ("ours", "dead", "alive", "young"))
    for directory, pid in ((ours, dead_pid), (dead, dead_pid), (alive, 1), (young, dead_pid)):
        directory.mkdir()
        (directory / f"counter_{pid}.db").write_bytes(b"")
    later = time.time() + 120
    young_time = later - 10
    os.utime(young, (young_time, young_time))
    removed = remove_stale_groups(tmp_path, ours, now=later)
    assert removed == [dead]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["alive", "ours", "young"]


# -- the trace option ------------------------------------------------------------------------
def test_a_trace_context_round_trips_through_the_options() -> None:
    options = {**BASE, **encode_trace({"traceparent": "00-ab-cd-01"}, {"traceparent": "x"})}
    decoded = KumikoOptions.decode(options)
    assert decoded.trace == TraceContext({"traceparent": "00-ab-cd-01"}, {"traceparent": "x"})
    assert decoded.encode()[TRACE] == options[TRACE]


def test_no_carrier_writes_no_trace_key() -> None:
    assert encode_trace(None, None) == {}
    assert encode_trace({}, None) == {}
    assert KumikoOptions.decode(BASE).trace is None


@pytest.mark.parametrize(
    "trace",
    [
        "00-ab-cd-01",
        {},
        {"parent": {"traceparent": "x"}, "other": {}},
        {"parent": {}},
        {"parent": {"traceparent": 1}},
        {"parent": {"": "x"}},
        {"link": ["traceparent", "x"]},
        {"parent": {f"k{n}": "v" for n in range(17)}},
        {"parent": {"baggage": "x" * 8193}},
    ],
)
def test_a_trace_option_kumiko_would_not_write_does_not_decode(trace: object) -> None:
    with pytest.raises(OptionsError, match=TRACE):
        KumikoOptions.decode({**BASE, TRACE: trace})
