"""NVML from captures: the NVML API over an nvidia-smi dump or a recording (FakeNvml), and the
parsers of nvidia-smi's capture formats. Replay, ``sources.nvml.dump``, the demo and the tests
use it wherever the GPUs are not here."""
