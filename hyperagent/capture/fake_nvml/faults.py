"""Injected NVML faults: a call made to block or fail, set in process or read from a JSON file
that a test rewrites while the agent runs."""

from __future__ import annotations

import json
import logging
import math
import os
import threading
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pynvml

from hyperagent.capture.fake_nvml.state import FakeNvmlHandle

log = logging.getLogger(__name__)

FAULTS_ENV = "HYPERAGENT_FAKE_NVML_FAULTS"
"""Names a JSON file of faults every FakeNvml of the process injects (see `FakeNvml`)."""


@dataclass(frozen=True)
class Fault:
    """What an injected fault does to a call: sleep `block_s` in the calling thread, then raise
    `pynvml.NVMLError(error)` (None: proceed); only on the handles of `gpus` (None: any call)."""

    block_s: float = 0.0
    error: int | None = None
    gpus: frozenset[int] | None = None

    def applies(self, args: tuple[Any, ...]) -> bool:
        if self.gpus is None:
            return True
        handle = args[0] if args else None
        return isinstance(handle, FakeNvmlHandle) and handle.index in self.gpus


def parse_faults(data: object, functions: Collection[str]) -> dict[str, Fault]:
    """Faults by NVML function name (one of `functions`, or "*": every function) from their
    JSON form, e.g. ``{"nvmlDeviceGetPowerUsage": {"block_s": 5}, "*": {"error":
    "NVML_ERROR_GPU_IS_LOST", "gpus": [3]}}``. Raises ValueError naming what is wrong."""
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError("faults must be a JSON object: NVML function name -> fault")
    faults: dict[str, Fault] = {}
    for name, spec in data.items():
        if name != "*" and name not in functions:
            raise ValueError(f"{name!r}: no such NVML function in FakeNvml")
        if not isinstance(spec, dict) or not spec:
            raise ValueError(f"{name}: a fault is an object with block_s and/or error")
        unknown = set(spec) - {"block_s", "error", "gpus"}
        if unknown:
            raise ValueError(f"{name}: unknown keys {sorted(unknown)} (block_s, error, gpus)")
        if not {"block_s", "error"} & set(spec):
            raise ValueError(f"{name}: a fault needs block_s or error")
        block_s = spec.get("block_s", 0.0)
        if isinstance(block_s, bool) or not isinstance(block_s, int | float):
            raise ValueError(f"{name}.block_s: a number of seconds, not {block_s!r}")
        if not 0 <= block_s < math.inf:
            raise ValueError(f"{name}.block_s: must be >= 0 and finite, not {block_s}")
        error = spec.get("error")
        code = None
        if error is not None:
            code = getattr(pynvml, error, None) if isinstance(error, str) else None
            if not isinstance(error, str) or not error.startswith("NVML_ERROR_") or code is None:
                raise ValueError(f"{name}.error: {error!r} is no pynvml NVML_ERROR_* name")
        gpus = spec.get("gpus")
        if gpus is not None and (
            not isinstance(gpus, list)
            or not all(isinstance(g, int) and not isinstance(g, bool) and g >= 0 for g in gpus)
        ):
            raise ValueError(f"{name}.gpus: a list of GPU indices, not {gpus!r}")
        faults[name] = Fault(float(block_s), code, None if gpus is None else frozenset(gpus))
    return faults


class FaultFile:
    """Faults read from a JSON file, read again whenever its mtime, size or inode change."""

    def __init__(self, path: Path, functions: Collection[str]) -> None:
        self.path = path
        self._functions = functions
        self.faults: dict[str, Fault] = {}
        self._seen: tuple[int, int, int] | None = None
        self._problem = ""
        self._lock = threading.Lock()

    def current(self) -> dict[str, Fault]:
        try:
            st = os.stat(self.path)
        except OSError:
            self._seen, self.faults = None, {}
            return self.faults
        key = (st.st_mtime_ns, st.st_size, st.st_ino)
        if key == self._seen:
            return self.faults
        with self._lock:
            if key != self._seen:
                self.faults = self._load()
                self._seen = key
        return self.faults

    def _load(self) -> dict[str, Fault]:
        try:
            text = self.path.read_text(encoding="utf-8")
            faults = parse_faults(json.loads(text) if text.strip() else None, self._functions)
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as e:
            problem = f"{FAULTS_ENV} file {self.path}: {e}; injecting no faults"
            if problem != self._problem:
                log.error("%s", problem)
                self._problem = problem
            return {}
        self._problem = ""
        return faults
