"""Capture directories wired in as hardware: the fake vendor libraries (FakeNvml, FakeAmdsmi,
FakeHlml), the recording's player and the tools' saved outputs handed to the same sources a
live agent builds (see README: capture directories). The agent's replay and
``sources.nvml.dump`` come through here; the sources themselves know nothing of captures.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from hyperagent.capture import amd_smi, hl_smi, nvidia_smi, xpu_smi
from hyperagent.capture.accelerators import CaptureFormatError
from hyperagent.capture.fake_amdsmi import FakeAmdsmi
from hyperagent.capture.fake_hlml import FakeHlml
from hyperagent.capture.fake_nvml import FakeNvml
from hyperagent.capture.xpu_smi import FakeXpuSmi
from hyperagent.config import Config
from hyperagent.devices.amd import AmdsmiLibrary
from hyperagent.devices.gaudi import HlmlLibrary
from hyperagent.devices.source import AcceleratorSource
from hyperagent.errors import ConfigError, ConfigProblem
from hyperagent.replay import (
    RECORDING_FILE,
    Player,
    RecordedNvmlSource,
    RecordedSource,
    load_recording,
)
from hyperagent.sources import Hardware, ipmi, ipmi_capture, job_source, pdu_sources, rdma, smi_text
from hyperagent.sources.base import Source
from hyperagent.sources.host import HostSource
from hyperagent.sources.nvml import NvmlSource


def configured_hardware(config: Config) -> Hardware:
    """The hardware the config's sources read: ``sources.nvml.dump``'s capture replayed by a
    FakeNvml taking power caps, else the libraries installed. Raises ConfigError naming
    ``sources.nvml.dump`` when that file does not parse."""
    dump = config.sources.nvml.dump
    if dump is None:
        return Hardware.installed()
    try:
        return Hardware(nvml=FakeNvml.from_capture(dump, writable=True))
    except (OSError, ValueError) as e:
        raise ConfigError([ConfigProblem("sources.nvml.dump", f"{dump}: {e}")]) from e


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

    - ``nvml``: ``nvidia-smi.xml`` (its GPUs' processes from ``nvidia-smi-compute-apps.csv``,
      ``--query-compute-apps=gpu_uuid,pid,...``), else the recording's GPU readings, which go
      through NvmlSource over a fake NVML taking power caps when ``actuation.power_cap`` is on;
    - ``rdma``: ``sys/class/infiniband`` with the ``rdma``/``ethtool`` outputs beside it;
    - ``ipmi``: ``ipmitool-sdr.txt`` or ``ipmiutil-sensor.txt`` (one table, or a day file of
      timestamped tables played as a time series) and ``ipmitool-dcmi.txt``;
    - ``pdu``: ``[[sources.pdu.targets]]`` with their outlets, each reading ``pdu/NAME.snmprec``
      (no targets configured: every recording in ``pdu/``);
    - ``host``: ``proc/`` (with a ``stat``), else this machine's when the config names
      ``[sources.host]``, else the recording's; a ``proc/`` of processes (and ``etc/passwd``)
      is what job attribution reads (``[attribution]``);
    - ``job``: the live job socket when the config names ``[sources.job]`` (a replayed node
      still serves its training job), else the recording's;
    - any other source the recording holds, as recorded.

    ``clock`` drives the fake GPUs' energy counters, the recording's player and day files;
    recorded time passes ``speed`` times as fast as it. Raises ConfigError naming ``--replay``
    when the directory holds nothing to replay, or a file that does not parse as its name
    says (the file, the line and the format expected).
    """
    hardware = Hardware(nvml=None, replayed=True, capture_dir=directory)
    sources: list[Source] = []
    nvml = None
    smi = directory / "nvidia-smi.xml"
    if config.sources.nvml.enabled and smi.is_file():
        nvml = FakeNvml.from_capture(smi, clock=clock)
        replay_processes(nvml, directory / nvidia_smi.COMPUTE_APPS_FILE)
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
    sources += _node_sources(directory, config, hardware, clock, speed)
    recorded, recorded_nvml = _recorded_sources(
        directory, config, {s.name for s in sources}, clock, speed
    )
    sources += recorded
    if recorded_nvml is not None:
        nvml = recorded_nvml
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


def _node_sources(
    directory: Path,
    config: Config,
    hardware: Hardware,
    clock: Callable[[], float],
    speed: float,
) -> list[Source]:
    """The rdma, pdu, ipmi, host and job sources of :func:`capture_sources`."""
    enabled = config.sources
    named = enabled.model_fields_set
    sources: list[Source] = []
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
    if enabled.host.enabled and (directory / "proc" / "stat").is_file():
        sources.append(HostSource(directory / "proc"))
    elif enabled.host.enabled and "host" in named:
        sources.append(HostSource())
    if enabled.job.enabled and "job" in named:
        sources.append(job_source(config))
    return sources


def _recorded_sources(
    directory: Path,
    config: Config,
    provided: set[str],
    clock: Callable[[], float],
    speed: float,
) -> tuple[list[Source], FakeNvml | None]:
    """The recording's sources that ``config`` enables and ``provided`` lacks, and the fake
    NVML its GPU readings play through (where power caps are on)."""
    recording = directory / RECORDING_FILE
    if not recording.is_file():
        return [], None
    player = Player(load_recording(recording), clock, speed)
    sources: list[Source] = []
    nvml = None
    for name in player.recording.source_names:
        if name in provided or not _enabled(config, name):
            continue
        if name == "nvml" and config.actuation.power_cap:
            nvml_replay = RecordedNvmlSource(player)
            nvml = nvml_replay.fake
            sources.append(nvml_replay)
        else:
            sources.append(RecordedSource(name, player))
    return sources, nvml


def replay_processes(nvml: FakeNvml, capture: Path) -> None:
    """Put the processes of a ``--query-compute-apps`` capture on the fake's GPUs (by uuid);
    raises ConfigError naming ``--replay`` for a malformed file or a uuid no GPU has."""
    if not capture.is_file():
        return
    try:
        apps = nvidia_smi.parse_compute_apps(capture.read_text())
        pids: dict[int, list[int]] = {}
        for uuid, pid in apps:
            pids.setdefault(nvml.index_of(uuid), []).append(pid)
    except ValueError as e:
        raise ConfigError([ConfigProblem("--replay", f"{capture}: {e}")]) from e
    for index, running in pids.items():
        nvml.set_processes(index, running)


def replayed_library(directory: Path, clock: Callable[[], float]) -> tuple[Any, Any, str] | None:
    """The fake vendor library replaying the directory's AMD (amd-smi, rocm-smi), Gaudi (hl-smi)
    or Intel GPU Max (xpu-smi) capture, its :class:`~hyperagent.devices.base.DeviceLibrary`
    (None for xpu-smi, a text tool the fake answers for) and its source name; None when the
    directory holds none of them."""
    try:
        if any((directory / name).is_file() for name in amd_smi.CAPTURE_FILES):
            amd = FakeAmdsmi.from_capture(directory, clock=clock)
            return amd, AmdsmiLibrary(amd, check_s=0.0), "amdsmi"
        if (directory / hl_smi.CAPTURE_FILE).is_file():
            hlml = FakeHlml.from_capture(directory, clock=clock)
            return hlml, HlmlLibrary(hlml), "hlml"
        if (directory / xpu_smi.DUMP_FILE).is_file():
            return FakeXpuSmi.from_capture(directory, clock=clock), None, "xpu_smi"
    except CaptureFormatError as e:
        raise ConfigError([ConfigProblem("--replay", str(e))]) from e
    return None


def _replayed_accelerators(
    directory: Path, config: Config, clock: Callable[[], float]
) -> Source | None:
    """The source over a fake vendor library replaying the directory's AMD or Gaudi capture
    (:func:`replayed_library`), when it holds one, the text source over FakeXpuSmi for an
    xpu-smi capture; the other text tools' captures (npu-smi, cnmon) as their text source."""
    timeout_s = config.sources.timeout_s
    replayed = replayed_library(directory, clock)
    if replayed is not None:
        fake, library, name = replayed
        if library is None:
            return smi_text.SmiTextSource(name, (), timeout_s=timeout_s, runner=fake.run)
        return AcceleratorSource(library, name=name, timeout_s=timeout_s)
    for name, capture in smi_text.CAPTURE_FILES.items():
        if (directory / capture).is_file():
            return smi_text.SmiTextSource(
                name, (), timeout_s=timeout_s, capture=directory / capture
            )
    return None
