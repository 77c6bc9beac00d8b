"""TunedDDP with hyperagent's NCCL tuner plugin: which process groups announce ``allreduce`` and
``protocol``, and two gloo ranks switching the plugin's AllReduce choice at one iteration.

On gloo NCCL never consults the plugin, so the ranks pass it explicitly (``nccl_plugin=``); the
setter still runs where it would under NCCL, which is what the switch test observes through
``hyperagent_nccl_selected``. Ranks run this file as a script.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path

import pytest

from hyperagent.job import JobSettings, StepReport
from hyperagent.nccl import TunerPlugin, build, compiler
from hyperagent.sources.job import JobSource

from conftest import REPO, free_port, unavailable

try:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch import nn

    from hyperagent.integrations.torch import (
        DdpKnobs,
        TunedDDP,
        knobs_from_settings,
        nccl_plugin_for,
    )

    TORCH_MISSING = ""
except ModuleNotFoundError as e:
    if e.name != "torch":
        raise
    TORCH_MISSING = str(e)

JOB = "nccl-plugin-test"
MIB = 1024 * 1024
TREE, RING = 0, 1
LL, LL128, SIMPLE = 0, 1, 2
MAX_STEPS = 400
STEPS_AFTER_LAST = 5


@pytest.fixture(autouse=True)
def _torch_installed() -> None:
    if TORCH_MISSING:
        pytest.fail(f"PyTorch is missing ({TORCH_MISSING}): .venv/bin/pip install torch==2.13.0")


@pytest.fixture(scope="module")
def library(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if compiler() is None:
        unavailable("no C compiler (cc, gcc or clang) to build the NCCL tuner plugin")
    return build(tmp_path_factory.mktemp("plugin") / "libhyperagent_nccl_tuner.so")


def test_the_plugin_is_used_only_for_nccl_with_the_plugin_named_and_no_forced_choice(
    library: Path, tmp_path: Path
) -> None:
    named = {"NCCL_TUNER_PLUGIN": str(library)}
    plugin, why = nccl_plugin_for("nccl", named)
    assert plugin is not None and plugin.path == library.resolve() and why == ""
    plugin, _ = nccl_plugin_for("cpu:gloo,cuda:nccl", named)
    assert plugin is not None
    refusals = [
        ("gloo", named, "gloo"),
        ("nccl", {}, "NCCL_TUNER_PLUGIN"),
        ("nccl", {**named, "NCCL_ALGO": "Ring"}, "NCCL_ALGO"),
        ("nccl", {**named, "NCCL_PROTO": "Simple"}, "NCCL_PROTO"),
        ("nccl", {"NCCL_TUNER_PLUGIN": "aws-ofi"}, "not a file"),
    ]
    other = tmp_path / "libother.so"
    other.write_bytes(b"not a library")
    refusals.append(("nccl", {"NCCL_TUNER_PLUGIN": str(other)}, "not hyperagent's plugin"))
    for backend, environ, reason in refusals:
        plugin, why = nccl_plugin_for(backend, environ)
        assert plugin is None and reason in why, (backend, environ, why)


def test_algorithm_and_protocol_are_read_only_for_the_plugin() -> None:
    message = JobSettings(
        1, {"bucket_mb": 2, "chunk_kb": 64, "allreduce": "tree", "protocol": "LL128"}
    )
    assert knobs_from_settings(message) == DdpKnobs(2 * MIB, 64 * 1024)
    assert knobs_from_settings(message, True) == DdpKnobs(2 * MIB, 64 * 1024, TREE, LL128)
    collnet = JobSettings(2, {"bucket_mb": 2, "allreduce": "collnet", "protocol": "fast"})
    assert knobs_from_settings(collnet, True) == DdpKnobs(2 * MIB, None, 2, None)


def settings(version: int, allreduce: str, protocol: str) -> JobSettings:
    knobs = {"bucket_mb": 4, "chunk_kb": 256, "allreduce": allreduce, "protocol": protocol}
    return JobSettings(version, knobs)


def worker(rank: int, port: int, library: Path, socket: Path, out: Path) -> None:
    """One gloo rank under TunedDDP with the plugin; logs the plugin's choice at every step,
    read right after ``step_begin`` (before the iteration's first collective)."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    plugin = TunerPlugin(library)
    tuned = TunedDDP(model, job=JOB, socket_path=socket, nccl_plugin=plugin)
    x, y = torch.randn(8, 32), torch.randint(0, 10, (8,))
    last_since = 0
    with open(out, "w", buffering=1) as log:
        for step in range(MAX_STEPS):
            tuned.step_begin()
            selected = plugin.selected()
            loss = F.cross_entropy(tuned(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            tuned.step_end(samples=8, loss=loss.item())
            chosen = [selected.algorithm, selected.protocol, selected.channels]
            log.write(json.dumps({"step": step, "version": tuned.version, "selected": chosen}))
            log.write("\n")
            last_since = last_since + 1 if tuned.version == 2 else 0
            if last_since >= STEPS_AFTER_LAST:  # every rank switched at the same step
                break
            time.sleep(0.02)
    tuned.close()
    dist.barrier()
    dist.destroy_process_group()


async def test_every_rank_switches_the_plugin_at_the_same_iteration_to_rank_0s_values(
    library: Path, tmp_path: Path
) -> None:
    sources = [JobSource(tmp_path / f"agent{rank}.sock") for rank in range(2)]
    reports: list[list[StepReport]] = [[], []]
    for rank, source in enumerate(sources):
        await source.start()
        source.listeners.append(reports[rank].append)
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(REPO / "tests"), "OMP_NUM_THREADS": "1"}
    env.pop("NCCL_ALGO", None)
    env.pop("NCCL_PROTO", None)
    logs = [tmp_path / f"rank{rank}.jsonl" for rank in range(2)]
    ranks = [
        await asyncio.create_subprocess_exec(
            sys.executable,
            __file__,
            "--rank",
            str(rank),
            "--port",
            str(port),
            "--library",
            str(library),
            "--socket",
            str(sources[rank].socket_path),
            "--out",
            str(logs[rank]),
            env=env,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
        )
        for rank in range(2)
    ]

    async def after(rank: int, steps: int) -> None:
        while len(reports[rank]) < steps:
            if any(r.returncode is not None for r in ranks):
                pytest.fail("a rank exited early")
            await asyncio.sleep(0.005)

    try:
        async with asyncio.timeout(100):
            await after(0, 3)
            for source in sources:
                assert source.jobs[JOB].knobs() == (
                    "bucket_mb",
                    "chunk_kb",
                    "allreduce",
                    "protocol",
                )
            assert sources[0].send_settings(JOB, settings(1, "tree", "ll")) == 1
            await after(0, 10)
            # rank 1 receives v1 later, and with other values: rank 0's are the version's
            assert sources[1].send_settings(JOB, settings(1, "ring", "simple")) == 1
            await after(1, len(reports[1]) + 5)
            for source in sources:
                assert source.send_settings(JOB, settings(2, "ring", "ll128")) == 1
            outputs = await asyncio.gather(*(r.communicate() for r in ranks))
    finally:
        for r in ranks:
            if r.returncode is None:
                r.kill()
                await r.wait()
        for source in sources:
            await source.close()
    assert [r.returncode for r in ranks] == [0, 0], [o[0].decode()[-3000:] for o in outputs]
    steps = [[json.loads(line) for line in log.read_text().splitlines()] for log in logs]
    assert steps[0] == steps[1], "every rank had the same choice at every step"
    chosen = {s["version"]: tuple(s["selected"]) for s in steps[0]}
    assert chosen == {0: (-1, -1, 0), 1: (TREE, LL, 0), 2: (RING, LL128, 0)}
    first_v1 = next(s["step"] for s in steps[0] if s["version"] == 1)
    assert first_v1 >= 10, "v1 waited for rank 1, which received it after rank 0's 10th step"
    versions = [s["version"] for s in steps[0]]
    assert versions == sorted(versions)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--library", type=Path, required=True)
    parser.add_argument("--socket", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    a = parser.parse_args()
    worker(a.rank, a.port, a.library, a.socket, a.out)
