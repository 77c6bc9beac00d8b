"""A real SNMP agent for the PDU tests: snmpsim serving fixtures/pdu-snmp on a loopback port."""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import pytest

from hyperagent.errors import SourceTimeout
from hyperagent.sources.pdu import PysnmpClient, SnmpClient, VarBind
from hyperagent.sources.pdu.parse import SYS_OBJECT_ID

from conftest import FIXTURES

CAPTURES = FIXTURES / "pdu-snmp"


def free_udp_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


async def answers(port: int, community: str) -> bool:
    client = PysnmpClient("127.0.0.1", port, community, timeout_s=0.3, retries=0)
    try:
        await client.get([SYS_OBJECT_ID])
        return True
    except SourceTimeout:
        return False
    finally:
        await client.close()


class Snmpsim:
    """snmpsim-command-responder serving every stored PDU walk on a loopback UDP port; a
    walk's community is its file name without the extension."""

    def __init__(self, workdir: Path) -> None:
        binary = Path(sys.executable).parent / "snmpsim-command-responder"
        if not binary.exists():
            pytest.fail("snmpsim is not installed: pip install -e '.[test]' (bash .ci/run does)")
        self.data = workdir / "data"
        self.data.mkdir()
        for capture in CAPTURES.iterdir():
            if capture.suffix in (".snmprec", ".snmpwalk"):
                shutil.copy(capture, self.data / capture.name)
        self.port = free_udp_port()
        self.log = workdir / "snmpsim.log"
        self.command = [
            str(binary),
            f"--data-dir={self.data}",
            f"--cache-dir={workdir / 'cache'}",
            f"--agent-udpv4-endpoint=127.0.0.1:{self.port}",
        ]
        self.process: subprocess.Popen[bytes] | None = None

    def start(self, timeout_s: float = 20.0) -> None:
        self.log_file = self.log.open("ab")
        self.process = subprocess.Popen(
            self.command,
            stdout=self.log_file,
            stderr=subprocess.STDOUT,
            env={**os.environ, "SNMPSIM_ALLOW_ROOT": "true"},
        )
        deadline = time.monotonic() + timeout_s
        while not asyncio.run(answers(self.port, "apc-8641")):
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                pytest.fail(f"snmpsim did not answer on 127.0.0.1:{self.port}: {self.log}")

    def stop(self) -> None:
        if self.process is not None:
            self.process.terminate()
            self.process.wait(timeout=10)
            self.process = None
            self.log_file.close()

    def client(self, capture: str) -> PysnmpClient:
        """A client of the simulated PDU; snmpsim spends about 1 ms per object returned, so
        small GETBULK pages keep the tests fast (real PDUs are better served by the default)."""
        community = Path(capture).stem
        return PysnmpClient("127.0.0.1", self.port, community, 2.0, retries=1, max_repetitions=10)


class Transcript:
    """Passes requests to an SNMP client and keeps each request with its answer."""

    def __init__(self, client: SnmpClient) -> None:
        self.client = client
        self.gets: list[tuple[list[str], list[VarBind]]] = []
        self.walks: list[tuple[str, list[VarBind]]] = []

    async def open(self) -> None:
        await self.client.open()

    async def get(self, oids: Sequence[str]) -> list[VarBind]:
        answer = await self.client.get(oids)
        self.gets.append((list(oids), list(answer)))
        return answer

    async def walk(self, oid: str) -> list[VarBind]:
        answer = await self.client.walk(oid)
        self.walks.append((oid, list(answer)))
        return answer

    async def close(self) -> None:
        await self.client.close()
