"""README's first command, shortened: the demo on its embedded broker runs to the end; with a
kept state directory and the coordinator's /metrics served, its journal, /metrics and summary
say the tuning's cost."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from demo_cli import check_cost, run_demo_command

from hyperagent import cli


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


@pytest.mark.long(12)
def test_demo_keeps_its_journal_and_serves_the_cost(tmp_path: Path) -> None:
    state_dir = tmp_path / "state"
    picture = tmp_path / "tuning.png"
    args = ["--nodes", "1", "--trials", "3", "--state-dir", str(state_dir)]
    args += ["--report", str(picture)]
    run = run_demo_command(args, timeout_s=180)
    assert run.returncode == 0, run.out
    check_cost(run, state_dir, "demo-job", tmp_path)
    assert (state_dir / "node-0" / "applied-settings.json").is_file()  # the agent's state too
    assert picture.stat().st_size > 0


def one_line_error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    assert cli.main(["demo", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


@pytest.mark.parametrize("workload", ["simulated", "torch-ddp"])
def test_demo_says_what_is_wrong_with_its_state_dir_and_metrics_port(
    workload: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    job = "demo-job" if workload == "simulated" else "torch-ddp"
    given = ["--workload", workload]
    assert one_line_error([*given, "--metrics-port", "70000"], capsys) == (
        "--metrics-port: must be between 0 and 65535"
    )
    assert one_line_error([*given, "--linger", "5"], capsys) == (
        "--linger: keeps /metrics served: give --metrics-port"
    )
    (tmp_path / "file").write_text("")
    error = one_line_error([*given, "--state-dir", str(tmp_path / "file" / "state")], capsys)
    assert error.startswith(f"--state-dir: cannot write {tmp_path / 'file' / 'state'}: ")
    journal = tmp_path / "kept" / "coordinator" / f"{job}.jsonl"
    journal.parent.mkdir(parents=True)
    journal.write_text("")
    assert one_line_error([*given, "--state-dir", str(tmp_path / "kept")], capsys) == (
        f"--state-dir: {journal} holds an earlier tuning: give a new or empty directory"
    )
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        error = one_line_error([*given, "--metrics-port", str(port)], capsys)
    assert error.startswith(f"--metrics-port: 127.0.0.1:{port}: "), error
