"""Shipped Grafana dashboards: well-formed, a datasource variable, every query valid PromQL."""

from __future__ import annotations

import json
import re

import promql_parser
import pytest

from hyperagent.catalog import HELP

from conftest import REPO

DASHBOARDS = sorted((REPO / "grafana" / "dashboards").glob("*.json"))


def substitute(expr: str) -> str:
    expr = expr.replace("$__rate_interval", "1m")
    return re.sub(r"\$\{?(\w+)\}?", ".*", expr)


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_dashboard_queries_parse_and_use_known_metrics(path) -> None:  # type: ignore[no-untyped-def]
    dashboard = json.loads(path.read_text())
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dashboard["panels"]:
        assert panel["datasource"]["uid"] == "${datasource}"
        for target in panel["targets"]:
            promql_parser.parse(substitute(target["expr"]))
            for name in re.findall(r"hyperagent_\w+", target["expr"]):
                assert name in HELP, f"{panel['title']}: {name} is not a metric hyperagent exposes"
