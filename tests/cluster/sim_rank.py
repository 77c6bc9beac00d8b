"""The simulated training ranks of one node for the namespace cluster: ``--ranks`` ranks (one
per GPU, as torchrun starts them), each with its own JobReporter connection, stepping together
as the simulated job model says under the settings each received, and logging every settings
version each rank received as JSON lines.

    python tests/cluster/sim_rank.py --job llama-ft --rank 0 --ranks 8 --log FILE [--socket PATH]
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
    parser.add_argument("--rank", type=int, default=0, help="the first rank on this node")
    parser.add_argument("--ranks", type=int, default=1, help="ranks on this node")
    parser.add_argument("--world-size", type=int, default=None, help="default: --ranks")
    parser.add_argument("--gpu", type=int, default=None, help="the first rank's GPU")
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
    reporters = [
        JobReporter(
            args.job,
            rank=args.rank + i,
            socket_path=args.socket,
            knobs=("bucket_mb", "chunk_kb"),
            gpu=None if args.gpu is None else args.gpu + i,
            world_size=args.world_size or args.ranks,
            local_world_size=args.ranks,
            tune=True,
        )
        for i in range(args.ranks)
    ]
    knobs: list[dict[str, Any]] = [dict(JOB_DEFAULTS) for _ in reporters]
    memory = MemoryReport(int(0.55 * GPU_MEMORY_BYTES), GPU_MEMORY_BYTES)
    with args.log.open("a", buffering=1) as log:
        log.write(json.dumps({"started": time.time(), "ranks": args.ranks}) + "\n")
        while running:
            for i, reporter in enumerate(reporters):
                new = reporter.poll_settings()
                if new is not None:
                    knobs[i] = {**JOB_DEFAULTS, **new.settings}
                    entry = {"rank": reporter.rank, "received": new.version, "ts": time.time()}
                    log.write(json.dumps(entry) + "\n")
            time.sleep(STEP_WALL_S)
            for i, reporter in enumerate(reporters):
                step = model.step({**knobs[i], "power_cap_w": 250.0}, rng)
                reporter.report_step(
                    step.samples // args.ranks,
                    step.step_s,
                    step.compute_s,
                    step.comm_s,
                    2.0,
                    memory,
                )
                if reporter.refused:
                    entry = {"rank": reporter.rank, "refused": reporter.refused, "ts": time.time()}
                    log.write(json.dumps(entry) + "\n")
        for reporter in reporters:
            reporter.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
