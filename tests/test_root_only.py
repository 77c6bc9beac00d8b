"""Tests that need root skip on a developer's machine, but fail under ``CI=true``: a CI that
lost root (or a tool the namespace cluster needs) is not green."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from conftest import REPO

ROOT_ONLY = [
    "tests/test_job_channel.py::test_a_user_outside_the_policy_is_refused_and_counted",
    "tests/test_job_channel.py::test_another_users_rank_under_a_jobs_id_is_a_job_of_its_own",
    "tests/test_cluster.py",
    "tests/systemd_real/test_installed.py::test_the_readme_brings_up_the_three_units",
]
NOT_ROOT = "import os\nos.geteuid = lambda: 1000\n"
"""A pytest plugin that makes this run a user's, whoever runs it."""


def run_as_a_user(tmp_path: Path, ci: str | None) -> str:
    (tmp_path / "as_a_user.py").write_text(NOT_ROOT)
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    env["PYTHONPATH"] = str(tmp_path)
    if ci is not None:
        env["CI"] = ci
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "as_a_user",
            "-p",
            "no:cacheprovider",
            *ROOT_ONLY,
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    return result.stdout.strip().splitlines()[-1]


def test_root_only_tests_skip_for_a_user(tmp_path: Path) -> None:
    assert f"{len(ROOT_ONLY)} skipped" in run_as_a_user(tmp_path, None)


def test_root_only_tests_fail_for_a_user_under_ci(tmp_path: Path) -> None:
    summary = run_as_a_user(tmp_path, "true")
    n = len(ROOT_ONLY)
    assert (f"{n} failed" in summary or f"{n} errors" in summary) and "skipped" not in summary, (
        summary
    )
