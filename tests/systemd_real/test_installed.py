"""The install page (docs/install/systemd.md, "Install on a cluster (systemd)"), run as written on
a Debian 12 host booted under a real systemd (tests/systemd_real/nspawn.py), then the three
units checked as an operator would.

The page's shell blocks are the script: the first (the package, from the registry) runs in
the root before it boots, with the host's network; the others run in the booted container, in
order, with ``sh -eu``. The container holds the three roles of the README (the broker, a GPU
node, the coordinator) on one host, ``gpu-017``. What the test adds is what an operator
supplies, each in ``operator_supplies``: the broker's certificate and its CA, the passwords, a
job's node list (this host) and trial budget, /etc/hosts naming the broker, the job's user, and
a capture for the agent to replay in place of GPUs with the README's replay drop-in.
"""

from __future__ import annotations

import contextlib
import json
import re
import secrets
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from cluster.harness import BROKER_HOST, CAPTURE, metric_values, shipped_toml
from pki import make_certificates
from systemd_real.nspawn import Container, Unavailable, check_host, copy_tree, debian_rootfs
from test_cluster import until

from hyperagent.scheduler import qualified

from conftest import REPO, unavailable

pytestmark = pytest.mark.timeout(1800)

NODE = "gpu-017"
"""The container's host name: the GPU node the README's steps name."""
JOB = "llama-ft"
"""The id the job's ranks give."""
JOB_UID = 2001
JOB_ID = qualified(JOB, JOB_UID)
"""The id the cluster knows the job by: a job outside any scheduler is bound to its user."""
TRIALS = 6
"""The job's trial budget in the node list the test supplies (the shipped file says 30)."""
JOB_USER = "alice"
CHECKOUT = "/usr/local/src/hyperagent"
REPLAY_DIR = "/srv/hyperagent/replay"
REPLAY_DROP_IN = (
    "[Service]\nExecStart=\nExecStart=/usr/local/bin/hyperagent agent"
    f" --config /etc/hyperagent/hyperagent.toml --replay {REPLAY_DIR}\n"
)
"""The README's replay drop-in for the agent."""
DAEMONS = ("hyperagent-agent", "hyperagent-coordinator")
UNITS = ("mosquitto", *DAEMONS)
UNCAPPED_W = 700.0
"""The replayed H200's power limit; the shipped job caps it at 400 W."""
JOURNAL_ERRORS = re.compile(
    r"seccomp|SIGSYS|EPERM|Operation not permitted|Read-only file system|Permission denied",
    re.I,
)
RESULT = re.compile(rf'{JOB_ID}: ([^"]* over the baseline, confirmed|no setting was better[^"]*)')
"""The coordinator's log line with the tuning's result."""


INSTALL_PAGE = REPO / "docs" / "install" / "systemd.md"
"""The install page: "Install on a cluster (systemd)", with mosquitto."""


def install_section(page: str) -> str:
    """The install page's text, from its title: every ```sh block on it is the install script."""
    return page.split("# Install on a cluster (systemd)\n", 1)[1]


def shell_blocks(section: str) -> list[str]:
    """The ```sh blocks of an install page, in order: the install script."""
    return re.findall(r"^```sh\n(.*?)^```$", section, re.M | re.S)


@dataclass
class Installed:
    """The booted host after the README's steps, and what the checks measured."""

    host: Container
    figures: dict[str, str] = field(default_factory=dict)
    broker: str = "mosquitto"
    """The broker's unit."""
    broker_log: str = "/var/log/mosquitto/mosquitto.log"
    """Where the broker writes its errors (mosquitto's go to a file, not the journal)."""

    def sh(self, script: str, timeout_s: float = 60) -> str:
        return self.host.sh(script, timeout_s=timeout_s).stdout

    def show(self, unit: str) -> dict[str, str]:
        keys = "ActiveState,SubState,Type,StatusText,NRestarts,MainPID,WatchdogUSec,Result"
        out = self.sh(f"systemctl show --property={keys} {unit}")
        return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)

    def running(self, unit: str) -> bool:
        props = self.show(unit)
        return props["ActiveState"] == "active" and props["SubState"] == "running"

    def journal(self, *units: str, since: str = "") -> str:
        flags = " ".join(f"-u {u}" for u in units)
        return self.sh(f"journalctl --no-pager -o cat {since} {flags}")

    def metrics(self, port: int) -> str:
        """The /metrics a daemon serves on ``port``, or "" when it serves none."""
        url = f"http://127.0.0.1:{port}/metrics"
        return self.host.sh(f"curl -sf --max-time 10 {url}", check=False).stdout

    def coordinator_journal(self) -> list[dict[str, Any]]:
        text = self.host.sh(f"cat /var/lib/hyperagent-coordinator/{JOB_ID}.jsonl", check=False)
        return [json.loads(line) for line in text.stdout.splitlines() if line.strip()]

    def diagnostics(self) -> str:
        return self.host.sh(
            f"systemctl --no-pager --full status {self.broker} 'hyperagent-*' 2>&1 | tail -n 60;"
            f" journalctl --no-pager -o cat -n 30 -u {self.broker} -u 'hyperagent-*' 2>&1;"
            f" tail -n 20 {self.broker_log} 2>&1",
            check=False,
            timeout_s=30,
        ).stdout


def operator_supplies(root: Path, pki: Path) -> dict[str, str]:
    """What an operator supplies before the README's steps, written into the container's root
    ``root``; returns the passwords the steps read from the shell."""
    checkout = root / CHECKOUT.lstrip("/")
    checkout.mkdir(parents=True)
    files = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO,
        capture_output=True,
        check=True,
    ).stdout.split(b"\0")
    for name in filter(None, files):
        source = REPO / name.decode()
        if source.is_file() or source.is_symlink():
            (checkout / name.decode()).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, checkout / name.decode(), follow_symlinks=False)
    # the broker's certificate (naming the broker's host in mqtt.url), its key, and its CA
    make_certificates(pki, BROKER_HOST, f"DNS:{BROKER_HOST}")
    for name in ("ca.crt", "broker.crt", "broker.key"):
        shutil.copy(pki / name, checkout / name)
    # no job list (the coordinator finds the job); the caps searched; a small trial budget
    toml, count = re.subn(r"(?m)^trials = \d+", f"trials = {TRIALS}", shipped_toml())
    assert count == 1, "the shipped hyperagent.toml gives the default trial budget once"
    (checkout / "systemd" / "hyperagent.toml").write_text(toml)
    # the host's name, and the broker's name resolving (here: this host)
    (root / "etc" / "hostname").write_text(f"{NODE}\n")
    (root / "etc" / "hosts").write_text(
        f"127.0.0.1 localhost\n127.0.1.1 {NODE}\n127.0.0.1 {BROKER_HOST}\n"
    )
    # a GPU node to replay (the H200 at its 700 W limit), outside /home and /root
    replay = root / REPLAY_DIR.lstrip("/")
    replay.mkdir(parents=True)
    for name, source in CAPTURE.items():
        if source.is_dir():
            shutil.copytree(source, replay / name, symlinks=False)
        else:
            shutil.copy(source, replay / name)
    subprocess.run(["chmod", "-R", "a+rX", str(root / "srv")], check=True)
    drop_in = root / "etc/systemd/system/hyperagent-agent.service.d/replay.conf"
    drop_in.parent.mkdir(parents=True)
    drop_in.write_text(REPLAY_DROP_IN)
    node_password = secrets.token_urlsafe(16)
    return {
        "COORDINATOR_PASSWORD": secrets.token_urlsafe(16),
        "GPU_017_PASSWORD": node_password,
        "MQTT_PASSWORD": node_password,  # this host's broker user: the GPU node's
    }


@contextlib.contextmanager
def booted_install(
    request: pytest.FixtureRequest,
    before_boot: list[str],
    steps: list[str],
    broker: str = "mosquitto",
    broker_log: str = "/var/log/mosquitto/mosquitto.log",
    masked: tuple[str, ...] = (),
) -> Iterator[Installed]:
    """A fresh copy of the cached rootfs with what the operator supplies, ``before_boot``'s
    scripts run in it with the host's network (the packages), then booted with the ``masked``
    units masked (what this host does not have) and ``steps`` run in it, in order: the
    README's install as written. Powered off at the end; its folder removed unless a test
    failed."""
    try:
        check_host()
    except Unavailable as e:
        unavailable(str(e))
    failed = request.session.testsfailed
    work = Path(tempfile.mkdtemp(prefix="hyperagent-systemd-", dir="/var/tmp"))
    started = time.monotonic()
    base = debian_rootfs(work / "debootstrap.log")
    built = time.monotonic()
    root = work / "root"
    root.mkdir()
    copy_tree(base, root)
    copied = time.monotonic()
    (work / "pki").mkdir()
    passwords = operator_supplies(root, work / "pki")
    for unit in masked:
        (root / "etc/systemd/system" / f"{unit}.service").symlink_to("/dev/null")
    host = Container(root, NODE, work / "console.log")
    kept = f"the container's root, console log and certificates are kept in {work}"
    for script in before_boot:
        package = host.prepare(script, CHECKOUT)
        assert package.returncode == 0, f"{script}\n{package.stdout}{package.stderr}\n{kept}"
    prepared = time.monotonic()
    with host:
        host.boot()
        installed = Installed(host, broker=broker, broker_log=broker_log)
        host.sh(f"useradd --uid {JOB_UID} --create-home --shell /bin/bash {JOB_USER}")
        for block in steps:
            try:
                host.sh(block, env=passwords, cwd=CHECKOUT, timeout_s=180)
            except AssertionError as e:
                raise AssertionError(
                    f"{e}\n--- on the host\n{installed.diagnostics()}\n{kept}"
                ) from None
        done = time.monotonic()
        installed.figures["setup"] = (
            f"rootfs {built - started:.0f} s, copy {copied - built:.0f} s, certificates and"
            f" packages {prepared - copied:.0f} s, boot and README {done - prepared:.0f} s"
        )
        yield installed
        figures = "; ".join(f"{k}: {v}" for k, v in installed.figures.items())
        poweroff = time.monotonic()
    capture = request.config.pluginmanager.get_plugin("capturemanager")
    with capture.global_and_fixture_disabled():
        print(
            f"\n{request.node.nodeid}: {figures}; poweroff {time.monotonic() - poweroff:.0f} s;"
            f" {time.monotonic() - started:.0f} s in all"
        )
    if request.session.testsfailed == failed:
        subprocess.run(["rm", "-rf", "--one-file-system", str(work)], check=True, timeout=300)
    else:
        print(kept)


def readme_install() -> tuple[str, list[str]]:
    """The install page and its ```sh blocks, the package first."""
    section = install_section(INSTALL_PAGE.read_text())
    blocks = shell_blocks(section)
    assert len(blocks) >= 2 and "pip install" in blocks[0], (
        "the install page gives no script: its ```sh blocks, the package first"
    )
    assert REPLAY_DROP_IN.replace("\n", "\\n") in section, (
        "the install page shows another replay drop-in"
    )
    return section, blocks


@pytest.fixture(scope="module")
def installed(request: pytest.FixtureRequest) -> Iterator[Installed]:
    _, blocks = readme_install()
    with booted_install(request, blocks[:1], blocks[1:]) as host:
        yield host


def test_the_readme_brings_up_the_three_units(installed: Installed) -> None:
    for unit in UNITS:
        assert until(lambda unit=unit: installed.running(unit), 60, f"{unit} running"), unit
    for unit in DAEMONS:
        props = installed.show(unit)
        assert props["Type"] == "notify" and props["WatchdogUSec"] == "30s", props
        assert props["StatusText"], f"{unit} sent no STATUS= line"
    for unit in DAEMONS:
        verify = installed.host.sh(f"systemd-analyze verify /etc/systemd/system/{unit}.service")
        assert not verify.stdout and not verify.stderr, verify.stdout + verify.stderr
    status = installed.sh("systemctl --no-pager status " + " ".join(UNITS))
    assert status.count("active (running)") == 3, status
    installed.figures["systemd tainted"] = installed.sh("systemctl show -P Tainted").strip()
    installed.figures["status"] = " | ".join(
        f"{u}: {installed.show(u)['StatusText']}" for u in DAEMONS
    )


def test_only_the_coordinator_reads_the_key_that_signs_settings(installed: Installed) -> None:
    """The README's key pair: the private key is out of the agent's user's reach (also through
    the group it shares with the coordinator) and a training user's; the coordinator signs with
    it, and the agent trusts its public half."""
    key = "/etc/hyperagent/signing/settings.key"
    for user in ("hyperagent", JOB_USER):
        read = installed.host.sh(f"runuser -u {user} -- cat {key}", check=False)
        assert read.returncode != 0 and "Permission denied" in read.stderr, (user, read.stdout)
    kid = installed.sh("hyperagent keys id /etc/hyperagent/trusted-keys/settings.pub").split()[0]
    assert installed.sh(f"hyperagent keys id {key}").split()[0] == kid
    assert f"signing settings with key {kid}" in installed.journal("hyperagent-coordinator")


def test_the_running_units_exposure_is_the_readme_s(installed: Installed) -> None:
    readme = install_section(INSTALL_PAGE.read_text())
    claimed = re.search(
        r"exposure (\d\.\d) for the agent and (\d\.\d) for\s+the coordinator", readme
    )
    assert claimed, "the install page gives no live exposure figures"
    live = []
    for unit in DAEMONS:
        out = installed.sh(f"systemd-analyze security --no-pager {unit}")
        match = re.search(r"Overall exposure level for \S+: (\d+\.\d+)", out)
        assert match, out
        live.append(match.group(1))
    installed.figures["exposure"] = f"agent {live[0]}, coordinator {live[1]}"
    assert live == [claimed.group(1), claimed.group(2)]


def start_job(installed: Installed) -> None:
    """The job as its user: 8 simulated ranks on JobReporter connections, until the agent
    counts them."""
    installed.sh(
        f"systemd-run --unit={JOB}-ranks --property=User={JOB_USER} --collect"
        f" /opt/hyperagent/bin/python {CHECKOUT}/tests/cluster/sim_rank.py --job {JOB}"
        f" --rank 0 --ranks 8 --gpu 0 --log /var/tmp/{JOB}-ranks.jsonl"
    )
    assert installed.show(f"{JOB}-ranks.service")["ActiveState"] == "active"
    ranks = until(
        lambda: [
            v
            for labels, v in metric_values(installed.metrics(10478), "hyperagent_job_ranks")
            if labels.get("job_id") == JOB_ID and v == 8
        ],
        60,
        f"the agent counting {JOB}'s 8 ranks",
    )
    assert ranks


def test_a_job_as_another_user_runs_through_a_watchdog_soak(installed: Installed) -> None:
    start_job(installed)
    pings = {u: installed.sh(f"systemctl show -P WatchdogTimestampMonotonic {u}") for u in DAEMONS}
    time.sleep(60)
    for unit in UNITS:
        props = installed.show(unit)
        assert installed.running(unit) and props["NRestarts"] == "0", (unit, props)
    for unit in DAEMONS:
        later = installed.sh(f"systemctl show -P WatchdogTimestampMonotonic {unit}")
        assert int(later) > int(pings[unit]), f"{unit} sent no watchdog ping in 60 s"
    log = installed.journal(*UNITS) + installed.sh("cat /var/log/mosquitto/mosquitto.log")
    assert not JOURNAL_ERRORS.findall(log), [
        line for line in log.splitlines() if JOURNAL_ERRORS.search(line)
    ]
    assert "hyperagent_tuner_trials_total" in installed.metrics(10479)
    refused = installed.sh(f"grep -c refused /var/tmp/{JOB}-ranks.jsonl || true").strip()
    assert refused == "0", "the agent refused the job's user"


def test_the_coordinator_resumes_its_journal_after_a_sigkill(installed: Installed) -> None:
    trials = until(
        lambda: [e for e in installed.coordinator_journal() if e.get("type") == "trial"],
        300,
        "a trial in the coordinator's journal",
        every_s=3,
    )
    seconds = sigkill_and_wait(installed, "hyperagent-coordinator")
    installed.figures["coordinator back after SIGKILL"] = f"{seconds:.1f} s"
    resumed = until(
        lambda: re.search(rf"{JOB_ID}: resumed (\d+) trials", installed.journal(DAEMONS[1])),
        60,
        "the coordinator resuming its journal",
    )
    assert int(resumed.group(1)) >= len(trials)
    installed.figures["coordinator resumed"] = f"{resumed.group(1)} trials"


def test_the_job_is_tuned_to_a_result(installed: Installed) -> None:
    tuned_to_a_result(installed)


def tuned_to_a_result(installed: Installed) -> None:
    """Wait for the coordinator's result of the job's tuning (its trials in ``figures``), then
    for its status saying every job is tuned."""
    result = until(
        lambda: RESULT.search(installed.journal(DAEMONS[1])), 900, "the tuning's result", 5
    )
    trials = [e for e in installed.coordinator_journal() if e.get("type") == "trial"]
    confirming = [e for e in trials if e.get("confirmation")]
    searched = len(trials) - len(confirming)
    installed.figures["trials"] = f"{searched} and {len(confirming)} confirming"
    installed.figures["result"] = result.group(0)
    # the result may be a coordinator's before a restart (an earlier test's): the one running
    # says so once it has applied its journal's final settings on every node again
    assert until(
        lambda: installed.show(DAEMONS[1])["StatusText"] == "every job tuned",
        120,
        "the coordinator's status: every job tuned",
        every_s=2,
    )


def sigkill_and_wait(installed: Installed, unit: str) -> float:
    """SIGKILL the unit's main process; the seconds until systemd has restarted it (one more
    restart counted) and it runs again under a new main pid."""
    before = installed.show(unit)
    started = time.monotonic()
    installed.sh(f"kill -KILL {before['MainPID']}")

    def back() -> bool:
        now = installed.show(unit)
        return (
            int(now["NRestarts"]) == int(before["NRestarts"]) + 1
            and now["MainPID"] not in ("0", before["MainPID"])
            and (now["ActiveState"], now["SubState"]) == ("active", "running")
        )

    until(back, 60, f"{unit} restarted and running again", every_s=0.2)
    return time.monotonic() - started


def test_restarts_and_a_sigkilled_agent_come_back(installed: Installed) -> None:
    for unit in DAEMONS:
        started = time.monotonic()
        installed.sh(f"systemctl restart {unit}")
        assert installed.running(unit)
        installed.figures[f"{unit} restart"] = f"{time.monotonic() - started:.1f} s"
    until(
        lambda: (
            len(re.findall(rf"{JOB_ID}: resumed \d+ trials", installed.journal(DAEMONS[1]))) >= 2
        ),
        60,
        "the restarted coordinator resuming its journal",
    )
    seconds = sigkill_and_wait(installed, "hyperagent-agent")
    installed.figures["agent back after SIGKILL"] = f"{seconds:.1f} s"
    assert until(lambda: installed.metrics(10478), 30, "the agent's /metrics again")


def test_stopping_the_agent_puts_back_the_power_limits(installed: Installed) -> None:
    capped = until(
        lambda: [
            v
            for _, v in metric_values(installed.metrics(10478), "hyperagent_gpu_power_limit_watts")
            if v < UNCAPPED_W
        ],
        120,
        "the tuned power cap on the agent's GPUs",
    )
    since = installed.sh("date +@%s").strip()
    installed.sh("systemctl stop hyperagent-agent", timeout_s=60)
    props = installed.show("hyperagent-agent")
    assert props["ActiveState"] == "inactive" and props["Result"] == "success", props
    log = installed.journal("hyperagent-agent", since=f"--since={since}")
    assert f"restored the original power limit of {len(capped)} GPU(s)" in log, log


def test_the_coordinator_and_the_broker_stop_cleanly(installed: Installed) -> None:
    for unit in (f"{JOB}-ranks", DAEMONS[1], "mosquitto"):
        started = time.monotonic()
        installed.sh(f"systemctl stop {unit}", timeout_s=60)
        installed.figures[f"{unit} stop"] = f"{time.monotonic() - started:.1f} s"
    for unit in (DAEMONS[1], "mosquitto"):
        props = installed.show(unit)
        assert props["ActiveState"] == "inactive" and props["Result"] == "success", (unit, props)
