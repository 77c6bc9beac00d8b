"""Shared fixtures: real peers on loopback (mosquitto, RabbitMQ), capture paths, free ports."""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import NoReturn

import pytest

pytest.register_assert_rewrite("demo_cli")

REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO / "fixtures"


class ManualClock:
    """A clock for code that takes one (``clock=time.monotonic``): it reads ``now``, which
    only the test moves."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def unavailable(reason: str) -> NoReturn:
    """Skip a test this machine cannot run (not root, a tool missing); under ``CI=true``, as CI
    services set it, fail it instead: a CI that lost root or a tool must not be green."""
    if os.environ.get("CI", "").lower() in ("true", "1"):
        pytest.fail(f"{reason} (CI=true: a test that cannot run here fails instead of skipping)")
    pytest.skip(reason)


BUSY = pytest.mark.xdist_group("busy")
"""For a test that keeps many processes busy (a whole cluster, real PyTorch ranks, the benchmark
harness): under ``-n 2`` these run one at a time on one worker, so that none starves another's
processes (an agent takes a job that does not step for 2 s as stalled). The namespace cluster
also needs it as it adds users and mount points on the host."""


OPENED = pytest.StashKey[dict[Path, int]]()
"""Directories given o+x for the session, and their modes before."""


def pytest_configure(config: pytest.Config) -> None:
    """As root, in the main process (not an xdist worker): let the users the tests run
    processes as reach this checkout and its Python wherever they are (tests/access.py)."""
    if os.geteuid() == 0 and not hasattr(config, "workerinput"):
        from access import open_the_way

        config.stash[OPENED] = open_the_way(REPO, Path(sys.executable).resolve())


def pytest_unconfigure(config: pytest.Config) -> None:
    if OPENED in config.stash:
        from access import put_back

        put_back(config.stash[OPENED])


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The tests marked ``long(seconds)`` first, longest first, the others in their order: with
    ``-n 2`` a worker then never starts a long test while the other is about to finish."""

    def seconds(item: pytest.Item) -> float:
        mark = item.get_closest_marker("long")
        return float(mark.args[0]) if mark is not None else 0.0

    items.sort(key=lambda item: -seconds(item))


@pytest.fixture
def root_only() -> None:
    """Use in tests that need root (``pytest.mark.usefixtures("root_only")``): skipped
    otherwise, failed under ``CI=true`` (see ``unavailable``)."""
    if os.geteuid() != 0:
        unavailable("needs root")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_port(port: int, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise TimeoutError(f"nothing listening on 127.0.0.1:{port} after {timeout_s}s")


def require_binary(name: str, package: str) -> str:
    path = shutil.which(name) or next(
        (str(p) for p in (Path("/usr/sbin") / name, Path("/usr/bin") / name) if p.exists()), None
    )
    if path is None:
        pytest.fail(f"{name} is not installed: apt-get install -y {package} (bash .ci/run does)")
    return path


class Mosquitto:
    """A real mosquitto broker on a loopback port, stoppable and restartable."""

    def __init__(self, workdir: Path, persistent: bool = False) -> None:
        self.binary = require_binary("mosquitto", "mosquitto")
        self.port = free_port()
        self.conf = workdir / "mosquitto.conf"
        persistence = (
            f"persistence true\npersistence_location {workdir}/\n"
            if persistent
            else "persistence false\n"
        )
        keep_user = "user root\n" if os.geteuid() == 0 else ""  # else it drops to "mosquitto"
        self.conf.write_text(
            f"listener {self.port} 127.0.0.1\nallow_anonymous true\n{persistence}{keep_user}"
            "max_queued_messages 100000\n"
        )
        self.log = workdir / "mosquitto.log"
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"mqtt://127.0.0.1:{self.port}"

    def start(self) -> None:
        self.process = subprocess.Popen(
            [self.binary, "-c", str(self.conf)],
            stdout=self.log.open("ab"),
            stderr=subprocess.STDOUT,
        )
        wait_for_port(self.port)

    def stop(self) -> None:
        if self.process is not None:
            self.process.terminate()
            self.process.wait(timeout=10)
            self.process = None


@pytest.fixture
def mosquitto(tmp_path: Path) -> Iterator[Mosquitto]:
    broker = Mosquitto(tmp_path)
    broker.start()
    yield broker
    broker.stop()


@pytest.fixture
def persistent_mosquitto(tmp_path: Path) -> Iterator[Mosquitto]:
    """A mosquitto that keeps sessions and queued messages across a restart."""
    broker = Mosquitto(tmp_path, persistent=True)
    broker.start()
    yield broker
    broker.stop()


RABBITMQ_SCRIPT = Path("/usr/lib/rabbitmq/bin/rabbitmq-server")
"""Debian's server script itself: /usr/sbin/rabbitmq-server switches to the rabbitmq user and
its /var/lib/rabbitmq, which a test's broker must not touch."""


class RabbitMq:
    """A real RabbitMQ with its MQTT plugin, on free loopback ports (MQTT, AMQP, the Erlang
    distribution, and an epmd of its own, so it clashes with no other broker or Erlang node on
    the machine), anonymous MQTT clients allowed. Its config, database, logs and Erlang cookie
    stay in ``workdir``. It serves a retained message only to a subscriber of its exact topic.
    """

    START_TIMEOUT_S = 90.0
    """Its start takes 10-20 s on two busy cores."""

    def __init__(self, workdir: Path) -> None:
        script = RABBITMQ_SCRIPT if RABBITMQ_SCRIPT.exists() else None
        self.binary = str(script or require_binary("rabbitmq-server", "rabbitmq-server"))
        self.epmd = require_binary("epmd", "erlang-base")
        self.workdir = workdir
        self.port = free_port()
        self.amqp_port, self.dist_port, self.epmd_port = free_port(), free_port(), free_port()
        home = workdir / "home"
        for folder in (home, workdir / "mnesia", workdir / "log"):
            folder.mkdir(parents=True, exist_ok=True)
        (workdir / "enabled_plugins").write_text("[rabbitmq_mqtt].\n")
        (workdir / "rabbitmq-env.conf").write_text("")
        (workdir / "rabbitmq.conf").write_text(
            f"listeners.tcp.default = 127.0.0.1:{self.amqp_port}\n"
            f"mqtt.listeners.tcp.default = 127.0.0.1:{self.port}\n"
            "mqtt.allow_anonymous = true\n"
            "loopback_users = none\n"
        )
        self.env = {
            **os.environ,
            "HOME": str(home),
            "RABBITMQ_NODENAME": f"hyperagent-test-{self.port}@localhost",
            "RABBITMQ_CONFIG_FILE": str(workdir / "rabbitmq.conf"),
            "RABBITMQ_ADVANCED_CONFIG_FILE": str(workdir / "advanced.config"),
            "RABBITMQ_CONF_ENV_FILE": str(workdir / "rabbitmq-env.conf"),
            "RABBITMQ_ENABLED_PLUGINS_FILE": str(workdir / "enabled_plugins"),
            "RABBITMQ_MNESIA_BASE": str(workdir / "mnesia"),
            "RABBITMQ_LOG_BASE": str(workdir / "log"),
            "RABBITMQ_PID_FILE": str(workdir / "rabbitmq.pid"),
            "RABBITMQ_DIST_PORT": str(self.dist_port),
            "ERL_EPMD_PORT": str(self.epmd_port),
            "ERL_EPMD_ADDRESS": "127.0.0.1",
        }
        self.log = workdir / "rabbitmq.out"
        self.process: subprocess.Popen[bytes] | None = None
        self.epmd_process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"mqtt://127.0.0.1:{self.port}"

    def start(self) -> None:
        # its own epmd, in the foreground, so that stop ends it (a daemon would outlive us)
        self.epmd_process = subprocess.Popen(
            [self.epmd, "-port", str(self.epmd_port), "-address", "127.0.0.1"],
            env=self.env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        wait_for_port(self.epmd_port)
        self.process = subprocess.Popen(
            [self.binary],
            cwd=self.workdir,
            env=self.env,
            stdout=self.log.open("ab"),
            stderr=subprocess.STDOUT,
            start_new_session=True,  # stop ends the script, the VM and its helpers together
        )
        try:
            wait_for_port(self.port, self.START_TIMEOUT_S)
        except TimeoutError:
            self.stop()
            tail = self.log.read_text(errors="replace")[-2000:]
            pytest.fail(f"RabbitMQ did not open its MQTT port; its output ends:\n{tail}")

    def stop(self) -> None:
        if self.process is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(timeout=10)
            self.process = None
        if self.epmd_process is not None:
            self.epmd_process.terminate()
            self.epmd_process.wait(timeout=10)
            self.epmd_process = None


@pytest.fixture(scope="session")
def rabbitmq(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RabbitMq]:
    """One RabbitMQ for the session (it takes 10-20 s to start): tests keep apart by using
    topic trees of their own (a cluster name each)."""
    broker = RabbitMq(tmp_path_factory.mktemp("rabbitmq"))
    broker.start()
    yield broker
    broker.stop()


@pytest.fixture(params=["mosquitto", "rabbitmq"])
def broker_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """The URL of a real broker: a fresh mosquitto, or the session's RabbitMQ."""
    if request.param == "rabbitmq":
        yield request.getfixturevalue("rabbitmq").url
        return
    broker = Mosquitto(tmp_path)
    broker.start()
    yield broker.url
    broker.stop()


@pytest.fixture
def nvidia_smi_dir() -> Path:
    return FIXTURES / "nvidia-smi"


@pytest.fixture
def shared_dir() -> Iterator[Path]:
    """A socket directory other users can reach (pytest's tmp_path is 0700)."""
    path = Path(tempfile.mkdtemp(prefix="hyperagent-job-"))
    path.chmod(0o755)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def system_user(name: str) -> int:
    """The uid of ``name``, made a system user without a home first where it does not exist."""
    try:
        return pwd.getpwnam(name).pw_uid
    except KeyError:
        subprocess.run(
            ["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", name],
            check=True,
        )
        return pwd.getpwnam(name).pw_uid
