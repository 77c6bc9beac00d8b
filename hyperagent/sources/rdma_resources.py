"""``rdma -j resource show qp|cq``: queue pairs and completion queues counted, never listed."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable
from typing import Any

from hyperagent.errors import SourceError
from hyperagent.readings import Reading

RDMA_QP_COMMAND = ("rdma", "-j", "resource", "show", "qp")
RDMA_CQ_COMMAND = ("rdma", "-j", "resource", "show", "cq")


def _json_list(text: str, what: str) -> list[Any]:
    try:
        data = json.loads(text)
    except ValueError as e:
        raise SourceError(f"{what}: output is not JSON: {e}") from e
    if not isinstance(data, list):
        raise SourceError(f"{what}: expected a JSON list, got {type(data).__name__}")
    return data


def parse_rdma_qps(text: str) -> list[Reading]:
    """``rdma -j resource show qp`` -> queue pairs counted per device, port, state and type.

    An entry without a device name is skipped; output that is not a JSON list raises SourceError.
    """
    counts: Counter[tuple[str, str, str, str]] = Counter()
    for entry in _json_list(text, "rdma resource show qp"):
        if not isinstance(entry, dict) or not isinstance(entry.get("ifname"), str):
            continue
        port = entry.get("port")
        counts[
            (
                entry["ifname"],
                "" if port is None else str(port),
                str(entry.get("state", "")),
                str(entry.get("type", "")),
            )
        ] += 1
    return [
        Reading(
            "hyperagent_rdma_qps",
            float(n),
            {"device": device, "port": port, "state": state, "type": qp_type},
        )
        for (device, port, state, qp_type), n in sorted(counts.items())
    ]


def parse_rdma_cqs(text: str, devices: Iterable[str] = ()) -> list[Reading]:
    """``rdma -j resource show cq`` -> completion queues per device (0 for ``devices`` without).

    An entry without a device name is skipped; output that is not a JSON list raises SourceError.
    """
    counts: Counter[str] = Counter({device: 0 for device in devices})
    for entry in _json_list(text, "rdma resource show cq"):
        if isinstance(entry, dict) and isinstance(entry.get("ifname"), str):
            counts[entry["ifname"]] += 1
    return [
        Reading("hyperagent_rdma_cqs", float(n), {"device": device})
        for device, n in sorted(counts.items())
    ]
