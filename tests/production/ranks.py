"""The training ranks of one node: ``--ranks`` JobReporter connections (one per rank, as
torchrun starts one process per GPU), stepping together as data-parallel ranks do.

    python tests/production/ranks.py --job alpha --node-rank 0 --ranks 8 --nodes 3 \
        --socket /run/hyperagent/job.sock --step-s 10 --wall-step-s 0.1 --log FILE

Each step, every rank takes the settings its connection received (at the iteration boundary),
runs one step of the simulated job model under them and reports it. ``--step-s`` is the step
time the ranks report (the model's step time scaled to it); ``--wall-step-s`` is how long a
step takes in real time (default: ``--step-s``). The agent measures trials and the
coordinator watches drift from the reported step times only; the agent's stall check uses
when steps arrive, in real time. SIGSTOP stalls the job (a hung filesystem); SIGTERM ends it.

What a rank says of itself is its own to say, as any user's code: ``--tune 1``/``0`` asks to be
tuned or not to be, ``--world-size`` and ``--first-rank`` may claim any world, ``--no-gpu``
declares no GPU (a CPU-only rank), ``--idle`` says hello and never reports a step.
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
from hyperagent.job import KNOBS, JobReporter, MemoryReport
from hyperagent.sim import JobModel

GPU_MEMORY_BYTES = 80 * 2**30


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--job", default=None, help="default: the scheduler's (SLURM_JOB_ID...)")
    parser.add_argument("--node-rank", type=int, default=0)
    parser.add_argument("--ranks", type=int, default=8, help="ranks on this node")
    parser.add_argument("--nodes", type=int, default=1, help="nodes of the job")
    parser.add_argument("--first-gpu", type=int, default=0, help="this node's first GPU of the job")
    parser.add_argument("--no-gpu", action="store_true", help="CPU-only ranks: declare no GPU")
    parser.add_argument("--tune", choices=("0", "1"), default=None, help="ask (not) to be tuned")
    parser.add_argument("--idle", action="store_true", help="stay connected, report no step")
    parser.add_argument("--first-rank", type=int, default=None, help="default: node rank x ranks")
    parser.add_argument("--world-size", type=int, default=None, help="default: the scheduler's")
    parser.add_argument("--socket", type=Path, required=True)
    parser.add_argument("--step-s", type=float, required=True, help="reported step time")
    parser.add_argument("--wall-step-s", type=float, default=None, help="real step time")
    parser.add_argument("--log", type=Path, required=True)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    wall_step_s = args.step_s if args.wall_step_s is None else args.wall_step_s
    running = True

    def stop(*_: Any) -> None:
        nonlocal running
        running = False

    signal.signal(signal.SIGTERM, stop)
    model = JobModel(nodes=args.nodes, gpus_per_node=args.ranks)
    scale = args.step_s / model.expected_step({**JOB_DEFAULTS, "power_cap_w": 250.0}).step_s
    rng = random.Random(args.seed * 1000 + args.node_rank)
    first = args.node_rank * args.ranks if args.first_rank is None else args.first_rank
    reporters = [
        JobReporter(
            args.job,
            rank=first + i,
            socket_path=args.socket,
            knobs=KNOBS,
            gpu=None if args.no_gpu else args.first_gpu + i,
            world_size=args.world_size,
            local_world_size=args.ranks,
            tune=None if args.tune is None else args.tune == "1",
        )
        for i in range(args.ranks)
    ]
    knobs: list[dict[str, Any]] = [dict(JOB_DEFAULTS) for _ in reporters]
    memory = MemoryReport(int(0.6 * GPU_MEMORY_BYTES), GPU_MEMORY_BYTES)
    with args.log.open("a", buffering=1) as log:
        log.write(json.dumps({"started": time.time(), "ranks": args.ranks}) + "\n")
        next_step = time.monotonic()
        while running:
            for i, reporter in enumerate(reporters):
                new = reporter.poll_settings()
                if new is not None:
                    knobs[i] = {**JOB_DEFAULTS, **new.settings}
                    entry = {"rank": reporter.rank, "received": new.version}
                    log.write(json.dumps({**entry, "settings": dict(new.settings)}) + "\n")
            if args.idle:
                time.sleep(wall_step_s)
                continue
            for i, reporter in enumerate(reporters):
                step = model.step({**knobs[i], "power_cap_w": 250.0}, rng)
                reporter.report_step(
                    step.samples // args.ranks,
                    step.step_s * scale,
                    step.compute_s * scale,
                    step.comm_s * scale,
                    2.0,
                    memory,
                )
            next_step += wall_step_s
            delay = next_step - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            else:  # a late step (a busy machine, or SIGSTOP) is not made up for
                next_step = time.monotonic()
        for reporter in reporters:
            reporter.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
