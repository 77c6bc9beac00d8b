"""The shipped Prometheus rules: promtool checks them and runs their unit tests; every alert is
tested firing and silent, links a runbook section, and every metric named exists."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from hyperagent.catalog import HELP
from hyperagent.devices import metrics as nvml

from conftest import REPO

RULES = REPO / "rules" / "hyperagent.rules.yml"
RUNBOOK = REPO / "rules" / "RUNBOOK.md"
UNIT_TESTS = sorted((REPO / "rules" / "tests").glob("*.test.yml"))
METRICS = {**HELP, **nvml.HELP}
PROMETHEUS_METRICS = {"up", "ALERTS", "ALERTS_FOR_STATE"}
LEVELS = {"node", "node_job_id", "job_id", "cluster"}
"""Recording-rule levels (the labels kept), as the header of hyperagent.rules.yml lists them."""


def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.fail("promtool is not installed: apt-get install -y prometheus (bash .ci/run does)")
    return path


def rules() -> list[dict[str, Any]]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return [rule for group in groups for rule in group["rules"]]


def alerts() -> dict[str, dict[str, Any]]:
    return {rule["alert"]: rule for rule in rules() if "alert" in rule}


def recorded() -> set[str]:
    return {rule["record"] for rule in rules() if "record" in rule}


def unit_test_cases() -> list[dict[str, Any]]:
    return [case for path in UNIT_TESTS for case in yaml.safe_load(path.read_text())["tests"]]


def github_anchor(heading: str) -> str:
    """The fragment GitHub gives a Markdown heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def runbook_anchors(text: str) -> set[str]:
    return {github_anchor(line[3:]) for line in text.splitlines() if line.startswith("## ")}


def test_rules_are_valid() -> None:
    for path in sorted((REPO / "rules").glob("*.rules.yml")):
        result = subprocess.run(
            [promtool(), "check", "rules", str(path)], capture_output=True, text=True, timeout=60
        )
        assert result.returncode == 0, result.stdout + result.stderr
        assert "SUCCESS" in result.stdout


def test_unit_tests_pass() -> None:
    assert UNIT_TESTS
    result = subprocess.run(
        [promtool(), "test", "rules", *map(str, UNIT_TESTS)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_alert_is_tested_firing_and_silent() -> None:
    firing: set[str] = set()
    silent: set[str] = set()
    for case in unit_test_cases():
        for check in case.get("alert_rule_test", []):
            (firing if check.get("exp_alerts") else silent).add(check["alertname"])
    names = set(alerts())
    assert "HighCCR" in names  # the notes' own alert name
    assert names - firing == set(), "alerts without a case where they fire"
    assert names - silent == set(), "alerts without a case where they stay silent"
    assert (firing | silent) - names == set(), "tests of alerts that do not exist"


def test_every_recording_rule_is_tested() -> None:
    tested = " ".join(
        check["expr"] for case in unit_test_cases() for check in case.get("promql_expr_test", [])
    )
    untested = {name for name in recorded() if not re.search(rf"{re.escape(name)}\b", tested)}
    assert untested == set()


def test_recording_rules_are_named_level_metric_operation() -> None:
    for name in recorded():
        level, metric, operation = name.split(":")
        assert level in LEVELS, name
        assert metric.startswith("hyperagent_") and not metric.endswith("_total"), name
        assert re.fullmatch(r"[a-z0-9_]+", operation), name


RUNBOOK_URL = re.compile(
    r"\{\{ with \$externalLabels\.runbook_base \}\}\{\{ \. \}\}\{\{ else \}\}rules\{\{ end \}\}"
    r"/RUNBOOK\.md#(?P<anchor>[a-z0-9-]+)"
)
"""runbook_url: the runbook_base external label (rules/prometheus.yml), else the repo path."""


def test_alerts_say_what_fired_and_link_their_runbook() -> None:
    anchors = runbook_anchors(RUNBOOK.read_text())
    linked = set()
    for name, rule in alerts().items():
        annotations = rule["annotations"]
        assert set(annotations) == {"summary", "description", "runbook_url"}, name
        assert rule["labels"]["severity"] in {"warning", "critical"}, name
        link = RUNBOOK_URL.fullmatch(annotations["runbook_url"])
        assert link is not None, f"{name}: {annotations['runbook_url']}"
        assert link["anchor"] in anchors, f"{name}: {link['anchor']}"
        linked.add(link["anchor"])
    assert anchors - linked == set(), "runbook sections no alert links"


def test_alert_titles_in_the_runbook_name_their_alert() -> None:
    text = RUNBOOK.read_text()
    for name, rule in alerts().items():
        anchor = RUNBOOK_URL.fullmatch(rule["annotations"]["runbook_url"])
        assert anchor is not None
        section = next(
            part
            for part in text.split("\n## ")[1:]
            if github_anchor(part.splitlines()[0]) == anchor["anchor"]
        )
        assert f"`{name}`" in section, f"{name} is not named in its runbook section"


def test_rules_name_only_metrics_that_exist() -> None:
    names = recorded()
    for rule in rules():
        expr = re.sub(r'"[^"]*"', '""', rule["expr"])  # label values are not metric names
        for token in re.findall(r"[a-zA-Z_:][a-zA-Z0-9_:]*", expr):
            if ":" in token:
                assert token in names, f"{token} is no recording rule"
            elif token.startswith("hyperagent_"):
                assert token in METRICS, f"{token} is not a metric hyperagent exposes"


def test_runbook_anchor_is_the_github_one() -> None:
    assert github_anchor("RDMA out-of-buffer drops") == "rdma-out-of-buffer-drops"
    assert github_anchor("High CCR") == "high-ccr"


def test_memory_pressure_alert_never_reads_nvml_s_estimate() -> None:
    expr = alerts()["HyperagentHighMemoryPressure"]["expr"]
    selectors = re.findall(r"hyperagent_memory_pressure_ratio(\{[^}]*\})?", expr)
    assert selectors == ['{method="reported"}']
    assert "hyperagent_gpu_memory_used_bytes" not in expr


def test_shipped_prometheus_config_is_valid(tmp_path: Path) -> None:
    text = (REPO / "rules" / "prometheus.yml").read_text()
    text = text.replace("/etc/prometheus/rules/", f"{REPO / 'rules'}/").replace(
        "/etc/prometheus/targets/", f"{REPO / 'rules' / 'targets'}/"
    )
    config = tmp_path / "prometheus.yml"
    config.write_text(text)
    result = subprocess.run(
        [promtool(), "check", "config", str(config)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout + result.stderr
