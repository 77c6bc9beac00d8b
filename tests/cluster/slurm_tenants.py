"""A hyperagent deployment on the real Slurm of ``slurm.py``, and the ranks its tenants run.

- :class:`Deployment`: mosquitto and ``hyperagent coordinator`` on the controller host (its
  namespace address), one ``hyperagent agent`` per Slurm node in that node's namespaces, run as
  the unprivileged ``hyperagent`` user, its job socket ``/run/hyperagent/job.sock`` in the
  node's mount namespace, replaying an 8-GPU capture with power capping on.
- :class:`Watch`: what the test looks at while the cluster runs, from the controller host's
  network namespace (a thread that joined it, ``setns``): every agent's GPU power limits and job
  series sampled from /metrics all along, and every settings, ack and coordinator status
  message the broker carries.
- ``python slurm_tenants.py ranks ...``: one process holding several JobReporter connections,
  each as the spec says (the job id it gives, rank, declared GPU, world size, whether it asks to
  be tuned, how many samples it claims); ``--slurm-ranks`` adds one rank per GPU of
  ``SLURM_STEP_GPUS``. A training user's own script: it can say anything.

Used by tests/test_slurm_tenants.py.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import pwd
import queue
import shlex
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests"))  # run as a script too (by srun, as a job's user)

from cluster.slurm import Slurm  # noqa: E402
from cluster.text import samples, toml_section, toml_value  # noqa: E402

AGENT_USER = "hyperagent"
JOB_SOCKET = Path("/run/hyperagent/job.sock")
RUN_DIR = JOB_SOCKET.parent
CAPTURE = REPO / "hyperagent" / "data" / "gtx-8card.xml"
"""8 x V100S under training load, 250 W limits in [100, 250] W (the production scenario's)."""
DEFAULT_LIMIT_W = 250.0
CLUSTER = "tenants"
BROKER_PORT = 1883
AGENT_PORT = 9400
COORDINATOR_PORT = 9401
GPU_POWER_LIMIT = "hyperagent_gpu_power_limit_watts"
GPU_JOB_INFO = "hyperagent_gpu_job_info"
JOB_RANKS = "hyperagent_job_ranks"
CLONE_NEWNET = 0x40000000
STOP_TIMEOUT_S = 20.0


# -- a thread in another network namespace ----------------------------------------------


def join_netns(path: str) -> None:
    """Move the calling thread (only it) into the network namespace at ``path``: sockets it
    opens from now on live there."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(path, os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            errno = ctypes.get_errno()
            raise OSError(errno, f"setns {path}: {os.strerror(errno)}")
    finally:
        os.close(fd)


class NetnsThread:
    """One thread in a network namespace that runs what it is given, in order."""

    def __init__(self, netns_path: str, name: str) -> None:
        self._calls: queue.Queue[tuple[Callable[[], Any], Future[Any]] | None] = queue.Queue()
        joined: Future[None] = Future()
        self._thread = threading.Thread(
            target=self._run, args=(netns_path, joined), name=name, daemon=True
        )
        self._thread.start()
        joined.result(10)

    def _run(self, path: str, joined: Future[None]) -> None:
        try:
            join_netns(path)
        except OSError as e:
            joined.set_exception(e)
            return
        joined.set_result(None)
        while (item := self._calls.get()) is not None:
            call, future = item
            try:
                future.set_result(call())
            except BaseException as e:  # handed to the caller
                future.set_exception(e)

    def call(self, call: Callable[[], Any], timeout_s: float = 20.0) -> Any:
        future: Future[Any] = Future()
        self._calls.put((call, future))
        return future.result(timeout_s)

    def close(self) -> None:
        self._calls.put(None)
        self._thread.join(10)


def get(url: str, timeout_s: float = 5.0) -> str:
    """The body of ``url``; "" when it does not answer."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            return str(response.read().decode())
    except OSError:
        return ""


# -- the deployment ---------------------------------------------------------------------


def ensure_agent_user() -> None:
    """The agent's service user, as README's install makes it (systemd/hyperagent.sysusers)."""
    try:
        pwd.getpwnam(AGENT_USER)
    except KeyError:
        subprocess.run(
            ["systemd-sysusers", str(REPO / "systemd" / "hyperagent.sysusers")],
            check=True,
            capture_output=True,
            timeout=30,
        )


@dataclass
class Deployment:
    """hyperagent on ``slurm``: files under ``root`` (every user may traverse it)."""

    slurm: Slurm
    root: Path
    job_users: tuple[str, ...]
    """``sources.job.allowed_users`` of every agent."""
    policy: dict[str, Any]
    """``[coordinator.defaults]`` (its ``plan`` a table of its own)."""
    rules: list[dict[str, Any]] = field(default_factory=list)
    """``[[coordinator.jobs]]`` entries."""
    agent_release_after_s: float = 3.0
    agent_job: dict[str, Any] = field(default_factory=dict)
    """More ``[sources.job]`` keys of every agent."""
    processes: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.logs = self.root / "logs"
        self.state = self.root / "coordinator"
        self.capture = self.root / "capture"
        self.ctl = self.slurm.hosts["ctl"]
        self.broker_url = f"mqtt://{self.ctl.address}:{BROKER_PORT}"

    # -- files ---------------------------------------------------------------------------

    def prepare(self) -> None:
        from hyperagent.signing import write_key_pair

        agent = pwd.getpwnam(AGENT_USER)
        self.root.mkdir(parents=True, exist_ok=True)
        self.root.chmod(0o755)
        self.logs.mkdir(mode=0o755, exist_ok=True)
        self.capture.mkdir(exist_ok=True)
        self.capture.chmod(0o755)
        (self.capture / "nvidia-smi.xml").symlink_to(CAPTURE)
        write_key_pair(self.root, "settings")
        (self.root / "settings.pub").chmod(0o644)
        for node in self.slurm.nodes:
            state = self.root / node / "state"
            state.mkdir(parents=True)
            (self.root / node).chmod(0o755)
            os.chown(state, agent.pw_uid, agent.pw_gid)
            run = self.slurm.host_path(node, RUN_DIR)  # the node's /run/hyperagent
            os.chown(run, agent.pw_uid, agent.pw_gid)
            run.chmod(0o755)
        (self.root / "broker.conf").write_text(
            f"listener {BROKER_PORT} {self.ctl.address}\nallow_anonymous true\n"
            "persistence false\nuser root\nmax_queued_messages 100000\n"
        )

    def agent_config(self, node: str) -> Path:
        job: dict[str, Any] = {
            "socket": JOB_SOCKET,
            "allowed_users": self.job_users,
            "release_after_s": self.agent_release_after_s,
            "slurm_node": node,  # the agent asks the controller (scontrol show job -d)
            "scontrol": ["scontrol"],
        }
        job.update(self.agent_job)
        text = f'cluster = "{CLUSTER}"\n'
        text += toml_section(
            "agent",
            {
                "interval_s": 0.5,
                "metrics_address": f"{self.slurm.hosts[node].address}:{AGENT_PORT}",
                "state_dir": self.root / node / "state",
            },
        )
        text += toml_section(
            "mqtt", {"url": self.broker_url, "reconnect_min_s": 0.2, "reconnect_max_s": 2.0}
        )
        text += toml_section("sources", {"timeout_s": 1.0})
        for off in ("host", "ipmi", "rdma", "pdu"):
            text += toml_section(f"sources.{off}", {"enabled": False})
        text += toml_section("sources.job", job)
        text += toml_section("actuation", {"power_cap": True})
        text += toml_section("security", {"trusted_keys": [self.root / "settings.pub"]})
        path = self.root / f"{node}.toml"
        path.write_text(text)
        path.chmod(0o644)
        return path

    def coordinator_config(self) -> Path:
        text = f'cluster = "{CLUSTER}"\n'
        text += toml_section(
            "mqtt", {"url": self.broker_url, "reconnect_min_s": 0.2, "reconnect_max_s": 2.0}
        )
        text += toml_section(
            "security",
            {
                "signing_key_file": self.root / "settings.key",
                "trusted_keys": [self.root / "settings.pub"],
            },
        )
        text += toml_section(
            "coordinator",
            {
                "metrics_address": f"{self.ctl.address}:{COORDINATOR_PORT}",
                "state_dir": self.state,
            },
        )
        text += toml_section(
            "coordinator.defaults", {k: v for k, v in self.policy.items() if k != "plan"}
        )
        text += toml_section("coordinator.defaults.plan", self.policy.get("plan", {}))
        for rule in self.rules:
            text += "[[coordinator.jobs]]\n" + "".join(
                f"{k} = {toml_value(v)}\n" for k, v in rule.items()
            )
        path = self.root / "coordinator.toml"
        path.write_text(text)
        return path

    # -- processes -----------------------------------------------------------------------

    def spawn(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> None:
        log = (self.logs / f"{name}.log").open("ab")
        try:
            self.processes[name] = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env={
                    "PATH": "/usr/sbin:/usr/bin:/sbin:/bin",
                    "PYTHONUNBUFFERED": "1",
                    "LANG": "C.UTF-8",
                    **(env or {}),
                },
            )
        finally:
            log.close()

    def kill(self, name: str, sig: int = signal.SIGTERM) -> None:
        process = self.processes.pop(name, None)
        if process is None:
            return
        if process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, sig)
        try:
            process.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait(STOP_TIMEOUT_S)

    def start_broker(self) -> None:
        self.spawn(
            "mosquitto", [*self.ctl.enter(), "mosquitto", "-c", str(self.root / "broker.conf")]
        )

    def start_agent(self, node: str) -> None:
        """The node's agent in its namespaces, as the ``hyperagent`` user with no new
        privileges (as its unit runs it), over the replayed GPUs."""
        argv = [
            *self.slurm.hosts[node].enter(),
            "setpriv",
            "--no-new-privs",
            "--inh-caps=-all",
            f"--reuid={AGENT_USER}",
            f"--regid={AGENT_USER}",
            "--init-groups",
            "--",
            sys.executable,
            "-m",
            "hyperagent.cli",
            "agent",
            "--config",
            str(self.agent_config(node)),
            "--replay",
            str(self.capture),
            "--node",
            node,
        ]
        self.spawn(f"agent-{node}", argv, {"HOME": str(self.root / node / "state")})

    def start_coordinator(self) -> None:
        argv = [*self.ctl.enter(), sys.executable, "-m", "hyperagent.cli", "coordinator"]
        self.spawn("coordinator", [*argv, "--config", str(self.coordinator_config())])

    def stop(self) -> None:
        for name in reversed(list(self.processes)):
            self.kill(name)

    # -- looking inside ------------------------------------------------------------------

    def metrics_url(self, name: str) -> str:
        if name == "coordinator":
            return f"http://{self.ctl.address}:{COORDINATOR_PORT}/metrics"
        return f"http://{self.slurm.hosts[name].address}:{AGENT_PORT}/metrics"

    def journal(self, job: str) -> list[dict[str, Any]]:
        path = self.state / f"{job}.jsonl"
        if not path.exists():
            return []
        out = []
        for line in path.read_text().splitlines():
            with contextlib.suppress(json.JSONDecodeError):  # a line being written
                out.append(json.loads(line))
        return out

    def journals(self) -> list[str]:
        """The jobs the coordinator journalled."""
        return sorted(p.stem for p in self.state.glob("*.jsonl")) if self.state.exists() else []

    def log(self, name: str) -> str:
        path = self.logs / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def tails(self, lines: int = 40) -> str:
        out = []
        for name in self.processes_seen():
            out.append(f"--- {name}.log, the last {lines} lines")
            out += self.log(name).splitlines()[-lines:]
        return "\n".join(out)

    def processes_seen(self) -> list[str]:
        return sorted(p.stem for p in self.logs.glob("*.log"))


# -- what the test watches --------------------------------------------------------------


@dataclass
class LimitSample:
    at: float
    node: str
    limits: dict[int, float]


@dataclass
class Message:
    at: float
    topic: str
    payload: dict[str, Any]


class Watch:
    """From the controller host's network namespace: every agent's /metrics every
    ``every_s`` (the power limit of each GPU kept, the last exposition of each kept whole),
    and every message on the broker's settings, ack and coordinator status topics."""

    def __init__(self, deployment: Deployment, every_s: float = 0.5) -> None:
        self.deployment = deployment
        self.every_s = every_s
        self.limits: list[LimitSample] = []
        self.last: dict[str, str] = {}
        self.messages: list[Message] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._netns = deployment.ctl.netns_path
        self.scraper = NetnsThread(self._netns, "scrape-ctl")
        self._sampler = threading.Thread(target=self._sample, name="sample-limits", daemon=True)
        self._mqtt: Any = None

    def start(self) -> None:
        self._sampler.start()
        self.scraper.call(self._subscribe)

    def _subscribe(self) -> None:
        import paho.mqtt.client as mqtt

        client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="test-watch")
        root = f"hyperagent/v1/{CLUSTER}"

        def on_connect(c: Any, userdata: Any, flags: Any, reason: Any, properties: Any) -> None:
            for topic in (
                f"{root}/job/+/settings",
                f"{root}/job/+/ack/+",
                f"{root}/coordinator/status",
            ):
                c.subscribe(topic, qos=1)

        def on_message(c: Any, userdata: Any, message: Any) -> None:
            try:
                payload = json.loads(message.payload) if message.payload else {}
            except ValueError:
                payload = {"unparsed": message.payload.decode(errors="replace")}
            with self._lock:
                self.messages.append(Message(time.time(), message.topic, payload))

        client.on_connect = on_connect
        client.on_message = on_message
        client.reconnect_delay_set(1, 2)
        deadline = time.monotonic() + 20
        while True:
            try:
                client.connect(self.deployment.ctl.address, BROKER_PORT)
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        client.loop_start()  # its thread is made from this one: in the same namespace
        self._mqtt = client

    def scrape(self, name: str) -> str:
        return str(self.scraper.call(lambda: get(self.deployment.metrics_url(name))))

    def metric(self, name: str, metric: str) -> list[tuple[dict[str, str], float]]:
        return samples(self.scrape(name), metric)

    def _sample(self) -> None:
        join_netns(self._netns)
        nodes = self.deployment.slurm.nodes
        while not self._stop.is_set():
            began = time.monotonic()
            for node in nodes:
                text = get(self.deployment.metrics_url(node), timeout_s=3)
                if not text:
                    continue
                limits = {int(labels["gpu"]): v for labels, v in samples(text, GPU_POWER_LIMIT)}
                with self._lock:
                    self.last[node] = text
                    self.limits.append(LimitSample(time.time(), node, limits))
            self._stop.wait(max(0.0, self.every_s - (time.monotonic() - began)))

    def limits_since(self, ts: float) -> list[LimitSample]:
        with self._lock:
            return [s for s in self.limits if s.at >= ts]

    def messages_of(self, kind: str, since: float = 0.0) -> list[Message]:
        """``settings``, ``ack`` or ``status`` messages received at or after ``since``."""
        with self._lock:
            found = list(self.messages)
        return [m for m in found if m.at >= since and _kind(m.topic) == kind]

    def close(self) -> None:
        self._stop.set()
        self._sampler.join(10)
        if self._mqtt is not None:
            with contextlib.suppress(Exception):
                self.scraper.call(self._mqtt.disconnect)
            self._mqtt.loop_stop()
        self.scraper.close()


def _kind(topic: str) -> str:
    """``settings``, ``ack``, ``status`` or "" for a topic of the tree."""
    parts = topic.split("/")
    if parts[-2:] == ["coordinator", "status"]:
        return "status"
    if len(parts) >= 6 and parts[3] == "job":
        return parts[5]
    return ""


# -- tenants' processes -----------------------------------------------------------------


def ready_and_wait(go: Path, timeout_s: float = 180.0) -> str:
    """A shell script that prints what Slurm told the task (``ready <node> <job> <node index>
    <GPUs> <pid>``), waits for ``go`` (at most ``timeout_s``), then runs its arguments in its
    place (the pid printed stays the rank process's)."""
    ticks = int(timeout_s * 10)
    return (
        'echo "ready ${SLURMD_NODENAME:-$(hostname)} ${SLURM_JOB_ID:-none} ${SLURM_NODEID:-0}'
        ' ${SLURM_STEP_GPUS:-none} $$"; i=0;'
        f" while [ ! -e {shlex.quote(str(go))} ]; do i=$((i+1));"
        f' [ "$i" -lt {ticks} ] || exit 3; sleep 0.1; done; exec "$@"'
    )


@dataclass(frozen=True)
class Ready:
    """A task's ``ready`` line: what Slurm told it (its environment before anything of the
    user's) and its pid."""

    node: str
    job: str
    node_index: int
    gpus: tuple[int, ...]
    pid: int


def parse_ready(line: str) -> Ready:
    word, node, job, index, gpus, pid = line.split()
    assert word == "ready", line
    indices = () if gpus == "none" else tuple(int(g) for g in gpus.split(","))
    return Ready(node, job, int(index), indices, int(pid))


def rank_command(
    conns: Sequence[dict[str, Any]] = (),
    *,
    slurm_ranks: bool = False,
    slurm_world: int | None = None,
    log: Path,
    step_s: float = 10.0,
    wall_step_s: float = 0.1,
    seed: int = 0,
) -> list[str]:
    """The argv of this script's ``ranks`` command (see :func:`ranks_main`)."""
    argv = [sys.executable, str(Path(__file__).resolve()), "ranks", "--log", str(log)]
    argv += [
        "--socket",
        str(JOB_SOCKET),
        "--step-s",
        str(step_s),
        "--wall-step-s",
        str(wall_step_s),
    ]
    argv += ["--seed", str(seed)]
    if slurm_ranks:
        argv.append("--slurm-ranks")
    if slurm_world is not None:
        argv += ["--slurm-world", str(slurm_world)]
    for conn in conns:
        argv += ["--conn", json.dumps(conn)]
    return argv


def ranks_main(argv: list[str]) -> int:
    """Ranks of one process, one JobReporter connection each, stepping together as the
    production scenario's ranks do (tests/production/ranks.py): each step every rank takes
    the settings it received and reports one step of the simulated job under them.

    ``--conn JSON``: ``{"job": id or null (the environment's), "rank": n, "gpu": n or null,
    "world": n, "local": n, "tune": true/false/null, "scale": samples multiplier}``.
    ``--slurm-ranks``: one rank per GPU of ``SLURM_STEP_GPUS``, ranks numbered from
    ``SLURM_NODEID`` x GPUs, the job id from the environment, world ``--slurm-world``."""
    from hyperagent.demo import JOB_DEFAULTS
    from hyperagent.job import KNOBS, JobReporter, MemoryReport
    from hyperagent.sim import JobModel

    parser = argparse.ArgumentParser(prog="slurm_tenants.py ranks")
    parser.add_argument("--socket", type=Path, required=True)
    parser.add_argument("--log", type=Path, required=True)
    parser.add_argument("--step-s", type=float, default=10.0)
    parser.add_argument("--wall-step-s", type=float, default=0.1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--slurm-ranks", action="store_true")
    parser.add_argument("--slurm-world", type=int, default=None)
    parser.add_argument("--conn", action="append", default=[], type=json.loads)
    args = parser.parse_args(argv)
    node = os.environ.get("SLURMD_NODENAME") or os.uname().nodename
    args.log = Path(str(args.log).replace("%N", node))
    conns: list[dict[str, Any]] = list(args.conn)
    if args.slurm_ranks:
        gpus = [int(g) for g in os.environ["SLURM_STEP_GPUS"].split(",")]
        first = int(os.environ.get("SLURM_NODEID", "0")) * len(gpus)
        world = args.slurm_world or len(gpus) * int(os.environ.get("SLURM_NNODES", "1"))
        conns += [
            {"job": None, "rank": first + i, "gpu": g, "world": world, "local": len(gpus)}
            for i, g in enumerate(gpus)
        ]
    running = True

    def stop(*_: Any) -> None:
        nonlocal running
        running = False

    signal.signal(signal.SIGTERM, stop)
    model = JobModel(nodes=1, gpus_per_node=max(1, len(conns)))
    scale = args.step_s / model.expected_step({**JOB_DEFAULTS, "power_cap_w": 250.0}).step_s
    reporters = [
        JobReporter(
            c.get("job"),
            rank=c["rank"],
            socket_path=args.socket,
            knobs=KNOBS,
            gpu=c.get("gpu"),
            world_size=c.get("world"),
            local_world_size=c.get("local", len(conns)),
            tune=c.get("tune"),
        )
        for c in conns
    ]
    knobs: list[dict[str, Any]] = [dict(JOB_DEFAULTS) for _ in reporters]
    memory = MemoryReport(int(0.6 * 80 * 2**30), 80 * 2**30)
    import random

    rng = random.Random(args.seed)
    with args.log.open("a", buffering=1) as log:
        log.write(json.dumps({"started": time.time(), "jobs": [r.job for r in reporters]}) + "\n")
        next_step = time.monotonic()
        while running:
            for i, reporter in enumerate(reporters):
                new = reporter.poll_settings()
                if new is not None:
                    knobs[i] = {**JOB_DEFAULTS, **new.settings}
                    log.write(
                        json.dumps(
                            {"rank": reporter.rank, "job": reporter.job, "received": new.version}
                        )
                        + "\n"
                    )
            for i, reporter in enumerate(reporters):
                step = model.step({**knobs[i], "power_cap_w": 250.0}, rng)
                reporter.report_step(
                    int(step.samples * float(conns[i].get("scale", 1.0))) // len(conns),
                    step.step_s * scale,
                    step.compute_s * scale,
                    step.comm_s * scale,
                    2.0,
                    memory,
                )
            next_step += args.wall_step_s
            delay = next_step - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            else:
                next_step = time.monotonic()
        for reporter in reporters:
            reporter.close()
    return 0


def as_user_on(slurm: Slurm, host: str, user: str, env: dict[str, str]) -> list[str]:
    """The argv prefix that runs a command on ``host`` as ``user`` outside any Slurm job (a
    shell on the node), with only ``env`` and a PATH in its environment."""
    return [
        *slurm.hosts[host].enter(),
        "setpriv",
        f"--reuid={user}",
        f"--regid={user}",
        "--init-groups",
        "--",
        "env",
        "-i",
        "PATH=/usr/sbin:/usr/bin:/sbin:/bin",
        *(f"{k}={v}" for k, v in env.items()),
    ]


@contextlib.contextmanager
def background(argv: list[str], log: Path) -> Iterator[subprocess.Popen[bytes]]:
    """``argv`` running, its output to ``log``; killed (its session) on the way out."""
    with log.open("ab") as out:
        process = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        yield process
    finally:
        if process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
                process.wait(STOP_TIMEOUT_S)


if __name__ == "__main__":
    if sys.argv[1:2] == ["ranks"]:
        sys.exit(ranks_main(sys.argv[2:]))
    sys.exit(f"usage: {sys.argv[0]} ranks ...")
