"""Every capture directory in fixtures/replay replays into the /metrics its golden file holds,
and promtool accepts it."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
from prometheus_client import generate_latest

from hyperagent.capture.directory import capture_sources
from hyperagent.config import build_config
from hyperagent.exporter import MetricsServer
from hyperagent.sources.runner import SourceRunner

from conftest import FIXTURES, ManualClock

DIRECTORIES = sorted(p for p in (FIXTURES / "replay").iterdir() if p.is_dir())
GOLDEN = Path(__file__).parent / "golden" / "replay"


async def exposition(directory: Path) -> bytes:
    clock = ManualClock()
    sources, _ = capture_sources(directory, build_config({}), clock)
    runner = SourceRunner(sources, timeout_s=10)
    await runner.start()
    clock.now = 10.0
    by_source = await runner.read_by_source()
    await runner.close()
    assert set(by_source) == {s.name for s in sources}, "a source failed on its capture"
    server = MetricsServer("127.0.0.1:0")
    server.collector.update([r for batch in by_source.values() for r in batch])
    return generate_latest(server.registry)


@pytest.mark.parametrize("directory", DIRECTORIES, ids=lambda p: p.name)
async def test_capture_directory_matches_golden(directory: Path) -> None:
    text = await exposition(directory)
    golden = GOLDEN / f"{directory.name}.prom"
    if os.environ.get("HYPERAGENT_UPDATE_GOLDEN"):
        golden.parent.mkdir(parents=True, exist_ok=True)
        golden.write_bytes(text)
    assert text.decode() == golden.read_text(), "rerun with HYPERAGENT_UPDATE_GOLDEN=1 to accept"
    promtool = shutil.which("promtool")
    assert promtool, "promtool is not installed: apt-get install -y prometheus"
    check = subprocess.run(
        [promtool, "check", "metrics"], input=text, capture_output=True, timeout=30
    )
    assert check.returncode == 0 and not check.stdout and not check.stderr, check
