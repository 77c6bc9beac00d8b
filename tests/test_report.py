from __future__ import annotations

import base64
import re
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import matplotlib.image
import pytest

from hyperagent import durable
from hyperagent.report import ReportError, describe_settings, read_journal, render_report
from hyperagent.tuner.journal import Journal

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
START = {"bucket_mb": 32, "chunk_kb": 4096, "power_cap_w": 250, "allreduce": "ring"}
TRIALS: list[tuple[dict[str, Any], float | None, str]] = [
    (START, 800.0, "ok"),
    ({**START, "chunk_kb": 256}, 840.0, "ok"),
    ({**START, "bucket_mb": 2, "allreduce": "tree"}, 300.0, "aborted"),
    ({**START, "bucket_mb": 128}, 880.0, "ok"),
    ({**START, "power_cap_w": 150}, None, "no_ack"),
    ({**START, "bucket_mb": 128, "chunk_kb": 8192}, 910.0, "ok"),
    ({**START, "bucket_mb": 64, "chunk_kb": 8192}, None, "nonfinite_loss"),
    ({**START, "bucket_mb": 128, "chunk_kb": 16384}, 900.0, "ok"),
]


def write_journal(
    path: Path,
    trials: Sequence[tuple[dict[str, Any], float | None, str]] = TRIALS,
    final: dict[str, Any] | None = None,
    in_flight: dict[str, Any] | None = None,
) -> Journal:
    journal = Journal(path)
    journal.append({"type": "start", "fingerprint": "nccl/4n/1.3B/V100"})
    for index, (settings, score, status) in enumerate(trials):
        version = index + 1
        journal.append(
            {"type": "published", "version": version, "trial": index, "settings": settings}
        )
        journal.append(
            {
                "type": "trial",
                "index": index,
                "version": version,
                "settings": settings,
                "score": score,
                "status": status,
                "reports": {"node-a": {"throughput": score, "samples": 640}},
                "seconds": 9.5 + index,
            }
        )
    if in_flight is not None:
        journal.append(
            {
                "type": "published",
                "version": len(trials) + 1,
                "trial": len(trials),
                "settings": in_flight,
            }
        )
    if final is not None:
        journal.append({"type": "published", "version": 99, "trial": None, **final})
        journal.append({"type": "final", "version": 99, **final})
    durable.wait()  # on disk, for the tests that read or edit the file themselves
    return journal


def finished(tmp_path: Path) -> Path:
    path = tmp_path / "job-a.jsonl"
    best = {**START, "bucket_mb": 128, "chunk_kb": 8192}
    write_journal(path, final={"settings": best, "score": 905.0, "baseline": 800.0})
    return path


def decoded_png_shape(data: bytes, tmp_path: Path) -> tuple[int, ...]:
    assert data.startswith(PNG_MAGIC)
    copy = tmp_path / "decoded.png"
    copy.write_bytes(data)
    return tuple(matplotlib.image.imread(copy).shape)


def test_png_of_a_finished_tuning(tmp_path: Path) -> None:
    out = tmp_path / "report.png"
    summary = render_report(finished(tmp_path), out)
    height, width, channels = decoded_png_shape(out.read_bytes(), tmp_path)
    assert width == 1000 and height > 600 and channels in (3, 4)
    assert summary.job == "job-a"
    assert summary.finished and summary.in_flight is None
    assert summary.trials == 8
    assert summary.statuses == {"aborted": 1, "no_ack": 1, "nonfinite_loss": 1, "ok": 5}
    assert summary.baseline == 800.0
    assert summary.best == 905.0
    assert summary.chosen == {**START, "bucket_mb": 128, "chunk_kb": 8192}
    assert summary.gain == pytest.approx(905.0 / 800.0 - 1)
    assert summary.knobs == ("bucket_mb", "chunk_kb", "power_cap_w", "allreduce")
    assert summary.journal == tmp_path / "job-a.jsonl" and summary.out == out


def test_html_embeds_the_png_and_tables_every_trial(tmp_path: Path) -> None:
    out = tmp_path / "report.html"
    summary = render_report(finished(tmp_path), out)
    page = out.read_text("utf-8")
    assert page.startswith("<!DOCTYPE html>")
    match = re.search(r'src="data:image/png;base64,([A-Za-z0-9+/=]+)"', page)
    assert match is not None
    decoded_png_shape(base64.b64decode(match.group(1)), tmp_path)
    rows = re.findall(r'<tr class="(\w+)">(.*?)</tr>', page)
    assert [r[0] for r in rows] == [
        "ok",
        "ok",
        "aborted",
        "ok",
        "failed",
        "ok",
        "failed",
        "ok",
    ]
    assert "<td>nonfinite_loss</td>" in rows[6][1]
    assert "<td>910</td><td>128</td><td>8192</td><td>250</td><td>ring</td>" in rows[5][1]
    assert "gain +13.1% over the starting settings, not confirmed" in page
    assert "chosen: bucket 128 MiB, chunk 8192 KiB, cap 250 W, ring" in page
    assert "http" not in page.replace("<!DOCTYPE html>", "")  # nothing fetched from elsewhere
    assert summary.trials == len(rows)


def test_the_report_says_what_the_tuning_cost_and_when_it_pays_back(tmp_path: Path) -> None:
    out = tmp_path / "report.html"
    summary = render_report(finished(tmp_path), out)
    cost = summary.cost
    assert cost is not None and cost.objective == "throughput"
    # 104 s at the start's 800/s: 83,200 samples; the trials trained 82,115 (the two without a
    # measurement counted at the start's rate)
    assert cost.seconds == pytest.approx(104.0) and cost.unmeasured_s == pytest.approx(29.0)
    assert cost.lost == pytest.approx(1085.0)
    assert cost.break_even_s == pytest.approx(1085.0 / 105.0)
    assert "cost: lost 1.3% of 104 s (1.08e+03 samples), break-even 10 s" in out.read_text()


def test_a_running_tuning_renders_with_its_best_so_far(tmp_path: Path) -> None:
    path = tmp_path / "running.jsonl"
    write_journal(path, TRIALS[:4], in_flight={**START, "bucket_mb": 256})
    out = tmp_path / "running.html"
    summary = render_report(path, out)
    assert not summary.finished
    assert summary.in_flight == 4
    assert summary.baseline == 800.0
    assert summary.best == 880.0
    assert summary.chosen == {**START, "bucket_mb": 128}
    assert summary.gain == pytest.approx(0.1)
    page = out.read_text("utf-8")
    assert "4 trials, running (trial 4 in flight)" in page
    assert "best so far: bucket 128 MiB" in page


def test_a_torn_last_line_of_a_running_journal_is_left_out_and_kept(tmp_path: Path) -> None:
    path = tmp_path / "torn.jsonl"
    write_journal(path, TRIALS[:3])
    with path.open("ab") as f:
        f.write(b'{"type": "trial", "index": 3, "sett')
    before = path.read_bytes()
    summary = render_report(path, tmp_path / "torn.png")
    assert summary.trials == 3
    assert path.read_bytes() == before


def test_no_baseline_when_trial_zero_failed(tmp_path: Path) -> None:
    path = tmp_path / "nobase.jsonl"
    write_journal(path, [(START, None, "timeout"), *TRIALS[1:3]])
    summary = render_report(path, tmp_path / "nobase.html")
    assert summary.baseline is None and summary.gain is None
    assert summary.best == 840.0
    assert "no baseline" in (tmp_path / "nobase.html").read_text("utf-8")


def test_only_failures_still_render(tmp_path: Path) -> None:
    path = tmp_path / "failing.jsonl"
    write_journal(path, [(START, None, "no_ack"), (START | {"bucket_mb": 8}, None, "xid")])
    out = tmp_path / "failing.png"
    summary = render_report(path, out)
    assert summary.best is None and summary.chosen is None
    assert summary.statuses == {"no_ack": 1, "xid": 1}
    decoded_png_shape(out.read_bytes(), tmp_path)


def test_a_space_without_chunk_or_algorithm(tmp_path: Path) -> None:
    path = tmp_path / "horovod.jsonl"
    trials = [
        ({"bucket_mb": 64, "power_cap_w": 250}, 500.0, "ok"),
        ({"bucket_mb": 16, "power_cap_w": 225}, 520.0, "ok"),
    ]
    write_journal(path, trials, final={"settings": trials[1][0], "score": 520.0, "baseline": 500})
    summary = render_report(path, tmp_path / "horovod.png")
    assert summary.knobs == ("bucket_mb", "power_cap_w")
    assert summary.gain == pytest.approx(0.04)


def test_only_the_last_round_counts(tmp_path: Path) -> None:
    path = tmp_path / "rounds.jsonl"
    journal = write_journal(path, TRIALS, final={"settings": START, "score": 1.0, "baseline": 1})
    journal.append({"type": "start", "fingerprint": "again"})
    journal.append(
        {
            "type": "trial",
            "index": 0,
            "version": 120,
            "settings": START,
            "score": 700.0,
            "status": "ok",
        }
    )
    summary = render_report(path, tmp_path / "rounds.png")
    assert summary.trials == 1 and not summary.finished
    assert summary.baseline == summary.best == 700.0 and summary.gain == 0.0


def test_read_journal_returns_trials_in_order(tmp_path: Path) -> None:
    job, trials, final, in_flight = read_journal(finished(tmp_path))
    assert job == "job-a" and in_flight is None
    assert final is not None and final["score"] == 905.0
    assert [t.index for t in trials] == list(range(8))
    assert [t.outcome for t in trials][2:5] == ["aborted", "ok", "failed"]


def test_describe_settings() -> None:
    assert describe_settings(START) == "bucket 32 MiB, chunk 4096 KiB, cap 250 W, ring"
    assert describe_settings({"bucket_mb": 8, "extra": 1}) == "bucket 8 MiB, extra 1"


def test_missing_journal(tmp_path: Path) -> None:
    path = tmp_path / "absent.jsonl"
    with pytest.raises(ReportError, match=f"{re.escape(str(path))}: no such journal file"):
        render_report(path, tmp_path / "out.png")


@pytest.mark.parametrize("content", [b"", b"\n  \n"])
def test_empty_journal(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "empty.jsonl"
    path.write_bytes(content)
    with pytest.raises(ReportError, match=f"{re.escape(str(path))}: the journal is empty"):
        render_report(path, tmp_path / "out.png")


def test_a_journal_without_trials(tmp_path: Path) -> None:
    path = tmp_path / "started.jsonl"
    Journal(path).append({"type": "start", "fingerprint": "x"})
    with pytest.raises(ReportError, match="no finished trial"):
        render_report(path, tmp_path / "out.png")


@pytest.mark.parametrize(
    ("line", "reason"),
    [
        (b"this is not json", "not a journal entry"),
        (b"[1, 2]", "expected a JSON object"),
        (b'{"type": "coffee"}', "unknown entry type 'coffee'"),
        (b'{"type": "trial", "index": 9, "settings": {}, "status": "ok", "score": "x"}', "score"),
        (b'{"type": "trial", "index": 9, "settings": [], "status": "ok"}', "settings"),
        (b'{"type": "trial", "index": "9", "settings": {}, "status": "ok"}', "index"),
        (b'{"type": "trial", "index": 0, "settings": {}, "status": "ok"}', "recorded twice"),
        (b'{"type": "final", "settings": {}, "score": 1, "baseline": true}', "baseline"),
    ],
)
def test_a_garbage_line_names_the_file_and_line(tmp_path: Path, line: bytes, reason: str) -> None:
    path = tmp_path / "bad.jsonl"
    write_journal(path, TRIALS[:2])
    lines = path.read_bytes().splitlines(keepends=True)
    lines.insert(3, line + b"\n")
    path.write_bytes(b"".join(lines))
    out = tmp_path / "out.png"
    with pytest.raises(ReportError, match=f"{re.escape(str(path))}:4: .*{re.escape(reason)}"):
        render_report(path, out)
    assert not out.exists()


def test_output_suffix_and_unwritable_output(tmp_path: Path) -> None:
    path = finished(tmp_path)
    with pytest.raises(ReportError, match=r"report.svg: .*\.png or \.html"):
        render_report(path, tmp_path / "report.svg")
    missing_dir = tmp_path / "no" / "such" / "dir" / "report.png"
    with pytest.raises(ReportError, match=f"{re.escape(str(missing_dir))}: cannot write"):
        render_report(path, missing_dir)
    upper = tmp_path / "REPORT.PNG"
    render_report(path, upper)
    assert upper.read_bytes().startswith(PNG_MAGIC)


def test_report_command_draws_a_journal(tmp_path: Path) -> None:
    import subprocess
    import sys

    journal = Journal(tmp_path / "job.jsonl")
    journal.append({"type": "start", "fingerprint": "nccl/4n/?B/?"})
    for index, score in enumerate((100.0, 120.0)):
        journal.append(
            {
                "type": "published",
                "version": index + 1,
                "trial": index,
                "settings": {"bucket_mb": 32 * (index + 1)},
            }
        )
        journal.append(
            {
                "type": "trial",
                "index": index,
                "version": index + 1,
                "settings": {"bucket_mb": 32 * (index + 1)},
                "score": score,
                "status": "ok",
                "reports": {},
                "seconds": 1.0,
            }
        )
    result = subprocess.run(
        [sys.executable, "-m", "hyperagent.cli", "report", str(journal.path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "job.png").read_bytes().startswith(b"\x89PNG")
    assert "2 trials, gain +20.0% over the starting settings" in result.stdout
    missing = subprocess.run(
        [sys.executable, "-m", "hyperagent.cli", "report", str(tmp_path / "absent.jsonl")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert missing.returncode == 1 and "absent.jsonl" in missing.stderr


def write_confirmed(path: Path, gain: float, low: float, high: float) -> Journal:
    """TRIALS, then the start and the best re-measured interleaved, and the final entry as the
    coordinator writes it after the confirmations."""
    journal = write_journal(path)
    best = TRIALS[5][0]
    for offset, settings in enumerate([START, best, best, START]):
        index = len(TRIALS) + offset
        journal.append(
            {"type": "published", "version": index + 1, "trial": index, "settings": settings}
        )
        journal.append(
            {
                "type": "trial",
                "index": index,
                "version": index + 1,
                "settings": settings,
                "score": 800.0 if settings == START else 800.0 * (1 + gain),
                "status": "ok",
                "reports": {},
                "seconds": 9.0,
                "confirmation": True,
            }
        )
    better = low > 0
    journal.append(
        {
            "type": "final",
            "version": 20,
            "settings": best if better else START,
            "score": 800.0 * (1 + gain) if better else 800.0,
            "baseline": 800.0,
            "gain": gain,
            "gain_low": low,
            "gain_high": high,
            "better": better,
        }
    )
    return journal


def test_the_report_gives_the_confirmed_gain_with_its_interval(tmp_path: Path) -> None:
    journal = write_confirmed(tmp_path / "job.jsonl", 0.05, 0.02, 0.08)
    summary = render_report(journal.path, tmp_path / "job.png")
    assert summary.trials == len(TRIALS) and summary.confirmations == 4  # not trials 9..12
    assert summary.gain == pytest.approx(0.05)
    assert summary.outcome() == (
        "gain +5.0% (95% interval +2.0% .. +8.0%) over the starting settings, confirmed"
    )
    result = subprocess.run(
        [sys.executable, "-m", "hyperagent.cli", "report", str(journal.path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert f"{len(TRIALS)} trials, gain +5.0% (95% interval +2.0% .. +8.0%)" in result.stdout


def test_a_gain_whose_interval_reaches_zero_is_reported_as_no_better(tmp_path: Path) -> None:
    journal = write_confirmed(tmp_path / "job.jsonl", 0.01, -0.02, 0.04)
    summary = render_report(journal.path, tmp_path / "job.png")
    assert summary.gain == 0.0 and summary.chosen == START
    assert summary.outcome() == (
        "no setting was better than the starting settings (the best candidate "
        "measured +1.0%, 95% interval -2.0% .. +4.0%)"
    )
