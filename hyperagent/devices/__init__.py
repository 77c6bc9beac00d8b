"""The device layer: one interface over every accelerator vendor's library.

- :mod:`~hyperagent.devices.base`: the interface (:class:`DeviceLibrary`, :class:`Accelerator`,
  :class:`DeviceIdentity`) and its units;
- :mod:`~hyperagent.devices.nvml`: NVIDIA through ``pynvml``;
- :mod:`~hyperagent.devices.amd`: AMD Instinct through ``amdsmi``;
- :mod:`~hyperagent.devices.gaudi`: Intel Gaudi through ``pyhlml`` (habana-pyhlml);
- :mod:`~hyperagent.devices.source`: the telemetry source over any library
  (``hyperagent_gpu_*`` readings);
- :mod:`~hyperagent.devices.smi_text`: Ascend (``npu-smi``) and Cambricon (``cnmon``), read from
  their tools' text, telemetry only.
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
