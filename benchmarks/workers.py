"""The processes ``benchmarks/run.py`` measures, one per scenario, so that CPU time and peak RSS
are the measured process's own.

    python benchmarks/workers.py agent|floor|coordinator|fanout|simagents|loadgen|powercap ...

Each worker prints ``READY ...`` once it is set up, then JSON lines (stats or its result) on
standard output, and stops when its work is done or its standard input closes.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import functools
import logging
import os
import resource
import socket
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]  # this tree's hyperagent, whatever is installed

from mqttsim import SimClient, connect_all, connect_packet, publish_packet, raise_fd_limit  # noqa: E402

CLUSTER = "bench"
JOB = "bench"
SETTINGS_SEED = b"benchmark-settings-key-012345678"
"""The seed of the one signing key of every worker process (a benchmark's, never a
deployment's)."""


@functools.cache
def settings_key() -> Any:
    from hyperagent.signing import SigningKey

    return SigningKey.of(Ed25519PrivateKey.from_private_bytes(SETTINGS_SEED))


@functools.cache
def trusted_keys() -> Any:
    return settings_key().trusted()


def cpu_seconds() -> float:
    """User plus system CPU time of this process, every thread included."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def peak_rss_mib() -> float:
    """Peak resident set size of this process: VmHWM, not ru_maxrss, which Linux carries over
    from the parent's memory at fork (the benchmark's parent holds the tuner's numpy)."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def emit(kind: str, data: Any = None) -> None:
    line = kind if data is None else f"{kind} {orjson.dumps(data).decode()}"
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


async def stdin_closed() -> None:
    """Returns when the parent closes our standard input (or dies)."""
    loop = asyncio.get_running_loop()
    await loop.run_in_executor(None, sys.stdin.buffer.read)


# -- the agent and the raw-read floor ------------------------------------------------------


def _agent_config(args: argparse.Namespace) -> Any:
    """The shipped defaults; with ``--every-cycle`` every source and telemetry every cycle."""
    from hyperagent.config import build_config

    every = 1.0 / args.hz
    sources: dict[str, Any] = {"job": {"socket": str(args.job_socket)}}
    agent: dict[str, Any] = {}
    if args.every_cycle:
        sources |= {
            "rdma": {"commands_interval_s": 0},
            "ipmi": {"interval_s": every},
            "pdu": {"interval_s": every},
        }
        agent["telemetry_interval_s"] = every
    attribution: dict[str, Any] = {}
    if args.attribution:
        attribution["mode"] = args.attribution
    if args.slurm_jobs:
        attribution["proc_root"] = str(args.slurm_jobs / "proc")
    return build_config(
        {
            "node": args.node,
            "cluster": CLUSTER,
            "mqtt": {"enabled": bool(args.broker), "url": args.broker or "mqtt://127.0.0.1:1883"},
            "agent": {
                "interval_s": every,
                "metrics_address": f"127.0.0.1:{args.metrics_port}" if args.metrics_port else "",
                "state_dir": str(args.state),
                **agent,
            },
            "sources": sources,
            "attribution": attribution,
        }
    )


def _node_sources(args: argparse.Namespace, config: Any) -> tuple[list[Any], Any]:
    """Every source of a node: the capture directory's (GPUs, RDMA, PDU, BMC), host, job."""
    from hyperagent.capture.directory import capture_sources
    from hyperagent.sources.host import HostSource
    from hyperagent.sources.job import JobSource

    sources, hardware = capture_sources(args.capture, config)
    if args.slurm_jobs and hardware.nvml is not None:  # the Slurm node's processes on its GPUs
        from hyperagent.capture.directory import replay_processes
        from hyperagent.capture.nvidia_smi import COMPUTE_APPS_FILE

        replay_processes(hardware.nvml, args.slurm_jobs / COMPUTE_APPS_FILE)
    if args.real_gpus:  # this machine's GPUs through NVML instead of the capture's FakeNvml
        import pynvml

        from hyperagent.sources import Hardware
        from hyperagent.sources.nvml import NvmlSource

        nvml = CountingNvml(pynvml)
        sources = [
            NvmlSource(nvml, health_interval_s=config.sources.nvml.health_interval_s),
            *(s for s in sources if s.name != "nvml"),
        ]
        hardware = Hardware(nvml=nvml, replayed=True)
    have = {s.name for s in sources}  # capture_sources builds those the config names
    sources += [s for s in (HostSource(), JobSource(args.job_socket)) if s.name not in have]
    return sources, hardware


class CountingNvml:
    """The real ``pynvml`` module with its ``nvml*`` functions counted (``call_counts()``, as
    FakeNvml has), for ``--real-gpus``; every other name is the module's own."""

    def __init__(self, module: Any) -> None:
        self._module = module
        self._calls: collections.Counter[str] = collections.Counter()
        self._lock = threading.Lock()

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._module, name)
        if name.startswith("nvml") and callable(value):
            function = value

            def value(*args: Any, **kwargs: Any) -> Any:
                with self._lock:
                    self._calls[name] += 1
                return function(*args, **kwargs)

        self.__dict__[name] = value
        return value

    def call_counts(self) -> dict[str, int]:
        with self._lock:
            return dict(self._calls)


def nvml_read_calls(nvml: Any) -> Callable[[], dict[str, int]] | None:
    """The NVML calls a FakeNvml (or CountingNvml) counted so far, by function, less the XID
    watcher's event waits (a blocking wait every few seconds, not part of a read); None for an
    NVML that counts nothing."""
    counts = getattr(nvml, "call_counts", None)
    if counts is None:
        return None

    def calls() -> dict[str, int]:
        return {k: v for k, v in counts().items() if not k.startswith("nvmlEventSetWait")}

    return calls


def _per_gpu_cycle(
    before: dict[str, int], after: dict[str, int], gpus: int, cycles: int
) -> dict[str, Any]:
    """NVML calls per GPU per cycle over a measured window, in all and by function."""
    if not gpus or not cycles:
        return {"nvml_calls_per_gpu_cycle": None, "nvml_calls_by_function": {}}
    made = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    by_function = {k: n / (gpus * cycles) for k, n in sorted(made.items(), key=lambda i: -i[1])}
    return {
        "nvml_calls_per_gpu_cycle": sum(made.values()) / (gpus * cycles),
        "nvml_calls_by_function": {k: v for k, v in by_function.items() if v},
    }


async def _measure(
    args: argparse.Namespace,
    cycles: Callable[[], int],
    ready: dict[str, Any],
    nvml_calls: Callable[[], dict[str, int]] | None = None,
    gpus: int = 0,
    at_end: Callable[[], dict[str, Any]] | None = None,
) -> None:
    emit("READY", ready)
    await asyncio.sleep(args.warmup)
    calls0 = nvml_calls() if nvml_calls else {}
    cpu0, wall0, cycles0 = cpu_seconds(), time.perf_counter(), cycles()
    await asyncio.sleep(args.seconds)
    cpu, wall, done = cpu_seconds() - cpu0, time.perf_counter() - wall0, cycles() - cycles0
    calls = (
        _per_gpu_cycle(calls0, nvml_calls(), gpus, done)
        if nvml_calls
        else {"nvml_calls_per_gpu_cycle": None, "nvml_calls_by_function": {}}
    )
    emit(
        "RESULT",
        {
            "hz": args.hz,
            "wall_s": wall,
            "cpu_s": cpu,
            "cycles": done,
            "cpu_percent": 100 * cpu / wall,
            "cpu_ms_per_cycle": 1000 * cpu / done if done else None,
            "peak_rss_mib": peak_rss_mib(),
            **calls,
            **(at_end() if at_end else {}),
        },
    )


async def agent_worker(args: argparse.Namespace) -> None:
    """The whole agent (``Agent.run``): sources, indicators, /metrics, MQTT telemetry."""
    from hyperagent.agent import Agent

    config = _agent_config(args)
    sources, hardware = _node_sources(args, config)
    agent = Agent.from_config(config, hardware, sources=sources)
    if args.every_cycle:
        agent.runner.intervals = {}
    running = asyncio.create_task(agent.run(), name="agent")
    try:
        async with asyncio.timeout(30):
            await agent.ready.wait()
            if agent.link is not None:
                await agent.link.connected.wait()
        readings = len(agent.snapshot.readings) if agent.snapshot else 0
        jobs = sorted(
            r.labels["job_id"]
            for r in (agent.snapshot.readings if agent.snapshot else ())
            if r.name == "hyperagent_job_gpus"
        )

        def up() -> dict[str, bool]:
            return {f"{s.name}": h for s, h in zip(agent.runner.sources, _up(agent), strict=True)}

        gpus = len(agent.nvml_source.gpus) if agent.nvml_source else 0
        await _measure(
            args,
            lambda: agent.collections,
            {
                "readings": readings,
                "sources_up": up(),
                "metrics_port": args.metrics_port,
                "jobs_on_gpus": jobs,
            },
            nvml_read_calls(hardware.nvml),
            gpus,
            lambda: {"sources_up_at_end": up()},
        )
    finally:
        running.cancel()
        await asyncio.gather(running, return_exceptions=True)


def _up(agent: Any) -> list[bool]:
    return [
        r.value == 1.0 for r in agent.runner.health_readings() if r.name == "hyperagent_source_up"
    ]


async def floor_worker(args: argparse.Namespace) -> None:
    """The raw reads alone: every source's ``read()`` on the agent's schedule, nothing else."""
    config = _agent_config(args)
    sources, _ = _node_sources(args, config)
    for source in sources:
        await source.start()
    interval = 1.0 / args.hz
    slow = {} if args.every_cycle else config.sources.intervals
    read_at = {id(s): -1e9 for s in sources}
    cycles = 0
    readings = 0
    first = asyncio.Event()

    def due(source: Any, now: float) -> bool:
        if now - read_at[id(source)] < 0.95 * slow.get(source.name, 0.0):
            return False
        read_at[id(source)] = now
        return True

    async def loop() -> None:
        nonlocal cycles, readings
        next_due = time.monotonic()
        while True:
            now = time.monotonic()
            chosen = [s for s in sources if due(s, now)]
            results = await asyncio.gather(*(s.read() for s in chosen), return_exceptions=True)
            readings = sum(len(r) for r in results if isinstance(r, list))
            cycles += 1
            first.set()
            next_due += interval
            delay = next_due - time.monotonic()
            if delay < 0:
                next_due, delay = time.monotonic(), 0
            await asyncio.sleep(delay)

    reading = asyncio.create_task(loop(), name="floor")
    try:
        async with asyncio.timeout(30):
            await first.wait()  # READY says what the first cycle read
        await _measure(args, lambda: cycles, {"readings": readings})
    finally:
        reading.cancel()
        await asyncio.gather(reading, return_exceptions=True)
        for source in sources:
            await source.close()


# -- the coordinator's ingest path ---------------------------------------------------------


def node_names(count: int) -> list[str]:
    return [f"sim{i:05d}" for i in range(count)]


def _coordinator_config(
    broker: str, state: Path, jobs: list[dict[str, Any]], defaults: dict[str, Any] | None = None
) -> Any:
    from hyperagent.config import build_config

    section: dict[str, Any] = {"metrics_address": "", "state_dir": str(state), "jobs": jobs}
    if defaults:
        section["defaults"] = defaults
    return build_config(
        {
            "node": "coordinator",
            "cluster": CLUSTER,
            "mqtt": {"url": broker, "reconnect_min_s": 0.1},
            "coordinator": section,
        }
    )


class Sampler:
    """Prints ``STATS`` lines every ``every`` seconds from a thread of its own, not from the
    measured event loop: a loop that is busy for seconds (a coordinator behind its telemetry)
    still gets sampled while it works, instead of leaving no sample for the harness to read
    (the ingest ladder read "0/s at 0% of a core" from such gaps, issue 47)."""

    def __init__(self, every: float, stats: Callable[[], dict[str, Any]]) -> None:
        self.every = every
        self.stats = stats
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stats", daemon=True)

    def _run(self) -> None:
        while True:
            emit("STATS", {"t": time.monotonic(), **self.stats()})
            if self._stop.wait(self.every):
                emit("STATS", {"t": time.monotonic(), **self.stats()})
                return

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)


async def coordinator_worker(args: argparse.Namespace) -> None:
    """A real Coordinator with no job list ingesting every simulated node's telemetry: each
    node carries 8 ranks of one job that did not ask to be tuned, so the coordinator finds
    it, keeps every node's sighting and tunes nothing; a subclass counts the telemetry
    messages handled. Prints a stats line every ``--every`` seconds (from a thread: see
    ``Sampler``), and a last one when its standard input closes."""
    from hyperagent.coordinator import Coordinator, coordinator_link

    class CountingCoordinator(Coordinator):
        ingested = 0

        async def _on_telemetry(self, topic: str, payload: bytes) -> None:
            self.ingested += 1
            await super()._on_telemetry(topic, payload)

    if args.quiet:
        logging.getLogger("hyperagent").setLevel(logging.ERROR)
    defaults = orjson.loads(args.defaults) if args.defaults else None
    config = _coordinator_config(args.broker, args.state, [], defaults)
    coordinator = CountingCoordinator(config, coordinator_link(config), settings_key())

    def stats() -> dict[str, Any]:
        # read from the sampler's thread: ints and lengths, each read whole under the GIL
        return {
            "ingested": coordinator.ingested,
            "invalid": coordinator.invalid_payloads,
            "tracked_nodes": len(coordinator.registry.jobs.get(JOB, {})),
            "found": coordinator.found,
            "held": len(coordinator.tuned),
            "seen": len(coordinator.registry.jobs),
            "connects": coordinator.link.connects,
            "cpu_s": cpu_seconds(),
            "peak_rss_mib": peak_rss_mib(),
        }

    running = asyncio.create_task(coordinator.run(), name="coordinator")
    try:
        async with asyncio.timeout(30):
            await coordinator.link.connected.wait()
        emit("READY", {"nodes": args.nodes})
        with Sampler(args.every, stats):
            await stdin_closed()
    finally:
        running.cancel()
        await asyncio.gather(running, return_exceptions=True)


# -- settings fan-out ----------------------------------------------------------------------


async def fanout_worker(args: argparse.Namespace) -> None:
    """The coordinator's link publishing signed settings versions (as the coordinator signs
    and retains them) to ``--nodes`` simulated agents and waiting for every ack."""
    from hyperagent import bus
    from hyperagent.coordinator import coordinator_link

    job_id = f"fan{args.nodes}"
    config = _coordinator_config(args.broker, args.state, [])
    link = coordinator_link(config)
    topics = bus.Topics(CLUSTER)
    nodes = node_names(args.nodes)
    acked: dict[int, set[str]] = {}
    complete: dict[int, asyncio.Event] = {}

    async def on_ack(topic: str, payload: bytes) -> None:
        message = bus.decode(payload, "ack")
        version = message["version"]
        acked.setdefault(version, set()).add(message["node"])
        if version in complete and len(acked[version]) >= args.nodes:
            complete[version].set()

    link.subscribe(topics.ack(job_id, "+"), 1, on_ack)
    running = asyncio.create_task(link.run(), name="mqtt")
    settings = {"bucket_mb": 25, "chunk_kb": 4096, "power_cap_w": None, "allreduce": "ring"}
    times: list[float] = []
    missing = 0
    try:
        async with asyncio.timeout(30):
            await link.connected.wait()
        emit("READY", {"nodes": args.nodes})
        for version in range(1, args.rounds + 2):
            complete[version] = asyncio.Event()
            began = time.perf_counter()
            message = {
                "job": job_id,
                "version": version,
                "trial": version,
                "nodes": nodes,
                "settings": settings,
                "backend": {},
                "plan": None,
                "issued_at": time.time(),
            }
            link.publish(
                topics.settings(job_id), bus.encode(bus.sign(message, settings_key())), 1, True
            )
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(args.timeout):
                    await complete[version].wait()
            elapsed = time.perf_counter() - began
            if version > 1:  # the first round warms the broker's subscription tree up
                times.append(elapsed)
                missing += args.nodes - len(acked.get(version, ()))
        link.publish(topics.settings(job_id), b"", 1, True)  # clear the retained
        await link.flush(5)
    finally:
        running.cancel()
        await asyncio.gather(running, return_exceptions=True)
    ordered = sorted(times)
    emit(
        "RESULT",
        {
            "nodes": args.nodes,
            "rounds": len(times),
            "p50_s": statistics.median(ordered),
            "p99_s": ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))],
            "max_s": ordered[-1],
            "missing_acks": missing,
        },
    )


async def simagents_worker(args: argparse.Namespace) -> None:
    """Simulated agents ``--first``..``--first + --count - 1``: each subscribes to settings,
    decodes and verifies what arrives with the package's own codec, and acks it (QoS 1)."""
    from hyperagent import bus

    raise_fd_limit(args.count + 100)
    topics = bus.Topics(CLUSTER)
    names = node_names(args.first + args.count)[args.first :]

    async def on_message(client: SimClient, topic: str, payload: bytes) -> None:
        if not payload:
            return
        message = bus.decode(payload, "settings")
        trusted = bus.verify(message, trusted_keys())
        if not trusted or client.client_id not in message["nodes"]:
            return
        ack = {
            "job": message["job"],
            "node": client.client_id,
            "version": message["version"],
            "ok": True,
            "error": None,
            "applied": {},
            "ts": time.time(),
        }
        client.publish(topics.ack(message["job"], ack["node"]), bus.encode(ack), qos=1)

    clients = [SimClient(name, on_message) for name in names]
    await connect_all(clients, "127.0.0.1", args.port)
    await asyncio.gather(*(c.subscribe(topics.settings("+"), 1) for c in clients))
    emit("READY", {"agents": len(clients)})
    await stdin_closed()
    await asyncio.gather(*(c.close() for c in clients), return_exceptions=True)


# -- replay --------------------------------------------------------------------------------


class VirtualClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


async def record(capture: Path, frames: int, out: Path) -> int:
    """A 1 Hz recording of the capture directory's sources, the host and a job reporting 40
    steps a second, ``frames`` seconds long, written with the package's Recorder."""
    from hyperagent import job as protocol
    from hyperagent.capture.directory import capture_sources
    from hyperagent.config import build_config
    from hyperagent.replay import Recorder
    from hyperagent.sources.host import HostSource
    from hyperagent.sources.job import JobSource, Peer
    from hyperagent.sources.runner import SourceRunner

    config = build_config({"node": "bench-node", "mqtt": {"enabled": False}})
    clock = VirtualClock()
    sources, _ = capture_sources(capture, config, clock=clock)
    job = JobSource(out.parent / "unused.sock")
    runner = SourceRunner([*sources, HostSource(), job], 10.0)
    await runner.start()
    steps = [
        protocol.encode_step(protocol.StepReport(JOB, rank, 32, 0.2, 0.16, 0.04, 2.0, 0))
        for rank in range(8)
    ]
    connections = [socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET) for _ in steps]
    ranks = [Peer(ours, os.getpid(), os.getuid(), os.getgid()) for ours, _ in connections]
    with out.open("wb") as f:
        recorder = Recorder(f, config.node, 1.0)
        for second in range(frames):
            clock.now = float(second)
            for _ in range(5):
                for rank, step in zip(ranks, steps, strict=True):
                    job.receive(step, rank)
            recorder.write(1_790_000_000.0 + second, await runner.read_by_source())
    await runner.close()
    for pair in connections:
        for end in pair:
            end.close()
    return recorder.frames


async def _replay(directory: Path, frames: int, power_cap: bool) -> dict[str, Any]:
    """Replay the recording as ``hyperagent agent --replay`` does (``capture_sources``), one
    recorded second per ``Agent.collect_once`` on a virtual clock. With ``power_cap`` the GPU
    readings go through NvmlSource over a fake NVML rebuilt from each frame (so that power caps
    apply); without, they are served as recorded."""
    from hyperagent.agent import Agent
    from hyperagent.capture.directory import capture_sources
    from hyperagent.config import build_config

    config = build_config(
        {
            "node": "bench-node",
            "mqtt": {"enabled": False},
            "agent": {"metrics_address": "", "state_dir": str(directory)},
            "actuation": {"power_cap": power_cap},
        }
    )
    clock = VirtualClock()
    began = time.perf_counter()
    sources, hardware = capture_sources(directory, config, clock=clock)
    load_s = time.perf_counter() - began
    agent = Agent(config, hardware, sources=sources)
    await agent.runner.start()
    readings = 0
    began, cpu0 = time.perf_counter(), cpu_seconds()
    for second in range(frames):
        clock.now = float(second)
        snapshot = await agent.collect_once()
        readings = len(snapshot.readings)
    wall, cpu = time.perf_counter() - began, cpu_seconds() - cpu0
    await agent.runner.close()
    return {
        "wall_s": wall,
        "cpu_s": cpu,
        "load_s": load_s,
        "speedup": frames / wall,
        "speedup_with_load": frames / (wall + load_s),
        "readings_per_frame": readings,
    }


async def replay_worker(args: argparse.Namespace) -> None:
    """Record ``--frames`` seconds at 1 Hz, then replay them both ways (see ``_replay``)."""
    import tempfile

    from hyperagent.replay import RECORDING_FILE

    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        frames = await record(args.capture, args.frames, directory / RECORDING_FILE)
        as_recorded = await _replay(directory, frames, power_cap=False)
        power_capped = await _replay(directory, frames, power_cap=True)
    emit(
        "RESULT",
        {
            "frames": frames,
            "recorded_s": float(frames),
            **as_recorded,
            "power_capped": power_capped,
        },
    )


# -- power-cap latency ---------------------------------------------------------------------


def _spread(latencies: list[float | None]) -> dict[str, Any]:
    measured = sorted(x for x in latencies if x is not None)
    return {
        "changes": len(latencies),
        "measured": len(measured),
        "p50_s": statistics.median(measured) if measured else None,
        "max_s": measured[-1] if measured else None,
    }


def powercap_worker(args: argparse.Namespace) -> None:
    """Time power-cap changes with the agent's ``PowerCapActuator``: each round caps every GPU at
    the lowest limit they all accept, then at the highest. A change's latency runs from its set
    call until the GPU's instant power is at or under the new limit (``AppliedCap.latency_s``):
    the GPUs must be under load, or they are under any cap already. The limits in force before
    are put back at the end. Without ``--real-gpus`` the capture's FakeNvml GPUs obey after
    ``--response-s``: that checks the harness, it measures nothing."""
    from hyperagent.actuators import PowerCapActuator
    from hyperagent.errors import ActuationError

    if args.real_gpus:
        import pynvml

        nvml: Any = CountingNvml(pynvml)
    else:
        from hyperagent.capture.fake_nvml import FakeNvml

        nvml = FakeNvml.from_capture(
            args.capture / "nvidia-smi.xml", cap_response_s=args.response_s
        )
    actuator = PowerCapActuator(nvml, latency_timeout_s=args.timeout)
    lowered: list[float | None] = []
    raised: list[float | None] = []
    try:
        limits = actuator.limits_w()
        if limits is None:
            emit("RESULT", {"error": "the GPUs share no power limit range"})
            return
        for _ in range(args.rounds):
            for watts, latencies in ((limits[0], lowered), (limits[1], raised)):
                latencies.extend(c.latency_s for c in actuator.apply(watts) if c.changed)
                time.sleep(args.pause_s)
    except ActuationError as e:
        emit("RESULT", {"error": str(e)})
        return
    finally:
        actuator.restore()
    emit(
        "RESULT",
        {
            "real_gpus": args.real_gpus,
            "limits_w": limits,
            "lowered": _spread(lowered),
            "raised": _spread(raised),
        },
    )


# -- telemetry load ------------------------------------------------------------------------


def telemetry_template(capture: Path) -> dict[str, Any]:
    """A real agent's telemetry payload for the capture directory (second cycle, so windowed
    indicators are present), decoded: simulated agents send it with their own name and time."""
    from hyperagent.agent import telemetry_payload
    from hyperagent.capture.directory import capture_sources
    from hyperagent.config import build_config
    from hyperagent.indicators import derive
    from hyperagent.readings import Snapshot
    from hyperagent.sources.host import HostSource
    from hyperagent.sources.runner import SourceRunner

    async def build() -> bytes:
        config = build_config({"node": "template", "cluster": CLUSTER, "mqtt": {"enabled": False}})
        clock = [0.0]
        sources, _ = capture_sources(capture, config, clock=lambda: clock[0])
        runner = SourceRunner([*sources, HostSource()], 10.0)
        await runner.start()
        previous = None
        payload = b""
        for ts in (0.0, 1.0):
            clock[0] = ts
            readings = await runner.read_all()
            snapshot = Snapshot(ts, "template", tuple(readings))
            indicators = derive(snapshot, previous, config.indicators.quantum_coefficients)
            jobs = {JOB: {"samples": 0, "step_s": 0.0}}
            payload = telemetry_payload(snapshot, indicators, jobs)
            previous = snapshot
        await runner.close()
        return payload

    message: dict[str, Any] = orjson.loads(asyncio.run(build()))
    return message


def load_connections(port: int, count: int) -> list[socket.socket]:
    """``count`` MQTT connections to the broker on ``port``, connected (blocking sockets)."""
    sockets = []
    for i in range(count):
        sock = socket.create_connection(("127.0.0.1", port), timeout=30)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.sendall(connect_packet(f"load-{os.getpid()}-{i}"))
        answer = sock.recv(4)
        if answer[:1] != b"\x20" or answer[3:4] != b"\x00":
            raise RuntimeError(f"broker refused load connection {i}: {answer!r}")
        sockets.append(sock)
    return sockets


class LoadGenerator:
    """Simulated agents publishing telemetry at 1 Hz each (QoS 0), over blocking sockets.

    Node i publishes once a second, spread evenly over the second; nodes share ``connections``
    MQTT connections round-robin (one each when there are as many connections as nodes). A
    message is the template with the node's name, the time and its job's running totals; the
    unchanging part is encoded once, so that the generator stays cheap next to the broker and
    the coordinator. Every node carries 8 ranks of one job whose world is the ranks of the
    largest step's nodes (``nodes``): at a smaller step most of its ranks are missing, and each
    node the coordinator sees for the first time changes the job's picture.
    """

    def __init__(self, port: int, template: dict[str, Any], nodes: int, connections: int) -> None:
        from hyperagent import bus

        raise_fd_limit(connections + 100)
        topics = bus.Topics(CLUSTER)
        fixed = {k: v for k, v in template.items() if k not in ("node", "ts", "jobs")}
        self.tail = b"," + orjson.dumps(fixed)[1:]
        self.names = [orjson.dumps(name) for name in node_names(nodes)]
        self.topics = [topics.telemetry(name).encode() for name in node_names(nodes)]
        self.samples = [0] * nodes
        self.nodes = nodes
        self.sockets = load_connections(port, connections)
        self.sent = 0
        self._next = 0

    def _packet(self, node: int, now: bytes) -> bytes:
        self.samples[node] += 32
        samples = self.samples[node]
        payload = b"".join(
            (
                b'{"node":',
                self.names[node],
                b',"ts":',
                now,
                f',"jobs":{{"{JOB}":{{"samples":{samples},"step_s":{samples / 320!r},'
                f'"attached":8,"world_size":{8 * self.nodes}}}}}'.encode(),
                self.tail,
            )
        )
        return publish_packet(self.topics[node], payload)

    def run(self, active: int, seconds: float) -> dict[str, Any]:
        """Nodes 0..active-1 publish at 1 Hz for ``seconds``; returns what was sent when."""
        began = time.monotonic()
        sent_before = self.sent
        connections = len(self.sockets)
        while True:
            now = time.monotonic()
            elapsed = now - began
            if elapsed >= seconds:
                break
            due = int(active * elapsed) - (self.sent - sent_before)
            batches: dict[int, list[bytes]] = {}
            wall = orjson.dumps(time.time())
            for _ in range(due):
                node = self._next % active
                self._next = node + 1
                batches.setdefault(node % connections, []).append(self._packet(node, wall))
            for index, packets in batches.items():
                self.sockets[index].sendall(b"".join(packets))
            self.sent += due
            time.sleep(0.005)
        ended = time.monotonic()
        sent = self.sent - sent_before
        return {"t0": began, "t1": ended, "sent": sent, "rate": sent / (ended - began)}

    def close(self) -> None:
        for sock in self.sockets:
            with contextlib.suppress(OSError):
                sock.sendall(b"\xe0\x00")
                sock.close()


def loadgen_worker(args: argparse.Namespace) -> None:
    """Steps of ``--rates`` (agents publishing at 1 Hz) for ``--step-s`` seconds each."""
    rates = [int(r) for r in args.rates.split(",")]
    generator = LoadGenerator(
        args.port, telemetry_template(args.capture), max(rates), args.connections
    )
    emit("READY", {"connections": len(generator.sockets), "nodes": max(rates)})
    try:
        for rate in rates:
            emit("STEP", {"agents": rate, **generator.run(rate, args.step_s)})
    finally:
        generator.close()
    emit("DONE")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    sub = parser.add_subparsers(dest="kind", required=True)
    for kind in ("agent", "floor"):
        p = sub.add_parser(kind)
        p.add_argument("--capture", type=Path, required=True)
        p.add_argument("--hz", type=float, required=True)
        p.add_argument("--seconds", type=float, required=True)
        p.add_argument("--warmup", type=float, default=3.0)
        p.add_argument("--state", type=Path, required=True)
        p.add_argument("--job-socket", type=Path, required=True)
        p.add_argument("--broker", default="")
        p.add_argument("--metrics-port", type=int, default=0)
        p.add_argument("--node", default="bench-node", help="node name (and MQTT client id)")
        p.add_argument("--real-gpus", action="store_true", help="NVML of this machine's GPUs")
        p.add_argument(
            "--slurm-jobs",
            type=Path,
            default=None,
            help="a capture directory's GPU processes and proc/ tree (Slurm jobs) on the GPUs",
        )
        p.add_argument(
            "--attribution", default="", help="attribution.mode (default: the shipped one)"
        )
        p.add_argument(
            "--every-cycle",
            action="store_true",
            help="every source (and telemetry) every cycle instead of the shipped intervals",
        )
    p = sub.add_parser("coordinator")
    p.add_argument("--broker", required=True)
    p.add_argument("--nodes", type=int, required=True)
    p.add_argument("--state", type=Path, required=True)
    p.add_argument("--every", type=float, default=0.25)
    p.add_argument("--defaults", default="", help="[coordinator.defaults] as JSON")
    p.add_argument("--quiet", action="store_true", help="log errors only")
    p = sub.add_parser("fanout")
    p.add_argument("--broker", required=True)
    p.add_argument("--nodes", type=int, required=True)
    p.add_argument("--rounds", type=int, required=True)
    p.add_argument("--timeout", type=float, default=30.0)
    p.add_argument("--state", type=Path, required=True)
    p = sub.add_parser("simagents")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--first", type=int, required=True)
    p.add_argument("--count", type=int, required=True)
    p = sub.add_parser("replay")
    p.add_argument("--capture", type=Path, required=True)
    p.add_argument("--frames", type=int, required=True)
    p = sub.add_parser("powercap")
    p.add_argument("--capture", type=Path, required=True)
    p.add_argument("--rounds", type=int, required=True)
    p.add_argument("--real-gpus", action="store_true", help="NVML of this machine's GPUs")
    p.add_argument("--timeout", type=float, default=5.0, help="longest wait for a GPU to obey")
    p.add_argument("--pause-s", type=float, default=1.0, help="pause after each change")
    p.add_argument("--response-s", type=float, default=0.25, help="fake GPUs' response time")
    p = sub.add_parser("loadgen")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--capture", type=Path, required=True)
    p.add_argument("--rates", required=True, help="comma-separated agent counts, one per step")
    p.add_argument("--step-s", type=float, required=True)
    p.add_argument("--connections", type=int, required=True)
    args = parser.parse_args(argv)
    if args.kind == "loadgen":
        loadgen_worker(args)
        return 0
    if args.kind == "powercap":
        powercap_worker(args)
        return 0
    workers = {
        "agent": agent_worker,
        "floor": floor_worker,
        "coordinator": coordinator_worker,
        "fanout": fanout_worker,
        "simagents": simagents_worker,
        "replay": replay_worker,
    }
    asyncio.run(workers[args.kind](args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
