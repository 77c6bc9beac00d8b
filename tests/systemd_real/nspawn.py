"""A Debian 12 host booted under a real systemd, for trying the shipped units as installed.

``debian_rootfs()`` builds a root file system with debootstrap from the Debian mirror this
machine's apt sources name, once, and keeps it under ``CACHE`` keyed by what it holds;
``Container`` boots a copy of it with ``systemd-nspawn --boot --private-network`` (systemd as
PID 1, the container's own network with loopback only) and runs commands in it. Before it boots
(``prepare``), a command runs in the copy with the host's network and CA bundle, to install
packages from the registries.

As root only: the host needs debootstrap, systemd-nspawn (Debian's ``systemd-container``, the
version of the host's systemd) and nsenter. The host need not run systemd: nspawn runs with
``--register=no --keep-unit``.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import re
import shlex
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator, Mapping
from pathlib import Path

SUITE = "bookworm"
PACKAGES = (
    "systemd",
    "systemd-sysv",
    "dbus",
    "python3",
    "python3-venv",
    "mosquitto",
    "mosquitto-clients",
    "openssl",
    "curl",
    "ca-certificates",
    "iproute2",
    "procps",
    "passwd",
)
"""What the rootfs holds beyond debootstrap's minbase: a booting systemd, the Python the README
installs into, Debian's mosquitto package, and the tools the README's steps and the checks use."""
CACHE = Path("/var/cache/hyperagent-tests/rootfs")
HOST_CA_BUNDLE = Path("/etc/ssl/certs/ca-certificates.crt")
PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
PASSED_THROUGH = ("http_proxy", "https_proxy", "no_proxy", "HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY")
"""The host's proxy settings, if any, reach ``prepare``'s commands (pip)."""
TOOLS = ("debootstrap", "systemd-nspawn", "nsenter")


class Unavailable(Exception):
    """This machine cannot boot the container (not root, a tool or the apt sources missing)."""


def check_host() -> None:
    if os.geteuid() != 0:
        raise Unavailable("booting a container under systemd-nspawn needs root")
    missing = [t for t in TOOLS if shutil.which(t) is None and not Path(f"/usr/sbin/{t}").exists()]
    if missing:
        raise Unavailable(
            f"missing tools: {', '.join(missing)} (bash .ci/run installs debootstrap and "
            "systemd-container)"
        )
    if not HOST_CA_BUNDLE.exists():
        raise Unavailable(f"no CA bundle at {HOST_CA_BUNDLE} (apt-get install ca-certificates)")


def _apt_entries(text: str, deb822: bool) -> Iterator[tuple[str, list[str], list[str]]]:
    """(uri, suites, components) of each binary-package entry of an apt sources file."""
    if deb822:
        for stanza in re.split(r"\n\s*\n", text):
            fields: dict[str, str] = {}
            key = ""
            for line in stanza.splitlines():
                if line.startswith("#") or not line.strip():
                    continue
                if line[0].isspace() and key:
                    fields[key] += " " + line.strip()
                elif ":" in line:
                    key, _, value = line.partition(":")
                    key = key.strip().lower()
                    fields[key] = value.strip()
            if "deb" in fields.get("types", "").split() and fields.get("enabled", "yes") != "no":
                suites, components = fields.get("suites", "").split(), fields.get("components", "")
                for uri in fields.get("uris", "").split():
                    yield uri, suites, components.split()
        return
    for line in text.splitlines():
        words = re.sub(r"\[[^]]*\]", "", line.split("#", 1)[0]).split()
        if len(words) >= 3 and words[0] == "deb":
            yield words[1], [words[2]], words[3:]


def debian_mirror(
    sources: Path = Path("/etc/apt/sources.list"),
    sources_dir: Path = Path("/etc/apt/sources.list.d"),
) -> str:
    """The Debian mirror this machine's apt sources name for ``SUITE``'s main component (or,
    failing that, any Debian archive they name, not its security archive)."""
    entries = []
    files = [sources, *sorted(sources_dir.glob("*"))] if sources_dir.is_dir() else [sources]
    for path in files:
        if path.is_file() and path.suffix in (".list", ".sources", ""):
            entries += list(
                _apt_entries(path.read_text(errors="replace"), path.suffix == ".sources")
            )
    exact = [uri for uri, suites, comps in entries if SUITE in suites and "main" in comps]
    if exact:
        return exact[0].rstrip("/")
    debian = [
        uri
        for uri, suites, comps in entries
        if "main" in comps
        and any(s.split("-")[0] in ("bookworm", "trixie", "stable", "testing") for s in suites)
        and not any("security" in s for s in suites)
    ]
    if debian:
        return debian[0].rstrip("/")
    raise Unavailable(f"no Debian mirror for {SUITE} main in {sources} or {sources_dir}")


def debian_rootfs(log: Path) -> Path:
    """The cached rootfs for ``SUITE`` with ``PACKAGES``, built with debootstrap if it is not
    there yet (about 1.5-4 minutes; its output goes to ``log``). Never modify it: copy it."""
    mirror = debian_mirror()
    key = hashlib.sha256(f"{SUITE} minbase {mirror} {' '.join(PACKAGES)}".encode()).hexdigest()
    root = CACHE / key[:16]
    CACHE.mkdir(parents=True, exist_ok=True)
    with (CACHE / ".lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (root / "etc" / "os-release").exists():
            return root
        partial = CACHE / f"{key[:16]}.partial"
        shutil.rmtree(partial, ignore_errors=True)
        with log.open("ab") as out:
            built = subprocess.run(
                [
                    "nice",
                    "-n",
                    "10",
                    "debootstrap",
                    "--variant=minbase",
                    f"--include={','.join(PACKAGES)}",
                    SUITE,
                    str(partial),
                    mirror,
                ],
                stdout=out,
                stderr=subprocess.STDOUT,
                timeout=1200,
            )
        if built.returncode != 0:
            tail = "\n".join(log.read_text(errors="replace").splitlines()[-20:])
            raise RuntimeError(f"debootstrap failed (exit {built.returncode}); {log}:\n{tail}")
        partial.rename(root)
    return root


def copy_tree(source: Path, target: Path) -> None:
    """``cp -a``: owners, modes, links and special files as they are."""
    subprocess.run(
        ["cp", "-a", "--reflink=auto", f"{source}/.", str(target)], check=True, timeout=600
    )


class Container:
    """A copy of a rootfs at ``root``, booted as machine ``machine`` (its host name) with its
    own network. Use as a context manager around ``boot``: it powers the container off."""

    def __init__(self, root: Path, machine: str, console_log: Path) -> None:
        self.root = root
        self.machine = machine
        self.console_log = console_log
        self.nspawn: subprocess.Popen[bytes] | None = None
        self.pid1 = 0

    def prepare(
        self, script: str, cwd: str, env: Mapping[str, str] | None = None, timeout_s: float = 900
    ) -> subprocess.CompletedProcess[str]:
        """Run ``script`` (sh -eu) in the root before it boots, with the host's network and
        CA bundle (pip reads it from PIP_CERT, as this machine's pip does)."""
        setenv = {"PIP_CERT": "/run/host-ca.crt", "PATH": PATH}
        setenv |= {k: v for k, v in os.environ.items() if k in PASSED_THROUGH}
        setenv |= dict(env or {})
        return subprocess.run(
            [
                "nice",
                "-n",
                "10",
                "systemd-nspawn",
                "--quiet",
                f"--directory={self.root}",
                "--register=no",
                "--keep-unit",
                "--pipe",
                f"--bind-ro={HOST_CA_BUNDLE}:/run/host-ca.crt",
                f"--chdir={cwd}",
                *(f"--setenv={k}={v}" for k, v in setenv.items()),
                "--",
                "/bin/sh",
                "-euc",
                script,
            ],
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )

    def boot(self, timeout_s: float = 180) -> str:
        """Boot: systemd as PID 1, the network private. Returns ``systemctl
        is-system-running --wait`` once the boot is done ("running" or "degraded")."""
        out = self.console_log.open("ab")
        self.nspawn = subprocess.Popen(
            [
                "systemd-nspawn",
                "--boot",
                f"--directory={self.root}",
                f"--machine={self.machine}",
                "--register=no",
                "--keep-unit",
                "--private-network",
                "--console=read-only",
            ],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        out.close()
        deadline = time.monotonic() + timeout_s
        while not self.pid1:
            if self.nspawn.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the container did not boot: see {self.console_log}")
            self.pid1 = self._systemd_child(self.nspawn.pid)
            time.sleep(0.1)
        while True:
            result = self.sh("systemctl is-system-running --wait", timeout_s=timeout_s, check=False)
            state = result.stdout.strip()
            if state in ("running", "degraded"):
                return state
            if time.monotonic() > deadline:
                raise RuntimeError(f"the container's boot did not finish: {state or result.stderr}")
            time.sleep(0.5)

    @staticmethod
    def _systemd_child(parent: int) -> int:
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            with contextlib.suppress(OSError):
                stat = (entry / "stat").read_text()
                ppid = int(stat.rsplit(")", 1)[1].split()[1])
                if ppid == parent and (entry / "comm").read_text().strip() == "systemd":
                    return int(entry.name)
        return 0

    def sh(
        self,
        script: str,
        *,
        env: Mapping[str, str] | None = None,
        cwd: str = "/",
        timeout_s: float = 60,
        check: bool = True,
    ) -> subprocess.CompletedProcess[str]:
        """Run ``script`` (sh -eu) as root inside the booted container, in ``cwd``, with a clean
        environment plus ``env``; with ``check``, a failure raises with its output."""
        assert self.pid1, "boot first"
        variables = [f"{k}={v}" for k, v in {"PATH": PATH, "HOME": "/root", **(env or {})}.items()]
        result = subprocess.run(
            [
                "nsenter",
                f"--target={self.pid1}",
                "--all",
                "--",
                "env",
                "-i",
                "LANG=C.UTF-8",
                *variables,
                "/bin/sh",
                "-euc",
                f"cd {shlex.quote(cwd)}\n{script}",
            ],
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
        if check and result.returncode != 0:
            raise AssertionError(
                f"in the container, exit {result.returncode}:\n{script}\n"
                f"--- stdout\n{result.stdout}--- stderr\n{result.stderr}"
            )
        return result

    def __enter__(self) -> Container:
        return self

    def __exit__(self, *exc: object) -> None:
        self.poweroff()

    def poweroff(self, timeout_s: float = 90) -> None:
        if self.nspawn is None or self.nspawn.poll() is not None:
            return
        with contextlib.suppress(subprocess.TimeoutExpired, AssertionError):
            self.sh("systemctl poweroff --no-block", timeout_s=20, check=False)
        try:
            self.nspawn.wait(timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.nspawn.pid, signal.SIGKILL)
            self.nspawn.wait()
        with contextlib.suppress(OSError):
            Path("/run/systemd/nspawn/propagate", self.machine).rmdir()
