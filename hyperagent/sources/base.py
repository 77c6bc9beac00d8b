"""The source contract: a name, a target, and ``async read() -> list[Reading]``."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from hyperagent.readings import Reading


@runtime_checkable
class Source(Protocol):
    """A telemetry source. ``start``/``close`` hold long-lived handles; ``read`` samples once.

    ``read`` raises SourceUnavailable when the hardware is absent (reported quietly as up 0)
    and any other SourceError when it fails; it must not block the event loop.
    """

    name: str
    target: str

    async def start(self) -> None: ...

    async def read(self) -> list[Reading]: ...

    async def close(self) -> None: ...
