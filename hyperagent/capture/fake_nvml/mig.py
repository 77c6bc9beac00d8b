"""The fake's MIG calls: MIG mode and the MIG devices a capture lists, with their handles."""

from __future__ import annotations

import pynvml

from hyperagent.capture.fake_nvml.state import FakeNvmlHandle, NvmlState, error, supported
from hyperagent.capture.nvidia_smi import MigRecord


class MigCalls(NvmlState):
    """MIG mode, devices and instance ids, as recorded."""

    def nvmlDeviceGetMigMode(self, handle: FakeNvmlHandle) -> list[int]:
        """`[current, pending]` MIG mode (the capture's current mode for both)."""
        enabled = supported(self._record(handle).mig_enabled)
        mode = pynvml.NVML_DEVICE_MIG_ENABLE if enabled else pynvml.NVML_DEVICE_MIG_DISABLE
        return [mode, mode]

    def nvmlDeviceGetMaxMigDeviceCount(self, handle: FakeNvmlHandle) -> int:
        """MIG device slots: those the capture lists (0 when MIG is off or unsupported)."""
        record = self._record(handle)
        if not record.mig_enabled or not record.mig_devices:
            return 0
        return max(mig.index for mig in record.mig_devices) + 1

    def nvmlDeviceGetMigDeviceHandleByIndex(
        self, handle: FakeNvmlHandle, index: int
    ) -> FakeNvmlHandle:
        """Handle of the MIG device in slot `index`; NOT_FOUND for an empty slot."""
        with self._lock:
            device = self._device(handle)
            if not device.record.mig_enabled:
                raise error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
            if device.mig(index) is None:
                raise error(pynvml.NVML_ERROR_NOT_FOUND)
            found = device.mig_handles.get(index)
            if found is None:
                found = device.mig_handles[index] = FakeNvmlHandle(self, device.record.index, index)
            return found

    def nvmlDeviceIsMigDeviceHandle(self, handle: FakeNvmlHandle) -> bool:
        """Whether `handle` is a MIG device's."""
        with self._lock:
            _, mig = self._mig_record(handle)
            return mig is not None

    def _mig_only(self, handle: FakeNvmlHandle) -> MigRecord:
        with self._lock:
            _, mig = self._mig_record(handle)
        return supported(mig)

    def nvmlDeviceGetGpuInstanceId(self, handle: FakeNvmlHandle) -> int:
        """GPU instance id of a MIG device (NOT_SUPPORTED on a GPU handle)."""
        return self._mig_only(handle).gpu_instance_id

    def nvmlDeviceGetComputeInstanceId(self, handle: FakeNvmlHandle) -> int:
        """Compute instance id of a MIG device (NOT_SUPPORTED on a GPU handle)."""
        return self._mig_only(handle).compute_instance_id

    def nvmlDeviceGetDeviceHandleFromMigDeviceHandle(
        self, handle: FakeNvmlHandle
    ) -> FakeNvmlHandle:
        """The parent GPU of a MIG device."""
        self._mig_only(handle)
        return self._devices[handle.index].handle
