"""What durable writes cost the event loop: QoS-1 publishes through an on-disk spool, and
tuning-journal entries, each written and fsynced.

For each kind, ``--count`` writes are issued from a running event loop in bursts (10 at a time
every 10 ms, as a job's step reports arrive) while a ticker task measures how late the loop
wakes it (every 1 ms). Printed: the time one call holds the loop (median, 99th percentile,
max), how late the ticker woke (99th percentile, max), and the time from the first write until
every write is on disk (with a writer thread, to the end of its queue; the bursts' pauses alone
take ``count / 10 * 10 ms``). Exits 1, saying what, when not every write is on disk at the
end (a check that the work happened, not of how fast).

Runs against whatever ``hyperagent`` is importable, so the figures before and after a change
come from the same script::

    python benchmarks/durable_writes.py [--count 500] [--dir DIR]
    git archive OLD | tar -x -C /tmp/old && PYTHONPATH=/tmp/old python benchmarks/durable_writes.py

``--dir`` should be on the disk the agent's state would be on (the default is a temporary
folder next to this file, not /tmp, which may be memory-backed).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

BURST = 10
BURST_EVERY_S = 0.01
TICK_S = 0.001
PAYLOAD = b'{"schema": 1, "job": "j", "node": "n", "step": 1234, "samples": 256}' * 4


def _wait_for_disk() -> None:
    """Block until queued durable writes are done, where a writer thread exists."""
    try:
        durable = importlib.import_module("hyperagent.durable")
    except ImportError:
        return
    durable.wait()


async def _measure(write: Callable[[int], Any], count: int) -> dict[str, float]:
    lateness: list[float] = []
    done = asyncio.Event()

    async def ticker() -> None:
        while not done.is_set():
            started = time.perf_counter()
            await asyncio.sleep(TICK_S)
            lateness.append(time.perf_counter() - started - TICK_S)

    tick = asyncio.create_task(ticker())
    await asyncio.sleep(0.05)
    held: list[float] = []
    started = time.perf_counter()
    for i in range(count):
        before = time.perf_counter()
        write(i)
        held.append(time.perf_counter() - before)
        if (i + 1) % BURST == 0:
            await asyncio.sleep(BURST_EVERY_S)
    issued = time.perf_counter() - started
    await asyncio.to_thread(_wait_for_disk)
    on_disk = time.perf_counter() - started
    done.set()
    await tick
    held.sort()
    lateness.sort()
    return {
        "held_median_ms": statistics.median(held) * 1000,
        "held_p99_ms": held[int(0.99 * (len(held) - 1))] * 1000,
        "held_max_ms": held[-1] * 1000,
        "loop_late_p99_ms": lateness[int(0.99 * (len(lateness) - 1))] * 1000,
        "loop_late_max_ms": lateness[-1] * 1000,
        "issue_s": issued,
        "on_disk_s": on_disk,
    }


async def run(directory: Path, count: int) -> dict[str, dict[str, float]]:
    from hyperagent.spool import Spool
    from hyperagent.tuner.journal import Journal

    spool = Spool(directory / "spool", limit=count + 1)
    journal = Journal(directory / "journal" / "job.jsonl")
    figures = {
        "spool (QoS-1 publish)": await _measure(
            lambda i: spool.append("hyperagent/v1/c/job/j/report", PAYLOAD, 1, False), count
        ),
        "journal entry": await _measure(
            lambda i: journal.append(
                {"type": "trial", "index": i, "settings": {"bucket_mb": 64}, "score": 812.4}
            ),
            count,
        ),
    }
    await asyncio.to_thread(_wait_for_disk)
    return figures


def not_written(directory: Path, count: int) -> list[str]:
    """What of the work is not on disk (empty when all of it is): ``count`` spooled messages,
    one file each, and ``count`` journal lines. A check that the writes happened, not of how
    fast."""
    spooled = [p for p in (directory / "spool").iterdir() if p.is_file()]
    journal = directory / "journal" / "job.jsonl"
    lines = len(journal.read_bytes().splitlines()) if journal.exists() else 0
    out = []
    if len(spooled) != count:
        out.append(f"{len(spooled)} of {count} spooled messages on disk")
    if lines != count:
        out.append(f"{lines} of {count} journal entries on disk")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--count", type=int, default=500, help="writes of each kind (500)")
    parser.add_argument("--dir", type=Path, default=None, help="where to write (a temp folder)")
    args = parser.parse_args(argv)
    if args.count < BURST:
        parser.error(f"--count must be at least {BURST}")
    import hyperagent

    where = Path(hyperagent.__file__).parent
    with tempfile.TemporaryDirectory(dir=args.dir or Path(__file__).parent) as tmp:
        figures = asyncio.run(run(Path(tmp), args.count))
        missing = not_written(Path(tmp), args.count)
    print(f"hyperagent from {where}; {args.count} writes of each kind, bursts of {BURST}")
    print(
        f"{'':24}{'held the loop: median':>22}{'p99':>10}{'max':>10}"
        f"{'loop late: p99':>16}{'max':>10}{'all on disk after':>19}"
    )
    for kind, f in figures.items():
        print(
            f"{kind:24}{f['held_median_ms']:>19.3f} ms{f['held_p99_ms']:>6.3f} ms"
            f"{f['held_max_ms']:>7.2f} ms{f['loop_late_p99_ms']:>13.2f} ms"
            f"{f['loop_late_max_ms']:>7.2f} ms"
            f"{f['on_disk_s']:>17.2f} s"
        )
    if missing:
        print(f"FAILED: the writes did not happen: {'; '.join(missing)}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
