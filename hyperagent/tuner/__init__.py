"""Closed-loop tuning of distributed-training settings: the search space (``space``), the
optimiser (``optimizer``), one trial's measurement and score (``trial``) and the journal; the
coordinator's side: jobs found from telemetry (``discovery``), one machine per job
(``tuning``, composed of ``runner``, ``trialrun``, ``rounds``, ``confirm``, ``drift``,
``resume`` and ``notices`` over ``lifecycle`` and ``events``), its data and readings
(``jobstate``, ``metrics``) and its journals (``journals``). The agent imports ``trial`` alone.

``from hyperagent.tuner import SearchSpace, Tuner`` works; each name's module is imported when
the name is first looked up, so the agent, which uses ``trial`` alone, never loads
scikit-optimize.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hyperagent.tuner.journal import Journal, JournalError
    from hyperagent.tuner.optimizer import Tuner
    from hyperagent.tuner.space import SearchSpace, Settings

_MODULES = {
    "Journal": "hyperagent.tuner.journal",
    "JournalError": "hyperagent.tuner.journal",
    "SearchSpace": "hyperagent.tuner.space",
    "Settings": "hyperagent.tuner.space",
    "Tuner": "hyperagent.tuner.optimizer",
}

__all__ = ["Journal", "JournalError", "SearchSpace", "Settings", "Tuner"]


def __getattr__(name: str) -> Any:
    module = _MODULES.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
