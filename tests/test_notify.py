"""Both daemons speak systemd's notify protocol: READY=1, then WATCHDOG=1, clean exit on SIGTERM."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from hyperagent.signing import write_key_pair

from conftest import REPO


@pytest.fixture
def notify_socket(tmp_path: Path) -> Iterator[tuple[socket.socket, str]]:
    path = str(tmp_path / "notify.sock")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    sock.settimeout(20)
    yield sock, path
    sock.close()


def messages_until(sock: socket.socket, key: str) -> list[str]:
    """Every field received up to and including the first ``key=...``."""
    seen: list[str] = []
    while True:
        fields = sock.recv(4096).decode().splitlines()
        seen += fields
        if any(f.startswith(key + "=") for f in fields):
            return seen


def run_daemon(argv: list[str], notify_path: str) -> subprocess.Popen[bytes]:
    env = {**os.environ, "NOTIFY_SOCKET": notify_path, "WATCHDOG_USEC": "400000"}
    return subprocess.Popen(
        [sys.executable, "-m", "hyperagent.cli", *argv], env=env, stderr=subprocess.PIPE
    )


def check_lifecycle(daemon: subprocess.Popen[bytes], sock: socket.socket) -> None:
    try:
        before_ready = messages_until(sock, "READY")
        assert not any(f.startswith("WATCHDOG=") for f in before_ready)
        assert any(f.startswith("STATUS=") for f in before_ready)
        messages_until(sock, "WATCHDOG")
        messages_until(sock, "WATCHDOG")  # keeps pinging
        daemon.send_signal(signal.SIGTERM)
        assert "STOPPING=1" in messages_until(sock, "STOPPING")
        _, err = daemon.communicate(timeout=20)
        assert daemon.returncode == 0, err.decode()
    finally:
        if daemon.poll() is None:
            daemon.kill()
            daemon.wait(10)


def test_agent_lifecycle(notify_socket: tuple[socket.socket, str]) -> None:
    sock, path = notify_socket
    daemon = run_daemon(
        [
            "agent",
            "--replay",
            str(REPO / "fixtures/replay/v100s-8gpu-training"),
            "--no-broker",
            "--metrics-address",
            "",
            "--interval",
            "0.1",
        ],
        path,
    )
    check_lifecycle(daemon, sock)


def test_coordinator_lifecycle(
    notify_socket: tuple[socket.socket, str],
    mosquitto,
    tmp_path: Path,  # type: ignore[no-untyped-def]
) -> None:
    sock, path = notify_socket
    _, key, _ = write_key_pair(tmp_path, "settings")
    config = tmp_path / "c.toml"
    config.write_text(
        f'cluster = "t"\n[mqtt]\nurl = "{mosquitto.url}"\n'
        f'[security]\nsigning_key_file = "{key}"\n'
        f'[coordinator]\nstate_dir = "{tmp_path / "state"}"\nmetrics_address = ""\n'
        '[[coordinator.jobs]]\nid = "j"\nnodes = ["absent-node"]\nack_timeout_s = 60\n'
    )
    daemon = run_daemon(["coordinator", "--config", str(config)], path)
    check_lifecycle(daemon, sock)
