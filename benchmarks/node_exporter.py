"""The agent beside Debian's ``prometheus-node-exporter``, in one run on one machine.

    python benchmarks/node_exporter.py [--seconds 60] [--warmup 5] [--json FILE]

Both run at once and are scraped once a second with Prometheus's Accept header: node_exporter
with its defaults (``--web.listen-address`` on a free loopback port, nothing else), and the
agent as ``benchmarks/run.py`` measures it (``workers.py agent``: ``Agent.run`` on the
full-node replay ``fixtures/replay/full-node`` with the shipped config's schedule, collecting
once a second, publishing to a mosquitto broker, a job socket fed by 8 simulated ranks).

CPU is user + system time of each whole process over the same window after the warm-up: the
agent's from ``getrusage`` in its process, node_exporter's from ``/proc/PID/stat``. The figure
is ``agent_vs_node_exporter``: the agent's CPU per second over node_exporter's CPU per scrape
(both scraped once a second, so both per second); at most 1 is the target. Needs
``apt-get install -y prometheus-node-exporter mosquitto``. Exits non-zero, saying what, when
the agent collected nothing or either answered no scrape in the window.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]

from mqttsim import Mosquitto, free_port, process_cpu_seconds  # noqa: E402
from run import BROKER_OPTIONS, CAPTURE, PROMETHEUS_ACCEPT, JobReports, worker  # noqa: E402

NODE_EXPORTER = ("prometheus-node-exporter", "node_exporter")


class EverySecond:
    """GETs each of ``urls`` once a second (Prometheus's Accept header), counting scrapes."""

    def __init__(self, urls: dict[str, str]) -> None:
        self.urls = urls
        self.scrapes = dict.fromkeys(urls, 0)
        self.bytes = dict.fromkeys(urls, 0)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            for name, url in self.urls.items():
                request = urllib.request.Request(url, headers={"Accept": PROMETHEUS_ACCEPT})
                with urllib.request.urlopen(request, timeout=10) as response:
                    self.bytes[name] = len(response.read())
                self.scrapes[name] += 1
            if self._stop.wait(1.0):
                return

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=15)


def _wait_serving(url: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                response.read()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def measure(seconds: float, warmup: float, work: Path) -> dict[str, Any]:
    """Both processes side by side; their CPU over the same window, and the ratio."""
    binary = next((found for name in NODE_EXPORTER if (found := shutil.which(name))), None)
    if binary is None:
        raise SystemExit(
            "prometheus-node-exporter is not installed: apt-get install -y prometheus-node-exporter"
        )
    port = free_port()
    exporter = subprocess.Popen(
        [binary, f"--web.listen-address=127.0.0.1:{port}"],
        stdout=subprocess.DEVNULL,
        stderr=(work / "node_exporter.log").open("wb"),
    )
    extra = "".join(f"{line}\n" for line in BROKER_OPTIONS)
    try:
        with Mosquitto(work, extra=extra) as broker:
            state = work / "agent"
            state.mkdir()
            args = ["agent", "--capture", str(CAPTURE), "--hz", "1", "--seconds", str(seconds)]
            args += ["--warmup", str(warmup), "--state", str(state)]
            args += ["--job-socket", str(state / "job.sock"), "--node", "bench-node-exporter"]
            args += ["--broker", broker.url, "--metrics-port", str(free_port())]
            with worker(*args) as agent:
                ready = agent.wait_for("READY", 120)
                exporter_url = f"http://127.0.0.1:{port}/metrics"
                _wait_serving(exporter_url, 30)
                reports = JobReports(state / "job.sock")
                scraper = EverySecond(
                    {
                        "agent": f"http://127.0.0.1:{ready['metrics_port']}/metrics",
                        "node_exporter": exporter_url,
                    }
                )
                try:
                    time.sleep(warmup)
                    cpu0, scrapes0 = process_cpu_seconds(exporter.pid), scraper.scrapes.copy()
                    wall0 = time.perf_counter()
                    result = agent.wait_for("RESULT", seconds + warmup + 120)
                    wall = time.perf_counter() - wall0
                    exporter_cpu = process_cpu_seconds(exporter.pid) - cpu0
                    scrapes = {k: v - scrapes0[k] for k, v in scraper.scrapes.items()}
                finally:
                    scraper.close()
                    reports.close()
    finally:
        exporter.terminate()
        exporter.wait(timeout=10)
    agent_ms_per_s = 1000 * result["cpu_s"] / result["wall_s"]
    exporter_ms_per_scrape = 1000 * exporter_cpu / max(1, scrapes["node_exporter"])
    nothing = [
        what
        for ok, what in (
            (result["cycles"] > 0, "the agent ran no collection cycle in the window"),
            (scrapes["agent"] > 0 and scraper.bytes["agent"] > 0, "the agent answered no scrape"),
            (
                scrapes["node_exporter"] > 0 and scraper.bytes["node_exporter"] > 0,
                "node_exporter answered no scrape",
            ),
            (exporter_cpu > 0, "no CPU time of node_exporter measured"),
        )
        if not ok
    ]
    if nothing:
        raise SystemExit(f"FAILED: the work did not happen: {'; '.join(nothing)}")
    return {
        "seconds": seconds,
        "agent": {
            "cpu_ms_per_s": agent_ms_per_s,
            "cpu_percent": result["cpu_percent"],
            "cycles": result["cycles"],
            "scrapes": scrapes["agent"],
            "scrape_bytes": scraper.bytes["agent"],
            "peak_rss_mib": result["peak_rss_mib"],
        },
        "node_exporter": {
            "binary": binary,
            "cpu_ms_per_scrape": exporter_ms_per_scrape,
            "cpu_percent": 100 * exporter_cpu / wall,
            "scrapes": scrapes["node_exporter"],
            "scrape_bytes": scraper.bytes["node_exporter"],
        },
        "agent_vs_node_exporter": agent_ms_per_s / exporter_ms_per_scrape,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--warmup", type=float, default=5.0)
    parser.add_argument("--json", type=Path, help="write the figures to this file")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="hyperagent-node-exporter-") as tmp:
        figures = measure(args.seconds, args.warmup, Path(tmp))
    agent, exporter = figures["agent"], figures["node_exporter"]
    print(
        f"agent 1 Hz, scraped 1/s: {agent['cpu_ms_per_s']:.2f} ms CPU per second"
        f" ({agent['cpu_percent']:.2f}% of a core, {agent['scrapes']} scrapes of"
        f" {agent['scrape_bytes'] // 1024} KiB)\n"
        f"node_exporter, scraped 1/s: {exporter['cpu_ms_per_scrape']:.2f} ms CPU per scrape"
        f" ({exporter['cpu_percent']:.2f}% of a core, {exporter['scrapes']} scrapes of"
        f" {exporter['scrape_bytes'] // 1024} KiB)\n"
        f"agent / node_exporter: {figures['agent_vs_node_exporter']:.2f}x",
        flush=True,
    )
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
