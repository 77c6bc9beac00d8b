"""README's first command, shortened: the demo on its embedded broker runs to the end."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.long(19)
def test_demo_prints_best_settings_and_gain(tmp_path: Path) -> None:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "hyperagent.cli",
            "demo",
            "--nodes",
            "2",
            "--trials",
            "5",
            "--report",
            str(tmp_path / "tuning.html"),
        ],
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, "COLUMNS": "200"},
    )
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert "embedded MQTT broker on mqtt://127.0.0.1:" in out
    assert re.search(r"best settings: +bucket \d+ MiB, chunk \d+ KiB, \w+, cap \d+ W", out)
    # a gain is printed only when confirmed: its interval, from interleaved re-measurements,
    # lies above zero; otherwise the output says that no setting was better
    gain = re.search(
        r"gain over the starting settings: \+(\d+\.\d)% \(95% interval \+(\d+\.\d)% \.\. "
        r"\+(\d+\.\d)%\)",
        out,
    )
    no_better = "no setting was better than the starting settings" in out
    assert (gain is not None) != no_better, out
    if gain is not None:
        low, value, high = float(gain[2]), float(gain[1]), float(gain[3])
        assert 0 < low <= value <= high
    # progress counts the trials of the budget, and the confirmations as such
    counts = [(int(a), int(b)) for a, b in re.findall(r"^ *(\d+)/(\d+) +v\d+", out, re.M)]
    assert [a for a, _ in counts] == list(range(1, len(counts) + 1))
    assert all(b == 5 and a <= 5 for a, b in counts)
    confirmations = re.findall(r"^confirm (\d)/4 +v\d+", out, re.M)
    assert confirmations in ([], ["1", "2", "3", "4"])
    assert f"a picture of the tuning: {tmp_path / 'tuning.html'}" in out.replace("\n", "")
    page = (tmp_path / "tuning.html").read_text()
    assert "data:image/png;base64," in page and "<table" in page


def test_demo_rejects_bad_arguments() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "hyperagent.cli", "demo", "--nodes", "0"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2 and "--nodes" in result.stderr
