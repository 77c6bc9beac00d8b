"""The GPU metric names, one catalog for every vendor: what ``hyperagent_gpu_*`` readings are
called and what ``HELP`` says of each. The device layer's readers (NVML's, the common
interface's, the text tools') and the dashboards, rules and catalog above them all take the
names from here.
"""

from __future__ import annotations

GPU_INFO = "hyperagent_gpu_info"
UTILIZATION = "hyperagent_gpu_utilization_ratio"
MEMORY_UTILIZATION = "hyperagent_gpu_memory_utilization_ratio"
SM_ACTIVE = "hyperagent_gpu_sm_active_ratio"
SM_OCCUPANCY = "hyperagent_gpu_sm_occupancy_ratio"
TENSOR_ACTIVE = "hyperagent_gpu_tensor_active_ratio"
DRAM_ACTIVE = "hyperagent_gpu_dram_active_ratio"
MEMORY_USED = "hyperagent_gpu_memory_used_bytes"
MEMORY_TOTAL = "hyperagent_gpu_memory_total_bytes"
POWER = "hyperagent_gpu_power_watts"
POWER_INSTANT = "hyperagent_gpu_power_instant_watts"
POWER_LIMIT = "hyperagent_gpu_power_limit_watts"
POWER_LIMIT_MIN = "hyperagent_gpu_power_limit_min_watts"
POWER_LIMIT_MAX = "hyperagent_gpu_power_limit_max_watts"
ENERGY = "hyperagent_gpu_energy_joules_total"
TEMPERATURE = "hyperagent_gpu_temperature_celsius"
MEMORY_TEMPERATURE = "hyperagent_gpu_memory_temperature_celsius"
SM_CLOCK = "hyperagent_gpu_sm_clock_hertz"
MEMORY_CLOCK = "hyperagent_gpu_memory_clock_hertz"
THROTTLE = "hyperagent_gpu_throttle_seconds_total"
ECC_ERRORS = "hyperagent_gpu_ecc_errors_total"
ECC_LIFETIME_ERRORS = "hyperagent_gpu_ecc_lifetime_errors_total"
RETIRED_PAGES = "hyperagent_gpu_retired_pages"
RETIRED_PAGES_PENDING = "hyperagent_gpu_retired_pages_pending"
REMAPPED_ROWS = "hyperagent_gpu_remapped_rows"
REMAPPED_ROWS_PENDING = "hyperagent_gpu_remapped_rows_pending"
REMAPPED_ROWS_FAILED = "hyperagent_gpu_remapped_rows_failed"
PCIE_THROUGHPUT = "hyperagent_gpu_pcie_throughput_bytes_per_second"
PCIE_REPLAYS = "hyperagent_gpu_pcie_replays_total"
NVLINK_UP = "hyperagent_gpu_nvlink_up"
NVLINK_DATA = "hyperagent_gpu_nvlink_data_bytes_total"
NVLINK_ERRORS = "hyperagent_gpu_nvlink_errors_total"
XID_ERRORS = "hyperagent_gpu_xid_errors_total"
MIG_INFO = "hyperagent_gpu_mig_info"
MIG_MEMORY_USED = "hyperagent_gpu_mig_memory_used_bytes"
MIG_MEMORY_TOTAL = "hyperagent_gpu_mig_memory_total_bytes"

HELP: dict[str, str] = {
    GPU_INFO: "GPU identity: model and driver version.",
    UTILIZATION: "Fraction of the last sample period a kernel ran.",
    MEMORY_UTILIZATION: "Fraction of the last sample period device memory was read or written.",
    SM_ACTIVE: "Fraction of SMs busy since the previous read (GPM SM utilisation).",
    SM_OCCUPANCY: "Resident warps as a fraction of the SMs' maximum since the previous read.",
    TENSOR_ACTIVE: "Fraction of time the SMs ran tensor-core instructions since the previous read.",
    DRAM_ACTIVE: "Device memory bandwidth used as a fraction of its peak since the previous read.",
    MEMORY_USED: "Device memory in use, including memory the driver reserves.",
    MEMORY_TOTAL: "Device memory installed.",
    POWER: "Power draw of the GPU board: NVML's 1 s average where the GPU has one (Ampere on).",
    POWER_INSTANT: "Power draw of the GPU board at the read, not averaged.",
    POWER_LIMIT: "Enforced power limit.",
    POWER_LIMIT_MIN: "Lowest power limit the device accepts.",
    POWER_LIMIT_MAX: "Highest power limit the device accepts.",
    ENERGY: "Energy consumed since the driver loaded.",
    TEMPERATURE: "GPU core temperature.",
    MEMORY_TEMPERATURE: "Device memory (HBM) temperature.",
    SM_CLOCK: "Current SM clock.",
    MEMORY_CLOCK: "Current memory clock.",
    THROTTLE: (
        "Time clocks were held down, by reason: NVML's own counter where it has one, "
        "else the agent's integration of the active reasons between reads."
    ),
    ECC_ERRORS: "ECC errors since the driver loaded (NVML volatile counts), by type.",
    ECC_LIFETIME_ERRORS: "ECC errors over the board's life (NVML aggregate counts), by type.",
    RETIRED_PAGES: "Device memory pages retired, by cause.",
    RETIRED_PAGES_PENDING: "1 when a page is waiting to be retired at the next driver reload.",
    REMAPPED_ROWS: "Device memory rows remapped, by the kind of error that caused it.",
    REMAPPED_ROWS_PENDING: "1 when a row remapping waits for a GPU reset.",
    REMAPPED_ROWS_FAILED: "1 when a row remapping failed: the GPU needs service.",
    PCIE_THROUGHPUT: "PCIe traffic over NVML's last 20 ms sample, by direction.",
    PCIE_REPLAYS: "PCIe link replays (retransmissions) since the driver loaded.",
    NVLINK_UP: "1 when the NVLink is active.",
    NVLINK_DATA: "NVLink payload bytes, by link and direction.",
    NVLINK_ERRORS: "NVLink data-link errors, by link and type.",
    XID_ERRORS: "Critical XID events reported by the driver since the agent started, by XID.",
    MIG_INFO: "A MIG device of the GPU: its UUID, GPU and compute instance and profile.",
    MIG_MEMORY_USED: "Memory in use in a MIG device.",
    MIG_MEMORY_TOTAL: "Memory of a MIG device.",
}
