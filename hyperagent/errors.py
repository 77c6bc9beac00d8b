"""The exception hierarchy. Vendor errors are translated at the boundary and chained."""

from __future__ import annotations

from dataclasses import dataclass


class HyperagentError(Exception):
    """Base of every error hyperagent raises on purpose."""


class SourceError(HyperagentError):
    """A telemetry source could not produce readings."""


class SourceUnavailable(SourceError):
    """The hardware or service behind a source is not present (reported as up 0, quietly)."""


class SourceTimeout(SourceError):
    """A source read did not finish within its time bound."""


@dataclass(frozen=True)
class ConfigProblem:
    """One problem in a configuration: the dotted key and why it is wrong."""

    key: str
    reason: str

    def __str__(self) -> str:
        return f"{self.key}: {self.reason}"


class ConfigError(HyperagentError):
    """Configuration is invalid; carries every problem found, each naming its key."""

    def __init__(self, problems: list[ConfigProblem], file: str | None = None) -> None:
        self.problems = problems
        self.file = file
        where = f"{file}: " if file else ""
        super().__init__(where + "; ".join(str(p) for p in problems))


class PayloadError(HyperagentError):
    """An MQTT or job-socket payload failed validation."""


class PublishError(HyperagentError):
    """A message could not be handed to the broker."""


class DeviceCallError(HyperagentError):
    """A call into a device library (NVML) did not answer in time (see hyperagent.gate)."""


class DeviceTimeout(DeviceCallError):
    """The call did not return within its timeout; it may still be running."""


class DeviceBusy(DeviceCallError):
    """Refused at once: another call to the library has been in flight past its timeout."""


class ActuationError(HyperagentError):
    """A setting could not be applied to the hardware or the job."""

    def __init__(self, message: str, vendor_code: int | None = None) -> None:
        super().__init__(message)
        self.vendor_code = vendor_code


class NotSupported(ActuationError):
    """The device does not support this setting."""


class NoPermission(ActuationError):
    """The process lacks the privilege to apply this setting."""
