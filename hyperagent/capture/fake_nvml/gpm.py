"""The fake's GPM calls: a device supports GPM when its record has an activity, and a metric
over two samples is the value the later sample took."""

from __future__ import annotations

import ctypes
from typing import Any

import pynvml

from hyperagent.capture.fake_nvml.state import FakeNvmlHandle, GpmSample, NvmlState, error

_GPM_FIELDS = {
    pynvml.NVML_GPM_METRIC_SM_UTIL: "sm_active_pct",
    pynvml.NVML_GPM_METRIC_SM_OCCUPANCY: "sm_occupancy_pct",
    pynvml.NVML_GPM_METRIC_ANY_TENSOR_UTIL: "tensor_active_pct",
    pynvml.NVML_GPM_METRIC_DRAM_BW_UTIL: "dram_active_pct",
}


class GpmCalls(NvmlState):
    """GPM support, samples and metrics over the replayed GPUs."""

    def nvmlGpmQueryDeviceSupport(self, handle: FakeNvmlHandle) -> pynvml.c_nvmlGpmSupport_t:
        """GPM support: a device whose record has a GPM activity supports it."""
        record = self._record(handle)
        supported = any(getattr(record, name) is not None for name in _GPM_FIELDS.values())
        return pynvml.c_nvmlGpmSupport_t(
            version=pynvml.NVML_GPM_SUPPORT_VERSION, isSupportedDevice=int(supported)
        )

    def nvmlGpmSampleAlloc(self) -> Any:
        """A new sample, a real `c_nvmlGpmSample_t` pointer so it fits pynvml's structs."""
        buffer = ctypes.create_string_buffer(8)
        with self._lock:
            self._check_init()
            self._gpm_samples[ctypes.addressof(buffer)] = GpmSample(buffer)
        return ctypes.cast(buffer, pynvml.c_nvmlGpmSample_t)

    def _gpm_sample(self, sample: Any) -> GpmSample:
        address = ctypes.cast(sample, ctypes.c_void_p).value if sample else None
        found = self._gpm_samples.get(address or 0)
        if found is None:
            raise error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return found

    def nvmlGpmSampleFree(self, gpmSample: Any) -> None:
        """Release a sample."""
        with self._lock:
            self._check_init()
            found = self._gpm_sample(gpmSample)
            del self._gpm_samples[ctypes.addressof(found.buffer)]

    def nvmlGpmSampleGet(self, device: FakeNvmlHandle, gpmSample: Any) -> Any:
        """Record the device's current GPM activities into `gpmSample`."""
        with self._lock:
            record = self._device(device).record
            sample = self._gpm_sample(gpmSample)
            values = {
                metric: value
                for metric, name in _GPM_FIELDS.items()
                if (value := getattr(record, name)) is not None
            }
            if not values:
                raise error(pynvml.NVML_ERROR_NOT_SUPPORTED)
            sample.device, sample.values = record.index, values
        return gpmSample

    def nvmlGpmMetricsGet(self, metricsGet: Any) -> Any:
        """Fill `metricsGet.metrics[:numMetrics]` from its two samples of one device."""
        with self._lock:
            self._check_init()
            if metricsGet.version != pynvml.NVML_GPM_METRICS_GET_VERSION:
                raise error(pynvml.NVML_ERROR_ARGUMENT_VERSION_MISMATCH)
            first = self._gpm_sample(metricsGet.sample1)
            second = self._gpm_sample(metricsGet.sample2)
            if first.device is None or first.device != second.device:
                raise error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
            if not 0 < metricsGet.numMetrics <= pynvml.NVML_GPM_METRIC_MAX:
                raise error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
            for i in range(metricsGet.numMetrics):
                metric = metricsGet.metrics[i]
                value = second.values.get(metric.metricId)
                metric.nvmlReturn = (
                    pynvml.NVML_ERROR_NOT_SUPPORTED if value is None else pynvml.NVML_SUCCESS
                )
                metric.value = 0.0 if value is None else value
        return metricsGet
