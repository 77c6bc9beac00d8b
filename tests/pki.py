"""Throwaway TLS material for brokers under test: a CA and a broker certificate it signed."""

from __future__ import annotations

import subprocess
from pathlib import Path


def openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def make_certificates(
    d: Path, common_name: str = "127.0.0.1", alt_names: str = "IP:127.0.0.1"
) -> None:
    """``ca.key``, ``ca.crt``, ``broker.key`` and ``broker.crt`` (for ``alt_names``) in ``d``."""
    openssl(
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-days",
        "2",
        "-subj",
        "/CN=hyperagent test CA",
        "-keyout",
        "ca.key",
        "-out",
        "ca.crt",
        cwd=d,
    )
    openssl(
        "req",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-subj",
        f"/CN={common_name}",
        "-keyout",
        "broker.key",
        "-out",
        "broker.csr",
        cwd=d,
    )
    (d / "san.ext").write_text(f"subjectAltName={alt_names}\n")
    openssl(
        "x509",
        "-req",
        "-in",
        "broker.csr",
        "-CA",
        "ca.crt",
        "-CAkey",
        "ca.key",
        "-CAcreateserial",
        "-days",
        "2",
        "-extfile",
        "san.ext",
        "-out",
        "broker.crt",
        cwd=d,
    )
