"""Job churn against one agent: a job restarted again and again, each time under a new job id
(as a scheduler gives every submission its own id), on a replayed node with the job channel on.

The agent runs as its own process (``hyperagent agent --replay DIR --no-broker``, serving
/metrics on 127.0.0.1). Each generation starts ``--ranks`` ranks of a new job id, which say
hello and report ``--steps`` steps each (with their allocator's retry and OOM counts), then
closes them (the job is killed) and waits ``--gap-s``. Printed per generation: whether the new
job was accepted (its steps reached /metrics) or refused, the series /metrics serves, how many
of them carry a ``job_id`` (and how many job ids), and the agent's resident memory; the idle
node's row is taken once its series stopped changing. After the last generation no job
arrives: the agent is watched for ``--release-after-s`` and a little more, and the series count
is printed against the idle node's (before the first job). The exit status is 0 when every new
job was accepted and the series came back to the idle node's.

Runs against whatever ``hyperagent`` is importable (the agent process inherits
``PYTHONPATH``), so the figures before and after a change come from the same script::

    python benchmarks/churn.py [--generations 40] [--ranks 4] [--release-after-s 5]
    git archive OLD | tar -x -C /tmp/old && PYTHONPATH=/tmp/old python benchmarks/churn.py

Everything is bounded: the agent is stopped when the run ends, and the run gives up after
``--bound-s`` whatever happened.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

from hyperagent.job import JobReporter, MemoryReport

REPO = Path(__file__).resolve().parents[1]
CAPTURE = REPO / "fixtures" / "replay" / "h200-bf16-matmul"
JOB_LABEL = re.compile(r'job_id="([^"]*)"')


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _until(predicate: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} within {timeout_s} s")
        time.sleep(0.02)


class Node:
    """The agent process and what its /metrics and /proc say."""

    def __init__(self, workdir: Path, release_after_s: float, interval_s: float) -> None:
        self.port = _free_port()
        self.socket_path = workdir / "job.sock"
        config = workdir / "agent.toml"
        config.write_text(
            f'[agent]\nmetrics_address = "127.0.0.1:{self.port}"\nstate_dir = "{workdir}"\n'
            f"interval_s = {interval_s}\n"
            f'[sources.job]\nsocket = "{self.socket_path}"\nrelease_after_s = {release_after_s}\n'
        )
        self.log = (workdir / "agent.log").open("wb")
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-c",
                "import sys; from hyperagent.cli import main; sys.exit(main())",
                "agent",
                "--config",
                str(config),
                "--replay",
                str(CAPTURE),
                "--no-broker",
                "--node",
                "churn",
            ],
            stdout=subprocess.DEVNULL,
            stderr=self.log,
        )
        _until(self._serving, 30, "the agent serving /metrics")

    def _serving(self) -> bool:
        if self.process.poll() is not None:
            raise RuntimeError(f"the agent exited ({self.process.returncode})")
        try:
            self.metrics()
        except OSError:
            return False
        return self.socket_path.is_socket()

    def metrics(self) -> list[str]:
        """The series /metrics serves (one line each)."""
        url = f"http://127.0.0.1:{self.port}/metrics"
        with urllib.request.urlopen(url, timeout=5) as response:
            text = response.read().decode()
        return [line for line in text.splitlines() if line and not line.startswith("#")]

    def rss_mib(self) -> float:
        for line in Path(f"/proc/{self.process.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        raise RuntimeError("no VmRSS")

    def steps(self, job: str) -> float:
        prefix = f'hyperagent_job_steps_total{{job_id="{job}"}} '
        return next((float(s[len(prefix) :]) for s in self.metrics() if s.startswith(prefix)), 0)

    def stop(self) -> None:
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.log.close()


def _warm_up(node: Node, steady_s: float = 2.0, bound_s: float = 30.0) -> None:
    """Wait until the idle node's series stop changing for ``steady_s`` (rates and ratios
    appear once the replay has two collections to compare)."""
    deadline = time.monotonic() + bound_s
    series, since = len(node.metrics()), time.monotonic()
    while time.monotonic() - since < steady_s and time.monotonic() < deadline:
        time.sleep(0.1)
        now = len(node.metrics())
        if now != series:
            series, since = now, time.monotonic()


def _row(node: Node, label: str, outcome: str) -> tuple[int, int]:
    series = node.metrics()
    jobs = {m.group(1) for s in series if (m := JOB_LABEL.search(s))}
    with_job = sum(1 for s in series if JOB_LABEL.search(s))
    print(
        f"{label:>10} {outcome:>9} {len(series):>7} {with_job:>9} {len(jobs):>5} "
        f"{node.rss_mib():>8.1f}",
        flush=True,
    )
    return len(series), with_job


def _generation(node: Node, job: str, ranks: int, steps: int) -> str:
    reporters = [JobReporter(job, rank=r, socket_path=node.socket_path) for r in range(ranks)]
    memory = MemoryReport(2**30, 2**31, alloc_retries=1, ooms=0)
    for _ in range(steps):
        for reporter in reporters:
            reporter.report_step(
                samples=8, step_s=0.01, compute_s=0.008, comm_s=0.002, memory=memory
            )
        time.sleep(0.01)
    try:
        _until(
            lambda: (
                node.steps(job) >= ranks * steps
                or any(r.poll_settings() is None and r.refused for r in reporters)
            ),
            5,
            f"{job}'s steps on /metrics",
        )
        outcome = "refused" if node.steps(job) < ranks * steps else "accepted"
    except TimeoutError:
        outcome = "lost"
    for reporter in reporters:
        reporter.close()
    return outcome


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--generations", type=int, default=40)
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--steps", type=int, default=5, help="steps per rank per generation")
    parser.add_argument("--gap-s", type=float, default=0.3, help="between generations")
    parser.add_argument("--release-after-s", type=float, default=5.0)
    parser.add_argument("--interval-s", type=float, default=0.2, help="agent collections")
    parser.add_argument("--bound-s", type=float, default=300.0, help="give up after this")
    args = parser.parse_args()
    signal.signal(signal.SIGALRM, lambda *_: sys.exit("churn: --bound-s reached"))
    signal.alarm(max(1, int(args.bound_s)))

    with tempfile.TemporaryDirectory(prefix="hyperagent-churn-") as workdir:
        node = Node(Path(workdir), args.release_after_s, args.interval_s)
        try:
            _warm_up(node)
            print(
                f"{'':>10} {'new job':>9} {'series':>7} {'job series':>9} {'jobs':>5} "
                f"{'RSS MiB':>8}"
            )
            idle, _ = _row(node, "idle", "-")
            outcomes = []
            for generation in range(args.generations):
                outcome = _generation(node, f"gen-{generation}", args.ranks, args.steps)
                outcomes.append(outcome)
                time.sleep(args.gap_s)
                _row(node, f"gen {generation}", outcome)
            time.sleep(args.release_after_s + 1.5 + 2 * args.interval_s)
            after, _ = _row(node, "released", "-")
        finally:
            node.stop()
    accepted = outcomes.count("accepted")
    print(
        f"accepted {accepted} of {args.generations} new job ids; series idle {idle}, "
        f"{args.release_after_s:g} s after the last job {after}"
        f" ({'back to idle' if after == idle else f'{after - idle:+d}'})"
    )
    return 0 if accepted == args.generations and after == idle else 1


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
