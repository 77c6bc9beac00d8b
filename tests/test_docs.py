"""The documentation: a README of one page with the two commands, a site that builds with
``mkdocs build --strict``, and reference pages generated from the code (docs/gen_reference.py)
that have an entry for every configuration key and every exported metric."""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
import sys
import typing
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
from pydantic import BaseModel
from pydantic.fields import FieldInfo

from hyperagent.config import Config

from conftest import REPO, unavailable

DOCS = REPO / "docs"
DEMO_COMMAND = (
    "python3 -m venv .venv && .venv/bin/pip install -q '.[all]' && .venv/bin/hyperagent demo"
)
TEST_COMMAND = "bash .ci/run"


def generator() -> ModuleType:
    """docs/gen_reference.py, the MkDocs hook that writes the reference pages."""
    spec = importlib.util.spec_from_file_location("gen_reference", DOCS / "gen_reference.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def gen() -> ModuleType:
    return generator()


def test_the_readme_is_one_page_with_the_two_commands() -> None:
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) <= 200
    code = {line.strip() for line in readme.splitlines() if line.startswith("    ")}
    assert DEMO_COMMAND in code and TEST_COMMAND in code
    for link in re.findall(r"\]\((docs/[^)#]+)", readme):
        assert (REPO / link).exists(), link


def config_fields(
    model: type[BaseModel] = Config, prefix: str = ""
) -> Iterator[tuple[str, FieldInfo]]:
    """Every key of the configuration file, dotted (a table's own keys, not the table), with its
    field."""
    for name, info in model.model_fields.items():
        inner = info.annotation
        while typing.get_origin(inner) is typing.Annotated:
            inner = typing.get_args(inner)[0]
        args = typing.get_args(inner)
        if typing.get_origin(inner) is tuple and len(args) == 2 and args[1] is Ellipsis:
            inner = args[0]
        if isinstance(inner, type) and issubclass(inner, BaseModel):
            yield from config_fields(inner, f"{prefix}{name}.")
        else:
            yield f"{prefix}{name}", info


def config_keys() -> list[str]:
    return [key for key, _ in config_fields()]


def entries(markdown: str) -> dict[str, list[str]]:
    """The reference's rows by the id each one carries: the row's cells after the first."""
    rows = {}
    for line in markdown.splitlines():
        found = re.match(r'\| <span id="([^"]+)"></span>', line)
        if found:
            cells = [cell.strip() for cell in re.split(r"(?<!\\)\|", line)[2:-1]]
            rows[found.group(1)] = cells
    return rows


def undocumented_keys(markdown: str) -> list[str]:
    """The keys with no row, or a row without a type, a default or a meaning."""
    rows = entries(markdown)
    return [key for key in config_keys() if not (key in rows and all(rows[key]))]


def test_every_config_key_has_its_entry(gen: ModuleType) -> None:
    markdown = gen.configuration_markdown()
    assert len(config_keys()) > 150
    assert undocumented_keys(markdown) == []
    # a key whose row went missing is found
    cut = markdown.replace('<span id="sources.job.max_jobs"></span>', "")
    assert undocumented_keys(cut) == ["sources.job.max_jobs"]


def test_a_key_computed_at_start_says_so(gen: ModuleType) -> None:
    factories = [key for key, info in config_fields() if info.default_factory is not None]
    assert sorted(factories) == sorted(gen.FACTORY_DEFAULTS)


METRIC_LITERAL = re.compile(r"""["'](hyperagent_[a-z0-9_]*[a-z0-9])["']""")
TYPE_LINE = re.compile(r"^# TYPE (hyperagent_[a-z0-9_]+) (\w+)$", re.M)


def exported_metrics() -> set[str]:
    """Every metric name the code writes out in full, and every family a golden exposition of a
    replayed node holds (names made up at run time: ``hyperagent_rdma_port_{counter}``)."""
    names = set()
    for path in (REPO / "hyperagent").rglob("*.py"):
        names.update(METRIC_LITERAL.findall(path.read_text()))
    for path in (REPO / "tests" / "golden").rglob("*.prom"):
        for family, kind in TYPE_LINE.findall(path.read_text()):
            counter = kind == "counter" and not family.endswith("_total")
            names.add(f"{family}_total" if counter else family)
    return names


def test_every_exported_metric_has_its_entry(gen: ModuleType) -> None:
    rows = entries(gen.metrics_markdown())
    exported = exported_metrics()
    assert len(exported) > 150
    missing = sorted(name for name in exported if name not in rows)
    assert missing == [], "metrics without help in hyperagent/catalog.py (or a source's HELP)"
    assert all(all(cells) for cells in rows.values())


def test_every_alert_and_panel_is_on_its_page(gen: ModuleType) -> None:
    import json

    import yaml

    alerts = gen.alerts_markdown()
    groups = yaml.safe_load((REPO / "rules" / "hyperagent.rules.yml").read_text())["groups"]
    for rule in (rule for group in groups for rule in group["rules"]):
        assert f"`{rule.get('alert') or rule['record']}`" in alerts
    boards = gen.dashboards_markdown()
    for path in (REPO / "grafana" / "dashboards").glob("*.json"):
        board = json.loads(path.read_text())
        for panel in gen._panels(board["panels"]):
            assert panel["title"] in boards, (path.name, panel["title"])
            for target in panel.get("targets", []):
                assert target.get("expr", "") in boards


def figure_tables(text: str) -> Iterator[tuple[list[str], list[str]]]:
    """Each table of a page as (its header cells, a row's cells), for every row."""
    header: list[str] = []
    for line in text.splitlines():
        if not line.startswith("|"):
            header = []
            continue
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if not header:
            header = cells
        elif not set(line) <= set("|-: "):
            yield header, cells


def test_every_measured_figure_says_its_date_machine_and_command() -> None:
    checked = 0
    for page in sorted((DOCS / "performance").glob("*.md")):
        for header, cells in figure_tables(page.read_text()):
            if not {"date", "machine", "command"} <= set(header):
                continue
            row = dict(zip(header, cells, strict=False))
            for column in ("date", "machine", "command"):
                assert row.get(column), (page.name, column, cells)
            assert re.match(r"(before )?\d{4}-\d\d-\d\d", row["date"]), (page.name, cells)
            checked += 1
    assert checked > 30


def test_the_install_pages_hold_the_scripts_the_real_tests_run() -> None:
    def blocks(page: str) -> list[str]:
        return re.findall(r"^```sh\n(.*?)^```$", (DOCS / page).read_text(), re.M | re.S)

    install = blocks("install/systemd.md")
    assert "pip install" in install[0]
    assert sum("mosquitto_passwd" in block for block in install) == 1
    assert "hyperagent-coordinator" in install[-1]
    rabbitmq = blocks("install/rabbitmq.md")
    assert "apt-get install" in rabbitmq[0] and "hyperagent-rabbitmq-users" in rabbitmq[1]
    slurm = blocks("install/slurm.md")
    assert len(slurm) == 2 and "scontrol ping" in slurm[1]


def test_the_site_builds_strict(tmp_path: Path) -> None:
    mkdocs = shutil.which("mkdocs", path=str(Path(sys.executable).parent))
    if mkdocs is None:
        unavailable("mkdocs is not installed: pip install -e '.[docs]' (bash .ci/run does)")
    done = subprocess.run(
        [mkdocs, "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=240,
        env={"PATH": "/usr/bin:/bin", "NO_MKDOCS_2_WARNING": "1", "HOME": str(tmp_path)},
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert (tmp_path / "site" / "reference" / "configuration" / "index.html").exists()
