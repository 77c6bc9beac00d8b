"""Telemetry sources, registered explicitly by config name."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from hyperagent.config import Config
from hyperagent.errors import ConfigError, ConfigProblem
from hyperagent.replay import (
    RECORDING_FILE,
    Player,
    RecordedNvmlSource,
    RecordedSource,
    load_recording,
)
from hyperagent.sources import ipmi, pdu, rdma
from hyperagent.sources.base import Source
from hyperagent.sources.host import HostSource
from hyperagent.sources.job import JobSource
from hyperagent.sources.nvml import NvmlSource


@dataclass(frozen=True)
class Hardware:
    """Where sources find the hardware: the real libraries, or fakes replaying captures."""

    nvml: Any
    """The ``pynvml`` module, or an object with its API (hyperagent.testing.fake_nvml)."""
    replayed: bool = False
    """True for a capture directory: nothing of it is kept on this machine's disk."""

    @classmethod
    def from_config(cls, config: Config) -> Hardware:
        dump = config.sources.nvml.dump
        if dump is not None:
            from hyperagent.testing.fake_nvml import FakeNvml

            try:
                return cls(nvml=FakeNvml.from_capture(dump, writable=True))
            except (OSError, ValueError) as e:
                raise ConfigError([ConfigProblem("sources.nvml.dump", f"{dump}: {e}")]) from e
        import pynvml

        return cls(nvml=pynvml)


SourceFactory = Callable[[Config, Hardware], list[Source]]


def ipmi_sources(config: Config, hardware: Hardware) -> list[Source]:
    """The BMC source as ``[sources.ipmi]`` says."""
    c = config.sources.ipmi
    backend: ipmi.IpmiBackend
    if c.backend == "rmcp":
        assert c.host is not None and c.interface != "open"
        password = ipmi.read_password_file(c.password_file) if c.password_file else ""
        backend = ipmi.RmcpBackend(
            c.host,
            c.port,
            c.username or "",
            password,
            interface=c.interface,
            cipher_suite=c.cipher_suite,
            privilege=c.privilege,
            timeout_s=c.timeout_s,
            dcmi=c.dcmi,
        )
    else:
        backend = ipmi.IpmitoolBackend(
            interface=c.interface,
            host=c.host,
            port=c.port,
            username=c.username,
            password_file=c.password_file,
            cipher_suite=c.cipher_suite,
            privilege=c.privilege,
            timeout_s=c.timeout_s,
            dcmi=c.dcmi,
        )
    return [ipmi.IpmiSource(backend)]


def rdma_sources(config: Config, hardware: Hardware) -> list[Source]:
    c = config.sources.rdma
    runner = partial(rdma.run_command, timeout_s=c.command_timeout_s) if c.commands else None
    return [
        rdma.RdmaSource(
            c.sysfs_root,
            runner,
            c.netdevs,
            c.commands_interval_s,
            rescan_interval_s=c.rescan_interval_s,
        )
    ]


def pdu_sources(config: Config, hardware: Hardware) -> list[Source]:
    """One source per configured PDU (none configured: none)."""
    c = config.sources.pdu
    targets = [
        pdu.PduTarget(t.name, t.host, t.port, t.community, t.vendor, t.outlets, t.inlets)
        for t in c.targets
    ]
    return list(pdu.pdu_sources(targets, timeout_s=c.timeout_s, retries=c.retries))


SOURCES: dict[str, SourceFactory] = {
    "nvml": lambda config, hw: [
        NvmlSource(hw.nvml, health_interval_s=config.sources.nvml.health_interval_s)
    ],
    "host": lambda config, hw: [HostSource()],
    "job": lambda config, hw: [JobSource(config.sources.job.socket)],
    "ipmi": ipmi_sources,
    "rdma": rdma_sources,
    "pdu": pdu_sources,
}
"""Config name -> factory. Each is enabled by ``[sources.<name>] enabled`` (default on)."""


def capture_sources(
    directory: Path, config: Config, clock: Callable[[], float] = time.monotonic
) -> tuple[list[Source], Hardware]:
    """Sources replaying what a capture directory holds (see README: capture directories);
    ``clock`` drives the fake GPUs' energy counters and the recording's player.

    A recording's GPU readings go through NvmlSource over a fake NVML that takes power caps
    when ``actuation.power_cap`` is on; otherwise they are replayed as recorded.

    Raises ConfigError naming ``--replay`` when the directory holds nothing to replay.
    """
    from hyperagent.testing.fake_nvml import FakeNvml

    sources: list[Source] = []
    nvml = None
    smi = directory / "nvidia-smi.xml"
    if smi.is_file():
        nvml = FakeNvml.from_capture(smi, clock=clock)
        sources.append(
            NvmlSource(nvml, clock=clock, health_interval_s=config.sources.nvml.health_interval_s)
        )
    if (directory / "sys" / "class" / "infiniband").is_dir():
        sources.append(
            rdma.RdmaSource(
                directory / "sys",
                rdma.capture_runner(directory),
                commands_interval_s=config.sources.rdma.commands_interval_s,
                clock=clock,
                rescan_interval_s=config.sources.rdma.rescan_interval_s,
            )
        )
    if (directory / "pdu").is_dir():
        sources += pdu.pdu_sources([], replay_dir=directory / "pdu")
    if (directory / "ipmitool-sdr.txt").is_file():
        backend = ipmi.IpmitoolBackend(ipmi.capture_runner(directory), target=directory.name)
        sources.append(ipmi.IpmiSource(backend))
    recording = directory / RECORDING_FILE
    if recording.is_file():
        player = Player(load_recording(recording), clock)
        provided = {s.name for s in sources}
        for name in player.recording.source_names:
            if name in provided:
                continue
            if name == "nvml" and config.actuation.power_cap:
                nvml_replay = RecordedNvmlSource(player)
                nvml = nvml_replay.fake
                sources.append(nvml_replay)
            else:
                sources.append(RecordedSource(name, player))
    if not sources:
        raise ConfigError(
            [
                ConfigProblem(
                    "--replay",
                    f"{directory} holds no capture to replay "
                    f"(nvidia-smi.xml, {RECORDING_FILE}, ...)",
                )
            ]
        )
    return sources, Hardware(nvml=nvml, replayed=True)


def build_sources(config: Config, hardware: Hardware) -> list[Source]:
    """The enabled sources, in registry order."""
    return [
        source
        for name, factory in SOURCES.items()
        if getattr(config.sources, name).enabled
        for source in factory(config, hardware)
    ]
