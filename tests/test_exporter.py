"""The NVML source over replayed captures, through indicators, into /metrics (golden files)."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from prometheus_client import generate_latest

from hyperagent.capture.fake_nvml import FakeNvml
from hyperagent.config import DEFAULT_QUANTUM_COEFFICIENTS
from hyperagent.exporter import MetricsServer, SnapshotCollector
from hyperagent.indicators import derive
from hyperagent.readings import Snapshot
from hyperagent.sources.nvml import NvmlSource

from conftest import ManualClock

GOLDEN = Path(__file__).parent / "golden"
CAPTURES = [
    "gtx-8card.xml",
    "gtx-1card.xml",
    "a100-sxm4-v12.xml",
    "a10g.xml",
    "tesla-t4.xml",
    "linux-x86_64__nvidia-h100-80gb-hbm3__590.48.01.txt",
    "linux-x86_64__nvidia-l40s__595.80.txt",
]


async def exposition(capture: Path) -> bytes:
    clock = ManualClock()
    source = NvmlSource(FakeNvml.from_capture(capture, clock=clock))
    await source.start()
    clock.now = 10.0  # ten seconds at the recorded draw
    readings = await source.read()
    await source.close()
    snapshot = Snapshot(0.0, "n", tuple(readings))
    server = MetricsServer("127.0.0.1:0")
    server.collector.update([*readings, *derive(snapshot, None, DEFAULT_QUANTUM_COEFFICIENTS)])
    return generate_latest(server.registry)


@pytest.mark.parametrize("capture", CAPTURES)
async def test_metrics_match_golden(capture: str, nvidia_smi_dir: Path) -> None:
    text = await exposition(nvidia_smi_dir / capture)
    golden = GOLDEN / f"{Path(capture).stem}.prom"
    if os.environ.get("HYPERAGENT_UPDATE_GOLDEN"):
        golden.parent.mkdir(exist_ok=True)
        golden.write_bytes(text)
    assert text.decode() == golden.read_text(), "rerun with HYPERAGENT_UPDATE_GOLDEN=1 to accept"


async def test_v100s_values(nvidia_smi_dir: Path) -> None:
    server = MetricsServer("127.0.0.1:0")
    clock = ManualClock()
    source = NvmlSource(FakeNvml.from_capture(nvidia_smi_dir / "gtx-8card.xml", clock=clock))
    await source.start()
    clock.now = 10.0
    readings = await source.read()
    server.collector.update(
        [*readings, *derive(Snapshot(0, "n", tuple(readings)), None, DEFAULT_QUANTUM_COEFFICIENTS)]
    )
    get = server.registry.get_sample_value
    uuid = "GPU-76098dc1-d3bc-9a1b-7ea6-f7b48837829e"
    labels = {"gpu": "0", "uuid": uuid}
    assert get("hyperagent_gpu_utilization_ratio", labels) == pytest.approx(0.97)
    assert get("hyperagent_gpu_memory_used_bytes", labels) == 31689 * 2**20
    assert get("hyperagent_gpu_power_watts", labels) == pytest.approx(232.8)
    assert get("hyperagent_gpu_power_limit_watts", labels) == 250
    assert get("hyperagent_gpu_power_limit_min_watts", labels) == 100
    # the fake integrates the recorded draw: 232.8 W for 10 s
    assert get("hyperagent_gpu_energy_joules_total", labels) == pytest.approx(2328, abs=0.01)
    assert (
        get(
            "hyperagent_gpu_info",
            {**labels, "model": "Tesla V100S-PCIE-32GB", "driver": "460.73.01"},
        )
        == 1
    )
    assert 0 < get("hyperagent_qu_ratio") < 1
    assert get("hyperagent_memory_pressure_ratio", {"method": "estimated"}) > 0.9


def test_collector_swaps_atomically_and_types_stay() -> None:
    from hyperagent.readings import Kind, Reading

    collector = SnapshotCollector()
    collector.update([Reading("hyperagent_source_errors_total", 3, {"source": "x"}, Kind.COUNTER)])
    families = list(collector.collect())
    assert families[0].type == "counter" and families[0].name == "hyperagent_source_errors"
    collector.update([])
    assert list(collector.collect()) == []


@pytest.mark.parametrize("capture", ["gtx-8card.xml", "a100-sxm4-v12.xml"])
async def test_promtool_check_metrics_is_clean(capture: str, nvidia_smi_dir: Path) -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.fail("promtool is not installed: apt-get install -y prometheus (bash .ci/run does)")
    text = await exposition(nvidia_smi_dir / capture)
    result = subprocess.run(
        [promtool, "check", "metrics"], input=text, capture_output=True, timeout=30
    )
    assert result.returncode == 0 and not result.stdout and not result.stderr, (
        result.stdout + result.stderr
    ).decode()


@pytest.mark.parametrize(
    "accept",
    [
        "application/openmetrics-text;version=1.0.0,application/openmetrics-text;"
        "version=0.0.1;q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1",  # Prometheus 3
        "application/openmetrics-text",
        "text/plain;version=0.0.4",
        "",
    ],
)
def test_http_exposition_is_byte_for_byte_what_prometheus_client_encodes(accept: str) -> None:
    """/metrics is rendered by hyperagent (once per cycle); it must equal prometheus_client's
    encoder for the same Accept header, escapes, info metrics and mixed labels included."""
    import urllib.request

    from prometheus_client.exposition import choose_encoder

    from hyperagent.readings import Kind, Reading

    readings = [
        Reading("hyperagent_gpu_power_watts", 251.5, {"gpu": "0", "uuid": "GPU-a"}),
        Reading("hyperagent_gpu_power_watts", float("nan"), {"gpu": "1", "uuid": "GPU-b"}),
        Reading("hyperagent_gpu_energy_joules_total", 1e12, {"gpu": "0"}, Kind.COUNTER),
        Reading("hyperagent_gpu_info", 1.0, {"gpu": "0", "name": 'Tesla "V100"\\x\n'}, Kind.INFO),
        Reading("hyperagent_source_up", 1.0, {"source": "nvml", "target": "local"}),
        Reading("hyperagent_source_up", 0.0, {"source": "pdu"}),  # one label short
        Reading("hyperagent_qu_ratio", float("inf")),
        Reading("hyperagent_rdma_unreadable_files", 3),
    ]
    server = MetricsServer("127.0.0.1:0")
    server.collector.update(readings)
    server.start()
    try:
        request = urllib.request.Request(
            f"http://127.0.0.1:{server.port}/metrics", headers={"Accept": accept}
        )
        with urllib.request.urlopen(request, timeout=10) as response:
            body, content_type = response.read(), response.headers["Content-Type"]
    finally:
        server.stop()
    encoder, expected_type = choose_encoder(accept)
    assert content_type == expected_type
    assert server.collector.exposition(expected_type) == body  # hyperagent rendered it
    assert body == encoder(server.registry)
    assert b'name="Tesla \\"V100\\"\\\\x\\n"' in body


REPLAYS = sorted(p for p in (Path(__file__).parent.parent / "fixtures" / "replay").iterdir()
                 if p.is_dir())


@pytest.mark.parametrize("directory", REPLAYS, ids=lambda p: p.name)
async def test_the_openmetrics_body_is_prometheus_clients_byte_for_byte(directory: Path) -> None:
    """What a Prometheus scrape gets (OpenMetrics 1.0.0, underscore escaping) from every
    replayed capture, twice (the second render reuses the label parts), over HTTP too."""
    import urllib.request

    from prometheus_client.openmetrics.exposition import generate_latest as openmetrics_latest

    from hyperagent.capture.directory import capture_sources
    from hyperagent.config import build_config
    from hyperagent.exporter import OpenMetricsText
    from hyperagent.sources.runner import SourceRunner

    clock = ManualClock()
    sources, _ = capture_sources(directory, build_config({}), clock)
    runner = SourceRunner(sources, timeout_s=10)
    await runner.start()
    server = MetricsServer("127.0.0.1:0")
    render = OpenMetricsText()
    try:
        for _ in range(2):
            clock.now += 10.0
            readings = await runner.read_all()
            snapshot = Snapshot(clock.now, "n", tuple(readings))
            server.collector.update([*readings, *derive(snapshot, None, {})])
            assert render(server.collector) == openmetrics_latest(server.registry)
        server.start()
        accept = "application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5"
        request = urllib.request.Request(
            f"http://127.0.0.1:{server.port}/metrics", headers={"Accept": accept}
        )

        def scrape() -> bytes:
            with urllib.request.urlopen(request, timeout=10) as response:
                return bytes(response.read())

        assert await asyncio.to_thread(scrape) == openmetrics_latest(server.registry)
    finally:
        server.stop()
        await runner.close()


def test_kept_family_text_follows_every_changed_reading() -> None:
    """Between renders a family's text is reused only while it is the very same readings: a
    new reading (its value changed, a label dict rebuilt with the same labels, one reading
    fewer, a sample gone to another name) renders afresh, as prometheus_client would."""
    from prometheus_client.openmetrics.exposition import generate_latest as openmetrics_latest

    from hyperagent.exporter import OpenMetricsText
    from hyperagent.readings import Kind, Reading

    def gpu(i: int) -> dict[str, str]:
        return {"gpu": str(i), "uuid": f"GPU-{i}"}

    power = [Reading("hyperagent_gpu_power_watts", 100.0 + i, gpu(i)) for i in range(4)]
    errors = [Reading("hyperagent_errors_total", 0, gpu(i), kind=Kind.COUNTER) for i in range(4)]
    first = [*power, *errors]
    changed_value = [*power[:3], Reading("hyperagent_gpu_power_watts", -0.0, gpu(3)), *errors]
    relabelled = [*power, *(Reading(r.name, r.value, dict(r.labels), kind=r.kind) for r in errors)]
    fewer = [*power[:2], *errors]
    renamed = [*power, *errors[:3], Reading("hyperagent_other_total", 0, gpu(3), kind=Kind.COUNTER)]
    moved = [*power, *errors[:3], Reading(errors[3].name, 0, {"gpu": "9"}, kind=Kind.COUNTER)]
    extra_label = [*power[:3], Reading(power[3].name, 103.0, {**gpu(3), "mig": "1g"}), *errors]
    reordered = [*power[::-1], *errors]

    def valued(*values: float) -> list[Reading]:  # new readings, the same labels
        pairs = zip(power, values, strict=True)
        return [Reading(r.name, v, r.labels, kind=r.kind) for r, v in pairs]

    render = OpenMetricsText()
    collector = SnapshotCollector()
    bodies = []
    variants = (first, first, changed_value, relabelled, fewer, renamed, first, moved, extra_label)
    again = (
        valued(0.0, 1.0, 2.0, 3.0),
        valued(0.0, 1.0, 2.0, 3.0),  # the same values in new readings
        valued(-0.0, 1.0, 2.0, 3.0),  # equal, but written otherwise
        valued(-0.0, 1, True, 3.0),  # an int and a bool: their doubles, so the same text
        valued(-0.0, 1.0, 2.0, float("nan")),
        valued(-0.0, 1.0, 2.0, float("nan")),
    )
    for readings in (*variants, reordered, first, *again):
        collector.update(readings)
        body = render(collector)
        assert body == openmetrics_latest(collector)
        bodies.append(body)
    assert bodies[0] == bodies[1] == bodies[3] == bodies[6] == bodies[10] and b"-0.0" in bodies[2]
    assert len({bodies[0], bodies[2], bodies[4], bodies[5], bodies[7], bodies[8], bodies[9]}) == 7
    assert bodies[11] == bodies[12] != bodies[13] and b"-0.0" in bodies[13]
    assert bodies[14] != bodies[13] and bodies[15] == bodies[16] and b"NaN" in bodies[16]
