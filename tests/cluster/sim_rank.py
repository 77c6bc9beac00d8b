"""One simulated training rank for the namespace cluster: steps as the simulated job model
says under the settings it receives (through a real JobReporter), and logs every step and
every settings version it received as JSON lines.

    python tests/cluster/sim_rank.py --job llama-ft --rank 0 --log FILE [--socket PATH]
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import sys
import time
from pathlib import Path
from typing import Any

from hyperagent.demo import JOB_DEFAULTS
from hyperagent.job import JobReporter, MemoryReport
from hyperagent.sim import JobModel

STEP_WALL_S = 0.05
"""Each simulated step takes this long in wall time (the model's step time is scaled)."""
GPU_MEMORY_BYTES = 32 * 2**30


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--job", required=True)
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--gpu", type=int, default=None)
    parser.add_argument("--socket", type=Path, default=None)
    parser.add_argument("--log", type=Path, required=True)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    running = True

    def stop(*_: Any) -> None:
        nonlocal running
        running = False

    signal.signal(signal.SIGTERM, stop)
    model = JobModel()
    rng = random.Random(args.seed * 100 + args.rank)
    knobs: dict[str, Any] = dict(JOB_DEFAULTS)
    reporter = JobReporter(
        args.job,
        rank=args.rank,
        socket_path=args.socket,
        knobs=("bucket_mb", "chunk_kb"),
        gpu=args.gpu,
    )
    with args.log.open("a", buffering=1) as log, reporter:
        log.write(json.dumps({"started": time.time()}) + "\n")
        while running:
            new = reporter.poll_settings()
            if new is not None:
                knobs = {**JOB_DEFAULTS, **new.settings}
                log.write(json.dumps({"received": new.version, "ts": time.time()}) + "\n")
            step = model.step({**knobs, "power_cap_w": 250.0}, rng)
            time.sleep(STEP_WALL_S)
            memory = MemoryReport(int(0.55 * GPU_MEMORY_BYTES), GPU_MEMORY_BYTES)
            reporter.report_step(
                step.samples, step.step_s, step.compute_s, step.comm_s, 2.0, memory
            )
            if reporter.refused:
                log.write(json.dumps({"refused": reporter.refused, "ts": time.time()}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
