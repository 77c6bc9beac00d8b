"""`pip install hyperagent` is the agent alone: the agent's commands run, and never import, what
the coordinator, the report and the demo need (their extras); those commands say in one line
which extra to install.

"Not installed" is real here: the commands run in a Python without site-packages whose path holds
this checkout and every installed distribution but the extras' (links into site-packages), so an
import of an extra fails as on a node that installed only the agent.
"""

from __future__ import annotations

import json
import os
import signal
import site
import subprocess
import sys
import textwrap
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from conftest import free_port, wait_for_port

pytestmark = pytest.mark.timeout(180)

REPO = Path(__file__).parents[1]
REPLAY = REPO / "fixtures" / "replay" / "full-node"
EXTRAS_MODULES = (
    "skopt",
    "sklearn",
    "scipy",
    "numpy",
    "matplotlib",
    "iotcore",
    "threadpoolctl",
    "joblib",
    "rich",
)
"""What the extras install (and what they pull in) that the agent must never import."""
_EXTRAS_ENTRIES = (*EXTRAS_MODULES, "scikit_", "mpl_toolkits", "pylab", "contourpy", "kiwisolver")

DRIVER = textwrap.dedent(
    """
    import atexit, json, sys
    path, modules_file, *argv = sys.argv[1:]
    if path:
        sys.path[:0] = path.split(":")
    def dump() -> None:
        with open(modules_file, "w") as f:
            json.dump(sorted({name.split(".")[0] for name in sys.modules}), f)
    atexit.register(dump)
    from hyperagent.cli import main
    sys.exit(main(argv))
    """
)


def without_extras(tmp_path: Path) -> str:
    """A module path of this checkout and links to every installed top-level entry but the
    extras' (and their dependencies')."""
    view = tmp_path / "site-packages-without-extras"
    view.mkdir()
    for packages in site.getsitepackages():
        for entry in Path(packages).iterdir():
            if entry.name.lower().startswith(_EXTRAS_ENTRIES) or (view / entry.name).exists():
                continue
            (view / entry.name).symlink_to(entry)
    return f"{REPO}:{view}"


@dataclass
class Command:
    """``hyperagent ARGV`` running in its own Python; ``imported`` is filled with the top-level
    modules it imported when it exits."""

    process: subprocess.Popen[str]
    modules_file: Path
    imported: list[str] = field(default_factory=list)

    def finish(self, timeout_s: float = 60) -> tuple[int, str, str]:
        out, err = self.process.communicate(timeout=timeout_s)
        if self.modules_file.exists():
            self.imported.extend(json.loads(self.modules_file.read_text()))
        return self.process.returncode, out, err


def start(tmp_path: Path, *argv: str, path: str | None) -> Command:
    """Start ``hyperagent ARGV`` (``path``: without the extras; None: in this environment)."""
    modules_file = tmp_path / f"modules-{len(list(tmp_path.glob('modules-*')))}.json"
    modules_file.touch()
    isolated = ["-S"] if path is not None else []
    process = subprocess.Popen(
        [sys.executable, *isolated, "-c", DRIVER, path or "", str(modules_file), *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        cwd=tmp_path,
    )
    return Command(process, modules_file)


def run(tmp_path: Path, *argv: str, path: str | None) -> tuple[int, str, str, list[str]]:
    command = start(tmp_path, *argv, path=path)
    code, out, err = command.finish()
    return code, out, err, command.imported


def serve_replay(tmp_path: Path, path: str | None) -> tuple[str, int, str, list[str]]:
    """The agent replaying the full node (GPUs, BMC, PDU, RDMA, host) for a few cycles:
    its /metrics, its exit status, its log and the modules it imported."""
    port = free_port()
    agent = start(
        tmp_path,
        "agent",
        "--replay",
        str(REPLAY),
        "--no-broker",
        "--metrics-address",
        f"127.0.0.1:{port}",
        "--interval",
        "0.2",
        path=path,
    )
    body = ""
    try:
        wait_for_port(port, 60)
        for _ in range(100):
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
                body = r.read().decode()
            if "hyperagent_qu_ratio" in body and "hyperagent_pdu_inlet_power_watts" in body:
                break
            subprocess.run(["sleep", "0.1"], check=True)
    finally:
        agent.process.send_signal(signal.SIGTERM)
        code, _, err = agent.finish()
    return body, code, err, agent.imported


def test_the_agent_serves_a_full_node_without_the_extras_installed(tmp_path: Path) -> None:
    body, code, err, imported = serve_replay(tmp_path, without_extras(tmp_path))
    assert code == 0, err
    assert "No module named" not in err
    assert body.count("hyperagent_gpu_power_watts{") == 8
    for name in ("hyperagent_qu_ratio", "hyperagent_pdu_inlet_power_watts", "hyperagent_bmc_"):
        assert name in body
    assert "pynvml" in imported and not set(imported) & set(EXTRAS_MODULES)


def test_record_check_config_and_metrics_run_without_the_extras_installed(
    tmp_path: Path,
) -> None:
    path = without_extras(tmp_path)
    code, out, err, imported = run(tmp_path, "metrics", path=path)
    assert code == 0 and "hyperagent_gpu_power_watts" in out, err
    config = tmp_path / "agent.toml"
    config.write_text('node = "gpu-001"\ncluster = "prod"\n[mqtt]\nenabled = false\n')
    code, out, err, imported_too = run(tmp_path, "check-config", str(config), path=path)
    assert code == 0 and out.startswith(f"{config}: OK"), err
    out_dir = tmp_path / "recorded"
    argv = ("record", "--replay", str(REPLAY), "--duration", "1", "--out", str(out_dir))
    code, out, err, recorded = run(tmp_path, *argv, "--interval", "0.2", path=path)
    assert code == 0 and out.startswith("recorded "), err
    assert any(out_dir.iterdir())
    for modules in (imported, imported_too, recorded):
        assert modules and not set(modules) & set(EXTRAS_MODULES), modules


def test_the_agent_imports_none_of_the_extras_where_they_are_installed(tmp_path: Path) -> None:
    """Installed beside it (`pip install 'hyperagent[all]'`), the extras still cost a node
    nothing: the agent's process never loads them."""
    body, code, err, imported = serve_replay(tmp_path, None)
    assert code == 0, err
    assert "hyperagent_qu_ratio" in body
    assert imported and not set(imported) & set(EXTRAS_MODULES), imported


@pytest.mark.parametrize(
    ("argv", "line"),
    [
        (
            ("coordinator", "--config", "missing.toml"),
            "hyperagent coordinator: needs scikit-optimize, scikit-learn, numpy, scipy, "
            "threadpoolctl: pip install 'hyperagent[coordinator]'",
        ),
        (
            ("report", "journal.jsonl"),
            "hyperagent report: needs matplotlib: pip install 'hyperagent[report]'",
        ),
        (
            ("demo",),
            "hyperagent demo: needs scikit-optimize, scikit-learn, numpy, scipy, threadpoolctl, "
            "matplotlib, iotcore, rich: pip install 'hyperagent[demo]'",
        ),
        (  # with a broker of its own the demo does without the embedded one
            ("demo", "--broker", "mqtt://127.0.0.1:1883"),
            "hyperagent demo: needs scikit-optimize, scikit-learn, numpy, scipy, threadpoolctl, "
            "matplotlib, rich: pip install 'hyperagent[demo]'",
        ),
    ],
)
def test_a_command_without_its_extra_names_the_pip_command(
    tmp_path: Path, argv: tuple[str, ...], line: str
) -> None:
    code, out, err, imported = run(tmp_path, *argv, path=without_extras(tmp_path))
    assert (code, out, err) == (2, "", line + "\n")
    assert not set(imported) & set(EXTRAS_MODULES)
