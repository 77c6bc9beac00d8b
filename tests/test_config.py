"""Config: strict validation naming keys, CLI overrides, check-config exit codes."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from hyperagent.config import DEFAULT_METRICS_PORT, build_config, load_config
from hyperagent.errors import ConfigError
from hyperagent.signing import write_key_pair

from conftest import REPO

NOBODY = 65534

GOOD = """
node = "gpu-17"
cluster = "prod"
[agent]
interval_s = 0.5
[mqtt]
url = "mqtt://broker.example:1884"
[[coordinator.jobs]]
id = "llama"
nodes = ["gpu-17", "gpu-18"]
backend = "mpi"
power_limits_w = [150, 300]
"""


def test_defaults_are_safe() -> None:
    config = build_config({})
    assert config.agent.metrics_address == f"127.0.0.1:{DEFAULT_METRICS_PORT}"
    assert config.mqtt.url == "mqtt://127.0.0.1:1883"
    assert config.sources.nvml.enabled and config.sources.host.enabled
    assert config.security.signing_key_file is None and config.security.trusted_keys == ()


def test_file_is_typed_and_frozen(tmp_path: Path) -> None:
    path = tmp_path / "h.toml"
    path.write_text(GOOD)
    config = load_config(path)
    assert config.node == "gpu-17" and config.agent.interval_s == 0.5
    assert (config.mqtt.host, config.mqtt.port) == ("broker.example", 1884)
    job = config.coordinator.jobs[0]
    assert job.nodes == ("gpu-17", "gpu-18") and job.power_limits_w == (150.0, 300.0)
    with pytest.raises(Exception):  # noqa: B017 - pydantic's frozen error
        config.node = "other"  # type: ignore[misc]


def test_overrides_win_and_are_validated(tmp_path: Path) -> None:
    path = tmp_path / "h.toml"
    path.write_text(GOOD)
    config = load_config(path, {"agent.metrics_address": "0.0.0.0:9999", "mqtt.enabled": False})
    assert config.agent.metrics_address == "0.0.0.0:9999" and not config.mqtt.enabled
    with pytest.raises(ConfigError) as e:
        load_config(path, {"agent.interval_s": -1})
    assert [p.key for p in e.value.problems] == ["agent.interval_s"]


def test_every_problem_names_its_key(tmp_path: Path) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(
        '[agent]\ninterval_s = "fast"\nmetrics_address = "nowhere"\n'
        '[mqtt]\nurl = "http://x"\nbogus = 1\n'
        '[[coordinator.jobs]]\nid = "j"\nnodes = ["gpu 17"]\nbackend = "infiniband"\n'
    )
    with pytest.raises(ConfigError) as e:
        load_config(path)
    keys = {p.key for p in e.value.problems}
    assert {
        "agent.interval_s",
        "agent.metrics_address",
        "mqtt.url",
        "mqtt.bogus",
        "coordinator.jobs.0.nodes.0",
        "coordinator.jobs.0.backend",
    } <= keys
    assert e.value.file == str(path)
    assert next(p for p in e.value.problems if p.key == "mqtt.bogus").reason == "unknown key"


@pytest.mark.parametrize(
    ("data", "key", "value", "separator"),
    [
        ({"node": "gpu-017.example"}, "node", "gpu-017.example", "."),
        ({"cluster": "eu/west"}, "cluster", "eu/west", "/"),
        ({"cluster": "all#"}, "cluster", "all#", "#"),
        ({"actuation": {"allowed_jobs": ["ok", "llama.ft"]}}, "actuation.allowed_jobs.1",
         "llama.ft", "."),
        ({"coordinator": {"jobs": [{"id": "slurm.*"}]}}, "coordinator.jobs.0.id", "slurm.*", "."),
        ({"coordinator": {"jobs": [{"id": "j", "nodes": ["a+b"]}]}}, "coordinator.jobs.0.nodes.0",
         "a+b", "+"),
    ],
)
def test_names_holding_a_topic_separator_name_the_key_and_the_value(
    data: dict[str, object], key: str, value: str, separator: str
) -> None:
    """Cluster, node and job names are MQTT topic levels: ``/``, ``+``, ``#`` and (RabbitMQ's
    separator) ``.`` are config errors that say which key, which value and why."""
    with pytest.raises(ConfigError) as e:
        build_config(data)
    [problem] = e.value.problems
    assert problem.key == key
    assert repr(value) in problem.reason and repr(separator) in problem.reason
    if separator == ".":
        assert "RabbitMQ" in problem.reason


def test_names_and_patterns_without_separators_are_taken() -> None:
    config = build_config(
        {
            "node": "gpu-017_a",
            "cluster": "EU-west",
            "coordinator": {"jobs": [{"id": "slurm-*"}, {"id": "llama-[!0]?", "nodes": ["n_1"]}]},
        }
    )
    assert config.node == "gpu-017_a" and config.coordinator.rule_for("slurm-42-0") is not None
    # the PDU's own name is a label, not a topic level: a dotted one stays fine
    target = {"name": "pdu-a.rack1", "host": "pdu-a.example", "outlets": ["1"]}
    assert build_config({"sources": {"pdu": {"targets": [target]}}})


def test_the_default_node_name_is_the_host_name_made_a_topic_level() -> None:
    from hyperagent.names import name_problem, safe_name

    assert safe_name("gpu+017") == "gpu-017" and safe_name("...") == "node"
    assert name_problem(build_config({}).node) is None


def test_syntax_error_and_missing_file(tmp_path: Path) -> None:
    broken = tmp_path / "broken.toml"
    broken.write_text("[agent\n")
    with pytest.raises(ConfigError, match="syntax"):
        load_config(broken)
    with pytest.raises(ConfigError, match="No such file"):
        load_config(tmp_path / "absent.toml")


def _check(path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "hyperagent.cli", "check-config", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_check_config_command(tmp_path: Path) -> None:
    good = tmp_path / "good.toml"
    good.write_text(GOOD)
    result = _check(good)
    assert result.returncode == 0, result.stderr
    assert "OK" in result.stdout
    bad = tmp_path / "bad.toml"
    bad.write_text('[sources.nvml]\nenabled = "yes please"\n[actuation]\nmin_power_w = 0\n')
    result = _check(bad)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert any(line.startswith(f"{bad}: sources.nvml.enabled:") for line in lines)
    assert any(line.startswith(f"{bad}: actuation.min_power_w:") for line in lines)


def test_check_config_reads_the_key_files(tmp_path: Path) -> None:
    path = tmp_path / "k.toml"
    path.write_text(f'[security]\ntrusted_keys = ["{tmp_path / "missing.pub"}"]\n')
    result = _check(path)
    assert result.returncode == 2
    assert "security.trusted_keys" in result.stderr and "No such file" in result.stderr


def test_shipped_example_config_is_valid() -> None:
    from conftest import REPO

    config = load_config(REPO / "systemd" / "hyperagent.toml")
    assert config.cluster == "prod"
    # no job list: the coordinator finds jobs and tunes those whose ranks ask
    assert config.coordinator.jobs == () and config.coordinator.defaults.tune == "asked"


def test_coordinator_refuses_to_start_without_a_key_but_needs_no_job_list(
    tmp_path: Path,
) -> None:
    path = tmp_path / "c.toml"
    path.write_text('cluster = "c"\n')
    result = subprocess.run(
        [sys.executable, "-m", "hyperagent.cli", "coordinator", "--config", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert "security.signing_key_file: required by the coordinator" in result.stderr
    assert "coordinator.jobs" not in result.stderr  # jobs are found, not configured


def test_mqtts_needs_a_ca_and_cert_and_key_go_together() -> None:
    with pytest.raises(ConfigError, match="tls_ca_file"):
        build_config({"mqtt": {"url": "mqtts://broker:8883"}})
    with pytest.raises(ConfigError, match="go together"):
        build_config({"mqtt": {"url": "mqtts://b", "tls_ca_file": "/ca", "tls_cert_file": "/c"}})
    config = build_config({"mqtt": {"url": "mqtts://b", "tls_ca_file": "/ca"}})
    assert config.mqtt.tls and config.mqtt.port == 8883


def test_searching_the_power_cap_needs_its_limits() -> None:
    job = {"id": "llama", "nodes": ["gpu-17"], "search_power_cap": True}
    with pytest.raises(ConfigError, match="search_power_cap = true needs power_limits_w"):
        build_config({"coordinator": {"jobs": [job]}})
    job["power_limits_w"] = [150, 300]
    assert build_config({"coordinator": {"jobs": [job]}}).coordinator.jobs[0].search_power_cap


def test_a_key_other_users_can_read_is_refused(tmp_path: Path) -> None:
    _, key, _ = write_key_pair(tmp_path, "settings")
    key.chmod(0o644)
    path = tmp_path / "k.toml"
    path.write_text(f'[security]\nsigning_key_file = "{key}"\n')
    result = _check(path)
    assert result.returncode == 2 and "accessible to other users (mode 644)" in result.stderr
    key.chmod(0o640)
    assert _check(path).returncode == 0


def test_coordinator_recommend_mode_publishes_nothing_and_explains(tmp_path: Path) -> None:
    _, key, _ = write_key_pair(tmp_path, "settings")
    path = tmp_path / "c.toml"
    path.write_text(
        'cluster = "c"\n[mqtt]\nurl = "mqtt://127.0.0.1:1"\n'
        f'[security]\nsigning_key_file = "{key}"\n'
        f'[coordinator]\nstate_dir = "{tmp_path}"\nmetrics_address = ""\n'
        '[[coordinator.jobs]]\nid = "big"\nnodes = ["a", "b", "c", "d", "e", "f", "g", "h", "i",'
        ' "j"]\nbackend = "mpi"\npower_limits_w = [200, 400]\n'
    )
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "hyperagent.cli",
            "coordinator",
            "--config",
            str(path),
            "--recommend",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    # ten nodes: BACKGROUND.md's table says halving-doubling with 1 MiB segments, Megatron-core
    # 40M fp32 gradients per bucket (snapped to 128 MiB)
    assert "big: would set" in result.stdout and "chunk 1024 KiB, halving_doubling" in result.stdout
    assert "because BACKGROUND.md's table for 10 nodes" in result.stdout
    assert "128 MiB buckets" in result.stdout and "bucket 128 MiB" in result.stdout
    assert not (tmp_path / "big.jsonl").exists()


def test_bmc_and_pdu_are_read_at_their_own_pace_by_default(tmp_path: Path) -> None:
    from hyperagent.agent import Agent
    from hyperagent.sources import Hardware

    assert build_config({}).sources.intervals == {"ipmi": 5.0, "pdu": 5.0}
    config = build_config(
        {
            "agent": {"interval_s": 0.1, "metrics_address": "", "state_dir": str(tmp_path)},
            "mqtt": {"enabled": False},
            "sources": {
                "rdma": {"interval_s": 5},
                "pdu": {"interval_s": 2},
                "ipmi": {"interval_s": 1},
            },
        }
    )
    agent = Agent.from_config(config, Hardware(nvml=None, replayed=True), sources=[])
    assert agent.runner.intervals == {"ipmi": 1.0, "rdma": 5.0, "pdu": 2.0}
    with pytest.raises(ConfigError) as e:
        build_config({"sources": {"ipmi": {"interval_s": 0}}})
    assert [p.key for p in e.value.problems] == ["sources.ipmi.interval_s"]


def test_duplicate_pdu_targets_and_job_ids_name_the_key(tmp_path: Path) -> None:
    """Two PDU targets of one name would expose the same series, two jobs of one id would
    share a journal: check-config says which entry repeats which, and exits 2."""
    path = tmp_path / "dup.toml"
    target = 'host = "pdu-a.example"\noutlets = ["1"]\n'
    path.write_text(
        f'[[sources.pdu.targets]]\nname = "rack1"\n{target}'
        f'[[sources.pdu.targets]]\nname = "rack2"\n{target}'
        f'[[sources.pdu.targets]]\nname = "rack1"\n{target}'
        '[[coordinator.jobs]]\nid = "llama"\nnodes = ["a"]\n'
        '[[coordinator.jobs]]\nid = "llama"\nnodes = ["b"]\n'
    )
    result = _check(path)
    assert result.returncode == 2, result.stdout
    lines = result.stderr.strip().splitlines()
    assert lines == [
        f"{path}: sources.pdu.targets.2.name: duplicate name 'rack1' (also "
        "sources.pdu.targets.0.name): two targets of one name would expose the same series",
        f"{path}: coordinator.jobs.1.id: duplicate id 'llama' (also coordinator.jobs.0.id): "
        "two jobs of one id would share one journal file and one settings topic",
    ]


def _agent(
    *args: str, user: int | None = None, timeout_s: float = 30
) -> subprocess.CompletedProcess[str]:
    """``hyperagent agent ARGS`` (as ``user`` through setpriv when given), with no /metrics."""
    command = [sys.executable, "-m", "hyperagent.cli", "agent", "--metrics-address", "", *args]
    if user is not None:
        command = [
            "setpriv",
            f"--reuid={user}",
            f"--regid={user}",
            "--clear-groups",
            "--",
            *command,
        ]
    return subprocess.run(
        command,
        capture_output=True,
        text=True,
        timeout=timeout_s,
        cwd="/",
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )


@pytest.mark.parametrize("interval", ["0", "-1", "nan"])
def test_an_interval_that_is_not_positive_is_an_error(tmp_path: Path, interval: str) -> None:
    """``--interval 0`` does not quietly collect every second: it is refused, exit 2."""
    config = tmp_path / "a.toml"
    config.write_text(
        f'[agent]\nstate_dir = "{tmp_path}"\n[sources.job]\nsocket = "{tmp_path / "j.sock"}"\n'
    )
    result = _agent("--config", str(config), "--no-broker", "--interval", interval, timeout_s=20)
    assert result.returncode == 2
    assert (
        f"argument --interval: must be a positive number of seconds, not {interval}"
        in result.stderr
    )


@pytest.fixture
def locked_dir() -> Iterator[Path]:
    """A folder other users can read but only root may write in, under one they can reach
    (pytest's tmp_path is 0700); holds an agent config whose state and job socket are in it."""
    shared = Path(tempfile.mkdtemp(prefix="hyperagent-locked-"))
    shared.chmod(0o755)
    locked = shared / "locked"
    locked.mkdir(mode=0o555)
    (shared / "agent.toml").write_text(
        f'[agent]\nstate_dir = "{locked / "state"}"\n'
        f'[sources.job]\nsocket = "{locked / "run" / "job.sock"}"\n'
        '[mqtt]\nurl = "mqtt://127.0.0.1:1"\n'
    )
    try:
        yield shared
    finally:
        locked.chmod(0o755)
        shutil.rmtree(shared, ignore_errors=True)


def test_an_agent_that_cannot_make_its_folders_says_so_in_one_line(locked_dir: Path) -> None:
    """An agent started as a user that may not create its state folder (or its job socket's
    folder) says which path and what to do, exit 2, instead of a PermissionError traceback."""
    user = NOBODY if os.geteuid() == 0 else None
    config = str(locked_dir / "agent.toml")
    state = locked_dir / "locked" / "state"
    result = _agent("--config", config, user=user)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == [
        f"{config}: agent.state_dir: cannot create {state}: Permission denied; run the agent as "
        "its service user (hyperagent, as the shipped unit does, which creates it) or set "
        "agent.state_dir to a folder this user may write"
    ]
    result = _agent("--config", config, "--no-broker", user=user)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert lines[0].startswith(
        f"sources.job.socket: cannot listen on {locked_dir / 'locked' / 'run' / 'job.sock'}: "
        "Permission denied; run the agent as its service user"
    )
