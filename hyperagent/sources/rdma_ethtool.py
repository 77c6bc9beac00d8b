"""``ethtool -S`` of the netdevs behind RoCE ports: pause (PFC and link-level) counters."""

from __future__ import annotations

import logging
import re

from hyperagent.errors import SourceError
from hyperagent.readings import Kind, Reading

log = logging.getLogger(__name__)

FRAMES = "hyperagent_rdma_pfc_pause_frames_total"
DURATION = "hyperagent_rdma_pfc_pause_duration_seconds_total"
TRANSITIONS = "hyperagent_rdma_pfc_pause_transitions_total"
PHY_FRAMES = "hyperagent_rdma_phy_pause_frames_total"
MICROSECONDS = 1e-6

_DIRECTION = {"rx": "received", "tx": "transmitted"}

PAUSE_STATISTICS: tuple[tuple[re.Pattern[str], str, float], ...] = tuple(
    (re.compile(pattern), metric, scale)
    for pattern, metric, scale in (
        # mlx5 (ConnectX-4 and later)
        (r"(?P<dir>rx|tx)_prio(?P<prio>[0-7])_pause", FRAMES, 1.0),
        (r"(?P<dir>rx|tx)_prio(?P<prio>[0-7])_pause_duration", DURATION, MICROSECONDS),
        (r"(?P<dir>rx|tx)_prio(?P<prio>[0-7])_pause_transition", TRANSITIONS, 1.0),
        (r"(?P<dir>rx|tx)_global_pause", FRAMES, 1.0),
        (r"(?P<dir>rx|tx)_global_pause_duration", DURATION, MICROSECONDS),
        (r"(?P<dir>rx|tx)_global_pause_transition", TRANSITIONS, 1.0),
        (r"(?P<dir>rx|tx)_pause_ctrl_phy", PHY_FRAMES, 1.0),
        # bnxt_en (Broadcom NetXtreme-C/E, RoCE through bnxt_re)
        (r"(?P<dir>rx|tx)_pfc_ena_frames_pri(?P<prio>[0-7])", FRAMES, 1.0),
        (r"pfc_pri(?P<prio>[0-7])_(?P<dir>rx|tx)_duration_us", DURATION, MICROSECONDS),
        (r"pfc_pri(?P<prio>[0-7])_(?P<dir>rx|tx)_transitions", TRANSITIONS, 1.0),
        (r"(?P<dir>rx|tx)_pause_frames", FRAMES, 1.0),
        # i40e (X710/X722, iWARP/RoCE through i40iw/irdma): XOFF frames are the pause requests
        (r"port\.(?P<dir>rx|tx)_priority_(?P<prio>[0-7])_xoff_(?:rx|tx)", FRAMES, 1.0),
        (r"port\.link_xoff_(?P<dir>rx|tx)", FRAMES, 1.0),
        # e1000e, igb, ixgbe: link-level flow control
        (r"(?P<dir>rx|tx)_flow_control_xoff", FRAMES, 1.0),
    )
)
"""``ethtool -S`` statistic name patterns -> pause metric and scale to base units."""

_STATISTIC = re.compile(r"^\s*(?P<name>[A-Za-z0-9_.\-]+):\s*(?P<value>\S+)\s*$")


def parse_ethtool_statistics(text: str, what: str = "ethtool -S") -> dict[str, str]:
    """Name -> value text of the NIC-wide lines of ``ethtool -S`` (per-queue ``[n]:`` lines
    are left out). Raises SourceError when the text has no statistics header."""
    lines = text.splitlines()
    if not any(line.strip() == "NIC statistics:" for line in lines):
        raise SourceError(f"{what}: no 'NIC statistics:' header in the output")
    statistics: dict[str, str] = {}
    for line in lines:
        match = _STATISTIC.match(line)
        if match:
            statistics.setdefault(match.group("name"), match.group("value"))
    return statistics


def _pause_statistic() -> tuple[re.Pattern[str], dict[str, tuple[str, float, str, str | None]]]:
    """:data:`PAUSE_STATISTICS` as one pattern, each alternative in a group ``p<i>`` (the
    last group a match closes, so ``lastgroup``), and what each group stands for: metric,
    scale and the names of its direction and priority groups. Alternatives are tried in
    order, so the first pattern that matches a name wins, as it would one by one."""
    alternatives: list[str] = []
    meanings: dict[str, tuple[str, float, str, str | None]] = {}
    for i, (pattern, metric, scale) in enumerate(PAUSE_STATISTICS):
        source = pattern.pattern.replace("(?P<dir>", f"(?P<dir{i}>")
        source = source.replace("(?P<prio>", f"(?P<prio{i}>")
        alternatives.append(f"(?P<p{i}>{source})")
        prio = f"prio{i}" if "prio" in pattern.groupindex else None
        meanings[f"p{i}"] = (metric, scale, f"dir{i}", prio)
    return re.compile("|".join(alternatives)), meanings


_PAUSE_STATISTIC, _PAUSE_MEANINGS = _pause_statistic()
_PAUSE_HINTS = ("pause", "pfc", "xoff")
"""Every :data:`PAUSE_STATISTICS` name holds one of these: other lines are not parsed."""
_HEADER = "NIC statistics:"


def parse_ethtool_pause(text: str, netdev: str) -> list[Reading]:
    """Pause frame, duration and transition counters of ``ethtool -S <netdev>`` output.

    A pause statistic whose value is not a non-negative integer is skipped; text without a
    statistics header raises SourceError (as :func:`parse_ethtool_statistics`).
    """
    lines = text.splitlines()
    if _HEADER not in text or not any(line.strip() == _HEADER for line in lines if _HEADER in line):
        raise SourceError(f"ethtool -S {netdev}: no 'NIC statistics:' header in the output")
    out: list[Reading] = []
    seen: set[str] = set()  # the first line of a name counts, as in parse_ethtool_statistics
    hint_a, hint_b, hint_c = _PAUSE_HINTS
    for line in lines:
        if hint_a not in line and hint_b not in line and hint_c not in line:
            continue
        statistic = _STATISTIC.match(line)
        if not statistic:
            continue
        name, value_text = statistic.group("name", "value")
        if name in seen:
            continue
        seen.add(name)
        match = _PAUSE_STATISTIC.fullmatch(name)
        if not match:
            continue
        metric, scale, dir_group, prio_group = _PAUSE_MEANINGS[match.lastgroup or ""]
        try:
            value = int(value_text)
        except ValueError:
            log.debug("ethtool -S %s: %s is not a number: %r", netdev, name, value_text)
            continue
        if value < 0:
            continue
        labels = {"netdev": netdev, "direction": _DIRECTION[match.group(dir_group)]}
        if metric != PHY_FRAMES:
            labels["priority"] = (match.group(prio_group) if prio_group else None) or "global"
        out.append(Reading(metric, value * scale, labels, Kind.COUNTER))
    return out
