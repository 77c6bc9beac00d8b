"""``hyperagent demo`` run as a user runs it, with a kept state directory and the coordinator's
/metrics served (scraped while the tuning runs and while the demo lingers after it), and the
checks that its journal, its /metrics, its summary and ``hyperagent report`` agree on the
tuning's cost."""

from __future__ import annotations

import json
import math
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from hyperagent import cli
from hyperagent.tuner.cost import Cost

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]

LINGER = "serving the coordinator's /metrics on "


def scrape(url: str) -> Samples:
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


@dataclass
class DemoRun:
    """What one ``hyperagent demo ... --metrics-port 0 --linger`` showed."""

    out: str
    """Its stdout and stderr, up to its exit."""
    returncode: int
    url: str
    """The /metrics URL it printed at the start."""
    during: list[Samples] = field(default_factory=list)
    """Scrapes taken while the round ran (``hyperagent_tuner_done`` 0) with a cost in them."""
    after: Samples = field(default_factory=dict)
    """The scrape taken while it lingered after the tuning."""


def run_demo_command(args: list[str], timeout_s: float) -> DemoRun:
    """Run ``hyperagent demo ARGS --metrics-port 0 --linger 300``, scraping /metrics every
    0.1 s while it tunes and once while it lingers, then end it with SIGTERM."""
    command = [sys.executable, "-m", "hyperagent.cli", "demo", *args]
    command += ["--metrics-port", "0", "--linger", "300"]
    process = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "COLUMNS": "300"},
    )
    assert process.stdout is not None
    lines: queue.Queue[str | None] = queue.Queue()

    def read() -> None:
        assert process.stdout is not None
        for line in process.stdout:
            lines.put(line)
        lines.put(None)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    out: list[str] = []
    url: str | None = None
    during: list[Samples] = []
    after: Samples | None = None
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            try:
                line = lines.get(timeout=0.1)
            except queue.Empty:
                line = ""
            if line is None:
                break
            out.append(line)
            found = re.search(r"coordinator's /metrics: (http://127\.0\.0\.1:\d+/metrics)", line)
            if found is not None:
                url = found[1]
            if line.startswith(LINGER):
                assert url is not None and url in line, "".join(out)
                after = scrape(url)
                process.send_signal(signal.SIGTERM)
            elif url is not None and after is None:
                samples = scrape(url)
                names = {name for name, _ in samples}
                running = 0 in (v for k, v in samples.items() if k[0] == "hyperagent_tuner_done")
                if running and "hyperagent_tuner_tuning_seconds" in names:
                    during.append(samples)
        else:
            pytest.fail(f"the demo did not end within {timeout_s:.0f} s:\n{''.join(out)}")
        returncode = process.wait(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    reader.join(timeout=10)
    assert url is not None and after is not None, "".join(out)
    return DemoRun("".join(out), returncode, url, during, after)


def value(samples: Samples, name: str, **labels: str) -> float | None:
    return samples.get((name, frozenset(labels.items())))


def final_entry(journal: Path) -> dict[str, Any]:
    entries = [json.loads(line) for line in journal.read_text().splitlines()]
    finals = [e for e in entries if e["type"] == "final"]
    assert len(finals) == 1, finals
    return finals[0]


def check_cost(run: DemoRun, state_dir: Path, job: str, tmp_path: Path) -> dict[str, Any]:
    """The kept journal's ``final`` entry has the round's cost, with the break-even the
    documented way; /metrics said the same figures (during the round a cost already, after it
    exactly the journal's); the summary and ``hyperagent report`` of the journal say them in
    words. Returns the journal's cost."""
    journal = state_dir / "coordinator" / f"{job}.jsonl"
    assert f"the tuning's journal: {journal}" in run.out, run.out
    final = final_entry(journal)
    cost = final["cost"]
    assert cost["seconds"] > 0
    assert math.isfinite(cost["samples_lost"]) and math.isfinite(cost["samples_lost_ratio"])
    lost, even = cost["samples_lost"], cost["break_even_s"]
    if lost <= 0:
        assert even == 0  # nothing lost: nothing to win back
    elif final["score"] > final["baseline"]:
        assert even == pytest.approx(lost / (final["score"] - final["baseline"]), rel=1e-9)
    else:
        assert even is None  # lost, and the chosen settings are the start: never

    labels = {"job_id": job, "objective": "throughput"}
    assert run.during, "no scrape while the round ran had its cost"
    assert value(run.during[-1], "hyperagent_tuner_tuning_seconds", **labels) > 0
    assert value(run.after, "hyperagent_tuner_done", job_id=job) == 1
    for metric, key in (
        ("hyperagent_tuner_tuning_seconds", "seconds"),
        ("hyperagent_tuner_samples_lost", "samples_lost"),
        ("hyperagent_tuner_samples_lost_ratio", "samples_lost_ratio"),
    ):
        assert value(run.after, metric, **labels) == pytest.approx(cost[key], rel=1e-12), metric
    served = value(run.after, "hyperagent_tuner_break_even_seconds", **labels)
    if even is None:
        assert served is None
    else:
        assert served == pytest.approx(even, rel=1e-12, abs=1e-12)

    words = Cost(
        "throughput",
        cost["seconds"],
        final["baseline"],
        final["score"],
        lost,
        cost["samples_lost_ratio"],
        even,
    ).describe()
    assert f"\ncost: {words}\n" in run.out, run.out
    picture = tmp_path / "report.html"
    assert cli.main(["report", str(journal), "--out", str(picture)]) == 0
    title = re.search(r"<h1>(.*)</h1>", picture.read_text(), re.S)
    assert title is not None and f"cost: {words}" in title[1], title
    return dict(cost)
