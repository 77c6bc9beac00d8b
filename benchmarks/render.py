"""What one scrape's OpenMetrics body costs to render, on consecutive snapshots of a real agent.

    python benchmarks/render.py [--cycles 12] [--repeats 20] [--capture DIR]

Runs the agent (``Agent.run``, the shipped config's schedule, collecting once a second) on the
full-node replay for ``--cycles`` seconds and keeps every cycle's snapshot, then renders them
in order, as scrapes once a second would, with ``exporter.OpenMetricsText`` (a family's text
kept while it is the same Reading objects, label parts kept) and with prometheus_client's
``generate_latest``. Prints the CPU time of one render (best of ``--repeats`` passes over the
snapshots after the first), how many of a snapshot's samples were the previous snapshot's very
readings, and checks that both bodies are byte for byte the same. Exits 1, saying what, when a
snapshot is empty (nothing was rendered) or the bodies differ.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]

import workers  # noqa: E402
from run import CAPTURE  # noqa: E402

from hyperagent.exporter import OpenMetricsText, SnapshotCollector  # noqa: E402
from hyperagent.readings import Reading  # noqa: E402


async def snapshots(capture: Path, cycles: int) -> list[tuple[Reading, ...]]:
    """Each cycle's readings of an agent on ``capture`` (no broker, no HTTP server)."""
    from hyperagent.agent import Agent

    with tempfile.TemporaryDirectory(prefix="hyperagent-render-") as tmp:
        state = Path(tmp)
        args = argparse.Namespace(
            capture=capture,
            hz=1.0,
            state=state,
            job_socket=state / "job.sock",
            broker="",
            metrics_port=0,
            node="bench-render",
            real_gpus=False,
            every_cycle=False,
            attribution=None,
            slurm_jobs=None,
        )
        config = workers._agent_config(args)
        sources, hardware = workers._node_sources(args, config)
        agent = Agent.from_config(config, hardware, sources=sources)
        running = asyncio.create_task(agent.run(), name="agent")
        try:
            async with asyncio.timeout(30):
                await agent.ready.wait()
            out: list[tuple[Reading, ...]] = []
            last = None
            async with asyncio.timeout(cycles * 5 + 10):
                while len(out) < cycles:
                    await asyncio.sleep(0.25)
                    if agent.snapshot is not None and agent.snapshot is not last:
                        last = agent.snapshot
                        out.append(tuple(last.readings))
            return out
        finally:
            running.cancel()
            await asyncio.gather(running, return_exceptions=True)


def best_render_ms(render: object, taken: list[tuple[Reading, ...]], repeats: int) -> float:
    """The CPU time of one render, best of ``repeats`` passes (each after a first render)."""
    from prometheus_client.openmetrics.exposition import generate_latest

    best = float("inf")
    for _ in range(repeats):
        collectors = []
        for readings in taken:
            collector = SnapshotCollector()
            collector.update(readings)
            collectors.append(collector)
        fresh = OpenMetricsText() if render is OpenMetricsText else None
        encode = fresh if fresh is not None else generate_latest
        encode(collectors[0])  # type: ignore[operator]
        began = time.process_time()
        for collector in collectors[1:]:
            encode(collector)  # type: ignore[operator]
        best = min(best, (time.process_time() - began) / (len(collectors) - 1))
    return 1000 * best


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--cycles", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--capture", type=Path, default=CAPTURE)
    args = parser.parse_args(argv)
    if args.cycles < 2:
        parser.error("--cycles must be at least 2")
    from prometheus_client.openmetrics.exposition import generate_latest

    taken = asyncio.run(snapshots(args.capture, args.cycles))
    empty = sum(1 for readings in taken if not readings)
    if len(taken) < 2 or empty:
        print(f"FAILED: the work did not happen: {empty} of {len(taken)} snapshots empty")
        return 1
    render = OpenMetricsText()
    reused = []
    for before, now in itertools.pairwise(taken):
        ids = {id(r) for r in before}
        reused.append(sum(id(r) in ids for r in now))
    for readings in taken:
        collector = SnapshotCollector()
        collector.update(readings)
        if render(collector) != generate_latest(collector):
            raise SystemExit("OpenMetricsText and prometheus_client disagree")
    ours = best_render_ms(OpenMetricsText, taken, args.repeats)
    theirs = best_render_ms(generate_latest, taken, max(1, args.repeats // 4))
    samples = len(taken[-1])
    print(
        f"{args.cycles} snapshots of {samples} samples ({min(reused)}-{max(reused)} the previous"
        f" snapshot's very readings); bodies byte for byte the same\n"
        f"OpenMetricsText: {ours:.2f} ms per render; prometheus_client: {theirs:.2f} ms",
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
