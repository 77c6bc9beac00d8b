"""A real closed loop on this machine: PyTorch DDP ranks tuned by an agent and the coordinator.

Two gloo ranks on 127.0.0.1 (subprocesses running this module) train an 11M-parameter MLP under
:class:`hyperagent.integrations.torch.TunedDDP`: 42 MiB of gradients, three buckets at DDP's
default, so both the bucket and the chunk size change how the gradients travel. The ranks share
one node, so one Agent (no GPU: ``Hardware(nvml=None)``, the job channel its only source)
relays their step reports and hands them settings. The coordinator tunes ``bucket_mb`` and
``chunk_kb`` (the knobs TunedDDP announces) for throughput over MQTT; each trial measures in
windows until its score is known to 2% or 8 windows are done. Its first trial is PyTorch's
default in the space: 25 MiB buckets snapped to 32, and 32 MiB chunks, as large as the bucket,
so each bucket is one allreduce (no chunking). After tuning, the coordinator measures the
defaults and the best trial's settings again, interleaved, and keeps the best only when its
gain's 95% interval lies above zero; otherwise it says that no setting was better.

Run a rank by hand with ``python -m hyperagent.demo_torch --rank 0 --world-size 2 ...``; the
daemons' modules are imported only by :func:`run_torch_demo`, so a rank starts quickly.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import itertools
import json
import math
import os
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hyperagent import durable
from hyperagent.demo import free_port
from hyperagent.errors import HyperagentError
from hyperagent.job import StepReport
from hyperagent.signing import SigningKey

if TYPE_CHECKING:
    from torch import nn

    from hyperagent.agent import Agent
    from hyperagent.coordinator import Coordinator
    from hyperagent.exporter import MetricsServer
    from hyperagent.tuner.jobstate import TrialRecord
    from hyperagent.tuner.tuning import JobTuning

JOB = "torch-ddp"
NODE = "node-0"
WORLD_SIZE = 2
DEFAULT_TRIALS = 10
START_SETTINGS = {"bucket_mb": 25, "chunk_kb": 32768}
"""PyTorch's default as the space has it: 25 MiB snaps to 32; a 32 MiB chunk is the whole bucket."""
PLAN = {
    "settle_steps": 3,
    "settle_s": 0.5,
    "measure_steps": 12,
    "measure_s": 1.2,
    "windows": 4,
    "target_rel_se": 0.02,
    "max_windows": 8,
}
"""Windows of at least 3 steps and 0.3 s; 4 to 8 of them, until the score is known to 2%."""
LAYERS = (1024, 1536, 1536, 1536, 1536, 1536, 10)
"""11M parameters: 42 MiB of fp32 gradients, in 3 buckets at DDP's default (the first of
1 MiB, then 25 MiB), one at 256 MiB and 43 at 1 MiB."""
BATCH = 8
PARAMETERS = sum(a * b + b for a, b in itertools.pairwise(LAYERS))
MODEL_DESCRIPTION = (
    f"{PARAMETERS / 1e6:.1f}M-parameter MLP ({PARAMETERS * 4 / 2**20:.0f} MiB of gradients)"
)
STARTUP_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 20.0
GLOO_TIMEOUT_S = 60.0

TrialCallback = Callable[["JobTuning", "TrialRecord"], None]


def require_torch() -> None:
    """Raise HyperagentError with the install command when PyTorch is missing."""
    if importlib.util.find_spec("torch") is None:
        raise HyperagentError(
            "the torch-ddp demo needs PyTorch: pip install 'hyperagent[torch]' "
            "(CPU build: pip install torch --index-url https://download.pytorch.org/whl/cpu)"
        )


@dataclass
class RankProcess:
    """One training rank running ``python -m hyperagent.demo_torch``."""

    rank: int
    process: asyncio.subprocess.Process
    log: Path
    """One JSON object per step (see :func:`train`)."""
    output: Path
    """The rank's stdout and stderr."""

    def output_tail(self, lines: int = 15) -> str:
        try:
            return "\n".join(self.output.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def steps(self) -> list[dict[str, Any]]:
        """The per-step records written so far (a torn last line is skipped)."""
        records = []
        with contextlib.suppress(FileNotFoundError):
            for line in self.log.read_text().splitlines():
                with contextlib.suppress(json.JSONDecodeError):
                    records.append(json.loads(line))
        return records


async def launch_ranks(
    workdir: Path,
    job: str,
    sockets: Sequence[Path],
    *,
    seed: int = 0,
    steps: int = 0,
    checksum: bool = False,
) -> list[RankProcess]:
    """Start ``len(sockets)`` gloo ranks on 127.0.0.1; rank r reports to ``sockets[r]``.

    ``steps`` 0 trains until :func:`stop_ranks`; ``checksum`` logs a parameter checksum per step.
    """
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
    ranks: list[RankProcess] = []
    try:
        for rank, path in enumerate(sockets):
            log, output = workdir / f"rank{rank}.jsonl", workdir / f"rank{rank}.out"
            args = [
                "--rank", str(rank), "--world-size", str(len(sockets)),
                "--master-port", str(port), "--job", job, "--socket", str(path),
                "--log", str(log), "--seed", str(seed), "--steps", str(steps),
            ]  # fmt: skip
            if checksum:
                args.append("--checksum")
            with output.open("wb") as sink:
                process = await asyncio.create_subprocess_exec(
                    sys.executable, "-m", "hyperagent.demo_torch", *args,
                    stdin=asyncio.subprocess.DEVNULL, stdout=sink, stderr=sink, env=env,
                )  # fmt: skip
            ranks.append(RankProcess(rank, process, log, output))
    except BaseException:
        await stop_ranks(ranks, timeout_s=0)
        raise
    return ranks


async def stop_ranks(ranks: Sequence[RankProcess], timeout_s: float = STOP_TIMEOUT_S) -> None:
    """SIGTERM every running rank (they agree to stop at the next iteration), then SIGKILL
    whatever is still running after ``timeout_s``; returns once all have exited."""
    for r in ranks:
        if r.process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                r.process.send_signal(signal.SIGTERM)
    try:
        async with asyncio.timeout(timeout_s):
            await asyncio.gather(*(r.process.wait() for r in ranks))
    except TimeoutError:
        for r in ranks:
            if r.process.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    r.process.kill()
        await asyncio.gather(*(r.process.wait() for r in ranks))


async def wait_until_stepping(
    ranks: Sequence[RankProcess], stepping: asyncio.Event, timeout_s: float
) -> None:
    """Wait for ``stepping`` (set by whoever sees every rank report); raise HyperagentError
    naming the rank when one exits first, or on timeout."""
    waiters: list[asyncio.Task[Any]] = [asyncio.create_task(stepping.wait(), name="stepping")]
    waiters += [asyncio.create_task(r.process.wait(), name=f"rank-{r.rank}-exit") for r in ranks]
    try:
        await asyncio.wait(waiters, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for waiter in waiters:
            waiter.cancel()
    _raise_if_exited(ranks)
    if not stepping.is_set():
        raise HyperagentError(f"the training ranks did not report a step within {timeout_s:.0f} s")


def _raise_if_exited(ranks: Sequence[RankProcess]) -> None:
    for r in ranks:
        if r.process.returncode is not None:
            raise HyperagentError(
                f"training rank {r.rank} exited with status {r.process.returncode}:\n"
                + r.output_tail()
            )


class _RankWatch:
    """A JobSource listener: sets ``stepping`` once every rank has reported a step."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.ranks: set[int] = set()
        self.stepping = asyncio.Event()

    def on_step(self, step: StepReport) -> None:
        self.ranks.add(step.rank)
        if len(self.ranks) >= self.world_size:
            self.stepping.set()


def torch_cluster_config(
    broker_url: str,
    trials: int,
    seed: int,
    workdir: Path,
    state_dir: Path | None = None,
    metrics_address: str = "",
) -> dict[str, Any]:
    """Raw config shared by the demo's agent and coordinator: one node, backend gloo, no power
    knob (no GPU), a measurement plan for steps of tens of milliseconds. The agent's and the
    coordinator's state go under ``state_dir`` (``agent``, ``coordinator``; default
    ``workdir``), the job socket into ``workdir``."""
    kept = state_dir if state_dir is not None else workdir
    return {
        "cluster": "torch-demo",
        "mqtt": {"url": broker_url, "reconnect_min_s": 0.2, "reconnect_max_s": 2.0},
        "agent": {"interval_s": 1.0, "metrics_address": "", "state_dir": str(kept / "agent")},
        "sources": {"job": {"socket": str(workdir / "job.sock")}},
        "actuation": {"power_cap": False},
        "coordinator": {
            "metrics_address": metrics_address,
            "state_dir": str(kept / "coordinator"),
            "jobs": [
                {
                    "id": JOB,
                    "nodes": [NODE],
                    "backend": "gloo",
                    "objective": "throughput",
                    "trials": trials,
                    "patience": trials,
                    "seed": seed,
                    "start": START_SETTINGS,
                    "plan": PLAN,
                    "ack_timeout_s": 10,
                    "trial_timeout_s": 60,
                }
            ],
        },
    }


@dataclass
class TorchDemoResult:
    """What the demo measured: the tuning, its confirmations and every rank's steps."""

    state: JobTuning
    rank_steps: dict[int, list[dict[str, Any]]]
    """rank -> one record per step: version, bucket_cap_mb, chunk_bytes, times, loss."""
    pids: list[int]
    returncodes: list[int | None]
    seconds: float
    """The whole demo, start to stop."""
    startup_s: float
    """Until both ranks reported a step (importing torch and wrapping DDP dominate)."""
    journal: Path | None = None
    """The coordinator's journal of the tuning (gone once the demo ends, unless it was given
    a ``state_dir``)."""

    @property
    def confirmations(self) -> list[TrialRecord]:
        """PyTorch's defaults and the best trial's settings measured again, interleaved."""
        return self.state.confirmations

    @property
    def start_settings(self) -> dict[str, Any]:
        """The first trial's settings: PyTorch's defaults in the space."""
        return self.state.trials[0].settings

    @property
    def best_settings(self) -> dict[str, Any]:
        """The settings the tuning ended with: the defaults unless something was confirmed
        better."""
        return self.state.best[0] if self.state.best else self.start_settings

    @property
    def candidate(self) -> dict[str, Any] | None:
        """The best trial's settings, confirmed or not (None when the defaults stayed best)."""
        for record in self.confirmations:
            if record.settings != self.start_settings:
                return record.settings
        return None

    @property
    def gain(self) -> float | None:
        """The confirmed gain over PyTorch's defaults (0 when no setting was better)."""
        return self.state.gain

    @property
    def versions_by_rank(self) -> dict[int, list[int]]:
        return {rank: [s["version"] for s in steps] for rank, steps in self.rank_steps.items()}

    @property
    def median_step_s(self) -> float:
        """Median step time over every rank's steps."""
        times = [s["step_s"] for steps in self.rank_steps.values() for s in steps]
        return statistics.median(times) if times else math.nan

    @property
    def ranks_consistent(self) -> bool:
        """Every rank ran the same number of steps, each with the same settings version."""
        runs = list(self.versions_by_rank.values())
        return len(runs) == WORLD_SIZE and all(run == runs[0] for run in runs) and bool(runs[0])

    def summary(self) -> list[str]:
        """Printable lines: the defaults, the outcome with its interval, steps and times."""

        def describe(s: dict[str, Any]) -> str:
            return f"bucket {s['bucket_mb']} MiB, chunk {s['chunk_kb']} KiB"

        lines = [f"PyTorch defaults: {describe(self.start_settings)}"]
        confirmed = self.state.confirmed
        candidate = self.candidate
        if candidate is None:
            lines.append(
                "no setting was better: no other setting measured without failing in "
                f"{len(self.state.trials)} trials"
            )
        elif confirmed is None:
            lines.append(
                f"no setting was better: the confirmations of {describe(candidate)} against "
                "the defaults measured too little to compare; the defaults stay"
            )
        else:
            counts = f"{confirmed.samples[0]} and {confirmed.samples[1]} windows"
            measured = (
                f"defaults {confirmed.baseline:.1f}, best {confirmed.best:.1f} samples/s "
                f"(interleaved re-measurements, {counts})"
            )
            if confirmed.better:
                lines.append(f"best settings:    {describe(candidate)}")
                lines.append(f"confirmed gain over PyTorch's defaults: {confirmed.describe()}")
            else:
                lines.append(
                    f"no setting was better: the best candidate ({describe(candidate)}) "
                    f"measured {confirmed.describe()} against the defaults; the defaults stay"
                )
            lines.append(measured)
        spent = self.state.cost()
        if spent is not None:
            lines.append(f"cost: {spent.describe()}")
        steps = {rank: len(s) for rank, s in self.rank_steps.items()}
        lines.append(
            f"{sum(steps.values())} steps on {len(steps)} ranks, same settings version at every "
            f"step: {'yes' if self.ranks_consistent else 'NO'}"
        )
        trials = [*self.state.trials, *self.confirmations]
        lines.append(
            f"{self.seconds:.0f} s in all: ranks stepping after {self.startup_s:.0f} s, "
            f"{len(self.state.trials)} trials and {len(self.confirmations)} confirmations of "
            f"{statistics.median(t.seconds for t in trials):.1f} s (median), "
            f"median step {self.median_step_s * 1000:.0f} ms"
        )
        return lines


async def run_torch_demo(
    broker_url: str,
    trials: int = DEFAULT_TRIALS,
    seed: int = 0,
    on_trial: TrialCallback | None = None,
    *,
    key: SigningKey | None = None,
    state_dir: Path | None = None,
    metrics: MetricsServer | None = None,
) -> TorchDemoResult:
    """Tune two real DDP ranks end to end over the broker at ``broker_url``.

    ``on_trial`` sees each trial and each confirmation (the coordinator measures the defaults
    and the best settings again, interleaved, after tuning). The coordinator's journal and the
    agent's state go under ``state_dir`` where given (``coordinator``, ``agent``), else into a
    temporary directory removed at the end; with ``metrics`` (a started MetricsServer) the
    coordinator's /metrics are its. Every process is stopped before returning.
    """
    from hyperagent.agent import Agent
    from hyperagent.config import build_config
    from hyperagent.coordinator import Coordinator, coordinator_link
    from hyperagent.sources import Hardware
    from hyperagent.sources.job import JobSource

    require_torch()
    if trials < 1:
        raise ValueError("trials must be >= 1")
    began = time.monotonic()
    key = key or SigningKey.generate()  # ephemeral: the demo's coordinator only
    with tempfile.TemporaryDirectory(prefix="hyperagent-torch-") as tmp:
        workdir = Path(tmp)
        address = f"{metrics.host}:{metrics.port}" if metrics is not None else ""
        raw = torch_cluster_config(broker_url, trials, seed, workdir, state_dir, address)
        agent_config = build_config(raw, {"node": NODE})
        job_source = JobSource(agent_config.sources.job.socket)
        watch = _RankWatch(WORLD_SIZE)
        job_source.listeners.append(watch.on_step)
        agent = Agent.from_config(
            agent_config, Hardware(nvml=None), key.trusted(), sources=[job_source]
        )
        coordinator_config = build_config(raw, {"node": "coordinator"})
        link = coordinator_link(coordinator_config)
        coordinator = Coordinator(
            coordinator_config,
            link,
            key,
            on_trial=on_trial,
            collector=metrics.collector if metrics is not None else None,
        )
        socket = agent_config.sources.job.socket
        ranks, startup_s = await _tune(agent, coordinator, watch, workdir, socket, seed, began)
        rank_steps = {r.rank: await asyncio.to_thread(r.steps) for r in ranks}
        await asyncio.to_thread(durable.wait)  # the journal on disk; nothing into a removed folder
    return TorchDemoResult(
        state=coordinator.job(JOB),
        rank_steps=rank_steps,
        pids=[r.process.pid for r in ranks],
        returncodes=[r.process.returncode for r in ranks],
        seconds=time.monotonic() - began,
        startup_s=startup_s,
        journal=coordinator.journals.path(JOB),
    )


async def _tune(
    agent: Agent,
    coordinator: Coordinator,
    watch: _RankWatch,
    workdir: Path,
    socket: Path,
    seed: int,
    began: float,
) -> tuple[list[RankProcess], float]:
    """Run the agent, start the ranks once it is connected and tune until the coordinator is
    done; the ranks (stopped) and the seconds from ``began`` until they stepped. A failure is
    raised once every rank is stopped."""
    assert agent.link is not None
    ranks: list[RankProcess] = []
    failure: Exception | None = None
    startup_s = math.nan
    async with asyncio.TaskGroup() as tasks:
        background = [tasks.create_task(agent.run(), name="agent")]
        try:
            await agent.ready.wait()
            await agent.link.connected.wait()
            ranks = await launch_ranks(workdir, JOB, [socket] * WORLD_SIZE, seed=seed)
            await wait_until_stepping(ranks, watch.stepping, STARTUP_TIMEOUT_S)
            startup_s = time.monotonic() - began
            await _while_ranks_run(ranks, coordinator.run(until_tuned=True))
        except Exception as e:
            failure = e
        finally:
            await stop_ranks(ranks)
            for task in background:
                task.cancel()
    if failure is not None:
        raise failure
    return ranks, startup_s


async def _while_ranks_run(ranks: Sequence[RankProcess], work: Coroutine[Any, Any, None]) -> None:
    """Await ``work``; if a rank exits first, cancel it and raise HyperagentError."""
    task = asyncio.create_task(work, name="tune")
    exits = [asyncio.create_task(r.process.wait(), name=f"rank-{r.rank}-exit") for r in ranks]
    try:
        await asyncio.wait([task, *exits], return_when=asyncio.FIRST_COMPLETED)
    finally:
        for waiter in exits:
            waiter.cancel()
    if not task.done():
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        _raise_if_exited(ranks)
    task.result()


def build_model(seed: int) -> nn.Module:
    """The demo's MLP (:data:`PARAMETERS`), initialised from ``seed``."""
    import torch
    from torch import nn

    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for i, (inputs, outputs) in enumerate(itertools.pairwise(LAYERS)):
        layers.append(nn.Linear(inputs, outputs))
        if i < len(LAYERS) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


def parameter_checksum(module: nn.Module) -> int:
    """Sum of every parameter's bit patterns as int32 (equal iff identical, for our purposes)."""
    import torch

    total = 0
    for p in module.parameters():
        total += int(p.detach().reshape(-1).view(torch.int32).sum(dtype=torch.int64))
    return total


def train(args: argparse.Namespace) -> int:
    """One rank: train the MLP on synthetic batches under TunedDDP, log every step."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from hyperagent.integrations.torch import TunedDDP

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{args.master_port}",
        rank=args.rank,
        world_size=args.world_size,
        timeout=timedelta(seconds=GLOO_TIMEOUT_S),
    )
    model = build_model(args.seed)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    data = torch.Generator().manual_seed(args.seed * 1000 + args.rank)
    batches = [
        (torch.randn(BATCH, LAYERS[0], generator=data), torch.randint(0, LAYERS[-1], (BATCH,)))
        for _ in range(8)
    ]
    tuned = TunedDDP(
        model,
        job=args.job,
        socket_path=args.socket,
        job_world_size=args.job_world_size,
        gpu=args.gpu,
    )
    signal.signal(signal.SIGTERM, lambda *_: tuned.request_stop())
    signal.signal(signal.SIGINT, lambda *_: tuned.request_stop())
    step = 0
    with open(args.log, "w", buffering=1) as log:
        while not args.steps or step < args.steps:
            tuned.step_begin()
            if tuned.stopping:
                break
            x, y = batches[step % len(batches)]
            loss = F.cross_entropy(tuned(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            timing = tuned.step_end(samples=len(x), loss=loss.item())
            record = {
                "step": step,
                "version": timing.version,
                "waiting": list(tuned.received_versions),
                "bucket_cap_mb": tuned.bucket_cap_mb,
                "chunk_bytes": tuned.chunk_bytes,
                "step_s": timing.step_s,
                "compute_s": timing.compute_s,
                "comm_s": timing.comm_s,
                "buckets": timing.buckets,
                "loss": float(loss.item()),
            }
            if args.checksum:
                record["checksum"] = parameter_checksum(model)
            log.write(json.dumps(record) + "\n")
            step += 1
    tuned.close()
    dist.barrier()  # leave together: rank 0 hosts the store the other rank still talks to
    dist.destroy_process_group()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of one training rank (``python -m hyperagent.demo_torch``)."""
    parser = argparse.ArgumentParser(description="one gloo rank of the torch-ddp demo")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world-size", type=int, default=WORLD_SIZE)
    parser.add_argument("--master-port", type=int, required=True)
    parser.add_argument("--job", default=JOB)
    parser.add_argument(
        "--job-world-size", type=int, default=None, help="the job's ranks, beyond this world's"
    )
    parser.add_argument("--socket", type=Path, required=True, help="the agent's job socket")
    parser.add_argument("--gpu", type=int, default=None, help="the node's GPU the rank declares")
    parser.add_argument("--log", type=Path, required=True, help="JSON lines, one per step")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=0, help="0: until SIGTERM")
    parser.add_argument("--checksum", action="store_true", help="log a parameter checksum")
    return train(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
