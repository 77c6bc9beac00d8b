"""Which part a device is, by PCI id as well as by name: a tool may name a card by a generic
firmware image or board name ("AMD Radeon Graphics") that no coefficient key matches, while its
PCI vendor and device id say exactly what it is.

The ids are those of the shipped coefficient table (``hyperagent/data/quantum_coefficients.toml``,
each model's ``pci_ids``). :func:`identified` keeps a name that holds its part's key and adds
the key to one that does not; a device whose name and id are both unknown is said once, with
the id.
"""

from __future__ import annotations

import functools
import logging
import tomllib
from importlib import resources

log = logging.getLogger(__name__)


@functools.cache
def _table() -> dict[str, dict[str, object]]:
    text = resources.files("hyperagent").joinpath("data", "quantum_coefficients.toml").read_text()
    return dict(tomllib.loads(text)["models"])


@functools.cache
def parts_by_pci_id() -> dict[str, str]:
    """``vendor:device`` (lower-case hex, ``0x1002:0x74a1``) -> the table's model key."""
    return {
        str(pci_id).lower(): key
        for key, entry in _table().items()
        for pci_id in entry.get("pci_ids", ())  # type: ignore[attr-defined]
    }


def pci_id(vendor_id: object, device_id: object) -> str:
    """``vendor:device`` as the table keys it (``0x1002``, ``"74A1"`` -> ``0x1002:0x74a1``);
    empty where either is unknown."""
    parts = []
    for value in (vendor_id, device_id):
        text = str(value or "").strip().lower()
        if isinstance(value, int):
            text = f"{value:#06x}"
        if not text or text in ("n/a", "0x0000"):
            return ""
        digits = text.removeprefix("0x")
        try:
            parts.append(f"0x{int(digits, 16):04x}")
        except ValueError:
            return ""
    return ":".join(parts)


def identified(model: str, pci: str) -> str:
    """``model``, or ``"<model> (<key>)"`` where its PCI id ``pci`` names a part whose key the
    name does not hold; a device known neither by name nor by id is warned about once, with
    its id."""
    key = parts_by_pci_id().get(pci.lower()) if pci else None
    if key is None:
        if not any(name.upper() in model.upper() for name in _table()):
            warn_unknown(model, pci)
        return model
    if key.upper() in model.upper():
        return model
    return f"{model} ({key})" if model else key


@functools.cache
def warn_unknown(model: str, pci: str) -> None:
    """Say once per process that a device is known neither by name nor by id."""
    log.warning(
        "accelerator %r (PCI id %s) is not a part the coefficient table names, by name or id",
        model,
        pci or "unknown",
    )
