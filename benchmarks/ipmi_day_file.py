"""What replaying a BMC day file costs: a day of ``ipmitool sdr elist`` logged once a minute.

The day file is 1,440 copies of the Dell R740 capture (``fixtures/ipmi/dell-r740-sdr-elist.txt``)
each after a ``Timestamp:`` line. Figures: the time to split it (once, on the first read), the
time of one replay cycle (the current table handed to the backend and parsed), and, for
comparison, parsing the whole file as one output (what a replay cycle cost before day files
were split: 0.69 s on the issue's machine).

    python benchmarks/ipmi_day_file.py [--tables 1440] [--cycles 200]

Exits 1, saying what, when the day file did not split into its tables or a replay read gave no
reading (a check that the work happened, not of how fast).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

from hyperagent.sources.ipmi import IpmiSource, IpmitoolBackend, parse_sdr_output
from hyperagent.sources.ipmi_capture import capture_runner, split_day_file

REPO = Path(__file__).resolve().parents[1]
TABLE = (REPO / "fixtures" / "ipmi" / "dell-r740-sdr-elist.txt").read_text().rstrip() + "\n"


def write_day_file(directory: Path, tables: int) -> Path:
    start = datetime(2026, 12, 1, tzinfo=UTC)
    text = "".join(
        f"Timestamp: {(start + timedelta(minutes=i)).isoformat()}\n{TABLE}" for i in range(tables)
    )
    path = directory / "ipmitool-sdr.txt"
    path.write_text(text)
    return path


async def replay_cycles(
    directory: Path, cycles: int, tables: int
) -> tuple[float, float, list[int]]:
    """Seconds of the first read (split included) and the mean of the following ones, the
    clock moving one table per cycle; the readings of each read."""
    now = [0.0]
    source = IpmiSource(IpmitoolBackend(capture_runner(directory, lambda: now[0], speed=60.0)))
    started = time.perf_counter()
    readings = [len(await source.read())]
    first = time.perf_counter() - started
    started = time.perf_counter()
    for i in range(cycles):
        now[0] = float(i % tables)
        readings.append(len(await source.read()))
    return first, (time.perf_counter() - started) / cycles, readings


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tables", type=int, default=1440)
    parser.add_argument("--cycles", type=int, default=200)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = write_day_file(Path(tmp), args.tables)
        text = path.read_text()
        started = time.perf_counter()
        day = split_day_file(text)
        split_s = time.perf_counter() - started
        started = time.perf_counter()
        whole = parse_sdr_output(text)
        whole_s = time.perf_counter() - started
        first_s, cycle_s, readings = asyncio.run(replay_cycles(Path(tmp), args.cycles, args.tables))
    split = 0 if day is None else len(day.tables)
    failures = [
        what
        for ok, what in (
            (split == args.tables, f"the day file split into {split} of {args.tables} tables"),
            (bool(whole), "the whole file parsed to no sensor"),
            (
                min(readings) > 0,
                f"{readings.count(0)} of {len(readings)} replay reads gave no reading",
            ),
        )
        if not ok
    ]
    print(f"day file: {args.tables} tables, {len(text) / 1e6:.1f} MB")
    print(f"split once:                 {split_s * 1e3:8.1f} ms")
    print(f"first replay read:          {first_s * 1e3:8.1f} ms (read, split, parse one table)")
    print(f"replay cycle:               {cycle_s * 1e3:8.3f} ms (mean of {args.cycles})")
    print(f"whole file parsed as one:   {whole_s * 1e3:8.1f} ms (the cost per cycle before)")
    if failures:
        print(f"FAILED: the work did not happen: {'; '.join(failures)}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
