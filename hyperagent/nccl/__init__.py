"""hyperagent's NCCL tuner plugin (``tuner.c``): build it, find it, and drive it from Python.

NCCL loads the library named by ``NCCL_TUNER_PLUGIN`` and asks it for every collective which
algorithm and protocol to run; :class:`TunerPlugin` loads the same file (one copy in the
process, one state) and sets the choice for AllReduce. :func:`library_path` is what
``hyperagent nccl-plugin`` prints: the library built at install, else one built on demand
into a cache directory.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

SOURCE_DIR = Path(__file__).resolve().parent
SOURCES = (SOURCE_DIR / "tuner.c", SOURCE_DIR / "nccl_tuner.h")
LIBRARY_NAME = "libhyperagent_nccl_tuner.so"
CFLAGS = ("-O2", "-std=c11", "-Wall", "-shared", "-fPIC", "-fvisibility=hidden")

ALGORITHMS: dict[str, int] = {
    "tree": 0,
    "ring": 1,
    "collnet_direct": 2,
    "collnet_chain": 3,
    "nvls": 4,
    "nvls_tree": 5,
    "pat": 6,
}
"""NCCL's ``NCCL_ALGO_*`` indices, by hyperagent's names."""
PROTOCOLS: dict[str, int] = {"ll": 0, "ll128": 1, "simple": 2}
"""NCCL's ``NCCL_PROTO_*`` indices."""
NCCL_CHOICE = -1
MAX_CHANNELS = 64


class PluginBuildError(RuntimeError):
    """No C compiler, or the compiler failed."""


def compiler() -> str | None:
    """The C compiler to build with: ``$CC``, else ``cc``, ``gcc`` or ``clang`` on PATH."""
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return name
    return None


def build(destination: Path, cc: str | None = None) -> Path:
    """Compile the plugin into ``destination`` (a file path), atomically; returns it."""
    cc = cc or compiler()
    if cc is None:
        raise PluginBuildError("no C compiler (cc, gcc or clang) on PATH; set CC")
    destination.parent.mkdir(parents=True, exist_ok=True)
    fd, partial = tempfile.mkstemp(prefix=".build-", suffix=".so", dir=destination.parent)
    os.close(fd)
    try:
        command = [cc, *CFLAGS, "-o", partial, str(SOURCES[0])]
        done = subprocess.run(command, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise PluginBuildError(f"{' '.join(command)} failed:\n{done.stderr.strip()}")
        os.replace(partial, destination)
    finally:
        if os.path.exists(partial):
            os.unlink(partial)
    return destination


def source_digest() -> str:
    """A short hash of the plugin's sources: a cached build is reused only for the same code."""
    digest = hashlib.sha256()
    for source in SOURCES:
        digest.update(source.read_bytes())
    return digest.hexdigest()[:16]


def cache_dir() -> Path:
    """``$HYPERAGENT_CACHE_DIR``, else ``$XDG_CACHE_HOME/hyperagent``, else ~/.cache/hyperagent."""
    explicit = os.environ.get("HYPERAGENT_CACHE_DIR")
    if explicit:
        return Path(explicit)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "hyperagent"


def installed_library() -> Path | None:
    """The library built at install, next to this module, when it is there."""
    path = SOURCE_DIR / LIBRARY_NAME
    return path if path.is_file() else None


def library_path(cc: str | None = None) -> Path:
    """The plugin's absolute path: the installed build, else the cache's (built if missing)."""
    installed = installed_library()
    if installed is not None:
        return installed
    cached = cache_dir().resolve() / "nccl" / source_digest() / LIBRARY_NAME
    if not cached.is_file():
        build(cached, cc)
    return cached


@dataclass(frozen=True, slots=True)
class Choice:
    """The AllReduce choice as NCCL's indices; -1 (algorithm, protocol) or 0 (channels): NCCL's."""

    algorithm: int = NCCL_CHOICE
    protocol: int = NCCL_CHOICE
    channels: int = 0


class TunerPlugin:
    """The plugin library loaded with ctypes; the setters act on what NCCL loaded from the
    same file (the dynamic loader keeps one copy per path)."""

    def __init__(self, path: Path | str) -> None:
        self.path = Path(path).resolve()
        lib = ctypes.CDLL(str(self.path))
        c_int, c_ull = ctypes.c_int, ctypes.c_ulonglong
        lib.hyperagent_nccl_select.argtypes = [c_int, c_int, c_int]
        lib.hyperagent_nccl_select.restype = c_int
        lib.hyperagent_nccl_selected.argtypes = [ctypes.POINTER(c_int)] * 3
        lib.hyperagent_nccl_selected.restype = c_int
        lib.hyperagent_nccl_select_chunk.argtypes = [c_ull]
        lib.hyperagent_nccl_select_chunk.restype = c_int
        lib.hyperagent_nccl_selected_chunk.restype = c_ull
        lib.hyperagent_nccl_fallbacks.restype = c_ull
        lib.hyperagent_nccl_offered.restype = ctypes.c_uint
        lib.hyperagent_nccl_loaded_version.restype = c_int
        self.lib = lib

    def select(self, choice: Choice) -> bool:
        """Set the AllReduce choice; False (the previous choice kept) for a value out of range."""
        return (
            self.lib.hyperagent_nccl_select(choice.algorithm, choice.protocol, choice.channels) == 0
        )

    def selected(self) -> Choice:
        a, p, c = ctypes.c_int(), ctypes.c_int(), ctypes.c_int()
        self.lib.hyperagent_nccl_selected(ctypes.byref(a), ctypes.byref(p), ctypes.byref(c))
        return Choice(a.value, p.value, c.value)

    def select_chunk(self, chunk_bytes: int) -> None:
        """NCCL's pipeline chunk for AllReduce in bytes (0: NCCL's); asked by NCCL >= 2.30.3 (v6)
        only, which clamps it."""
        self.lib.hyperagent_nccl_select_chunk(chunk_bytes)

    def selected_chunk(self) -> int:
        return int(self.lib.hyperagent_nccl_selected_chunk())

    def fallbacks(self) -> int:
        """AllReduces where the chosen entry was unsupported, so NCCL's own choice stood."""
        return int(self.lib.hyperagent_nccl_fallbacks())

    def offered(self) -> frozenset[str]:
        """The algorithms some AllReduce cost table offered (an entry >= 0), by name."""
        mask = int(self.lib.hyperagent_nccl_offered())
        return frozenset(name for name, index in ALGORITHMS.items() if mask >> index & 1)

    def loaded_version(self) -> int:
        """The newest tuner interface NCCL initialised in this process (0: none yet)."""
        return int(self.lib.hyperagent_nccl_loaded_version())
