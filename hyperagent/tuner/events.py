"""What goes into a job's tuning machine and what comes out (:mod:`~hyperagent.tuner.tuning`).

Events say what happened (time passed, a node acked or reported, the tuner answered), each
with the time it carries; effects say what the coordinator is to do, in order (journal before
publish). Plain frozen records: nothing here acts.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from hyperagent.config import JobTuningSection
from hyperagent.tuner.discovery import JobView, SpacePlan
from hyperagent.tuner.jobstate import Progress, TrialRecord
from hyperagent.tuner.trial import MeasurementPlan

if TYPE_CHECKING:
    from hyperagent.tuner.optimizer import Tuner


# -- events --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Tick:
    """Time passed: ``now``."""

    now: float


@dataclass(frozen=True)
class Seen:
    """The agents' picture of the job changed (ranks attached or left, nodes)."""

    now: float
    view: JobView


@dataclass(frozen=True)
class Begin:
    """Every rank is attached: the job's tuning (nodes resolved), its space and its start."""

    now: float
    config: JobTuningSection
    plan: SpacePlan
    start: Mapping[str, Any]
    """The starting settings (the config's, or a finished tuning's of the same
    fingerprint)."""
    offline: frozenset[str] = frozenset()
    """Nodes whose status said offline before the tuning began."""


@dataclass(frozen=True)
class Ack:
    """A node's ack (or refusal) of a version, already checked as coming from it."""

    now: float
    message: Mapping[str, Any]


@dataclass(frozen=True)
class Report:
    """A node's measurement (``partial`` after each window, ``stalled`` when its job stopped)."""

    now: float
    message: Mapping[str, Any]


@dataclass(frozen=True)
class NodeStatus:
    now: float
    node: str
    online: bool


@dataclass(frozen=True)
class Steps:
    """A node's running totals of the job, from its telemetry."""

    now: float
    node: str
    progress: Progress


@dataclass(frozen=True)
class Asked:
    """The tuner's answer to :class:`Ask` number ``token``."""

    now: float
    token: int
    settings: Mapping[str, Any]


@dataclass(frozen=True)
class VersionSeen:
    """A settings version of this job exists (retained on the broker, or applied by an
    agent): versions continue above it."""

    version: int


Event = Tick | Seen | Begin | Ack | Report | NodeStatus | Steps | Asked | VersionSeen


# -- effects -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Publish:
    """Sign and publish settings ``version`` (retained) to ``nodes``; ``plan`` None: apply
    without measuring (a rollback, the final settings)."""

    version: int
    settings: dict[str, Any]
    plan: MeasurementPlan | None
    trial: int | None
    nodes: tuple[str, ...]


@dataclass(frozen=True)
class Journal:
    """Append ``entry`` to the job's journal (before any later Publish leaves)."""

    entry: dict[str, Any]


@dataclass(frozen=True)
class Ask:
    """Ask the tuner for the next settings (it may fit a model: off the event loop), then
    hand them back as :class:`Asked` with ``token``."""

    token: int
    tuner: Tuner


@dataclass(frozen=True)
class Say:
    """One log line."""

    level: int
    text: str


@dataclass(frozen=True)
class Status:
    """The service's status line for this job."""

    text: str


@dataclass(frozen=True)
class Measured:
    """A trial (or a confirmation) was measured and recorded."""

    record: TrialRecord


Effect = Publish | Journal | Ask | Say | Status | Measured
