"""Running the tools sources shell out to (``rdma``, ``ethtool``, ``ipmitool``), or answering
them from a capture directory, behind one small interface."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path

from hyperagent.errors import SourceError, SourceTimeout, SourceUnavailable

RunCommand = Callable[[Sequence[str]], Awaitable[str]]
"""Runs a command line and returns its standard output; raises SourceError when it fails."""


class CommandFailed(SourceError):
    """A command exited non-zero, timed out or could not be started.

    ``argv`` is the command line, ``returncode`` its exit status (None when it never exited),
    ``stderr`` what it printed there.
    """

    def __init__(
        self, message: str, argv: Sequence[str], returncode: int | None = None, stderr: str = ""
    ) -> None:
        super().__init__(message)
        self.argv = tuple(argv)
        self.returncode = returncode
        self.stderr = stderr


class CommandTimeout(CommandFailed, SourceTimeout):
    """A command did not finish within its time bound."""


class CommandUnavailable(SourceUnavailable):
    """The command's program is not installed."""


class CaptureMissing(SourceUnavailable, FileNotFoundError):
    """A capture directory holds no output for the requested command."""


async def run_command(argv: Sequence[str], timeout_s: float | None = None) -> str:
    """Run ``argv`` without a shell and return its standard output.

    Raises CommandUnavailable when the program is not installed, CommandTimeout when it did
    not finish within ``timeout_s``, CommandFailed when it fails; the process is killed and
    reaped on timeout or cancellation (a caller's own time bound).
    """
    line = " ".join(argv)
    try:
        process = await asyncio.create_subprocess_exec(
            *argv,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
    except FileNotFoundError as e:
        raise CommandUnavailable(f"{argv[0]} is not installed") from e
    except OSError as e:
        raise CommandFailed(f"{line} could not start: {e}", argv) from e
    try:
        async with asyncio.timeout(timeout_s):
            stdout, stderr = await process.communicate()
    except TimeoutError as e:
        raise CommandTimeout(f"{line} did not finish within {timeout_s:g}s", argv) from e
    finally:
        if process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                process.kill()
            await process.wait()
    if process.returncode != 0:
        message = stderr.decode(errors="replace").strip()
        last = next((x for x in reversed(message.splitlines()) if x.strip()), "")
        raise CommandFailed(
            f"{line} exited {process.returncode}: {last.strip()}",
            argv,
            process.returncode,
            message,
        )
    return stdout.decode(errors="replace")


def capture_runner(directory: Path, file_for: Callable[[Sequence[str]], str]) -> RunCommand:
    """A RunCommand answering from a capture directory: ``file_for(argv)`` names the file that
    holds the command's output (it raises CommandFailed for a command no capture answers).
    An absent file raises CaptureMissing."""

    async def run(argv: Sequence[str]) -> str:
        path = directory / file_for(argv)
        try:
            return await asyncio.to_thread(path.read_text, encoding="utf-8", errors="replace")
        except FileNotFoundError as e:
            raise CaptureMissing(f"no {path.name} in {directory}") from e
        except OSError as e:
            raise CommandFailed(f"reading {path} failed: {e}", argv) from e

    return run
