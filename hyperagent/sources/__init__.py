"""Telemetry sources, registered explicitly by config name."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from hyperagent.config import Config
from hyperagent.sources import ipmi, pdu, rdma
from hyperagent.sources.base import Source
from hyperagent.sources.command import RunCommand
from hyperagent.sources.host import HostSource
from hyperagent.sources.job import JobSource, PeerPolicy
from hyperagent.sources.nvml import NvmlSource


@dataclass(frozen=True)
class Hardware:
    """Where sources find the hardware: the real libraries, or fakes replaying captures."""

    nvml: Any
    """The ``pynvml`` module, or an object with its API (hyperagent.capture.fake_nvml)."""
    accelerators: Any = None
    """Another vendor's :class:`~hyperagent.devices.base.DeviceLibrary` whose power limits the
    agent sets where there is no NVML (AMD through amdsmi, Gaudi through HLML), or None."""
    replayed: bool = False
    """True for a capture directory: nothing of it is kept on this machine's disk."""
    capture_dir: Path | None = None
    """The capture directory replayed, whose recordings the factories read instead of the
    network (a PDU target reads ``pdu/NAME.snmprec``)."""
    tools: Mapping[str, RunCommand] = field(default_factory=dict)
    """Text tools answered by fakes instead of the installed ones, by source name
    (``xpu_smi``: a FakeXpuSmi's ``run``)."""

    @classmethod
    def installed(cls) -> Hardware:
        """The vendor libraries installed on this machine (``pynvml``)."""
        import pynvml

        return cls(nvml=pynvml)

    @property
    def power_library(self) -> Any:
        """What the power-cap actuator sets limits through: NVML, else the other vendor's
        library (``accelerators``), else None."""
        return self.nvml if self.nvml is not None else self.accelerators


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
    """One source per configured PDU (none configured: none). Replaying a capture directory,
    each target reads its recording in ``pdu/``, and without targets every recording there is
    a PDU of its own (without the node's outlets)."""
    c = config.sources.pdu
    targets = [
        pdu.PduTarget(t.name, t.host, t.port, t.community, t.vendor, t.outlets, t.inlets)
        for t in c.targets
    ]
    replay_dir = None if hardware.capture_dir is None else hardware.capture_dir / "pdu"
    return list(
        pdu.pdu_sources(targets, replay_dir=replay_dir, timeout_s=c.timeout_s, retries=c.retries)
    )


def job_source(config: Config) -> JobSource:
    """The job channel as ``sources.job`` configures it."""
    job = config.sources.job
    policy = PeerPolicy.resolve(
        job.allowed_users,
        job.allowed_groups,
        max_jobs=job.max_jobs,
        max_ranks=job.max_ranks,
        max_jobs_per_user=job.max_jobs_per_user,
        max_connections_per_user=job.max_connections_per_user,
        release_after_s=job.release_after_s,
    )
    return JobSource(job.socket, policy)


def _amdsmi_library() -> Any:
    from hyperagent.devices.amd import AmdsmiLibrary, load_amdsmi

    module = load_amdsmi()
    return None if module is None else AmdsmiLibrary(module)


def _hlml_library() -> Any:
    from hyperagent.devices.gaudi import HlmlLibrary, load_pyhlml

    module = load_pyhlml()
    return None if module is None else HlmlLibrary(module)


def accelerator_sources(name: str) -> SourceFactory:
    """The source of the vendor library ``name`` (amdsmi, hlml): over ``hardware.accelerators``
    when it is that library, else over the installed one."""
    make = {"amdsmi": _amdsmi_library, "hlml": _hlml_library}[name]

    def build(config: Config, hardware: Hardware) -> list[Source]:
        from hyperagent.devices.source import AcceleratorSource

        found = hardware.accelerators
        library = found if found is not None and found.name == name else make()
        return [AcceleratorSource(library, name=name, timeout_s=config.sources.timeout_s)]

    return build


def smi_text_sources(name: str) -> SourceFactory:
    """The source reading the tool of ``name`` (npu_smi, cnmon, xpu_smi) as text."""

    def build(config: Config, hardware: Hardware) -> list[Source]:
        from hyperagent.sources import smi_text

        section = getattr(config.sources, name)
        runner = hardware.tools.get(name)
        return [
            smi_text.SmiTextSource(
                name, section.command, timeout_s=section.timeout_s, runner=runner
            )
        ]

    return build


SOURCES: dict[str, SourceFactory] = {
    "nvml": lambda config, hw: [
        NvmlSource(
            hw.nvml,
            health_interval_s=config.sources.nvml.health_interval_s,
            timeout_s=config.sources.timeout_s,
        )
    ],
    "host": lambda config, hw: [HostSource()],
    "job": lambda config, hw: [job_source(config)],
    "ipmi": ipmi_sources,
    "rdma": rdma_sources,
    "pdu": pdu_sources,
    "amdsmi": accelerator_sources("amdsmi"),
    "hlml": accelerator_sources("hlml"),
    "npu_smi": smi_text_sources("npu_smi"),
    "cnmon": smi_text_sources("cnmon"),
    "xpu_smi": smi_text_sources("xpu_smi"),
}
"""Config name -> factory. Each is enabled by ``[sources.<name>] enabled`` (default on, except
the other accelerator vendors': amdsmi, hlml, npu_smi, cnmon and xpu_smi are off unless enabled)."""


def build_sources(config: Config, hardware: Hardware) -> list[Source]:
    """The enabled sources, in registry order."""
    return [
        source
        for name, factory in SOURCES.items()
        if getattr(config.sources, name).enabled
        for source in factory(config, hardware)
    ]
