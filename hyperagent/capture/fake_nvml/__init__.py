"""A fake NVML that replays `nvidia-smi` captures or agent recordings behind `pynvml`'s names.

`FakeNvml` stands in for the `pynvml` module: code written against `pynvml` (the nvidia-ml-py
package) runs unchanged when handed an instance, with the same function names, return types,
units (mW, mJ, bytes, KB/s, MHz, percent, ns) and the real `pynvml.NVMLError` subclasses.

Its parts: `state` (the replayed GPUs, their lock and lookups), one module of NVML calls per
family (`device`, `power`, `fields`, `events`, `mig`, `gpm`), `controls` (the simulation's
controls), `recordings` (agent readings to records), `faults` (injected faults) and `fake`
(FakeNvml, composed of them). The parts import `state` (`controls` also `device`), never
`fake`.
"""

from hyperagent.capture.fake_nvml.fake import NVML_FUNCTIONS, FakeNvml
from hyperagent.capture.fake_nvml.faults import FAULTS_ENV, Fault, parse_faults
from hyperagent.capture.fake_nvml.state import FakeEventData, FakeEventSet, FakeNvmlHandle

__all__ = [
    "FAULTS_ENV",
    "NVML_FUNCTIONS",
    "FakeEventData",
    "FakeEventSet",
    "FakeNvml",
    "FakeNvmlHandle",
    "Fault",
    "parse_faults",
]
