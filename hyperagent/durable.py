"""The process's writer thread for files that must survive a crash: spooled messages and the
tuning journal.

The event loop never waits for a disk: it submits a write and goes on. One thread runs the
writes in the order they were submitted, each one flushed and fsynced before the next starts,
so a write that is on disk has every write submitted before it on disk too. A spooled message
leaves for the broker only once its :func:`submit` (or :func:`barrier`) future is done, so
nothing the process sends can overtake a durable write submitted before it (a journal entry
before the settings it records). Writes still queued when the interpreter exits are finished
first (``concurrent.futures`` joins its workers at exit).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

_lock = threading.Lock()
_executor: ThreadPoolExecutor | None = None
_pid = 0


def _writer() -> ThreadPoolExecutor:
    global _executor, _pid
    with _lock:
        if _executor is None or _pid != os.getpid():  # a forked child starts its own thread
            _executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hyperagent-durable")
            _pid = os.getpid()
        return _executor


def submit(write: Callable[[], None]) -> Future[None]:
    """Run ``write`` on the writer thread after every write submitted before it."""
    return _writer().submit(write)


def barrier() -> Future[None]:
    """A future done once every write submitted so far has finished (however it ended)."""
    return submit(_nothing)


def wait() -> None:
    """Block until every write submitted so far has finished (start-up and tests only: never
    from the event loop)."""
    barrier().result()


def _nothing() -> None:
    return None


def write_file(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` (its folder created when missing) atomically: a fsynced
    temporary file renamed over it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".tmp")
    with partial.open("wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(partial, path)


def append_line(path: Path, line: bytes) -> None:
    """Append ``line`` to ``path`` (created with its folder when missing), flushed and fsynced."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("ab") as f:
        f.write(line)
        f.flush()
        os.fsync(f.fileno())
