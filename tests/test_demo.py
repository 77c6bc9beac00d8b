"""README's first command, shortened: the demo on its embedded broker runs to the end."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path


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
    gain = re.search(
        r"gain over the starting settings: [+-]\d+\.\d% measured"
        r" \(([+-]\d+\.\d)% on the noiseless model\)",
        out,
    )
    assert gain, out
    # whatever the noise made of the measured gain, the settings picked are never worse than
    # the starting ones on the simulated job itself
    assert float(gain.group(1)) >= 0.0, out
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
