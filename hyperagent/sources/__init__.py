"""Telemetry sources, registered explicitly by config name."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace
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
from hyperagent.sources import ipmi, ipmi_capture, pdu, rdma
from hyperagent.sources.base import Source
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

    @classmethod
    def from_config(cls, config: Config) -> Hardware:
        dump = config.sources.nvml.dump
        if dump is not None:
            from hyperagent.capture.fake_nvml import FakeNvml

            try:
                return cls(nvml=FakeNvml.from_capture(dump, writable=True))
            except (OSError, ValueError) as e:
                raise ConfigError([ConfigProblem("sources.nvml.dump", f"{dump}: {e}")]) from e
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
    """The source reading the tool of ``name`` (npu_smi, cnmon) as text."""

    def build(config: Config, hardware: Hardware) -> list[Source]:
        from hyperagent.devices import smi_text

        section = getattr(config.sources, name)
        return [smi_text.SmiTextSource(name, section.command, timeout_s=section.timeout_s)]

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
}
"""Config name -> factory. Each is enabled by ``[sources.<name>] enabled`` (default on, except
the other accelerator vendors': amdsmi, hlml, npu_smi and cnmon are off unless enabled)."""


PDU_RECORDINGS = (".snmprec", ".snmpwalk")


def _check_pdu_recordings(config: Config, folder: Path) -> None:
    """Raise ConfigError naming a configured PDU target that has no recording in ``folder``."""
    recorded = sorted(p.stem for p in folder.iterdir() if p.suffix in PDU_RECORDINGS)
    problems = [
        ConfigProblem(
            f"sources.pdu.targets[{i}].name",
            f"{t.name}: no {t.name}.snmprec in {folder}"
            f" (recorded: {', '.join(recorded) or 'none'})",
        )
        for i, t in enumerate(config.sources.pdu.targets)
        if t.name not in recorded
    ]
    if problems:
        raise ConfigError(problems)


def _enabled(config: Config, name: str) -> bool:
    """Whether the config enables the source ``name`` (one it does not know: yes)."""
    section = getattr(config.sources, name, None)
    return bool(getattr(section, "enabled", True))


def capture_sources(
    directory: Path,
    config: Config,
    clock: Callable[[], float] = time.monotonic,
    speed: float = 1.0,
) -> tuple[list[Source], Hardware]:
    """Sources replaying what a capture directory holds (see README: capture directories), the
    ones ``config`` enables, built as a live agent builds them where the capture allows:

    - ``nvml``: ``nvidia-smi.xml``, else the recording's GPU readings, which go through
      NvmlSource over a fake NVML taking power caps when ``actuation.power_cap`` is on;
    - ``rdma``: ``sys/class/infiniband`` with the ``rdma``/``ethtool`` outputs beside it;
    - ``ipmi``: ``ipmitool-sdr.txt`` or ``ipmiutil-sensor.txt`` (one table, or a day file of
      timestamped tables played as a time series) and ``ipmitool-dcmi.txt``;
    - ``pdu``: ``[[sources.pdu.targets]]`` with their outlets, each reading ``pdu/NAME.snmprec``
      (no targets configured: every recording in ``pdu/``);
    - ``host``: ``proc/``, else this machine's when the config names ``[sources.host]``, else
      the recording's;
    - ``job``: the live job socket when the config names ``[sources.job]`` (a replayed node
      still serves its training job), else the recording's;
    - any other source the recording holds, as recorded.

    ``clock`` drives the fake GPUs' energy counters, the recording's player and day files;
    recorded time passes ``speed`` times as fast as it. Raises ConfigError naming ``--replay``
    when the directory holds nothing to replay.
    """
    from hyperagent.capture.fake_nvml import FakeNvml

    enabled = config.sources
    named = enabled.model_fields_set
    hardware = Hardware(nvml=None, replayed=True, capture_dir=directory)
    sources: list[Source] = []
    nvml = None
    smi = directory / "nvidia-smi.xml"
    if enabled.nvml.enabled and smi.is_file():
        nvml = FakeNvml.from_capture(smi, clock=clock)
        sources.append(
            NvmlSource(
                nvml,
                clock=clock,
                health_interval_s=config.sources.nvml.health_interval_s,
                timeout_s=config.sources.timeout_s,
            )
        )
    accelerators = _replayed_accelerators(directory, config, clock)
    if accelerators is not None:
        sources.append(accelerators)
    if enabled.rdma.enabled and (directory / "sys" / "class" / "infiniband").is_dir():
        sources.append(
            rdma.RdmaSource(
                directory / "sys",
                rdma.capture_runner(directory),
                commands_interval_s=config.sources.rdma.commands_interval_s,
                clock=clock,
                rescan_interval_s=config.sources.rdma.rescan_interval_s,
            )
        )
    if enabled.pdu.enabled and (directory / "pdu").is_dir():
        _check_pdu_recordings(config, directory / "pdu")
        sources += pdu_sources(config, hardware)
    if enabled.ipmi.enabled and any(
        (directory / name).is_file() for name in ipmi_capture.SDR_CAPTURES
    ):
        runner = ipmi_capture.capture_runner(directory, clock, speed)
        sources.append(ipmi.IpmiSource(ipmi.IpmitoolBackend(runner, target=directory.name)))
    if enabled.host.enabled and (directory / "proc").is_dir():
        sources.append(HostSource(directory / "proc"))
    elif enabled.host.enabled and "host" in named:
        sources.append(HostSource())
    if enabled.job.enabled and "job" in named:
        sources.append(job_source(config))
    recording = directory / RECORDING_FILE
    if recording.is_file():
        player = Player(load_recording(recording), clock, speed)
        provided = {s.name for s in sources}
        for name in player.recording.source_names:
            if name in provided or not _enabled(config, name):
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
    library = getattr(accelerators, "library", None)
    return sources, replace(hardware, nvml=nvml, accelerators=library)


def replayed_library(directory: Path, clock: Callable[[], float]) -> tuple[Any, Any, str] | None:
    """The fake vendor library replaying the directory's AMD (amd-smi, rocm-smi) or Gaudi
    (hl-smi) capture, its :class:`~hyperagent.devices.base.DeviceLibrary` and its source name;
    None when the directory holds neither."""
    from hyperagent.capture import amd_smi, hl_smi

    if any((directory / name).is_file() for name in amd_smi.CAPTURE_FILES):
        from hyperagent.capture.fake_amdsmi import FakeAmdsmi
        from hyperagent.devices.amd import AmdsmiLibrary

        amd = FakeAmdsmi.from_capture(directory, clock=clock)
        return amd, AmdsmiLibrary(amd, check_s=0.0), "amdsmi"
    if (directory / hl_smi.CAPTURE_FILE).is_file():
        from hyperagent.capture.fake_hlml import FakeHlml
        from hyperagent.devices.gaudi import HlmlLibrary

        hlml = FakeHlml.from_capture(directory, clock=clock)
        return hlml, HlmlLibrary(hlml), "hlml"
    return None


def _replayed_accelerators(
    directory: Path, config: Config, clock: Callable[[], float]
) -> Source | None:
    """The source over a fake vendor library replaying the directory's AMD or Gaudi capture
    (:func:`replayed_library`), when it holds one; text tools' captures (npu-smi, cnmon) as
    their text source."""
    from hyperagent.devices import smi_text
    from hyperagent.devices.source import AcceleratorSource

    timeout_s = config.sources.timeout_s
    replayed = replayed_library(directory, clock)
    if replayed is not None:
        _, library, name = replayed
        return AcceleratorSource(library, name=name, timeout_s=timeout_s)
    for name, capture in smi_text.CAPTURE_FILES.items():
        if (directory / capture).is_file():
            return smi_text.SmiTextSource(
                name, (), timeout_s=timeout_s, capture=directory / capture
            )
    return None


def build_sources(config: Config, hardware: Hardware) -> list[Source]:
    """The enabled sources, in registry order."""
    return [
        source
        for name, factory in SOURCES.items()
        if getattr(config.sources, name).enabled
        for source in factory(config, hardware)
    ]
