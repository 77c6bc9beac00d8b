"""The shipped Prometheus rules: promtool checks them and runs their unit tests."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from conftest import REPO


def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.fail("promtool is not installed: apt-get install -y prometheus (bash .ci/run does)")
    return path


def test_rules_are_valid() -> None:
    for rules in sorted((REPO / "rules").glob("*.rules.yml")):
        result = subprocess.run(
            [promtool(), "check", "rules", str(rules)], capture_output=True, text=True, timeout=60
        )
        assert result.returncode == 0, result.stdout + result.stderr


def test_every_alert_fires_and_stays_silent_as_tested() -> None:
    tests = sorted((REPO / "rules" / "tests").glob("*.test.yml"))
    assert tests
    result = subprocess.run(
        [promtool(), "test", "rules", *map(str, tests)], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stdout + result.stderr
    rules = (REPO / "rules" / "hyperagent.rules.yml").read_text()
    alerts = {
        line.split(":", 1)[1].strip()
        for line in rules.splitlines()
        if line.strip().startswith("- alert:")
    }
    tested = "".join(t.read_text() for t in tests)
    for alert in alerts:
        assert f"alertname: {alert}\n" in tested, f"{alert} has no promtool test"


def test_shipped_prometheus_config_is_valid(tmp_path) -> None:  # type: ignore[no-untyped-def]
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
