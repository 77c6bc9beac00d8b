"""Reaching a checkout as the other users the tests run processes as (the daemons' users, a
job's user): a checkout under /root, or a Python under /root/.pyenv, sits below a directory
only root may enter."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path


def open_the_way(*paths: Path) -> dict[Path, int]:
    """Let every user traverse the directories above ``paths`` (a checkout under /root, a
    Python under /root/.pyenv, as installed code would be reachable): each ancestor without
    o+x gets it, traverse only (no listing). Returns the modes to put back."""
    changed: dict[Path, int] = {}
    for path in paths:
        for directory in path.parents:
            mode = directory.stat().st_mode & 0o7777
            if directory not in changed and not mode & 0o001:
                os.chmod(directory, mode | 0o001)
                changed[directory] = mode
    return changed


def put_back(modes: dict[Path, int]) -> None:
    """The modes :func:`open_the_way` changed, as they were."""
    for directory, mode in modes.items():
        with contextlib.suppress(OSError):
            os.chmod(directory, mode)
