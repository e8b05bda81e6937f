"""The monitoring examples (Prometheus alerts, scrape config, Grafana dashboard) use only
metrics kumiko exports."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import yaml

from kumiko_dramatiq.middleware.metrics import exported_names

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "monitoring"
METRIC = re.compile(r"\bkumiko_[a-z_]+\b")


def alert_rules() -> list[dict[str, Any]]:
    document = yaml.safe_load((EXAMPLES / "kumiko-alerts.yml").read_text(encoding="utf-8"))
    return [rule for group in document["groups"] for rule in group["rules"]]


def dashboard_exprs() -> list[str]:
    dashboard = json.loads((EXAMPLES / "kumiko-dashboard.json").read_text(encoding="utf-8"))
    return [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]


def test_every_metric_an_alert_uses_is_exported() -> None:
    used = {name for rule in alert_rules() for name in METRIC.findall(rule["expr"])}
    assert used
    assert used - exported_names() == set()


def test_every_metric_the_dashboard_uses_is_exported() -> None:
    used = {name for expr in dashboard_exprs() for name in METRIC.findall(expr)}
    assert used
    assert used - exported_names() == set()


def test_the_alerts_cover_dead_letters_cron_lag_queue_growth_and_no_live_worker() -> None:
    rules = {rule["alert"]: rule for rule in alert_rules()}
    assert {
        "KumikoDeadLettersRising",
        "KumikoCronLag",
        "KumikoQueueGrowing",
        "KumikoNoLiveWorker",
    } <= set(rules)
    for rule in rules.values():
        assert rule["labels"]["severity"] in {"warning", "critical"}
        assert rule["annotations"]["summary"]


def test_the_scrape_config_loads_the_alerts() -> None:
    config = yaml.safe_load((EXAMPLES / "prometheus.yml").read_text(encoding="utf-8"))
    assert config["rule_files"] == ["kumiko-alerts.yml"]
    assert {job["job_name"] for job in config["scrape_configs"]} == {
        "kumiko-workers",
        "kumiko-scheduler",
    }
