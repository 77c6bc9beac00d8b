"""What the agent did with the coordinator's messages, counted for /metrics and tests: one
``AgentStats`` that the settings path, the trial reports and their receipts add to."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from hyperagent import bus
from hyperagent.readings import Kind, Reading


@dataclass
class AgentStats:
    """What the agent did with settings messages, for /metrics and tests."""

    applied: int = 0
    rejected: Counter[str] = field(default_factory=Counter)
    invalid_payloads: int = 0
    reports_sent: int = 0
    reports_resent: int = 0


def self_readings(stats: AgentStats, link: bus.MqttLink | None, unconfirmed: int) -> list[Reading]:
    """The agent's own counters, and its link's (``unconfirmed``: the reports the coordinator
    has not confirmed yet)."""
    out = [
        Reading("hyperagent_settings_applied_total", stats.applied, {}, Kind.COUNTER),
        Reading(
            "hyperagent_mqtt_invalid_payloads_total",
            stats.invalid_payloads,
            {},
            Kind.COUNTER,
        ),
    ]
    for reason, count in sorted(stats.rejected.items()):
        out.append(
            Reading("hyperagent_settings_rejected_total", count, {"reason": reason}, Kind.COUNTER)
        )
    if link is not None:
        out += link.broker_readings()
        sent, resent = stats.reports_sent, stats.reports_resent
        out.append(Reading("hyperagent_reports_sent_total", sent, {}, Kind.COUNTER))
        out.append(Reading("hyperagent_reports_resent_total", resent, {}, Kind.COUNTER))
        out.append(Reading("hyperagent_reports_unconfirmed", unconfirmed))
        out.append(Reading("hyperagent_mqtt_dropped_total", link.dropped_total, {}, Kind.COUNTER))
        out.append(Reading("hyperagent_mqtt_queued_messages", link.queued))
        out += link.handler_error_readings()
    return out
