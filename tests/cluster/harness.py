"""A hyperagent cluster of network namespaces on one machine, installed from the shipped files.

One namespace per GPU node (its own host name, /etc/hyperagent, /run/hyperagent and
/var/lib/hyperagent), one for the broker and the coordinator, one for Prometheus, joined by
veth pairs to a bridge that lives in a namespace of its own: the addresses exist only inside
these namespaces, and everything is removed at the end.

What is installed is what README's "Install on a cluster (systemd)" installs: the shipped
hyperagent.toml, sysusers and tmpfiles entries, broker conf and ACL, prometheus.yml and rules.
The only substitutions are host names and addresses (the job's node list, /etc/hosts), file
paths under a temporary root (bind-mounted at the shipped paths), and throwaway TLS material
and passwords. The units' users and sandbox are emulated: each agent runs as the unprivileged
``hyperagent`` user with no new privileges in a mount namespace of its own with a private
/tmp (``User=``, ``NoNewPrivileges=``, ``PrivateTmp=``, ``UMask=``); the coordinator as a
dynamic uid with the ``hyperagent`` supplementary group (``DynamicUser=``,
``SupplementaryGroups=``); training jobs as other unprivileged users.

Run a cluster by hand (as root), to try a change as deployed:

    .venv/bin/python tests/cluster/harness.py --minutes 10

It prints where the logs, the journal and the Prometheus URL are, and tears down on Ctrl-C.
"""

from __future__ import annotations

import argparse
import contextlib
import grp
import json
import os
import pwd
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests"))  # run as a script too

from access import open_the_way, put_back  # noqa: E402
from pki import make_certificates  # noqa: E402

from hyperagent.scheduler import qualified  # noqa: E402
from hyperagent.signing import write_key_pair  # noqa: E402

SYSTEMD = REPO / "systemd"
BIN = Path(sys.executable).parent
REPLAY = REPO / "fixtures" / "replay"
CAPTURE = {
    "recording.jsonl": REPLAY / "h200-bf16-matmul" / "recording.jsonl",
    **{
        name: REPLAY / "full-node" / name
        for name in (
            "sys",
            "ethtool-S-eth0.txt",
            "rdma-resource-qp.json",
            "rdma-resource-cq.json",
            "ipmitool-sdr.txt",
            "pdu",
        )
    },
}
"""What each node replays: the real H200 under a bf16 matmul loop at its 700 W limit (so every
power cap of the shipped job's 200-400 W range takes effect), and full-node's RDMA, BMC and PDU
captures (links, as full-node itself is: see fixtures/replay/README.md)."""

NODES = ("gpu-017", "gpu-018", "gpu-019")
"""The shipped hyperagent.toml's node names (its fourth, gpu-020, is not built)."""
BROKER_HOST = "mqtt.cluster.internal"
"""The broker's host name in the shipped hyperagent.toml."""
COORDINATOR_HOST = "hyperagent-coordinator"
RABBITMQ_NODES = ("rabbit-0", "rabbit-1", "rabbit-2")
"""The host names of a RabbitMQ cluster's broker nodes (Erlang node rabbit@HOST each)."""
RABBITMQ = Path("/usr/lib/rabbitmq/bin/rabbitmq-server")
PROMETHEUS_HOST = "prometheus"
RANKS_PER_NODE = 8
"""Ranks of the simulated job on each node, one JobReporter connection each (one per GPU, as
torchrun starts them); the TunedDDP node runs two real PyTorch ranks."""
JOB_USER, OTHER_USER = "ha-train", "ha-mallory"
"""The training job's user (in hyperagent-jobs) and a user who is not allowed to report."""
COORDINATOR_UID = 61923
"""A DynamicUser-range uid with no passwd entry, as systemd allocates one."""
TOOLS = (
    "ip",
    "unshare",
    "nsenter",
    "setpriv",
    "mosquitto",
    "mosquitto_passwd",
    "openssl",
    "prometheus",
    "systemd-sysusers",
    "useradd",
)


def shipped_toml() -> str:
    """systemd/hyperagent.toml as an operator sets it for these nodes: no job list, the power
    caps searched between 200 and 400 W (its commented example taken)."""
    text = (SYSTEMD / "hyperagent.toml").read_text()
    text, count = re.subn(r"(?m)^# (power_limits_w = \[200, 400\])", r"\1", text)
    assert count == 1, "the shipped hyperagent.toml gives an example of power_limits_w once"
    tomllib.loads(text)
    return text


class Unavailable(Exception):
    """This machine cannot host the cluster (not root, or a tool is missing)."""


def check_host(broker: str = "mosquitto") -> None:
    if os.geteuid() != 0:
        raise Unavailable("the namespace cluster needs root (network and mount namespaces)")
    tools = (*TOOLS, "rabbitmqctl", "ss") if broker == "rabbitmq" else TOOLS
    missing = [t for t in tools if shutil.which(t) is None and not Path(f"/usr/sbin/{t}").exists()]
    if missing:
        raise Unavailable(f"missing tools: {', '.join(missing)} (bash .ci/run installs them)")


def run(*argv: str, **kwargs: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, check=True, text=True, capture_output=True, **kwargs)


def bridge_namespaces(bridge_ns: str, hosts: list[tuple[str, str]], veth_prefix: str) -> None:
    """Network namespace ``bridge_ns`` holding a bridge, and each (namespace, address) of
    ``hosts`` made with an ``eth0`` at that address (/24) on it (veth pairs named after
    ``veth_prefix``, which must be unique on the machine)."""
    run("ip", "netns", "add", bridge_ns)
    run("ip", "-n", bridge_ns, "link", "add", "br0", "type", "bridge")
    run("ip", "-n", bridge_ns, "link", "set", "br0", "up")
    for i, (netns, address) in enumerate(hosts):
        run("ip", "netns", "add", netns)
        outer, inner = f"{veth_prefix}v{i}", f"{veth_prefix}p{i}"
        run("ip", "link", "add", outer, "type", "veth", "peer", "name", inner)
        run("ip", "link", "set", outer, "netns", bridge_ns)
        run("ip", "link", "set", inner, "netns", netns)
        run("ip", "-n", bridge_ns, "link", "set", outer, "master", "br0")
        run("ip", "-n", bridge_ns, "link", "set", outer, "up")
        run("ip", "-n", netns, "link", "set", inner, "name", "eth0")
        run("ip", "-n", netns, "addr", "add", f"{address}/24", "dev", "eth0")
        run("ip", "-n", netns, "link", "set", "eth0", "up")
        run("ip", "-n", netns, "link", "set", "lo", "up")


@dataclass
class Host:
    """One namespace: a name, an address, and a process holding its mount and UTS namespace."""

    name: str
    netns: str
    address: str
    holder: subprocess.Popen[bytes] | None = None
    root: Path = Path()

    def enter(self) -> list[str]:
        assert self.holder is not None
        return ["nsenter", "-t", str(self.holder.pid), "-m", "-u", "-n", "--"]


@dataclass
class Cluster:
    """The cluster; use as a context manager (``with Cluster(root) as c: c.start()``)."""

    root: Path
    broker: str = "mosquitto"
    """``mosquitto`` (on the coordinator's host) or ``rabbitmq``: a 3-node RabbitMQ cluster, each
    node a host of its own, the daemons given all three addresses (the agents spread over
    them, the coordinator on the second) and the agents persistent sessions."""
    defaults: dict[str, str] = field(default_factory=dict)
    """``[coordinator.defaults]`` keys set over the shipped ones (TOML values as text)."""
    tag: str = field(default_factory=lambda: secrets.token_hex(2))
    hosts: dict[str, Host] = field(default_factory=dict)
    processes: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    _mount_points: list[Path] = field(default_factory=list)
    _users: list[str] = field(default_factory=list)
    _log_files: list[Any] = field(default_factory=list)
    _opened: dict[Path, int] = field(default_factory=dict)
    """Directories given o+x for the cluster's users, and their modes before."""

    def __post_init__(self) -> None:
        subnet = 16 + int(self.tag, 16) % 200
        self.bridge_ns = f"hac{self.tag}-br"
        names = [("ctl", COORDINATOR_HOST, 2), ("prom", PROMETHEUS_HOST, 3)]
        names += [(f"n{i}", node, 11 + i) for i, node in enumerate(NODES)]
        if self.broker == "rabbitmq":
            names += [(f"b{i}", node, 4 + i) for i, node in enumerate(RABBITMQ_NODES)]
        for key, name, last in names:
            self.hosts[key] = Host(name, f"hac{self.tag}-{key}", f"10.231.{subnet}.{last}")
        self.logs = self.root / "logs"
        self.capture = self.root / "capture"

    # -- the whole cluster ---------------------------------------------------------------

    def __enter__(self) -> Cluster:
        check_host(self.broker)
        self.root.mkdir(parents=True, exist_ok=True)
        os.chmod(self.root, 0o755)
        self.logs.mkdir(exist_ok=True)
        self._opened = open_the_way(REPO, BIN, Path(sys.executable).resolve())
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self, torch_node: str | None = None) -> None:
        """Install and start everything: network, users, files, broker, coordinator, agents,
        jobs (``torch_node``'s job runs as two TunedDDP ranks) and Prometheus."""
        self._users_and_groups()
        self._network()
        self._pki()
        self._install()
        self.capture.mkdir()
        for name, target in CAPTURE.items():
            (self.capture / name).symlink_to(target)
        for host in self.hosts.values():
            self._hold(host)
        self.start_broker()
        for key in self.node_keys:
            self.start_agent(key)
        self.start_coordinator()
        # one job: two TunedDDP ranks on the torch node, 8 simulated ranks on each other node
        # (the torch ranks are ranks 0 and 1 of the job, the simulated ones number on)
        torch = [k for k in self.node_keys if self.hosts[k].name == torch_node][:1]
        world = 2 * len(torch) + RANKS_PER_NODE * (len(self.node_keys) - len(torch))
        first = 0
        for key in torch:
            self.start_torch_job(key, world)
            first += 2
        for key in self.node_keys:
            if key not in torch:
                self.start_job(key, world_size=world, first_rank=first)
                first += RANKS_PER_NODE
        self.start_prometheus()

    @property
    def node_keys(self) -> list[str]:
        return [k for k in self.hosts if k.startswith("n")]

    @property
    def broker_keys(self) -> list[str]:
        return [k for k in self.hosts if k.startswith("b")]

    def stop(self) -> None:
        for name in reversed(list(self.processes)):
            self.kill(name, signal.SIGTERM)
        for host in self.hosts.values():
            if host.holder is not None:
                host.holder.kill()
                host.holder.wait()
        for key in self.broker_keys:  # the epmd each RabbitMQ node started as a daemon
            pids = subprocess.run(
                ["ip", "netns", "pids", self.hosts[key].netns], capture_output=True, text=True
            ).stdout.split()
            for pid in pids:
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(pid), signal.SIGKILL)
        for host in self.hosts.values():
            subprocess.run(["ip", "netns", "del", host.netns], capture_output=True)
        subprocess.run(["ip", "netns", "del", self.bridge_ns], capture_output=True)
        for path in reversed(self._mount_points):
            with contextlib.suppress(OSError):
                path.rmdir()
        for user in self._users:
            subprocess.run(["userdel", user], capture_output=True)
        put_back(self._opened)
        for handle in self._log_files:
            handle.close()

    # -- installation --------------------------------------------------------------------

    def _users_and_groups(self) -> None:
        run("systemd-sysusers", str(SYSTEMD / "hyperagent.sysusers"))
        for user, groups in ((JOB_USER, ["hyperagent-jobs"]), (OTHER_USER, [])):
            try:
                pwd.getpwnam(user)
            except KeyError:
                extra = ["-G", ",".join(groups)] if groups else []
                run(
                    "useradd",
                    "--system",
                    "--no-create-home",
                    "--user-group",
                    "--shell",
                    "/usr/sbin/nologin",
                    *extra,
                    user,
                )
                self._users.append(user)

    def _network(self) -> None:
        hosts = [(h.netns, h.address) for h in self.hosts.values()]
        bridge_namespaces(self.bridge_ns, hosts, f"hac{self.tag}")

    def _pki(self) -> None:
        pki = self.root / "pki"
        pki.mkdir()
        ctl = self.hosts["ctl"]
        names = [f"DNS:{BROKER_HOST}", f"IP:{ctl.address}"]
        for key in self.broker_keys:
            names += [f"DNS:{self.hosts[key].name}", f"IP:{self.hosts[key].address}"]
        make_certificates(pki, BROKER_HOST, ",".join(names))
        self.ca = pki / "ca.crt"

    def _hosts_file(self) -> Path:
        path = self.root / "hosts"
        lines = ["127.0.0.1 localhost"]
        ctl = self.hosts["ctl"]
        lines.append(f"{ctl.address} {COORDINATOR_HOST} {BROKER_HOST}")
        lines += [f"{h.address} {h.name}" for k, h in self.hosts.items() if k != "ctl"]
        path.write_text("\n".join(lines) + "\n")
        return path

    def _tmpfiles(self, root: Path) -> None:
        """The shipped tmpfiles.d entries under ``root``."""
        for line in (SYSTEMD / "hyperagent.tmpfiles").read_text().splitlines():
            if not line.strip() or line.startswith("#"):
                continue
            kind, path, mode, user, group, *_ = line.split()
            target = root / path.lstrip("/")
            if kind == "d":
                target.mkdir(parents=True, exist_ok=True)
            if target.exists():
                os.chown(target, pwd.getpwnam(user).pw_uid, grp.getgrnam(group).gr_gid)
                os.chmod(target, int(mode, 8))

    def _install(self) -> None:
        hyperagent = pwd.getpwnam("hyperagent")
        group = grp.getgrnam("hyperagent").gr_gid
        toml = shipped_toml()
        # README: hyperagent keys generate on the coordinator's host; settings.pub to each node
        signing_group = grp.getgrnam("hyperagent-signing").gr_gid
        keys = self.root / "keys"
        write_key_pair(keys, "settings", "hyperagent-signing")
        self.passwords = {"coordinator": secrets.token_urlsafe(16)}
        self.passwords |= {self.hosts[k].name: secrets.token_urlsafe(16) for k in self.node_keys}
        hosts_file = self._hosts_file()
        for key_name, host in self.hosts.items():
            host.root = self.root / key_name
            (host.root / "etc").mkdir(parents=True)
            shutil.copy(hosts_file, host.root / "etc" / "hosts")
            if key_name == "prom":
                continue
            if key_name == "ctl" or key_name.startswith("n"):
                # README: install -m 0640 -g hyperagent systemd/hyperagent.toml ...
                self._tmpfiles(host.root)
                etc = host.root / "etc" / "hyperagent"
                user = "coordinator" if key_name == "ctl" else host.name
                for name, content in (
                    ("hyperagent.toml", self._toml(toml, key_name)),
                    ("mqtt.password", self.passwords[user] + "\n"),
                    ("mqtt-ca.crt", self.ca.read_text()),
                ):
                    (etc / name).write_text(content)
                    os.chown(etc / name, 0, group)
                    os.chmod(etc / name, 0o640)
                shutil.copy(keys / "settings.pub", etc / "trusted-keys" / "settings.pub")
                os.chmod(etc / "trusted-keys" / "settings.pub", 0o644)
                if key_name == "ctl":
                    shutil.copy(keys / "settings.key", etc / "signing" / "settings.key")
                    os.chown(etc / "signing" / "settings.key", 0, signing_group)
                    os.chmod(etc / "signing" / "settings.key", 0o640)
            if key_name.startswith("n"):
                for path, mode in (("run/hyperagent", 0o755), ("var/lib/hyperagent", 0o700)):
                    (host.root / path).mkdir(parents=True)
                    os.chown(host.root / path, hyperagent.pw_uid, hyperagent.pw_gid)
                    os.chmod(host.root / path, mode)
                jobs = host.root / "jobs"
                jobs.mkdir()
                os.chmod(jobs, 0o1777)
        if self.broker == "rabbitmq":
            self._install_rabbitmq()
        else:
            self._install_broker()
        self._install_prometheus()
        state = self.hosts["ctl"].root / "var/lib/hyperagent-coordinator"
        state.mkdir(parents=True)
        os.chown(state, COORDINATOR_UID, COORDINATOR_UID)
        os.chmod(state, 0o700)

    def _install_broker(self) -> None:
        etc = self.hosts["ctl"].root / "etc" / "mosquitto"
        (etc / "conf.d").mkdir(parents=True)
        (etc / "certs").mkdir()
        shutil.copy(SYSTEMD / "mosquitto" / "hyperagent.conf", etc / "conf.d" / "hyperagent.conf")
        # what Debian's /etc/mosquitto/mosquitto.conf sets that the conf.d file relies on
        (etc / "mosquitto.conf").write_text(
            "persistence_location /var/lib/mosquitto/\ninclude_dir /etc/mosquitto/conf.d\n"
        )
        shutil.copy(SYSTEMD / "mosquitto" / "hyperagent.acl", etc / "hyperagent.acl")
        passwd = etc / "hyperagent.passwd"
        for i, (user, password) in enumerate(self.passwords.items()):
            create = ["-c"] if i == 0 else []
            run("mosquitto_passwd", *create, "-b", str(passwd), user, password)
        pki = self.root / "pki"
        for name in ("ca.crt", "broker.crt", "broker.key"):
            shutil.copy(pki / name, etc / "certs" / name)
        mosquitto = pwd.getpwnam("mosquitto")
        for path in [passwd, *(etc / "certs").iterdir(), etc / "hyperagent.acl"]:
            os.chown(path, mosquitto.pw_uid, mosquitto.pw_gid)
            os.chmod(path, 0o600)
        data = self.hosts["ctl"].root / "var/lib/mosquitto"
        data.mkdir(parents=True)
        os.chown(data, mosquitto.pw_uid, mosquitto.pw_gid)

    def _toml(self, toml: str, key: str) -> str:
        """The shipped hyperagent.toml for host ``key``: on RabbitMQ, ``mqtt.url`` the three
        broker nodes (the agents' first choice spread over them, the coordinator's the
        second) and the agents' sessions persistent; ``defaults`` over the shipped ones."""
        if self.broker == "rabbitmq":
            urls = [f"mqtts://{self.hosts[b].name}:8883" for b in self.broker_keys]
            first = 1 if key == "ctl" else [0, 0, 2][self.node_keys.index(key) % 3]
            urls = urls[first:] + urls[:first]
            listed = ", ".join(f'"{u}"' for u in urls)
            toml, count = re.subn(r'(?m)^url = "mqtts://[^"]*"$', f"url = [{listed}]", toml)
            assert count == 1, "the shipped hyperagent.toml sets mqtt.url once"
            if key != "ctl":
                toml = toml.replace("[mqtt]\n", "[mqtt]\npersistent_session = true\n", 1)
        if self.defaults:
            for k in self.defaults:  # the shipped line of a key set here goes
                toml = re.sub(rf"(?m)^{re.escape(k)} = .*\n", "", toml)
            keys = "".join(f"{k} = {v}\n" for k, v in self.defaults.items())
            toml = toml.replace("[coordinator.defaults]\n", f"[coordinator.defaults]\n{keys}", 1)
        tomllib.loads(toml)
        return toml

    def _install_rabbitmq(self) -> None:
        """README's "Installing with RabbitMQ instead of mosquitto" on each broker host: the
        shipped rabbitmq.conf and enabled_plugins, the certificates, one Erlang cookie."""
        rabbitmq = pwd.getpwnam("rabbitmq")
        cookie = secrets.token_hex(16).upper()
        pki = self.root / "pki"
        for key in self.broker_keys:
            root = self.hosts[key].root
            etc = root / "etc" / "rabbitmq"
            certs = etc / "certs"
            certs.mkdir(parents=True)
            os.chmod(certs, 0o750)
            os.chown(certs, 0, rabbitmq.pw_gid)
            for name in ("rabbitmq.conf", "enabled_plugins"):
                shutil.copy(SYSTEMD / "rabbitmq" / name, etc / name)
                os.chmod(etc / name, 0o644)
            for name, mode in (("ca.crt", 0o644), ("broker.crt", 0o644), ("broker.key", 0o640)):
                shutil.copy(pki / name, certs / name)
                os.chown(certs / name, 0, rabbitmq.pw_gid)
                os.chmod(certs / name, mode)
            for sub in ("var/lib/rabbitmq", "var/log/rabbitmq"):
                (root / sub).mkdir(parents=True)
                os.chown(root / sub, rabbitmq.pw_uid, rabbitmq.pw_gid)
            jar = root / "var/lib/rabbitmq/.erlang.cookie"
            jar.write_text(cookie)
            os.chown(jar, rabbitmq.pw_uid, rabbitmq.pw_gid)
            os.chmod(jar, 0o400)

    def _install_prometheus(self) -> None:
        etc = self.hosts["prom"].root / "etc" / "prometheus"
        (etc / "rules").mkdir(parents=True)
        (etc / "targets").mkdir()
        shutil.copy(REPO / "rules" / "prometheus.yml", etc / "prometheus.yml")
        for rules in (REPO / "rules").glob("*.rules.yml"):
            shutil.copy(rules, etc / "rules" / rules.name)
        nodes = [f"{self.hosts[k].name}:10478" for k in self.node_keys]
        for name, targets in (("nodes", nodes), ("coordinator", [f"{COORDINATOR_HOST}:10479"])):
            entry = [{"targets": targets, "labels": {"cluster": "prod"}}]
            (etc / "targets" / f"hyperagent-{name}.json").write_text(json.dumps(entry))
        data = self.hosts["prom"].root / "data"
        data.mkdir()

    def _mount_point(self, path: Path, is_file: bool = False) -> None:
        if path.exists():
            return
        missing = [p for p in [path, *path.parents] if not p.exists()]
        for p in reversed(missing):
            p.mkdir()
            self._mount_points.append(p)

    def _hold(self, host: Host) -> None:
        """Start the process that holds the host's mount and UTS namespace, with the host's
        files bind-mounted at the shipped paths."""
        binds = [(host.root / "etc" / "hosts", Path("/etc/hosts"))]
        for sub in (
            "etc/hyperagent",
            "run/hyperagent",
            "var/lib/hyperagent",
            "var/lib/hyperagent-coordinator",
            "etc/mosquitto",
            "var/lib/mosquitto",
            "etc/prometheus",
            "etc/rabbitmq",
            "var/lib/rabbitmq",
            "var/log/rabbitmq",
        ):
            if (host.root / sub).is_dir():
                self._mount_point(Path("/") / sub)
                binds.append((host.root / sub, Path("/") / sub))
        ready = host.root / "ready"
        script = [f"hostname {host.name}"]
        script += [f"mount --bind '{source}' '{target}'" for source, target in binds]
        script += [f"touch '{ready}'", "exec sleep infinity"]
        host.holder = subprocess.Popen(
            [
                "ip",
                "netns",
                "exec",
                host.netns,
                "unshare",
                "--mount",
                "--uts",
                "--propagation",
                "private",
                "--",
                "sh",
                "-ec",
                "\n".join(script),
            ],
        )
        deadline = time.monotonic() + 10
        while not ready.exists():
            if host.holder.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{host.name}: namespace holder failed")
            time.sleep(0.02)

    # -- processes -----------------------------------------------------------------------

    def spawn(
        self,
        name: str,
        host: Host,
        argv: list[str],
        *,
        user: str | None = None,
        uid_gid: tuple[int, int] | None = None,
        groups: str | None = None,
        private_tmp: bool = False,
        umask: str = "0022",
        env: dict[str, str] | None = None,
    ) -> subprocess.Popen[bytes]:
        """Run ``argv`` on ``host`` as a unit would: as ``user`` (with its groups) or as a
        uid/gid with ``groups``, with no new privileges and, with ``private_tmp``, in a mount
        namespace of its own with an empty /tmp and /var/tmp."""
        setpriv = ["setpriv", "--no-new-privs", "--inh-caps=-all"]
        if user is not None:
            setpriv += [f"--reuid={user}", f"--regid={user}", "--init-groups"]
        elif uid_gid is not None:
            setpriv += [
                f"--reuid={uid_gid[0]}",
                f"--regid={uid_gid[1]}",
                f"--groups={groups}" if groups else "--clear-groups",
            ]
        script = ["umask 0022"]  # the mount points below: reachable by the unit's user
        if private_tmp:
            # a checkout under /tmp stays visible, as installed code is: set aside, then back
            kept = [
                p for p in (REPO, BIN) if p.is_relative_to("/tmp") or p.is_relative_to("/var/tmp")
            ]
            for i, path in enumerate(kept):
                script.append(f"mount --bind '{path}' '{self._keep(i)}'")
            script += [
                "mount -t tmpfs -o mode=1777 tmpfs /tmp",
                "mount -t tmpfs -o mode=1777 tmpfs /var/tmp",
            ]
            for i, path in enumerate(kept):
                script += [f"mkdir -p '{path}'", f"mount --move '{self._keep(i)}' '{path}'"]
        script += [f"umask {umask}", 'exec "$@"']
        command = [
            *host.enter(),
            "unshare",
            "--mount",
            "--propagation",
            "private",
            "--",
            "sh",
            "-ec",
            "\n".join(script),
            "sh",
            *setpriv,
            "--",
            *argv,
        ]
        log = (self.logs / f"{name}.log").open("ab")
        self._log_files.append(log)
        process = subprocess.Popen(
            command,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={
                "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
                "PYTHONUNBUFFERED": "1",
                **(env or {}),
            },
        )
        self.processes[name] = process
        return process

    def _keep(self, i: int) -> Path:
        path = self.root / "keep" / str(i)
        path.mkdir(parents=True, exist_ok=True)
        return path

    def kill(self, name: str, sig: int = signal.SIGKILL, timeout_s: float = 30) -> None:
        process = self.processes.pop(name, None)
        if process is None or process.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, sig)
        try:
            process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()

    def start_broker(self) -> None:
        if self.broker == "rabbitmq":
            self.start_rabbitmq()
            return
        self.spawn(
            "mosquitto",
            self.hosts["ctl"],
            ["mosquitto", "-c", "/etc/mosquitto/mosquitto.conf"],
        )
        # started as root, mosquitto drops to its own user itself, as its Debian unit has it
        self.wait_listening("ctl", 8883)

    def start_rabbitmq_node(self, key: str) -> None:
        """The RabbitMQ node of broker host ``key``, as its unit runs it (User=rabbitmq)."""
        self.spawn(
            f"rabbitmq-{self.hosts[key].name}",
            self.hosts[key],
            [str(RABBITMQ)],
            user="rabbitmq",
            umask="0027",
            env={"HOME": "/var/lib/rabbitmq"},
        )

    def rabbitmqctl(self, key: str, *args: str, stdin: str | None = None) -> str:
        return run(*self.hosts[key].enter(), "rabbitmqctl", *args, input=stdin, timeout=120).stdout

    def start_rabbitmq(self) -> None:
        """Three nodes joined into one cluster, then the users of README's RabbitMQ section."""
        for key in self.broker_keys:
            self.start_rabbitmq_node(key)
        first, *others = self.broker_keys
        for key in self.broker_keys:
            self.wait_listening(key, 8883, 120)
        for key in others:
            self.rabbitmqctl(key, "stop_app")
            self.rabbitmqctl(key, "join_cluster", f"rabbit@{self.hosts[first].name}")
            self.rabbitmqctl(key, "start_app")
        for key in self.broker_keys:
            self.rabbitmqctl(key, "await_startup")
            self.wait_listening(key, 8883, 120)
        lines = "".join(f"{user} {password}\n" for user, password in self.passwords.items())
        users = subprocess.run(
            [
                *self.hosts[first].enter(),
                "sh",
                str(SYSTEMD / "rabbitmq" / "hyperagent-rabbitmq-users"),
                str(SYSTEMD / "mosquitto" / "hyperagent.acl"),
            ],
            input=lines,
            text=True,
            capture_output=True,
            timeout=120,
        )
        if users.returncode:
            raise RuntimeError(f"hyperagent-rabbitmq-users: {users.stdout}{users.stderr}")
        self.rabbitmqctl(first, "delete_user", "guest")

    def mqtt_peer(self, key: str) -> str | None:
        """The broker host key that ``key``'s established MQTT connection goes to."""
        out = self.in_host(key, ["ss", "-Htn", "state", "established", "( dport = :8883 )"])
        addresses = {self.hosts[b].address: b for b in self.broker_keys}
        for line in out.splitlines():
            peer = line.split()[-1].rsplit(":", 1)[0]
            if peer in addresses:
                return addresses[peer]
        return None

    def start_coordinator(self) -> None:
        unit = (SYSTEMD / "hyperagent-coordinator.service").read_text()
        names = re.search(r"(?m)^SupplementaryGroups=(.+)$", unit)
        assert names, "the coordinator's unit names its supplementary groups"
        groups = ",".join(str(grp.getgrnam(g).gr_gid) for g in names.group(1).split())
        self.spawn(
            "coordinator",
            self.hosts["ctl"],
            [str(BIN / "hyperagent"), "coordinator", "--config", "/etc/hyperagent/hyperagent.toml"],
            uid_gid=(COORDINATOR_UID, COORDINATOR_UID),
            groups=groups,
            private_tmp=True,
            umask="0077",
        )

    def start_agent(self, key: str) -> None:
        self.spawn(
            f"agent-{self.hosts[key].name}",
            self.hosts[key],
            [
                str(BIN / "hyperagent"),
                "agent",
                "--config",
                "/etc/hyperagent/hyperagent.toml",
                "--replay",
                str(self.capture),
            ],
            user="hyperagent",
            private_tmp=True,
            umask="0027",
        )

    def start_job(
        self,
        key: str,
        user: str = JOB_USER,
        job: str = "llama-ft",
        ranks: int = RANKS_PER_NODE,
        name: str | None = None,
        world_size: int | None = None,
        first_rank: int | None = None,
    ) -> Path:
        """The simulated job's ``ranks`` ranks on ``key`` as ``user`` (ranks numbered from
        ``first_rank``, by default
        the node's position times ``ranks``, one GPU each; the world: ``ranks`` on every
        node unless ``world_size``); their log."""
        host = self.hosts[key]
        first = self.node_keys.index(key) * ranks if first_rank is None else first_rank
        log = host.root / "jobs" / f"{name or f'job-{user}'}.jsonl"
        self.spawn(
            name or f"job-{host.name}-{user}",
            host,
            [
                sys.executable,
                str(REPO / "tests" / "cluster" / "sim_rank.py"),
                "--job",
                job,
                "--rank",
                str(first),
                "--ranks",
                str(ranks),
                "--world-size",
                str(world_size or ranks * len(self.node_keys)),
                "--gpu",
                "0",
                "--log",
                str(log),
            ],
            user=user,
            env={"PYTHONPATH": str(REPO)},
        )
        return log

    def start_torch_job(self, key: str, job_world_size: int | None = None) -> None:
        host = self.hosts[key]
        for rank in (0, 1):
            log = host.root / "jobs" / f"torch-{rank}.jsonl"
            self.spawn(
                f"job-{host.name}-torch-{rank}",
                host,
                [
                    sys.executable,
                    "-m",
                    "hyperagent.demo_torch",
                    "--rank",
                    str(rank),
                    "--world-size",
                    "2",
                    "--master-port",
                    "29517",
                    "--job",
                    "llama-ft",
                    *(["--job-world-size", str(job_world_size)] if job_world_size else []),
                    "--socket",
                    "/run/hyperagent/job.sock",
                    "--gpu",
                    str(rank),
                    "--log",
                    str(log),
                ],
                user=JOB_USER,
            )

    def start_prometheus(self) -> None:
        prom = self.hosts["prom"]
        prometheus = shutil.which("prometheus") or "/usr/bin/prometheus"
        self.spawn(
            "prometheus",
            prom,
            [
                prometheus,
                "--config.file=/etc/prometheus/prometheus.yml",
                f"--storage.tsdb.path={prom.root / 'data'}",
                "--web.listen-address=0.0.0.0:9090",
                "--web.enable-lifecycle",
            ],
        )
        self.wait_listening("prom", 9090)

    # -- looking inside ------------------------------------------------------------------

    def in_host(self, key: str, argv: list[str], timeout_s: float = 20) -> str:
        """Run a short command on ``key``'s host as root; its stdout."""
        return run(*self.hosts[key].enter(), *argv, timeout=timeout_s).stdout

    def http_get(self, key: str, url: str) -> str:
        """GET ``url`` from inside ``key``'s namespace (the addresses exist only there)."""
        code = (
            "import sys, urllib.request; "
            "sys.stdout.write(urllib.request.urlopen(sys.argv[1], timeout=10).read().decode())"
        )
        return self.in_host(key, [sys.executable, "-c", code, url])

    def wait_listening(self, key: str, port: int, timeout_s: float = 30) -> None:
        deadline = time.monotonic() + timeout_s
        code = (
            "import socket, sys; s = socket.socket(); s.settimeout(1); "
            "sys.exit(s.connect_ex(('127.0.0.1', int(sys.argv[1]))))"
        )
        while time.monotonic() < deadline:
            probe = subprocess.run(
                [*self.hosts[key].enter(), sys.executable, "-c", code, str(port)],
                capture_output=True,
            )
            if probe.returncode == 0:
                return
            time.sleep(0.3)
        raise TimeoutError(f"nothing listens on {key}:{port}; see {self.logs}")

    def metrics(self, key: str) -> str:
        """The agent's (or, for "ctl", the coordinator's) /metrics, scraped across hosts from
        the Prometheus host as Prometheus does."""
        host = self.hosts[key]
        port = 10479 if key == "ctl" else 10478
        return self.http_get("prom", f"http://{host.name}:{port}/metrics")

    def query(self, promql: str) -> list[dict[str, Any]]:
        from urllib.parse import quote

        body = self.http_get("prom", f"http://127.0.0.1:9090/api/v1/query?query={quote(promql)}")
        result: list[dict[str, Any]] = json.loads(body)["data"]["result"]
        return result

    @staticmethod
    def job_id(job: str = "llama-ft", user: str = JOB_USER) -> str:
        """The id the cluster knows ``user``'s job ``job`` by (bound to the user: it runs
        outside any scheduler)."""
        return qualified(job, pwd.getpwnam(user).pw_uid)

    def journal(self) -> list[dict[str, Any]]:
        path = self.hosts["ctl"].root / "var/lib/hyperagent-coordinator" / f"{self.job_id()}.jsonl"
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

    def agent_log(self, key: str) -> str:
        path = self.logs / f"agent-{self.hosts[key].name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def node_log(self, key: str, name: str) -> list[dict[str, Any]]:
        path = self.hosts[key].root / "jobs" / name
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def metric_values(text: str, name: str) -> list[tuple[dict[str, str], float]]:
    """(labels, value) of every sample of ``name`` in a Prometheus text exposition."""
    out = []
    pattern = re.compile(rf"^{re.escape(name)}(?:\{{(.*)\}})? (\S+)$")
    for line in text.splitlines():
        match = pattern.match(line)
        if match:
            labels = dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', match.group(1) or ""))
            out.append((labels, float(match.group(2))))
    return out


def new_root() -> Path:
    """A directory for one cluster, outside /tmp (each daemon's private /tmp hides that) and
    reachable by the daemons' and jobs' users."""
    path = Path(tempfile.mkdtemp(prefix="hyperagent-cluster-", dir="/var/lib"))
    path.chmod(0o755)
    return path


@contextlib.contextmanager
def cluster(root: Path | None = None, torch_node: str | None = None) -> Iterator[Cluster]:
    """A started cluster under ``root`` (a new temporary directory by default)."""
    base = root or new_root()
    with Cluster(base) as c:
        c.start(torch_node)
        yield c


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=10.0, help="tear down after this long")
    parser.add_argument("--torch-node", default=None, help="run TunedDDP ranks on this node")
    args = parser.parse_args()
    try:
        with contextlib.suppress(KeyboardInterrupt), cluster(torch_node=args.torch_node) as c:
            print(f"cluster up under {c.root}; logs in {c.logs}")
            print(
                f"Prometheus: {c.hosts['prom'].address}:9090 inside netns {c.hosts['prom'].netns}"
            )
            deadline = time.monotonic() + 60 * args.minutes
            while time.monotonic() < deadline:
                done = [e for e in c.journal() if e.get("type") == "trial"]
                print(f"trials: {len(done)} {[e['status'] for e in done][-5:]}", flush=True)
                time.sleep(10)
    except Unavailable as e:
        print(e, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
