"""The fake's NVML calls that read a GPU: library and identity, utilisation, memory,
temperature, clocks and clock events, memory health, PCIe and NVLink, and its processes."""

from __future__ import annotations

from collections.abc import Iterable

import pynvml

from hyperagent.capture.fake_nvml.state import (
    NO_COMPUTE_INSTANCE,
    NO_GPU_INSTANCE,
    FakeNvmlHandle,
    NvmlState,
    error,
    supported,
)
from hyperagent.capture.nvidia_smi import GpuRecord, MigRecord, NvLinkRecord, RemappedRows
from hyperagent.devices import nvml_api

_VIOLATIONS = {policy: reason for reason, policy in nvml_api.violation_policies(pynvml)}
REASON_BITS = nvml_api.clock_event_reason_bits(pynvml)
_NVLINK_ERRORS = {which: name for name, which in nvml_api.nvlink_error_counters(pynvml)}
_ECC_TYPES = {
    pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED: "corrected",
    pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED: "uncorrected",
}
_ECC_COUNTERS = {pynvml.NVML_VOLATILE_ECC: "volatile", pynvml.NVML_AGGREGATE_ECC: "aggregate"}
_ECC_LOCATIONS = {
    pynvml.NVML_MEMORY_LOCATION_L1_CACHE: "l1_cache",
    pynvml.NVML_MEMORY_LOCATION_L2_CACHE: "l2_cache",
    pynvml.NVML_MEMORY_LOCATION_DEVICE_MEMORY: "device_memory",
    pynvml.NVML_MEMORY_LOCATION_REGISTER_FILE: "register_file",
    pynvml.NVML_MEMORY_LOCATION_TEXTURE_MEMORY: "texture_memory",
    pynvml.NVML_MEMORY_LOCATION_TEXTURE_SHM: "texture_shm",
    pynvml.NVML_MEMORY_LOCATION_CBU: "cbu",
    pynvml.NVML_MEMORY_LOCATION_SRAM: "sram",
}


class LibraryCalls(NvmlState):
    """NVML's library calls and the identity of its devices."""

    def nvmlInit(self) -> None:
        """Initialise (refcounted: each call needs a matching `nvmlShutdown`)."""
        with self._lock:
            self._refcount += 1

    def nvmlShutdown(self) -> None:
        """Drop one reference; at zero every call raises NVMLError_Uninitialized."""
        with self._lock:
            self._check_init()
            self._refcount -= 1
            self._events.notify_all()

    def nvmlSystemGetDriverVersion(self) -> str:
        """The driver version string of the capture."""
        with self._lock:
            self._check_init()
            return self._driver

    def nvmlDeviceGetCount(self) -> int:
        """Number of GPUs, failed ones included."""
        with self._lock:
            self._check_init()
            return len(self._devices)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> FakeNvmlHandle:
        """Handle of GPU `index`; NVMLError_InvalidArgument when there is no such GPU."""
        with self._lock:
            self._check_init()
            if not isinstance(index, int) or not 0 <= index < len(self._devices):
                raise error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
            device = self._devices[index]
            if device.failure is not None:
                raise error(device.failure)
            return device.handle

    def nvmlDeviceGetHandleByUUID(self, uuid: str | bytes) -> FakeNvmlHandle:
        """Handle of the GPU with `uuid`; NVMLError_NotFound when there is none."""
        wanted = uuid.decode() if isinstance(uuid, bytes) else uuid
        with self._lock:
            self._check_init()
            for device in self._devices:
                if device.record.uuid == wanted:
                    if device.failure is not None:
                        raise error(device.failure)
                    return device.handle
            raise error(pynvml.NVML_ERROR_NOT_FOUND)

    def nvmlDeviceGetName(self, handle: FakeNvmlHandle) -> str:
        """Product name, e.g. "NVIDIA A100-SXM4-80GB"; "<GPU name> MIG <profile>" for MIG."""
        with self._lock:
            device, mig = self._mig_record(handle)
            if mig is None:
                return device.record.name
            return f"{device.record.name} MIG {supported(mig.profile)}"

    def nvmlDeviceGetUUID(self, handle: FakeNvmlHandle) -> str:
        """GPU UUID string, "GPU-..."; a MIG device's "MIG-..." where recorded."""
        with self._lock:
            device, mig = self._mig_record(handle)
            return device.record.uuid if mig is None else supported(mig.uuid)

    def nvmlDeviceGetIndex(self, handle: FakeNvmlHandle) -> int:
        """NVML index of the device."""
        return self._record(handle).index


class ReadingCalls(NvmlState):
    """Utilisation, memory, temperature, clocks and clock events, as recorded."""

    def nvmlDeviceGetUtilizationRates(self, handle: FakeNvmlHandle) -> pynvml.c_nvmlUtilization_t:
        """`.gpu` and `.memory` utilisation, integer percent (NOT_SUPPORTED e.g. under MIG)."""
        record = self._record(handle)
        return pynvml.c_nvmlUtilization_t(
            gpu=round(supported(record.util_gpu_pct)),
            memory=round(supported(record.util_mem_pct)),
        )

    def nvmlDeviceGetMemoryInfo(
        self, handle: FakeNvmlHandle, version: int | None = None
    ) -> pynvml.c_nvmlMemory_t | pynvml.c_nvmlMemory_v2_t:
        """Frame-buffer memory in bytes, as NVML's v1 or (with `version=nvmlMemory_v2`) v2 struct.

        v1 `used` is reserved plus allocated memory, as NVML v1 reports it; v2 separates
        `reserved`. `free` is total - used - reserved in both. Works on MIG device handles.
        """
        with self._lock:
            device, mig = self._mig_record(handle)
            recorded: GpuRecord | MigRecord = device.record if mig is None else mig
        total = supported(recorded.mem_total_bytes)
        used = supported(recorded.mem_used_bytes)
        reserved = recorded.mem_reserved_bytes or 0
        free = max(0, total - used - reserved)
        if not version:
            return pynvml.c_nvmlMemory_t(total=total, free=free, used=used + reserved)
        if version != pynvml.nvmlMemory_v2:
            raise error(pynvml.NVML_ERROR_ARGUMENT_VERSION_MISMATCH)
        return pynvml.c_nvmlMemory_v2_t(
            version=version, total=total, reserved=reserved, free=free, used=used
        )

    def nvmlDeviceGetTemperature(self, handle: FakeNvmlHandle, sensor: int) -> int:
        """GPU temperature in degrees C; `sensor` must be NVML_TEMPERATURE_GPU."""
        record = self._record(handle)
        if sensor != pynvml.NVML_TEMPERATURE_GPU:
            raise error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return round(supported(record.temperature_c))

    def nvmlDeviceGetClockInfo(self, handle: FakeNvmlHandle, type: int) -> int:
        """Current clock in MHz for NVML_CLOCK_GRAPHICS, _SM or _MEM (_VIDEO: NOT_SUPPORTED)."""
        record = self._record(handle)
        clocks = {
            pynvml.NVML_CLOCK_GRAPHICS: record.graphics_clock_mhz,
            pynvml.NVML_CLOCK_SM: record.sm_clock_mhz,
            pynvml.NVML_CLOCK_MEM: record.mem_clock_mhz,
            pynvml.NVML_CLOCK_VIDEO: None,
        }
        if type not in clocks:
            raise error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return round(supported(clocks[type]))

    def _reasons_mask(self, record: GpuRecord) -> int:
        active = supported(record.clock_event_reasons)
        return sum(bit for name, bit in REASON_BITS if name in active)

    def nvmlDeviceGetCurrentClocksEventReasons(self, handle: FakeNvmlHandle) -> int:
        """Active clock-event reasons as NVML's bitmask; FUNCTION_NOT_FOUND for old drivers."""
        record = self._record(handle)
        if not record.clock_event_api:
            raise error(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
        return self._reasons_mask(record)

    def nvmlDeviceGetCurrentClocksThrottleReasons(self, handle: FakeNvmlHandle) -> int:
        """The same bitmask under its pre-535 name, which every driver still exports."""
        return self._reasons_mask(self._record(handle))

    def nvmlDeviceGetViolationStatus(
        self, handle: FakeNvmlHandle, perfPolicyType: int
    ) -> pynvml.c_nvmlViolationTime_t:
        """Cumulative time (ns) clocks were held down by a perf policy, where recorded."""
        record = self._record(handle)
        if perfPolicyType not in _VIOLATIONS:
            raise error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        ns = supported(record.clock_event_counters_ns.get(_VIOLATIONS[perfPolicyType]))
        return pynvml.c_nvmlViolationTime_t(
            referenceTime=round(self._clock() * 1e6), violationTime=ns
        )


class HealthCalls(NvmlState):
    """Memory health (ECC, retired pages, remapped rows), PCIe and NVLink, as recorded."""

    def nvmlDeviceGetTotalEccErrors(
        self, handle: FakeNvmlHandle, errorType: int, counterType: int
    ) -> int:
        """ECC errors of a type (corrected/uncorrected), volatile or aggregate, all locations."""
        record = self._record(handle)
        if errorType not in _ECC_TYPES or counterType not in _ECC_COUNTERS:
            raise error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return supported(record.ecc_errors.get((_ECC_TYPES[errorType], _ECC_COUNTERS[counterType])))

    def nvmlDeviceGetMemoryErrorCounter(
        self, handle: FakeNvmlHandle, errorType: int, counterType: int, locationType: int
    ) -> int:
        """ECC errors of a type and counter at one memory location."""
        record = self._record(handle)
        if (
            errorType not in _ECC_TYPES
            or counterType not in _ECC_COUNTERS
            or locationType not in _ECC_LOCATIONS
        ):
            raise error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        key = (_ECC_TYPES[errorType], _ECC_COUNTERS[counterType], _ECC_LOCATIONS[locationType])
        return supported(record.ecc_errors_by_location.get(key))

    def nvmlDeviceGetRetiredPages(self, handle: FakeNvmlHandle, sourceFilter: int) -> list[int]:
        """Retired page addresses for a cause; pages 0..n-1 stand for n recorded pages."""
        record = self._record(handle)
        counts = {
            pynvml.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS: (
                record.retired_pages_single_bit
            ),
            pynvml.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR: record.retired_pages_double_bit,
        }
        if sourceFilter not in counts:
            raise error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return list(range(supported(counts[sourceFilter])))

    def nvmlDeviceGetRetiredPagesPendingStatus(self, handle: FakeNvmlHandle) -> int:
        """NVML_FEATURE_ENABLED when a page waits for retirement, else NVML_FEATURE_DISABLED."""
        pending = supported(self._record(handle).retired_pages_pending)
        return pynvml.NVML_FEATURE_ENABLED if pending else pynvml.NVML_FEATURE_DISABLED

    def nvmlDeviceGetRemappedRows(self, handle: FakeNvmlHandle) -> tuple[int, int, int, int]:
        """(correctable, uncorrectable, pending, failure) as pynvml returns them."""
        rows: RemappedRows = supported(self._record(handle).remapped_rows)
        return (rows.correctable, rows.uncorrectable, int(rows.pending), int(rows.failure))

    def nvmlDeviceGetPcieThroughput(self, handle: FakeNvmlHandle, counter: int) -> int:
        """PCIe throughput in KB/s (1 KB = 1024 B) for NVML_PCIE_UTIL_TX_BYTES or _RX_BYTES."""
        record = self._record(handle)
        rates = {
            pynvml.NVML_PCIE_UTIL_TX_BYTES: record.pcie_tx_bytes_per_s,
            pynvml.NVML_PCIE_UTIL_RX_BYTES: record.pcie_rx_bytes_per_s,
        }
        if counter not in rates:
            raise error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return supported(rates[counter]) // 1024

    def nvmlDeviceGetPcieReplayCounter(self, handle: FakeNvmlHandle) -> int:
        """PCIe replay count from the capture."""
        return supported(self._record(handle).pcie_replay_count)

    def _link(self, handle: FakeNvmlHandle, link: int) -> NvLinkRecord:
        links = {found.link: found for found in self._record(handle).nvlinks}
        if not links:
            raise error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        if not 0 <= link <= max(links):
            raise error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return supported(links.get(link))

    def nvmlDeviceGetNvLinkState(self, handle: FakeNvmlHandle, link: int) -> int:
        """NVML_FEATURE_ENABLED for an active link; INVALID_ARGUMENT past the last link."""
        active = supported(self._link(handle, link).active)
        return pynvml.NVML_FEATURE_ENABLED if active else pynvml.NVML_FEATURE_DISABLED

    def nvmlDeviceGetNvLinkErrorCounter(
        self, handle: FakeNvmlHandle, link: int, counter: int
    ) -> int:
        """An NVLink data-link error counter (NVML_NVLINK_ERROR_DL_*) of one link."""
        found = self._link(handle, link)
        if counter not in _NVLINK_ERRORS:
            raise error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return supported(found.errors.get(_NVLINK_ERRORS[counter]))


class ProcessCalls(NvmlState):
    """The compute processes on each device: set by the simulation, read through NVML."""

    def set_processes(self, index: int, pids: Iterable[int]) -> None:
        """Make ``pids`` the compute processes running on device ``index``."""
        with self._lock:
            self._control(index).processes = tuple(pids)

    def run_on_every_device(self, pid: int) -> None:
        """Make ``pid`` the compute process running on every device (one process driving the
        node's GPUs, as a simulated job's rank does)."""
        with self._lock:
            for device in self._devices:
                device.processes = (pid,)

    def nvmlDeviceGetComputeRunningProcesses(
        self, handle: FakeNvmlHandle
    ) -> list[pynvml.c_nvmlProcessInfo_t]:
        """The compute processes on the device, as pynvml's structs (memory not tracked)."""
        device = self._device(handle)
        return [
            pynvml.c_nvmlProcessInfo_t(
                pid=pid,
                usedGpuMemory=0,
                gpuInstanceId=NO_GPU_INSTANCE,
                computeInstanceId=NO_COMPUTE_INSTANCE,
            )
            for pid in device.processes
        ]
