"""The shipped units: `systemd-analyze verify` silent, `security` exposure within budget."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO

BUDGET = {"hyperagent-agent.service": 4.5, "hyperagent-coordinator.service": 2.5}


def systemd_analyze() -> str:
    path = shutil.which("systemd-analyze")
    if path is None:
        pytest.fail("systemd-analyze is not installed: apt-get install -y systemd")
    return path


def installed_copy(unit: str, tmp_path: Path) -> Path:
    """The unit as installed, with ExecStart pointing at this checkout's hyperagent."""
    executable = Path(sys.executable).with_name("hyperagent")
    assert executable.exists(), "install the package first (pip install -e .)"
    text = (
        (REPO / "systemd" / unit).read_text().replace("/usr/local/bin/hyperagent", str(executable))
    )
    path = tmp_path / unit
    path.write_text(text)
    return path


@pytest.mark.parametrize("unit", sorted(BUDGET))
def test_unit_verifies_cleanly(unit: str, tmp_path: Path) -> None:
    result = subprocess.run(
        [systemd_analyze(), "verify", str(installed_copy(unit, tmp_path))],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0 and not result.stdout and not result.stderr, (
        result.stdout + result.stderr
    )


@pytest.mark.parametrize("unit", sorted(BUDGET))
def test_unit_exposure_within_budget(unit: str, tmp_path: Path) -> None:
    result = subprocess.run(
        [systemd_analyze(), "security", "--offline=true", str(installed_copy(unit, tmp_path))],
        capture_output=True,
        text=True,
        timeout=60,
    )
    match = re.search(r"Overall exposure level for \S+: (\d+\.\d+)", result.stdout)
    assert match, result.stdout + result.stderr
    assert float(match.group(1)) <= BUDGET[unit]


def test_units_are_notify_services_with_a_watchdog() -> None:
    for unit in BUDGET:
        text = (REPO / "systemd" / unit).read_text()
        assert "Type=notify" in text and re.search(r"^WatchdogSec=\d+s$", text, re.M)
        assert "Restart=on-failure" in text and "/etc/hyperagent/hyperagent.toml" in text
