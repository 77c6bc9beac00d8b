"""README's test command runs the suite on two workers (``-n 2 --dist loadgroup``) and relies on
``xdist_group`` marks: the tests that keep many processes busy run one at a time on one worker
(conftest.BUSY), and a module that starts one broker for all its tests keeps them on the worker
that started it. A pytest that pytest-xdist cannot group under ignores the marks silently, so
this runs a small suite the way README's command does and checks where its tests ran."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SUITE = """
import os, time, pytest

def ran(name):
    with open(os.path.join(os.environ["WHERE"], name), "w") as f:
        f.write(os.environ.get("PYTEST_XDIST_WORKER", "none"))
    time.sleep(0.3)

@pytest.mark.xdist_group("together")
@pytest.mark.parametrize("i", range(4))
def test_grouped(i):
    ran(f"grouped-{i}")

@pytest.mark.parametrize("i", range(4))
def test_free(i):
    ran(f"free-{i}")
"""


def test_tests_of_one_xdist_group_run_on_one_worker(tmp_path: Path) -> None:
    (tmp_path / "test_where.py").write_text(SUITE)
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    where = tmp_path / "where"
    where.mkdir()
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-n",
            "2",
            "--dist",
            "loadgroup",
            "-p",
            "no:cacheprovider",
            str(tmp_path / "test_where.py"),
        ],
        cwd=tmp_path,
        env={"WHERE": str(where), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    workers = {p.name: p.read_text() for p in where.iterdir()}
    assert len(workers) == 8, workers
    grouped = {w for name, w in workers.items() if name.startswith("grouped-")}
    assert len(grouped) == 1, f"one xdist_group ran on workers {sorted(grouped)}"
    assert grouped <= {"gw0", "gw1"}
