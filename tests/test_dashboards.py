"""Shipped Grafana dashboards: generated from grafana/generate.py, well-formed for Grafana 11.6,
a datasource variable, every query valid PromQL over metrics and recording rules that exist."""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import promql_parser
import pytest
import yaml
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models.dashboard import Dashboard

from hyperagent.catalog import HELP
from hyperagent.devices import metrics as nvml

from conftest import REPO

DASHBOARDS = sorted((REPO / "grafana" / "dashboards").glob("*.json"))
METRICS = {**HELP, **nvml.HELP}
RULES = yaml.safe_load((REPO / "rules" / "hyperagent.rules.yml").read_text())["groups"]
RECORDED = {rule["record"] for group in RULES for rule in group["rules"] if "record" in rule}
PROMETHEUS_METRICS = {"up", "ALERTS"}
FILTERS = {
    "hyperagent-cluster": ["$cluster"],
    "hyperagent-node": ["$cluster", "$instance"],
    "hyperagent-job": ["$cluster", "$job_id"],
}
"""Variables every query of a dashboard filters on."""


def load_generator() -> ModuleType:
    """grafana/generate.py as a module (grafana/ is no package)."""
    name = "hyperagent_grafana_generate"
    spec = importlib.util.spec_from_file_location(name, REPO / "grafana" / "generate.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def substitute(expr: str) -> str:
    expr = expr.replace("$__rate_interval", "1m").replace("$__range", "1h")
    return re.sub(r"\$\{?(\w+)\}?", ".*", expr)


def panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    return [p for p in dashboard["panels"] if p["type"] != "row"]


def test_committed_dashboards_are_the_generators_output() -> None:
    rendered = load_generator().rendered()
    assert sorted(rendered) == [p.name for p in DASHBOARDS]
    for path in DASHBOARDS:
        assert path.read_text() == rendered[path.name], (
            f"{path.name} is not what grafana/generate.py writes: run it"
        )


def test_generator_check_mode_reports_a_stale_file(tmp_path: Path) -> None:
    generator = load_generator()
    generator.OUT = tmp_path
    assert generator.main(["--check"]) == 1
    assert generator.main([]) == 0
    assert generator.main(["--check"]) == 0
    (tmp_path / "hyperagent-node.json").write_text("{}\n")
    assert generator.main(["--check"]) == 1


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_dashboard_is_a_grafana_11_dashboard(path: Path) -> None:
    raw = json.loads(path.read_text())
    assert raw["schemaVersion"] == 41
    assert raw["uid"] == path.stem and raw["uid"] in FILTERS
    assert json.loads(json.dumps(Dashboard.from_json(raw), cls=JSONEncoder)) == raw


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_dashboard_queries_parse_and_use_known_metrics(path: Path) -> None:
    dashboard = json.loads(path.read_text())
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    for name in FILTERS[dashboard["uid"]]:
        assert variables[name.lstrip("$")]["type"] == "query"
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in panels(dashboard):
        assert panel["datasource"]["uid"] == "${datasource}"
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            expr = target["expr"]
            promql_parser.parse(substitute(expr))
            for needed in FILTERS[dashboard["uid"]]:
                assert needed in expr, f"{panel['title']}: {expr} ignores {needed}"
            names = re.sub(r'"[^"]*"|\[[^]]*\]', "", expr)  # not label values nor ranges
            for token in re.findall(r"[a-zA-Z_:][a-zA-Z0-9_:]*", names):
                if ":" in token:
                    assert token in RECORDED, f"{panel['title']}: {token} is no recording rule"
                elif token.startswith("hyperagent_"):
                    assert token in METRICS, f"{panel['title']}: {token} is not exposed"


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_panel_titles_are_unique(path: Path) -> None:
    titles = [panel["title"] for panel in panels(json.loads(path.read_text()))]
    assert sorted(t for t in set(titles) if titles.count(t) > 1) == []


def query_kind(expr: str) -> str:
    """What a query's values are: a count per interval, a rate per second, or a level."""
    if "increase(" in expr:
        return "count per interval"
    if re.search(r"\b(rate|irate)\(", expr):
        return "per second"
    return "level"


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_a_panel_does_not_mix_rates_counts_and_levels(path: Path) -> None:
    mixed = {
        panel["title"]: kinds
        for panel in panels(json.loads(path.read_text()))
        if len(kinds := {query_kind(t["expr"]) for t in panel["targets"]}) > 1
    }
    assert mixed == {}


def test_gpu_memory_repairs_show_retired_pages_and_remapped_rows_side_by_side() -> None:
    node = json.loads((REPO / "grafana" / "dashboards" / "hyperagent-node.json").read_text())
    by_title = {panel["title"]: panel for panel in panels(node)}
    retired, remapped = by_title["Retired pages"], by_title["Remapped rows"]
    assert "hyperagent_gpu_remapped_rows{" in remapped["targets"][0]["expr"]
    assert retired["gridPos"]["y"] == remapped["gridPos"]["y"]
    assert retired["gridPos"]["x"] + retired["gridPos"]["w"] == remapped["gridPos"]["x"]


def test_provisioning_points_grafana_at_prometheus_and_the_dashboards() -> None:
    provisioning = REPO / "grafana" / "provisioning"
    (source,) = yaml.safe_load((provisioning / "datasources" / "prometheus.yml").read_text())[
        "datasources"
    ]
    assert source["type"] == "prometheus" and source["url"].startswith("http")
    scrape = yaml.safe_load((REPO / "rules" / "prometheus.yml").read_text())["global"]
    assert source["jsonData"]["timeInterval"] == scrape["scrape_interval"]
    (provider,) = yaml.safe_load((provisioning / "dashboards" / "hyperagent.yml").read_text())[
        "providers"
    ]
    assert provider["type"] == "file" and provider["options"]["path"]
