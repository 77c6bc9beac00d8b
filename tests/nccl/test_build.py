"""The plugin is built at install when a C compiler is present, and `hyperagent nccl-plugin`
prints its absolute path, building it into the cache when the install could not."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hyperagent.cli import main
from hyperagent.nccl import LIBRARY_NAME, TunerPlugin, compiler

from conftest import REPO, unavailable


@pytest.fixture(autouse=True)
def _compiler() -> None:
    if compiler() is None:
        unavailable("no C compiler (cc, gcc or clang) to build the NCCL tuner plugin")


def test_nccl_plugin_prints_the_path_of_a_library_it_built(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("HYPERAGENT_CACHE_DIR", str(tmp_path / "cache"))
    assert main(["nccl-plugin"]) == 0
    path = Path(capsys.readouterr().out.strip())
    assert path.is_absolute() and path.is_file() and path.name == LIBRARY_NAME
    assert path.is_relative_to(tmp_path / "cache")
    ctypes.c_void_p.in_dll(ctypes.CDLL(str(path)), "ncclTunerPlugin_v6")
    assert TunerPlugin(path).selected().algorithm == -1
    built = path.stat().st_mtime_ns
    assert main(["nccl-plugin"]) == 0
    assert Path(capsys.readouterr().out.strip()) == path
    assert path.stat().st_mtime_ns == built, "the cached build is reused"


def test_nccl_plugin_without_a_compiler_says_why(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("HYPERAGENT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    monkeypatch.delenv("CC", raising=False)
    assert main(["nccl-plugin"]) == 1
    captured = capsys.readouterr()
    assert captured.out == "" and "no C compiler" in captured.err


def _build_package(out: Path, path: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PATH": path, "CC": ""}
    return subprocess.run(
        [sys.executable, "setup.py", "-q", "build_py", "-d", str(out)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_the_install_builds_the_plugin_into_the_package(tmp_path: Path) -> None:
    done = _build_package(tmp_path / "lib", os.environ["PATH"])
    assert done.returncode == 0, done.stderr
    package = tmp_path / "lib" / "hyperagent" / "nccl"
    library = package / LIBRARY_NAME
    assert library.is_file()
    for version in (3, 4, 5, 6):
        ctypes.c_void_p.in_dll(ctypes.CDLL(str(library)), f"ncclTunerPlugin_v{version}")
    assert (package / "tuner.c").is_file() and (package / "nccl_tuner.h").is_file()


def test_the_install_without_a_compiler_still_succeeds(tmp_path: Path) -> None:
    done = _build_package(tmp_path / "lib", str(tmp_path / "empty"))
    assert done.returncode == 0, done.stderr
    package = tmp_path / "lib" / "hyperagent" / "nccl"
    assert not (package / LIBRARY_NAME).exists()
    assert (package / "tuner.c").is_file(), "the source ships for `hyperagent nccl-plugin`"
    assert "nccl-plugin" in done.stdout
