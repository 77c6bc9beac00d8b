"""The Grafana dashboards of grafana/dashboards/, generated with grafana-foundation-sdk.

    .venv/bin/python grafana/generate.py           rewrite grafana/dashboards/*.json
    .venv/bin/python grafana/generate.py --check   exit 1 when a committed file differs

Needs ``grafana-foundation-sdk==1769699379!11.6.0`` (Grafana 11.6, schemaVersion 41).

Every panel reads the Prometheus data source picked in ``$datasource`` and filters on
``$cluster`` (the label the file_sd targets add, rules/targets/) and on ``$instance`` (node
dashboard) or ``$job_id`` (job dashboard). Aggregates come from the recording rules of
rules/hyperagent.rules.yml (``node:``, ``node_job_id:``, ``job_id:``, ``cluster:``).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from grafana_foundation_sdk.builders import common as common_builders
from grafana_foundation_sdk.builders import dashboard as dash
from grafana_foundation_sdk.builders import prometheus, stat, statetimeline, table, timeseries
from grafana_foundation_sdk.cog import variants
from grafana_foundation_sdk.cog.builder import Builder
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import common
from grafana_foundation_sdk.models import dashboard as model
from grafana_foundation_sdk.models.prometheus import PromQueryFormat

OUT = Path(__file__).resolve().parent / "dashboards"
DATASOURCE = model.DataSourceRef(type_val="prometheus", uid="${datasource}")

CLUSTER = 'cluster=~"$cluster"'
NODE = f'{CLUSTER}, instance=~"$instance"'
JOB = f'{CLUSTER}, job_id=~"$job_id"'
RATE = "$__rate_interval"
JOB_LISTS = "hyperagent_tuner_done|hyperagent_job_gpus"
"""The series whose job_id labels the job dashboard lists: tuned jobs and jobs holding GPUs."""

GREEN, YELLOW, ORANGE, RED, BLUE = "green", "yellow", "orange", "red", "blue"

MEMORY_PRESSURE = (
    "max(GPU, host memory pressure). GPU: the job's allocator (method reported; alert above 0.8 "
    "for 10 minutes), or NVML's used fraction (method estimated), which a caching allocator "
    "keeps near 100% on a healthy node. Host: used memory or PSI's stall share."
)


@dataclass(frozen=True)
class Query:
    """A PromQL expression and the legend of its series."""

    expr: str
    legend: str = ""


def _targets(
    queries: Sequence[Query], *, instant: bool = False
) -> list[Builder[variants.Dataquery]]:
    targets: list[Builder[variants.Dataquery]] = []
    for i, q in enumerate(queries):
        target = (
            prometheus.Dataquery().expr(q.expr).ref_id(chr(ord("A") + i)).datasource(DATASOURCE)
        )
        if q.legend:
            target = target.legend_format(q.legend)
        if instant:
            target = target.instant().format(PromQueryFormat.TABLE)
        targets.append(target)
    return targets


def _thresholds(*steps: tuple[float | None, str]) -> dash.ThresholdsConfig:
    return (
        dash.ThresholdsConfig()
        .mode(model.ThresholdsMode.ABSOLUTE)
        .steps([model.Threshold(value=value, color=color) for value, color in steps])
    )


def _value_text(texts: dict[str, tuple[str, str]]) -> list[model.ValueMapping]:
    return [
        model.ValueMap(
            options={
                value: model.ValueMappingResult(text=text, color=color, index=i)
                for i, (value, (text, color)) in enumerate(texts.items())
            }
        )
    ]


def graph(
    title: str,
    description: str,
    unit: str,
    *queries: Query,
    ratio: bool = False,
    width: int = 12,
) -> timeseries.Panel:
    """A time series panel; ``ratio`` fixes the axis to 0..1."""
    panel = (
        timeseries.Panel()
        .title(title)
        .description(description)
        .datasource(DATASOURCE)
        .targets(_targets(queries))
        .unit(unit)
        .span(width)
        .height(8)
        .fill_opacity(10)
        .show_points(common.VisibilityMode.NEVER)
        .legend(
            common_builders.VizLegendOptions()
            .display_mode(common.LegendDisplayMode.LIST)
            .placement(common.LegendPlacement.BOTTOM)
            .show_legend(True)
        )
        .tooltip(
            common_builders.VizTooltipOptions()
            .mode(common.TooltipDisplayMode.MULTI)
            .sort(common.SortOrder.DESCENDING)
        )
    )
    if ratio:
        panel = panel.min(0).max(1)
    return panel


def single(
    title: str,
    description: str,
    unit: str,
    query: Query,
    thresholds: dash.ThresholdsConfig | None = None,
    mappings: list[model.ValueMapping] | None = None,
    width: int = 4,
) -> stat.Panel:
    """A stat panel showing the last value."""
    panel = (
        stat.Panel()
        .title(title)
        .description(description)
        .datasource(DATASOURCE)
        .targets(_targets([query]))
        .unit(unit)
        .span(width)
        .height(4)
        .graph_mode(common.BigValueGraphMode.AREA)
        .color_mode(common.BigValueColorMode.VALUE)
        .reduce_options(common_builders.ReduceDataOptions().calcs(["lastNotNull"]).values(False))
        .thresholds(thresholds or _thresholds((None, BLUE)))
    )
    if mappings:
        panel = panel.mappings(mappings)
    return panel


def listing(
    title: str,
    description: str,
    query: Query,
    mappings: list[model.ValueMapping] | None = None,
    width: int = 12,
) -> table.Panel:
    """A table of the current series (instant query), one row per series."""
    panel = (
        table.Panel()
        .title(title)
        .description(description)
        .datasource(DATASOURCE)
        .targets(_targets([query], instant=True))
        .span(width)
        .height(8)
        .with_transformation(
            model.DataTransformerConfig(
                id_val="organize",
                options={"excludeByName": {"Time": True, "__name__": True}},
            )
        )
    )
    if mappings:
        panel = panel.mappings(mappings)
    return panel


def timeline(
    title: str,
    description: str,
    query: Query,
    mappings: list[model.ValueMapping] | None = None,
    width: int = 12,
) -> Builder[model.Panel]:
    """A state timeline: which series is present when (for ``_info`` metrics), or, with
    ``mappings``, the state each value stands for."""
    panel = (
        statetimeline.Panel()
        .title(title)
        .description(description)
        .datasource(DATASOURCE)
        .targets(_targets([query]))
        .span(width)
        .height(5)
        .show_value(common.VisibilityMode.NEVER)
        .merge_values(True)
    )
    if mappings:
        panel = panel.mappings(mappings)
    return panel


def datasource_variable() -> dash.DatasourceVariable:
    return dash.DatasourceVariable("datasource").label("Data source").type("prometheus")


def query_variable(name: str, label: str, query: str, multi: bool = False) -> dash.QueryVariable:
    variable = (
        dash.QueryVariable(name)
        .label(label)
        .datasource(DATASOURCE)
        .query(query)
        .refresh(model.VariableRefresh.ON_TIME_RANGE_CHANGED)
        .sort(model.VariableSort.ALPHABETICAL_ASC)
    )
    if multi:
        return variable.multi(True).include_all(True).all_value(".*")
    return variable


def cluster_variable() -> dash.QueryVariable:
    return query_variable("cluster", "Cluster", "label_values(hyperagent_source_up, cluster)")


def new_dashboard(uid: str, title: str, description: str) -> dash.Dashboard:
    return (
        dash.Dashboard(title)
        .uid(uid)
        .description(description)
        .tags(["hyperagent"])
        .editable()
        .tooltip(model.DashboardCursorSync.CROSSHAIR)
        .refresh("30s")
        .time("now-3h", "now")
        .timezone("browser")
        .link(
            dash.DashboardLink("hyperagent")
            .type(model.DashboardLinkType.DASHBOARDS)
            .tags(["hyperagent"])
            .as_dropdown(True)
            .include_vars(True)
            .keep_time(True)
        )
    )


def cluster_dashboard() -> dash.Dashboard:
    c = CLUSTER
    ratio_bad_below = _thresholds((None, RED), (0.7, GREEN))
    return (
        new_dashboard(
            "hyperagent-cluster",
            "hyperagent / Cluster overview",
            "Cluster indicators, power, energy per sample and alerts of hyperagent.",
        )
        .with_variable(datasource_variable())
        .with_variable(cluster_variable())
        .with_row(dash.Row("Indicators"))
        .with_panel(
            single(
                "Quantum utilisation",
                "sum(q_i u_i) / sum(q_i) over every GPU of the cluster (alert below 70%).",
                "percentunit",
                Query(f"cluster:hyperagent_qu_ratio:avg{{{c}}}"),
                ratio_bad_below,
            )
        )
        .with_panel(
            single(
                "Communication/compute ratio",
                "Mean CCR of the nodes: healthy below 0.3, HighCCR above 0.5.",
                "none",
                Query(f"cluster:hyperagent_ccr_ratio:avg{{{c}}}"),
                _thresholds((None, GREEN), (0.3, YELLOW), (0.5, RED)),
            )
        )
        .with_panel(
            single(
                "Memory pressure (fullest node)",
                "Highest memory pressure index of the nodes: reported by the jobs' allocators "
                "(alert above 0.8), or estimated from NVML's used memory, which a caching "
                "allocator keeps near 100% on healthy nodes (never alerted on).",
                "percentunit",
                Query(f"cluster:hyperagent_memory_pressure_ratio:max{{{c}}}", "{{method}}"),
                _thresholds((None, GREEN), (0.8, RED)),
            ).override_by_name(
                "estimated",
                [
                    model.DynamicConfigValue(
                        id_val="thresholds", value=_thresholds((None, BLUE)).build()
                    )
                ],
            )
        )
        .with_panel(
            single(
                "Nodes online",
                "Nodes whose retained MQTT status says online, as the coordinator sees them.",
                "none",
                Query(f"cluster:hyperagent_node_online:sum{{{c}}}"),
            )
        )
        .with_panel(
            single(
                "Training throughput",
                "Samples per second of every job of the cluster.",
                "suffix: samples/s",
                Query(f"cluster:hyperagent_job_samples:rate5m{{{c}}}"),
            )
        )
        .with_panel(
            single(
                "Energy per sample",
                "GPU energy of the training nodes per training sample.",
                "joule",
                Query(f"cluster:hyperagent_energy_per_sample_joules:ratio_rate5m{{{c}}}"),
            )
        )
        .with_panel(
            graph(
                "Quantum utilisation by node",
                "Per node QU and the cluster's quantum-weighted QU.",
                "percentunit",
                Query(f"hyperagent_qu_ratio{{{c}}}", "{{instance}}"),
                Query(f"cluster:hyperagent_qu_ratio:avg{{{c}}}", "cluster {{cluster}}"),
                ratio=True,
            )
        )
        .with_panel(
            graph(
                "Communication/compute ratio by node",
                "Reported by the job, or estimated from RDMA traffic (method label).",
                "none",
                Query(f"hyperagent_ccr_ratio{{{c}}}", "{{instance}} ({{method}})"),
            )
        )
        .with_panel(
            graph(
                "Memory pressure by node",
                MEMORY_PRESSURE,
                "percentunit",
                Query(f"hyperagent_memory_pressure_ratio{{{c}}}", "{{instance}} ({{method}})"),
                ratio=True,
            )
        )
        .with_panel(
            graph(
                "Compute entropy and quantum dispersion by node",
                "Normalised entropy (1 = even load) and the coefficient of variation of "
                "quantum-weighted load (above 0.7: compute bubbles).",
                "none",
                Query(f"hyperagent_compute_entropy_ratio{{{c}}}", "entropy {{instance}}"),
                Query(f"hyperagent_quantum_dispersion_ratio{{{c}}}", "dispersion {{instance}}"),
            )
        )
        .with_row(dash.Row("Power and energy"))
        .with_panel(
            graph(
                "Cluster power",
                "GPU boards (NVML), node input (BMC) and node wall power (PDU outlets).",
                "watt",
                Query(f"cluster:hyperagent_gpu_power_watts:sum{{{c}}}", "GPUs (NVML)"),
                Query(f"cluster:hyperagent_bmc_power_watts:sum{{{c}}}", "nodes (BMC)"),
                Query(f"cluster:hyperagent_pdu_node_power_watts:sum{{{c}}}", "nodes (PDU)"),
            )
        )
        .with_panel(
            graph(
                "Power by node",
                "Each node's GPU, BMC and PDU power.",
                "watt",
                Query(f"node:hyperagent_gpu_power_watts:sum{{{c}}}", "{{instance}} GPUs"),
                Query(f"node:hyperagent_bmc_power_watts:max{{{c}}}", "{{instance}} BMC"),
                Query(f"node:hyperagent_pdu_node_power_watts:sum{{{c}}}", "{{instance}} PDU"),
            )
        )
        .with_panel(
            graph(
                "Energy per sample by job",
                "GPU energy of a job's nodes per sample it processed.",
                "joule",
                Query(
                    f"job_id:hyperagent_energy_per_sample_joules:ratio_rate5m{{{c}}}", "{{job_id}}"
                ),
            )
        )
        .with_panel(
            graph(
                "Energy per sample by node",
                "GPU energy per training sample of each node, over the agent's last interval.",
                "joule",
                Query(f"hyperagent_energy_per_sample_joules{{{c}}}", "{{instance}}"),
            )
        )
        .with_panel(
            graph(
                "Throughput by job",
                "Samples per second of each job, all its nodes.",
                "suffix: samples/s",
                Query(f"job_id:hyperagent_job_samples:rate5m{{{c}}}", "{{job_id}}"),
            )
        )
        .with_panel(
            graph(
                "Scrape targets up",
                "Agents and coordinators Prometheus scrapes successfully.",
                "none",
                Query(
                    f'sum by (job) (up{{{c}, job=~"hyperagent|hyperagent-coordinator"}})',
                    "{{job}}",
                ),
            )
        )
        .with_row(dash.Row("Alerts and health"))
        .with_panel(
            listing(
                "Alerts",
                "Firing and pending alerts of the cluster (rules/RUNBOOK.md says what to do).",
                Query(f"ALERTS{{{c}}}"),
            )
        )
        .with_panel(
            listing(
                "Sources",
                "Every source of every agent; absent hardware is down without errors.",
                Query(f"hyperagent_source_up{{{c}}}"),
                _value_text({"1": ("up", GREEN), "0": ("down", ORANGE)}),
            )
        )
    )


def node_dashboard() -> dash.Dashboard:
    n = NODE
    instance = query_variable(
        "instance", "Node", f"label_values(hyperagent_source_up{{{CLUSTER}}}, instance)", True
    )
    per_gpu = "{{instance}} GPU {{gpu}}"
    port = "{{instance}} {{device}}/{{port}}"
    return (
        new_dashboard(
            "hyperagent-node",
            "hyperagent / Node",
            "One node: indicators, GPUs, RDMA, BMC, PDU, host and the agent itself.",
        )
        .with_variable(datasource_variable())
        .with_variable(cluster_variable())
        .with_variable(instance)
        .with_row(dash.Row("Indicators"))
        .with_panel(
            graph(
                "Quantum utilisation and compute entropy",
                "QU (alert below 70% while training) and the normalised compute entropy.",
                "percentunit",
                Query(f"hyperagent_qu_ratio{{{n}}}", "QU {{instance}}"),
                Query(f"hyperagent_compute_entropy_ratio{{{n}}}", "entropy {{instance}}"),
                ratio=True,
            )
        )
        .with_panel(
            graph(
                "Quantum dispersion",
                "Coefficient of variation of q_i u_i: above 0.7 load balancing is needed.",
                "none",
                Query(f"hyperagent_quantum_dispersion_ratio{{{n}}}", "{{instance}}"),
            )
        )
        .with_panel(
            graph(
                "Communication/compute ratio",
                "Healthy below 0.3; HighCCR fires above 0.5 for 5 minutes.",
                "none",
                Query(f"hyperagent_ccr_ratio{{{n}}}", "{{instance}} ({{method}})"),
            )
        )
        .with_panel(
            graph(
                "Memory pressure",
                MEMORY_PRESSURE,
                "percentunit",
                Query(f"hyperagent_memory_pressure_ratio{{{n}}}", "{{instance}} ({{method}})"),
                ratio=True,
            )
        )
        .with_panel(
            graph(
                "Training throughput",
                "Samples per second each job reports on the node.",
                "suffix: samples/s",
                Query(
                    f"node_job_id:hyperagent_job_samples:rate5m{{{n}}}", "{{instance}} {{job_id}}"
                ),
            )
        )
        .with_panel(
            graph(
                "Energy per sample",
                "GPU energy per training sample over the agent's last interval.",
                "joule",
                Query(f"hyperagent_energy_per_sample_joules{{{n}}}", "{{instance}}"),
            )
        )
        .with_row(dash.Row("GPUs"))
        .with_panel(
            graph(
                "GPU utilisation",
                "Fraction of the sample period a kernel ran.",
                "percentunit",
                Query(f"hyperagent_gpu_utilization_ratio{{{n}}}", per_gpu),
                ratio=True,
            )
        )
        .with_panel(
            graph(
                "GPU memory used",
                "Device memory in use as a fraction of the installed memory.",
                "percentunit",
                Query(
                    f"hyperagent_gpu_memory_used_bytes{{{n}}}"
                    f" / hyperagent_gpu_memory_total_bytes{{{n}}}",
                    per_gpu,
                ),
                ratio=True,
            )
        )
        .with_panel(
            graph(
                "GPU power and limit",
                "Board power draw and the enforced power limit (the tuner's power cap).",
                "watt",
                Query(f"hyperagent_gpu_power_watts{{{n}}}", per_gpu),
                Query(f"hyperagent_gpu_power_limit_watts{{{n}}}", f"{per_gpu} limit"),
            )
        )
        .with_panel(
            graph(
                "GPU temperature",
                "Core and device memory (HBM) temperature.",
                "celsius",
                Query(f"hyperagent_gpu_temperature_celsius{{{n}}}", per_gpu),
                Query(f"hyperagent_gpu_memory_temperature_celsius{{{n}}}", f"{per_gpu} memory"),
            )
        )
        .with_panel(
            graph(
                "SM clock",
                "Current SM clock of each GPU.",
                "hertz",
                Query(f"hyperagent_gpu_sm_clock_hertz{{{n}}}", per_gpu),
            )
        )
        .with_panel(
            graph(
                "Clocks held down, by reason",
                "Mean fraction of time the node's GPUs were throttled, per reason.",
                "percentunit",
                Query(
                    "avg by (instance, reason) "
                    f"(rate(hyperagent_gpu_throttle_seconds_total{{{n}}}[{RATE}]))",
                    "{{instance}} {{reason}}",
                ),
            )
        )
        .with_panel(
            graph(
                "ECC errors",
                "New ECC errors per interval, by type (uncorrected ones alert).",
                "short",
                Query(
                    "sum by (instance, type) "
                    f"(increase(hyperagent_gpu_ecc_errors_total{{{n}}}[{RATE}]))",
                    "{{instance}} {{type}}",
                ),
            )
        )
        .with_panel(
            graph(
                "XID events since the agent started",
                "Critical XID events by GPU and XID (rules/RUNBOOK.md lists what they mean).",
                "short",
                Query(f"hyperagent_gpu_xid_errors_total{{{n}}}", f"{per_gpu} XID {{{{xid}}}}"),
            )
        )
        .with_panel(
            graph(
                "Retired pages",
                "Device memory pages retired, by cause (GPUs before Ampere retire pages).",
                "short",
                Query(f"hyperagent_gpu_retired_pages{{{n}}}", f"{per_gpu} {{{{cause}}}}"),
            )
        )
        .with_panel(
            graph(
                "Remapped rows",
                "Device memory rows remapped, by the kind of error (A100, H100, H200 and later "
                "remap rows instead of retiring pages; a pending remap needs a GPU reset).",
                "short",
                Query(f"hyperagent_gpu_remapped_rows{{{n}}}", f"{per_gpu} {{{{cause}}}}"),
            )
        )
        .with_panel(
            graph(
                "PCIe throughput",
                "PCIe traffic of each GPU, by direction.",
                "Bps",
                Query(
                    f"hyperagent_gpu_pcie_throughput_bytes_per_second{{{n}}}",
                    f"{per_gpu} {{{{direction}}}}",
                ),
            )
        )
        .with_panel(
            timeline(
                "Jobs on GPUs",
                "Which training job runs on which GPU: the job's ranks on NVML's list of the "
                "GPU's processes.",
                Query(f"hyperagent_gpu_job_info{{{n}}}", f"{per_gpu} {{{{job_id}}}}"),
            )
        )
        .with_panel(
            graph(
                "GPU power by job",
                "Board power of the GPUs each job runs on (a GPU two jobs share counts for both).",
                "watt",
                Query(
                    f"node_job_id:hyperagent_gpu_power_watts:sum{{{n}}}", "{{instance}} {{job_id}}"
                ),
                width=24,
            )
        )
        .with_row(dash.Row("RDMA"))
        .with_panel(
            graph(
                "RDMA port traffic",
                "Bytes per second through each RDMA port.",
                "Bps",
                Query(
                    f"rate(hyperagent_rdma_port_data_transmitted_bytes_total{{{n}}}[{RATE}])",
                    f"{port} tx",
                ),
                Query(
                    f"rate(hyperagent_rdma_port_data_received_bytes_total{{{n}}}[{RATE}])",
                    f"{port} rx",
                ),
            )
        )
        .with_panel(
            graph(
                "RDMA port rate",
                "Link rate each port negotiated (a drop means fewer lanes or a lower speed).",
                "Bps",
                Query(f"hyperagent_rdma_port_rate_bytes_per_second{{{n}}}", port),
            )
        )
        .with_panel(
            listing(
                "RDMA ports",
                "Link layer, logical and physical state and netdev of each port.",
                Query(f"hyperagent_rdma_port_info{{{n}}}"),
            )
        )
        .with_panel(
            listing(
                "RoCE netdev MTU",
                "MTU of the netdevs behind RDMA ports (one value per cluster, or an alert).",
                Query(f"hyperagent_rdma_netdev_mtu_bytes{{{n}}}"),
            )
        )
        .with_panel(
            graph(
                "Completion errors",
                "Work completions with error per second, by side.",
                "short",
                Query(
                    "sum by (instance, device, port, side) "
                    f"(rate(hyperagent_rdma_port_cqe_errors_total{{{n}}}[{RATE}]))",
                    f"{port} {{{{side}}}}",
                ),
            )
        )
        .with_panel(
            graph(
                "Receive drops and ack timeouts",
                "Packets dropped for lack of a posted receive buffer, and ack timeouts.",
                "pps",
                Query(
                    f"rate(hyperagent_rdma_port_out_of_buffer_drops_total{{{n}}}[{RATE}])",
                    f"{port} out of buffer",
                ),
                Query(
                    f"rate(hyperagent_rdma_port_local_ack_timeouts_total{{{n}}}[{RATE}])",
                    f"{port} ack timeouts",
                ),
            )
        )
        .with_panel(
            graph(
                "PFC pause frames",
                "Pause frames per second by netdev, direction and priority.",
                "pps",
                Query(
                    "sum by (instance, netdev, direction, priority) "
                    f"(rate(hyperagent_rdma_pfc_pause_frames_total{{{n}}}[{RATE}]))",
                    "{{instance}} {{netdev}} {{direction}} prio {{priority}}",
                ),
            )
        )
        .with_panel(
            graph(
                "Symbol errors",
                "Minor link errors per second on each port (a dirty or failing cable or optic).",
                "cps",
                Query(
                    f"rate(hyperagent_rdma_port_symbol_errors_total{{{n}}}[{RATE}])",
                    port,
                ),
                width=6,
            )
        )
        .with_panel(
            graph(
                "Link-down events",
                "Times each port's link went down, per interval.",
                "short",
                Query(
                    f"increase(hyperagent_rdma_port_link_downed_total{{{n}}}[{RATE}])",
                    port,
                ),
                width=6,
            )
        )
        .with_panel(
            graph(
                "Queue pairs and completion queues",
                "Queue pairs by state and completion queues per device.",
                "short",
                Query(
                    f"sum by (instance, device, state) (hyperagent_rdma_qps{{{n}}})",
                    "{{instance}} {{device}} QPs {{state}}",
                ),
                Query(f"hyperagent_rdma_cqs{{{n}}}", "{{instance}} {{device}} CQs"),
            )
        )
        .with_panel(
            timeline(
                "RDMA commands",
                "Whether each command the rdma source runs (rdma resource show, ethtool -S) "
                "worked in its latest read; failing ones lose their readings (alert after 10 "
                "minutes, the agent's log says why).",
                Query(f"hyperagent_rdma_command_up{{{n}}}", "{{instance}} {{command}}"),
                _value_text({"1": ("ok", GREEN), "0": ("failing", RED)}),
            )
        )
        .with_row(dash.Row("BMC"))
        .with_panel(
            graph(
                "Node input power (BMC)",
                "The BMC's node power (DCMI, else its largest power sensor) and every power "
                "sensor.",
                "watt",
                Query(f"node:hyperagent_bmc_power_watts:max{{{n}}}", "{{instance}} node"),
                Query(f"hyperagent_bmc_power_watts{{{n}}}", "{{instance}} {{sensor}}"),
            )
        )
        .with_panel(
            graph(
                "BMC temperatures",
                "Temperature sensors of the BMC (inlet, exhaust, CPUs).",
                "celsius",
                Query(
                    f"hyperagent_bmc_temperature_celsius{{{n}}}",
                    "{{instance}} {{sensor}} ({{entity}})",
                ),
            )
        )
        .with_panel(
            graph(
                "Fans",
                "Fan speeds the BMC reports.",
                "rotrpm",
                Query(f"hyperagent_bmc_fan_speed_rpm{{{n}}}", "{{instance}} {{sensor}}"),
            )
        )
        .with_panel(
            single(
                "BMC sensors not ok",
                "Readable BMC sensors whose state is non-critical or worse.",
                "none",
                Query(f"sum by (instance) (hyperagent_bmc_sensor_state{{{n}}} > bool 0)"),
                _thresholds((None, GREEN), (1, RED)),
                width=12,
            )
        )
        .with_row(dash.Row("PDU"))
        .with_panel(
            graph(
                "Node power: GPUs, BMC and PDU",
                "The same node seen by NVML, its BMC and its PDU outlets.",
                "watt",
                Query(f"node:hyperagent_gpu_power_watts:sum{{{n}}}", "{{instance}} GPUs"),
                Query(f"node:hyperagent_bmc_power_watts:max{{{n}}}", "{{instance}} BMC"),
                Query(f"node:hyperagent_pdu_node_power_watts:sum{{{n}}}", "{{instance}} PDU"),
            )
        )
        .with_panel(
            graph(
                "PDU inlet power",
                "Active power through each inlet of the PDUs the agent polls.",
                "watt",
                Query(f"hyperagent_pdu_inlet_power_watts{{{n}}}", "{{pdu}} inlet {{inlet}}"),
            )
        )
        .with_panel(
            graph(
                "PDU outlet power",
                "Active power of every outlet of the PDUs the agent polls.",
                "watt",
                Query(f"hyperagent_pdu_outlet_power_watts{{{n}}}", "{{pdu}} outlet {{outlet}}"),
                width=24,
            )
        )
        .with_row(dash.Row("Host"))
        .with_panel(
            graph(
                "Host CPU and memory",
                "CPU busy fraction and memory used fraction of the host.",
                "percentunit",
                Query(f"hyperagent_host_cpu_utilization_ratio{{{n}}}", "{{instance}} CPU"),
                Query(
                    f"1 - hyperagent_host_memory_available_bytes{{{n}}}"
                    f" / hyperagent_host_memory_total_bytes{{{n}}}",
                    "{{instance}} memory",
                ),
                ratio=True,
            )
        )
        .with_panel(
            graph(
                "Swap used",
                "Swap space in use.",
                "bytes",
                Query(f"hyperagent_host_swap_used_bytes{{{n}}}", "{{instance}}"),
                width=8,
            )
        )
        .with_panel(
            single(
                "Kernel NUMA balancing",
                "kernel.numa_balancing: off is what a GPU training node wants.",
                "none",
                Query(f"max(hyperagent_host_numa_balancing_mode{{{n}}})"),
                _thresholds((None, GREEN), (1, RED)),
                _value_text(
                    {"0": ("off", GREEN), "1": ("automatic", RED), "2": ("tiering", ORANGE)}
                ),
            )
        )
        .with_panel(
            graph(
                "Memory stall time (PSI)",
                "Share of time some task (some) or every non-idle task (full) of the host "
                "waited for memory (/proc/pressure/memory); the alert reads some above 10%.",
                "percentunit",
                Query(
                    f"rate(hyperagent_host_memory_pressure_stall_seconds_total{{{n}}}[{RATE}])",
                    "{{instance}} {{kind}}",
                ),
                ratio=True,
            )
        )
        .with_panel(
            graph(
                "Swap activity",
                "Pages swapped in and out per second (/proc/vmstat): swap-in on a training node "
                "stalls its data loaders.",
                "suffix: pages/s",
                Query(
                    f"rate(hyperagent_host_swap_pages_total{{{n}}}[{RATE}])",
                    "{{instance}} {{direction}}",
                ),
            )
        )
        .with_row(dash.Row("Agent"))
        .with_panel(
            graph(
                "Sources up",
                "1 when the source's last read succeeded (absent hardware is 0 without errors).",
                "none",
                Query(f"hyperagent_source_up{{{n}}}", "{{instance}} {{source}} {{target}}"),
                width=8,
            )
        )
        .with_panel(
            graph(
                "Source read time",
                "Duration of each source's last read.",
                "s",
                Query(
                    f"hyperagent_source_duration_seconds{{{n}}}",
                    "{{instance}} {{source}} {{target}}",
                ),
                width=8,
            )
        )
        .with_panel(
            graph(
                "Source errors",
                "Failed reads of each source per interval.",
                "short",
                Query(
                    "sum by (instance, source) "
                    f"(increase(hyperagent_source_errors_total{{{n}}}[{RATE}]))",
                    "{{instance}} {{source}}",
                ),
                width=8,
            )
        )
        .with_panel(
            timeline(
                "MQTT connection",
                "Whether the agent is connected to the MQTT broker.",
                Query(f"hyperagent_mqtt_connected{{{n}}}", "{{instance}}"),
                _value_text({"1": ("connected", GREEN), "0": ("disconnected", RED)}),
            )
        )
        .with_panel(
            graph(
                "MQTT queued messages",
                "Outgoing MQTT messages waiting: telemetry and spooled acks and reports.",
                "short",
                Query(f"hyperagent_mqtt_queued_messages{{{n}}}", "{{instance}}"),
            )
        )
    )


def job_dashboard() -> dash.Dashboard:
    j = JOB
    job = query_variable(
        "job_id",
        "Job",
        f'label_values({{__name__=~"{JOB_LISTS}", {CLUSTER}}}, job_id)',
    )
    per_gpu = "on (cluster, instance, gpu, uuid) group_right ()"
    return (
        new_dashboard(
            "hyperagent-job",
            "hyperagent / Job",
            "One job: the GPUs it holds, their utilisation, memory, power and energy (every job, "
            "also a batch job that never reports), and for a tuned job the coordinator's trials, "
            "scores and settings and how the job runs with them.",
        )
        .with_variable(datasource_variable())
        .with_variable(cluster_variable())
        .with_variable(job)
        .with_row(dash.Row("GPUs, power and energy"))
        .with_panel(
            single(
                "GPUs held",
                "GPUs the job holds now, all its nodes.",
                "none",
                Query(f"job_id:hyperagent_job_gpus:sum{{{j}}}"),
            )
        )
        .with_panel(
            single(
                "GPU utilisation",
                "Mean utilisation of the job's GPUs now (alert below 10% for an hour).",
                "percentunit",
                Query(f"job_id:hyperagent_job_gpu_utilization_ratio:avg{{{j}}}"),
                _thresholds((None, RED), (0.1, YELLOW), (0.5, GREEN)),
            )
        )
        .with_panel(
            single(
                "GPU memory used",
                "Memory used on the job's GPUs now, all its nodes.",
                "bytes",
                Query(f"sum(hyperagent_job_gpu_memory_used_bytes{{{j}}})"),
            )
        )
        .with_panel(
            single(
                "GPU power",
                "Power of the job's GPUs now, all its nodes.",
                "watt",
                Query(f"job_id:hyperagent_gpu_power_watts:sum{{{j}}}"),
            )
        )
        .with_panel(
            single(
                "GPU energy",
                "Energy of the job's GPUs since it started holding them (kWh).",
                "kwatth",
                Query(f"sum(hyperagent_job_gpu_energy_joules_total{{{j}}}) / 3.6e6"),
            )
        )
        .with_panel(
            single(
                "GPU-hours",
                "GPUs held times hours held over the time range (counted every 15 s).",
                "none",
                Query(
                    f"sum(sum_over_time(job_id:hyperagent_job_gpus:sum{{{j}}}[$__range:15s]))"
                    " * 15 / 3600"
                ),
            )
        )
        .with_panel(
            listing(
                "Who and where",
                "The job's user, Slurm job and step, and the GPUs it holds on each node.",
                Query(
                    "max by (job_id, user, slurm_job, slurm_step, instance)"
                    f" (hyperagent_job_gpus{{{j}}})"
                ),
                width=24,
            )
        )
        .with_panel(
            graph(
                "GPUs held over time",
                "GPUs the job holds on each node.",
                "none",
                Query(f"sum by (instance) (hyperagent_job_gpus{{{j}}})", "{{instance}}"),
            )
        )
        .with_panel(
            graph(
                "Utilisation of the job's GPUs",
                "Mean GPU utilisation of the job (all nodes, weighted by GPUs) and per node, and "
                "the SM activity per node where the GPUs measure it.",
                "percentunit",
                Query(f"job_id:hyperagent_job_gpu_utilization_ratio:avg{{{j}}}", "job"),
                Query(f"hyperagent_job_gpu_utilization_ratio{{{j}}}", "{{instance}}"),
                Query(f"hyperagent_job_gpu_sm_active_ratio{{{j}}}", "{{instance}} SM active"),
                ratio=True,
            )
        )
        .with_panel(
            graph(
                "Utilisation per GPU",
                "Utilisation of each GPU while the job holds it.",
                "percentunit",
                Query(
                    f"hyperagent_gpu_utilization_ratio{{{CLUSTER}}}"
                    f" * {per_gpu} hyperagent_gpu_job_info{{{j}}}",
                    "{{instance}} GPU {{gpu}}",
                ),
                ratio=True,
            )
        )
        .with_panel(
            graph(
                "GPU memory used by the job",
                "Memory used on the job's GPUs, per node, and on each of its GPUs.",
                "bytes",
                Query(
                    f"sum by (instance) (hyperagent_job_gpu_memory_used_bytes{{{j}}})",
                    "{{instance}}",
                ),
                Query(
                    f"hyperagent_gpu_memory_used_bytes{{{CLUSTER}}}"
                    f" * {per_gpu} hyperagent_gpu_job_info{{{j}}}",
                    "{{instance}} GPU {{gpu}}",
                ),
            )
        )
        .with_panel(
            graph(
                "Power of the job",
                "Power of the job's GPUs per node, and the node's BMC or PDU power where the "
                "job holds the whole node.",
                "watt",
                Query(
                    f"sum by (instance) (hyperagent_job_gpu_power_watts{{{j}}})",
                    "{{instance}} GPUs",
                ),
                Query(f"hyperagent_job_node_power_watts{{{j}}}", "{{instance}} node"),
            )
        )
        .with_panel(
            graph(
                "Energy of the job",
                "Energy of the job's GPUs since it started holding them, per node (kWh).",
                "kwatth",
                Query(
                    f"sum by (instance) (hyperagent_job_gpu_energy_joules_total{{{j}}}) / 3.6e6",
                    "{{instance}}",
                ),
            )
        )
        .with_row(dash.Row("Tuning"))
        .with_panel(
            single(
                "Gain over baseline",
                "Best score over the score of the starting settings, minus one.",
                "percentunit",
                Query(f"job_id:hyperagent_tuner_gain:ratio{{{j}}}"),
                _thresholds((None, RED), (0, GREEN)),
            )
        )
        .with_panel(
            single(
                "Trials",
                "Finished trials, whatever their outcome.",
                "none",
                Query(f"sum(hyperagent_tuner_trials_total{{{j}}})"),
            )
        )
        .with_panel(
            single(
                "Tuning",
                "Whether the tuning finished and its best settings went out.",
                "none",
                Query(f"max(hyperagent_tuner_done{{{j}}})"),
                mappings=_value_text({"0": ("running", BLUE), "1": ("done", GREEN)}),
            )
        )
        .with_panel(
            single(
                "Settings version",
                "Version of the settings last published for the job.",
                "none",
                Query(f"max(hyperagent_tuner_settings_version{{{j}}})"),
            )
        )
        .with_panel(
            single(
                "Running trial for",
                "Time since the running trial's settings went out (alert after 15 minutes).",
                "s",
                Query(f"time() - max(hyperagent_tuner_trial_started_timestamp_seconds{{{j}}})"),
                _thresholds((None, GREEN), (600, YELLOW), (900, RED)),
            )
        )
        .with_panel(
            single(
                "Throughput",
                "Samples per second of the job, all its nodes.",
                "suffix: samples/s",
                Query(f"job_id:hyperagent_job_samples:rate5m{{{j}}}"),
            )
        )
        .with_panel(
            graph(
                "Scores",
                "Score of the starting settings, the best so far and the last trial "
                "(throughput, or samples per joule).",
                "none",
                Query(f"hyperagent_tuner_baseline_score{{{j}}}", "baseline ({{objective}})"),
                Query(f"hyperagent_tuner_best_score{{{j}}}", "best"),
                Query(f"hyperagent_tuner_last_score{{{j}}}", "last trial"),
            )
        )
        .with_panel(
            graph(
                "Gain over baseline over time",
                "Best score over the baseline, minus one.",
                "percentunit",
                Query(f"job_id:hyperagent_tuner_gain:ratio{{{j}}}", "{{job_id}}"),
            )
        )
        .with_panel(
            graph(
                "Trials by outcome",
                "Finished trials: ok, aborted early, failed (rolled back).",
                "none",
                Query(f"sum by (status) (hyperagent_tuner_trials_total{{{j}}})", "{{status}}"),
            )
        )
        .with_panel(
            graph(
                "Settings version: published and applied",
                "The version the coordinator published and the one each node's job applied.",
                "none",
                Query(f"max(hyperagent_tuner_settings_version{{{j}}})", "published"),
                Query(f"hyperagent_job_settings_version{{{j}}}", "{{instance}}"),
            )
        )
        .with_row(dash.Row("Settings over time"))
        .with_panel(
            graph(
                "DDP bucket size",
                "Gradient bucket size of the settings last published.",
                "mbytes",
                Query(f'hyperagent_tuner_setting{{{j}, knob="bucket_mb"}}', "bucket"),
                width=8,
            )
        )
        .with_panel(
            graph(
                "Gradient chunk size",
                "Chunk size of the settings last published.",
                "kbytes",
                Query(f'hyperagent_tuner_setting{{{j}, knob="chunk_kb"}}', "chunk"),
                width=8,
            )
        )
        .with_panel(
            graph(
                "GPU power cap",
                "Power cap of the settings last published, and the limit each training node's "
                "GPUs enforce.",
                "watt",
                Query(f'hyperagent_tuner_setting{{{j}, knob="power_cap_w"}}', "published"),
                Query(
                    f"avg by (cluster, instance) (hyperagent_gpu_power_limit_watts{{{CLUSTER}}})"
                    " and on (cluster, instance)"
                    f" (node_job_id:hyperagent_job_steps:rate5m{{{j}}} > 0)",
                    "{{instance}}",
                ),
                width=8,
            )
        )
        .with_panel(
            timeline(
                "AllReduce algorithm",
                "AllReduce algorithm of the settings last published.",
                Query(f"hyperagent_tuner_allreduce_info{{{j}}}", "{{algorithm}}"),
                width=24,
            )
        )
        .with_row(dash.Row("The job"))
        .with_panel(
            graph(
                "Throughput by node",
                "Samples per second of the job and of each node.",
                "suffix: samples/s",
                Query(f"job_id:hyperagent_job_samples:rate5m{{{j}}}", "job"),
                Query(f"node_job_id:hyperagent_job_samples:rate5m{{{j}}}", "{{instance}}"),
            )
        )
        .with_panel(
            graph(
                "Energy per sample",
                "GPU energy per sample: of the job's own GPUs where the agents attribute them, "
                "else of every GPU of its nodes.",
                "joule",
                Query(f"job_id:hyperagent_energy_per_sample_joules:ratio_rate5m{{{j}}}", "job"),
            )
        )
        .with_panel(
            graph(
                "GPU power of the job",
                "Board power of the GPUs the job runs on, all nodes and per node.",
                "watt",
                Query(f"job_id:hyperagent_gpu_power_watts:sum{{{j}}}", "job"),
                Query(f"node_job_id:hyperagent_gpu_power_watts:sum{{{j}}}", "{{instance}}"),
            )
        )
        .with_panel(
            listing(
                "GPUs of the job",
                "The GPUs the job's ranks run on, by node.",
                Query(f"hyperagent_gpu_job_info{{{j}}}"),
            )
        )
        .with_panel(
            graph(
                "Quantum utilisation and CCR",
                "QU over the job's GPUs and its communication/compute ratio from step reports.",
                "none",
                Query(f"job_id:hyperagent_qu_ratio:avg{{{j}}}", "QU"),
                Query(f"job_id:hyperagent_ccr_ratio:rate5m{{{j}}}", "CCR"),
            )
        )
        .with_panel(
            graph(
                "Step time",
                "Mean wall time of a step on each node.",
                "s",
                Query(
                    f"rate(hyperagent_job_step_seconds_total{{{j}}}[{RATE}])"
                    f" / rate(hyperagent_job_steps_total{{{j}}}[{RATE}])",
                    "{{instance}}",
                ),
            )
        )
        .with_panel(
            graph(
                "Loss",
                "Loss of the last reported step on each node.",
                "none",
                Query(f"hyperagent_job_loss{{{j}}}", "{{instance}}"),
            )
        )
        .with_panel(
            graph(
                "Non-finite losses",
                "Steps that reported a NaN or infinite loss, per interval.",
                "short",
                Query(
                    f"increase(hyperagent_job_nonfinite_loss_total{{{j}}}[{RATE}])",
                    "{{instance}}",
                ),
            )
        )
    )


DASHBOARDS = {
    "hyperagent-cluster.json": cluster_dashboard,
    "hyperagent-node.json": node_dashboard,
    "hyperagent-job.json": job_dashboard,
}


def render(builder: dash.Dashboard) -> str:
    """The dashboard as the JSON Grafana provisions, panels numbered in order."""
    built = builder.build()
    for number, panel in enumerate(built.panels or [], start=1):
        panel.id_val = number
    return json.dumps(built, cls=JSONEncoder, indent=2, sort_keys=True) + "\n"


def rendered() -> dict[str, str]:
    """File name -> JSON text of every dashboard."""
    return {name: render(make()) for name, make in DASHBOARDS.items()}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--check", action="store_true", help="compare instead of writing")
    args = parser.parse_args(argv)
    stale = []
    for name, text in rendered().items():
        path = OUT / name
        if args.check:
            if not path.exists() or path.read_text() != text:
                stale.append(name)
        else:
            path.write_text(text)
    if stale:
        print(f"out of date (run grafana/generate.py): {', '.join(stale)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
