"""A real Slurm on one machine for tests: Debian's ``slurmctld``, ``slurmd`` and ``munge``
(22.05), one slurmd per node network namespace, jobs in real Slurm cgroups.

Every "host" is a network namespace joined to a bridge (as the namespace cluster of
``harness.py`` is) with a mount namespace of its own, held by a ``sleep`` process: the
controller host ``ctl`` runs slurmctld and the clients (``srun``, ``sbatch``, ``scontrol``, as
from a login node); each node host runs one ``slurmd -N <node>``. Inside each host
``/etc/slurm``, ``/run/munge`` and ``/run/dcgm-job-mapping`` are the cluster's own directories
under a temporary root (bind mounts), so the daemons and clients run with Slurm's default
paths, as installed, and nothing of the machine's own is read or written. The nodes share one
``/etc/slurm``; each has its own ``/run/dcgm-job-mapping`` (``Slurm.node_path``).

What it runs with: ``ProctrackType=proctrack/cgroup``, ``TaskPlugin=task/cgroup`` (cgroup v1,
``ConstrainDevices=yes``), ``SelectType=select/cons_tres``, ``GresTypes=gpu`` and
``Gres=gpu:<n>`` per node over fake device nodes ``/dev/nvidia<i>`` (``c 195 <i>``; made for
the cluster where missing, removed at the end; existing ones are used and kept). A job's tasks
sit in ``/sys/fs/cgroup/<controller>/slurm_<node>/uid_<uid>/job_<id>/step_<step>/task_<n>``
(the multiple-slurmd form). Users alice, bob, mallory and eve are made where missing (and
removed at the end).

The cgroup directories are named by node, the device nodes are the machine's: run one
cluster at a time on a machine (conftest.BUSY in the suite). Everything stops within bounded
times; at the end every daemon, job process and namespace is gone.

    with slurm_cluster(nodes=("gpu-1", "gpu-2")) as slurm:
        job = slurm.srun("alice", "sleep", "30", nodes=2, ntasks=4, gres="gpu:2")

Run one by hand (as root) to look around; it prints how to enter the controller host:

    .venv/bin/python tests/cluster/slurm.py --minutes 10
"""

from __future__ import annotations

import argparse
import contextlib
import os
import pwd
import re
import secrets
import select
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests"))  # run as a script too

from cluster.harness import Unavailable, bridge_namespaces  # noqa: E402

__all__ = ["NODES", "USERS", "Slurm", "SlurmHost", "Unavailable", "check_host", "slurm_cluster"]

NODES = ("gpu-1", "gpu-2", "gpu-3", "gpu-4")
"""Four nodes: a job on two and another on three sharing one of them fit beside each other."""
USERS = ("alice", "bob", "mallory", "eve")
"""Ordinary Unix users who run jobs (made where missing, removed at the end)."""
GPUS_PER_NODE = 8
CPUS_PER_NODE = 8
"""Slurm CPUs per node (``SlurmdParameters=config_overrides``: more than the machine has, so
that several jobs share a node as they do on a GPU node; cores are not constrained)."""
NVIDIA_MAJOR = 195
ETC_SLURM = Path("/etc/slurm")
RUN_MUNGE = Path("/run/munge")
MAPPING_DIR = Path("/run/dcgm-job-mapping")
"""The job-mapping directory the shipped prolog writes (one per node)."""
BOUND = (ETC_SLURM, RUN_MUNGE, MAPPING_DIR)
"""Paths each host sees as a directory of its own under the cluster's root."""
PROGRAMS = {
    "/usr/sbin/slurmctld": "slurmctld",
    "/usr/sbin/slurmd": "slurmd",
    "/usr/sbin/slurmstepd": "slurmd",
    "/usr/bin/srun": "slurm-client",
    "/usr/bin/scontrol": "slurm-client",
    "/usr/sbin/munged": "munge",
}
TOOLS = ("ip", "nsenter", "unshare", "runuser", "useradd", "userdel", "mknod", "mount")
START_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 15.0
CLIENT_TIMEOUT_S = 30.0


def check_host() -> None:
    """Raise Unavailable unless this machine can run the cluster: root, the Debian packages
    ``slurmctld slurmd slurm-client munge``, the namespace tools and cgroup v1's freezer and
    devices hierarchies (proctrack/cgroup and ConstrainDevices on cgroup/v1)."""
    if os.geteuid() != 0:
        raise Unavailable("the Slurm cluster needs root (namespaces, daemons, device nodes)")
    missing = sorted({pkg for path, pkg in PROGRAMS.items() if not Path(path).exists()})
    if missing:
        raise Unavailable(
            f"missing Debian packages: {' '.join(missing)} (bash .ci/run installs them)"
        )
    tools = [t for t in TOOLS if shutil.which(t) is None and not Path(f"/usr/sbin/{t}").exists()]
    if tools:
        raise Unavailable(f"missing tools: {', '.join(tools)}")
    for controller in ("freezer", "devices"):
        if not Path(f"/sys/fs/cgroup/{controller}/tasks").exists():
            raise Unavailable(f"no cgroup v1 {controller} hierarchy at /sys/fs/cgroup/{controller}")


def _run(*argv: str, timeout_s: float = CLIENT_TIMEOUT_S, **kw: Any) -> str:
    done = subprocess.run(argv, text=True, capture_output=True, timeout=timeout_s, **kw)
    if done.returncode != 0:
        raise subprocess.CalledProcessError(done.returncode, argv, done.stdout, done.stderr)
    return done.stdout


@dataclass
class SlurmHost:
    """One host: a network namespace, an address on the bridge, and a process holding a mount
    namespace in which ``BOUND`` (and ``Slurm.host_dirs``) are the host's own directories
    under ``root``."""

    name: str
    netns: str
    address: str
    root: Path
    holder: subprocess.Popen[bytes] | None = None

    @property
    def netns_path(self) -> str:
        return f"/run/netns/{self.netns}"

    def enter(self) -> list[str]:
        """The argv prefix that runs a command on this host (its network and mount
        namespaces; the machine's /proc, /sys and cgroups)."""
        assert self.holder is not None, f"{self.name} is not started"
        return ["nsenter", "-t", str(self.holder.pid), "-m", "-n", "--"]


@dataclass
class Slurm:
    """A Slurm cluster; use :func:`slurm_cluster`, or ``with Slurm(root, nodes) as s:
    s.prepare(); s.start()``. ``etc`` is the cluster's /etc/slurm (every host's
    ``/etc/slurm``), ``logs`` the daemons' logs, ``jobs`` a folder every job may write."""

    root: Path
    nodes: tuple[str, ...] = NODES
    gpus_per_node: int = GPUS_PER_NODE
    cpus_per_node: int = CPUS_PER_NODE
    users: tuple[str, ...] = USERS
    host_dirs: tuple[Path, ...] = ()
    """More paths each host sees as a folder of its own (``/run/hyperagent``,
    ``/etc/hyperagent`` for an agent on each node), beside ``BOUND``; see :meth:`host_path`."""
    tag: str = field(default_factory=lambda: secrets.token_hex(2))
    hosts: dict[str, SlurmHost] = field(default_factory=dict)
    """``ctl`` and every node name -> its host."""
    daemons: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    clients: list[subprocess.Popen[bytes]] = field(default_factory=list)
    """Every srun started (killed at the end if still running)."""
    _made_devices: list[Path] = field(default_factory=list)
    _made_dirs: list[Path] = field(default_factory=list)
    _made_users: list[str] = field(default_factory=list)
    _logs: list[Any] = field(default_factory=list)
    _pending: dict[int, bytes] = field(default_factory=dict)
    """Output of each srun read but not yet returned by read_lines."""

    def __post_init__(self) -> None:
        subnet = 16 + int(self.tag, 16) % 200
        self.bridge_ns = f"hsl{self.tag}-br"
        self.hostname = socket.gethostname()
        """slurmctld's host name: it must be the machine's (else "This host not a valid
        controller"); its address is the ctl namespace's."""
        names = [("ctl", 2), *((node, 11 + i) for i, node in enumerate(self.nodes))]
        for i, (name, last) in enumerate(names):
            self.hosts[name] = SlurmHost(
                name, f"hsl{self.tag}-{i}", f"10.232.{subnet}.{last}", self.root / "hosts" / name
            )
        self.etc = self.root / "etc-slurm"
        self.logs = self.root / "log"
        self.jobs = self.root / "jobs"
        """World-writable (sticky), for batch scripts' output."""

    # -- the whole cluster ---------------------------------------------------------------

    @property
    def bound(self) -> tuple[Path, ...]:
        """Every path a host sees as its own: ``BOUND`` and ``host_dirs``."""
        return (*BOUND, *self.host_dirs)

    def __enter__(self) -> Slurm:
        check_host()
        self.root.mkdir(parents=True, exist_ok=True)
        self.root.chmod(0o755)
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def prepare(self) -> None:
        """Everything before the daemons: users, device nodes, the network, the hosts'
        mount namespaces, munge, and a slurm.conf, cgroup.conf and gres.conf in ``etc``
        without the lines an operator adds for hyperagent (systemd/slurm/)."""
        self._users()
        self._devices()
        self._directories()
        self._network()
        for host in self.hosts.values():
            self._hold(host)
        self._write_conf()
        self._start_munge()

    def start(self) -> None:
        """slurmctld, then each slurmd; returns when every node is idle."""
        self.start_slurmctld()
        for node in self.nodes:
            self.start_slurmd(node)
        self.wait_nodes("idle")

    def stop(self) -> None:
        """Cancel every job, stop the daemons, kill what is left in the hosts, remove the
        cluster's cgroups, namespaces, device nodes, mount points and users."""
        if "slurmctld" in self.daemons:
            with contextlib.suppress(Exception):
                self.cancel_all()
        for process in self.clients:
            _kill_group(process)
        for name in [n for n in self.daemons if n.startswith("slurmd")] + ["slurmctld", "munged"]:
            if name in self.daemons:
                _kill_group(self.daemons.pop(name), signal.SIGTERM)
        for host in self.hosts.values():  # slurmstepd and tasks left behind, and the holders
            for pid in self._netns_pids(host):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            if host.holder is not None:
                host.holder.wait(STOP_TIMEOUT_S)
                host.holder = None
        self._remove_cgroups()
        for host in self.hosts.values():
            subprocess.run(["ip", "netns", "del", host.netns], capture_output=True, timeout=20)
        subprocess.run(["ip", "netns", "del", self.bridge_ns], capture_output=True, timeout=20)
        for path in reversed(self._made_devices):
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
        self._made_devices.clear()
        for path in reversed(self._made_dirs):
            with contextlib.suppress(OSError):
                path.rmdir()
        self._made_dirs.clear()
        for user in self._made_users:
            subprocess.run(["userdel", user], capture_output=True, timeout=20)
        self._made_users.clear()
        for handle in self._logs:
            handle.close()
        self._logs.clear()

    # -- preparation ---------------------------------------------------------------------

    def _users(self) -> None:
        for user in self.users:
            try:
                pwd.getpwnam(user)
            except KeyError:
                _run("useradd", "--no-create-home", "--user-group", "--shell", "/bin/sh", user)
                self._made_users.append(user)

    def _devices(self) -> None:
        for index in range(self.gpus_per_node):
            path = self.device(index)
            if os.path.lexists(path):
                mode = path.lstat().st_mode
                if not stat.S_ISCHR(mode):
                    raise Unavailable(f"{path} exists and is not a character device")
                continue
            os.mknod(path, 0o666 | stat.S_IFCHR, os.makedev(NVIDIA_MAJOR, index))
            self._made_devices.append(path)

    @staticmethod
    def device(index: int) -> Path:
        return Path(f"/dev/nvidia{index}")

    def _directories(self) -> None:
        slurm = pwd.getpwnam("slurm")
        for path in self.bound:  # mount points on the machine (left empty there)
            if not path.exists():
                missing = [p for p in (path, *path.parents) if not p.exists()]
                path.mkdir(parents=True)
                self._made_dirs += reversed(missing)
        for host in self.hosts.values():
            for path in (MAPPING_DIR, *self.host_dirs):
                self.host_path(host.name, path).mkdir(parents=True)
        self.etc.mkdir(mode=0o755)
        for name in ("state", "log", "run"):
            folder = self.root / name
            folder.mkdir(mode=0o755)
            os.chown(folder, slurm.pw_uid, slurm.pw_gid)
        for node in self.nodes:
            (self.root / "spool" / node).mkdir(parents=True)
        self.jobs.mkdir(mode=0o755)
        self.jobs.chmod(0o1777)
        munge = pwd.getpwnam("munge")
        folder = self.root / "munge"
        folder.mkdir(mode=0o755)
        os.chown(folder, munge.pw_uid, munge.pw_gid)

    def host_path(self, host: str, path: Path) -> Path:
        """Where ``path`` (in ``bound``) of host ``host`` is on the machine: the cluster's
        ``etc`` for /etc/slurm, the one munged's folder for /run/munge, else the host's own
        folder (``node_path``)."""
        if path == ETC_SLURM:
            return self.etc
        if path == RUN_MUNGE:
            return self.root / "munge"
        return self.hosts[host].root / path.relative_to("/")

    def node_path(self, node: str, path: Path = MAPPING_DIR) -> Path:
        """Where node ``node``'s ``path`` (its /run/dcgm-job-mapping by default) is, from the
        machine."""
        return self.host_path(node, path)

    def _network(self) -> None:
        hosts = [(h.netns, h.address) for h in self.hosts.values()]
        bridge_namespaces(self.bridge_ns, hosts, f"hsl{self.tag}")

    def _hold(self, host: SlurmHost) -> None:
        """A process in ``host``'s network namespace and a new mount namespace with ``bound``
        bound to the host's folders (``nsenter --net``, not ``ip netns exec``: that remounts
        /sys, and slurmd then finds no cgroup hierarchy)."""
        binds = [f"mount --bind '{self.host_path(host.name, p)}' '{p}'" for p in self.bound]
        script = "\n".join([*binds, "echo ready", "exec sleep infinity"])
        host.holder = subprocess.Popen(
            [
                "nsenter",
                f"--net={host.netns_path}",
                "--",
                "unshare",
                "--mount",
                "--propagation",
                "private",
                "--",
                "sh",
                "-ec",
                script,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
        assert host.holder.stdout is not None
        ready, _, _ = select.select([host.holder.stdout], [], [], 10)
        line = host.holder.stdout.readline() if ready else b""
        if line.strip() != b"ready":
            error = b""
            if host.holder.poll() is not None and host.holder.stderr is not None:
                error = host.holder.stderr.read()
            raise RuntimeError(f"host {host.name} did not start: {error!r}")

    def _write_conf(self) -> None:
        ctl = self.hosts["ctl"]
        nodes = "\n".join(
            f"NodeName={node} NodeAddr={self.hosts[node].address} CPUs={self.cpus_per_node}"
            f" RealMemory=2000 Gres=gpu:{self.gpus_per_node} State=UNKNOWN"
            for node in self.nodes
        )
        (self.etc / "slurm.conf").write_text(
            f"""\
# The test cluster's own lines (tests/cluster/slurm.py); an operator's for hyperagent are
# systemd/slurm/slurm.conf, added after these as README's "Slurm" section says.
ClusterName=hyperagent-test
SlurmctldHost={self.hostname}({ctl.address})
SlurmUser=slurm
AuthType=auth/munge
CredType=cred/munge
StateSaveLocation={self.root}/state
SlurmdSpoolDir={self.root}/spool/%n
SlurmctldPidFile={self.root}/run/slurmctld.pid
SlurmdPidFile={self.root}/run/slurmd-%n.pid
SlurmctldLogFile={self.logs}/slurmctld.log
SlurmdLogFile={self.logs}/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
GresTypes=gpu
MpiDefault=none
SwitchType=switch/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
ReturnToService=2
KillWait=2
InactiveLimit=0
MinJobAge=300
MessageTimeout=10
{nodes}
PartitionName=gpu Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""
        )
        (self.etc / "cgroup.conf").write_text(
            "# this machine mounts cgroup v1 (freezer, devices, cpuset, memory)\n"
            "CgroupPlugin=cgroup/v1\n"
        )
        last = self.gpus_per_node - 1
        (self.etc / "gres.conf").write_text(f"Name=gpu File=/dev/nvidia[0-{last}]\n")
        (self.etc / "plugstack.conf").write_text("")

    def _start_munge(self) -> None:
        munge = pwd.getpwnam("munge")
        folder = self.root / "munge"
        key = folder / "munge.key"
        key.write_bytes(secrets.token_bytes(1024))
        os.chown(key, munge.pw_uid, munge.pw_gid)
        key.chmod(0o400)
        self.daemons["munged"] = self._spawn(
            "munged",
            [
                "setpriv",
                f"--reuid={munge.pw_uid}",
                f"--regid={munge.pw_gid}",
                "--clear-groups",
                "--",
                "/usr/sbin/munged",
                "--foreground",
                f"--socket={folder}/munge.socket.2",
                f"--key-file={key}",
                f"--pid-file={folder}/munged.pid",
                f"--log-file={folder}/munged.log",
                f"--seed-file={folder}/munged.seed",
            ],
        )
        _until(lambda: (folder / "munge.socket.2").exists(), 10, "munged's socket", self)

    # -- daemons -------------------------------------------------------------------------

    def _spawn(self, name: str, argv: list[str]) -> subprocess.Popen[bytes]:
        self.logs.mkdir(exist_ok=True)
        log = (self.logs / f"{name}.out").open("ab")
        self._logs.append(log)
        return subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"},
        )

    def start_slurmctld(self) -> None:
        self.daemons["slurmctld"] = self._spawn(
            "slurmctld", [*self.hosts["ctl"].enter(), "/usr/sbin/slurmctld", "-D"]
        )
        _until(lambda: self._ping(), START_TIMEOUT_S, "slurmctld to answer", self)

    def start_slurmd(self, node: str) -> None:
        """slurmd of ``node`` on its host (``slurmd -D -N <node>``)."""
        self.daemons[f"slurmd-{node}"] = self._spawn(
            f"slurmd-{node}", [*self.hosts[node].enter(), "/usr/sbin/slurmd", "-D", "-N", node]
        )

    def stop_slurmd(self, node: str) -> None:
        if f"slurmd-{node}" in self.daemons:
            _kill_group(self.daemons.pop(f"slurmd-{node}"), signal.SIGTERM)

    def _ping(self) -> bool:
        done = subprocess.run(
            [*self.client(None), "scontrol", "ping"],
            capture_output=True,
            text=True,
            timeout=CLIENT_TIMEOUT_S,
        )
        return done.returncode == 0 and " is UP" in done.stdout

    def _netns_pids(self, host: SlurmHost) -> list[int]:
        done = subprocess.run(
            ["ip", "netns", "pids", host.netns], capture_output=True, text=True, timeout=20
        )
        return [int(p) for p in done.stdout.split() if p.isdigit()]

    def _remove_cgroups(self) -> None:
        """The ``slurm_<node>`` cgroups slurmd made, deepest first (their processes are
        gone; a directory still in use stays)."""
        for node in self.nodes:
            for top in Path("/sys/fs/cgroup").glob(f"*/slurm_{node}"):
                deadline = time.monotonic() + 5
                while top.exists() and time.monotonic() < deadline:
                    folders = sorted(
                        (p for p in top.rglob("*") if p.is_dir()),
                        key=lambda p: -len(p.parts),
                    )
                    for folder in [*folders, top]:
                        with contextlib.suppress(OSError):
                            folder.rmdir()
                    if top.exists():
                        time.sleep(0.1)

    # -- clients -------------------------------------------------------------------------

    def client(self, user: str | None, host: str = "ctl") -> list[str]:
        """The argv prefix that runs a command on ``host`` (the controller host by default, as
        a login node) as ``user`` (root: None)."""
        prefix = [*self.hosts[host].enter(), "env", "-i", "PATH=/usr/sbin:/usr/bin:/sbin:/bin"]
        if user is None:
            return prefix
        return [*prefix, "runuser", "-u", user, "--"]

    def srun(
        self,
        user: str,
        *command: str,
        nodes: int = 1,
        ntasks: int | None = None,
        gres: str | None = None,
        nodelist: Sequence[str] | None = None,
        extra: Sequence[str] = (),
    ) -> subprocess.Popen[bytes]:
        """``srun`` as ``user`` running ``command`` in each task, unbuffered, its stdout a pipe
        (the tasks' lines; read them with :meth:`read_lines`), stderr to the log folder;
        killed at the end if still running."""
        argv = [*self.client(user), "srun", "--unbuffered", f"--nodes={nodes}"]
        if ntasks is not None:
            argv.append(f"--ntasks={ntasks}")
        if gres is not None:
            argv.append(f"--gres={gres}")
        if nodelist:
            argv.append(f"--nodelist={','.join(nodelist)}")
        stderr = (self.logs / f"srun-{user}-{len(self.clients)}.err").open("ab")
        self._logs.append(stderr)
        process = subprocess.Popen(
            [*argv, *extra, "--", *command],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=stderr,
            cwd=self.jobs,
            start_new_session=True,
        )
        self.clients.append(process)
        return process

    def sbatch(
        self,
        user: str,
        script: str,
        *,
        nodes: int = 1,
        ntasks: int | None = None,
        gres: str | None = None,
        nodelist: Sequence[str] | None = None,
        output: Path | None = None,
        extra: Sequence[str] = (),
    ) -> str:
        """Submit ``script`` (a shell script) as ``user``; its job id. Its output goes to
        ``output`` (by default ``jobs/<user>-<job id>.out``)."""
        argv = [*self.client(user), "sbatch", "--parsable", f"--nodes={nodes}"]
        if ntasks is not None:
            argv.append(f"--ntasks={ntasks}")
        if gres is not None:
            argv.append(f"--gres={gres}")
        if nodelist:
            argv.append(f"--nodelist={','.join(nodelist)}")
        out = output or self.jobs / f"{user}-%j.out"
        argv += [f"--output={out}", f"--chdir={self.jobs}", *extra]
        return _run(*argv, input=script, cwd=self.jobs).strip().split(";")[0]

    def scontrol(self, *args: str, user: str | None = None) -> str:
        """``scontrol <args>`` on the controller host; its stdout (CalledProcessError when it
        fails)."""
        return _run(*self.client(user), "scontrol", *args)

    def squeue(self, *args: str) -> str:
        return _run(*self.client(None), "squeue", *args)

    def job_ids(self) -> list[str]:
        """The jobs Slurm still runs or has pending."""
        return self.squeue("-h", "-o", "%i").split()

    def job_state(self, job_id: str) -> str:
        """``JobState`` of ``scontrol show job <id>`` (``PENDING``, ``RUNNING``,
        ``COMPLETED``...)."""
        text = self.scontrol("show", "job", job_id)
        match = re.search(r"\bJobState=(\S+)", text)
        return match.group(1) if match else ""

    def wait_job(
        self, job_id: str, states: Sequence[str] = ("RUNNING",), timeout_s: float = 30.0
    ) -> str:
        """Wait until job ``job_id`` is in one of ``states``; that state."""
        return str(
            _until(
                lambda: (s := self.job_state(job_id)) in states and s,
                timeout_s,
                f"job {job_id} in {'/'.join(states)}",
                self,
            )
        )

    def cancel_all(self, timeout_s: float = 30.0) -> None:
        ids = self.job_ids()
        if ids:
            _run(*self.client(None), "scancel", *ids)
        self.wait_idle(timeout_s)

    def nodes_states(self) -> dict[str, str]:
        out = _run(*self.client(None), "sinfo", "-h", "-N", "-o", "%N %t")
        return dict(line.split() for line in out.splitlines() if line.strip())

    def wait_nodes(self, state: str = "idle", timeout_s: float = START_TIMEOUT_S) -> None:
        _until(
            lambda: all(self.nodes_states().get(n) == state for n in self.nodes),
            timeout_s,
            f"every node {state}",
            self,
        )

    def wait_idle(self, timeout_s: float = 30.0) -> None:
        """Wait until no job is left and every node is idle (epilogs done)."""
        _until(
            lambda: (
                not self.job_ids() and all(self.nodes_states().get(n) == "idle" for n in self.nodes)
            ),
            timeout_s,
            "no job left and every node idle",
            self,
        )

    def log(self, name: str) -> str:
        """A daemon's log: ``slurmctld``, ``slurmd-<node>``, ``munged``."""
        path = self.root / "munge" / "munged.log" if name == "munged" else self.logs / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def read_lines(
        self, process: subprocess.Popen[bytes], count: int, timeout_s: float = 30
    ) -> list[str]:
        """The next ``count`` lines of ``process``'s stdout (an :meth:`srun`'s), within
        ``timeout_s`` (TimeoutError, or EOFError when the output ends first)."""
        assert process.stdout is not None
        fd = process.stdout.fileno()
        pending = self._pending.setdefault(process.pid, b"")
        lines: list[str] = []
        deadline = time.monotonic() + timeout_s
        while True:
            while b"\n" in pending and len(lines) < count:
                line, pending = pending.split(b"\n", 1)
                lines.append(line.decode(errors="replace"))
            if len(lines) == count:
                self._pending[process.pid] = pending
                return lines
            left = deadline - time.monotonic()
            ready, _, _ = select.select([fd], [], [], max(left, 0))
            if not ready:
                self._pending[process.pid] = pending
                raise TimeoutError(f"{len(lines)} of {count} lines after {timeout_s:g}s: {lines}")
            chunk = os.read(fd, 65536)
            if not chunk:
                raise EOFError(f"output ended after {len(lines)} of {count} lines: {lines}")
            pending += chunk


def _kill_group(process: subprocess.Popen[Any], sig: int = signal.SIGKILL) -> None:
    if process.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, sig)
    try:
        process.wait(STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait(STOP_TIMEOUT_S)


def _until(predicate: Any, timeout_s: float, what: str, slurm: Slurm | None = None) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        with contextlib.suppress(subprocess.CalledProcessError, subprocess.TimeoutExpired):
            value = predicate()
            if value:
                return value
        if time.monotonic() > deadline:
            where = f"; logs in {slurm.logs}" if slurm is not None else ""
            raise TimeoutError(f"waited {timeout_s:g}s for {what}{where}")
        time.sleep(0.2)


def new_root() -> Path:
    """A directory for one cluster that every user may traverse (jobs write there)."""
    path = Path(tempfile.mkdtemp(prefix="hyperagent-slurm-", dir="/var/lib"))
    path.chmod(0o755)
    return path


@contextlib.contextmanager
def slurm_cluster(
    nodes: Sequence[str] = NODES,
    *,
    root: Path | None = None,
    gpus_per_node: int = GPUS_PER_NODE,
    users: Sequence[str] = USERS,
    host_dirs: Sequence[Path] = (),
    install: Callable[[Slurm], object] | None = None,
    keep: bool = False,
) -> Iterator[Slurm]:
    """A started Slurm of ``nodes``, every node idle; stopped and removed at the end (its
    root kept with ``keep``); each host sees ``host_dirs`` as folders of its own.
    ``install(slurm)``, if given, runs after the cluster's own configuration is written and
    before the daemons start (an operator's steps: files in ``slurm.etc``, run on a host with
    ``slurm.client(None)``). Raises Unavailable where this machine cannot run it."""
    check_host()
    base = root or new_root()
    try:
        with Slurm(
            base,
            tuple(nodes),
            gpus_per_node=gpus_per_node,
            users=tuple(users),
            host_dirs=tuple(host_dirs),
        ) as s:
            s.prepare()
            if install is not None:
                install(s)
            s.start()
            yield s
    finally:
        if not keep and root is None:
            shutil.rmtree(base, ignore_errors=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=10.0, help="tear down after this long")
    args = parser.parse_args()
    try:
        with contextlib.suppress(KeyboardInterrupt), slurm_cluster(keep=True) as s:
            print(f"Slurm up under {s.root}; logs in {s.logs}")
            print("a shell on the controller host: " + " ".join(s.client(None)) + " bash")
            time.sleep(60 * args.minutes)
    except Unavailable as e:
        print(e, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
