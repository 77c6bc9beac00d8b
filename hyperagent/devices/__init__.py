"""The device layer: one interface over every accelerator vendor's library, and the bottom of
the package (it imports nothing from ``sources/``, ``capture/`` or replay).

- :mod:`~hyperagent.devices.base`: the interface (:class:`DeviceLibrary`, :class:`Accelerator`,
  :class:`DeviceIdentity`) and its units;
- :mod:`~hyperagent.devices.metrics`: the ``hyperagent_gpu_*`` names every vendor's readings
  take, and their help;
- :mod:`~hyperagent.devices.nvml`: NVIDIA through ``pynvml``, the common interface;
- :mod:`~hyperagent.devices.nvml_telemetry`: NVIDIA's full telemetry (field-value batches, GPM,
  NVLink, MIG, XID events, processes), every NVML call the agent makes to read GPUs, in parts:
  :mod:`~hyperagent.devices.nvml_api` (NVML's codes, ids and the call wrapper),
  :mod:`~hyperagent.devices.nvml_gpu` (what is kept per GPU between reads),
  :mod:`~hyperagent.devices.nvml_fields` (the field-value batches) and
  :mod:`~hyperagent.devices.nvml_xid` (the XID event watcher);
- :mod:`~hyperagent.devices.amd`: AMD Instinct through ``amdsmi``;
- :mod:`~hyperagent.devices.gaudi`: Intel Gaudi through ``pyhlml`` (habana-pyhlml);
- :mod:`~hyperagent.devices.source`: the telemetry source over any library
  (``hyperagent_gpu_*`` readings).

Tools that only print text (Ascend's ``npu-smi``, Cambricon's ``cnmon``) are read by
:mod:`hyperagent.sources.smi_text`.
"""

from __future__ import annotations

from typing import Any

from hyperagent.devices.base import DeviceLibrary


def as_library(devices: DeviceLibrary | Any) -> DeviceLibrary:
    """``devices`` when it is a DeviceLibrary, else NVML's over it (the ``pynvml`` module or a
    fake with its API)."""
    if hasattr(devices, "power_devices") and hasattr(devices, "module"):
        return devices  # type: ignore[no-any-return]
    from hyperagent.devices.nvml import NvmlLibrary

    return NvmlLibrary(devices)
