"""The settings path: the coordinator's settings for a job verified (signed by a trusted key,
not stale, not expired), bounded (the node's power-cap bounds), applied (a power cap on the
GPUs the job holds here, the knobs handed to its ranks, the trial they ask for measured) and
acked or refused; the versions applied per job, kept across restarts; and the job events that
take a departed job's caps off its GPUs and put them back when it returns."""

from __future__ import annotations

import asyncio
import logging
import math
import time
from pathlib import Path
from typing import Any

import orjson

from hyperagent import bus, durable
from hyperagent.actuators import PowerCapActuator
from hyperagent.agent.gpus import JobGpus
from hyperagent.agent.stats import AgentStats
from hyperagent.agent.trials import Trials
from hyperagent.config import Config
from hyperagent.devices.source import AcceleratorSource
from hyperagent.errors import ActuationError, PayloadError
from hyperagent.job import JobSettings
from hyperagent.signing import TrustedKeys
from hyperagent.sources import Hardware
from hyperagent.sources.job import JobSource

log = logging.getLogger(__name__)


class AppliedSettings:
    """The settings message applied last per job, kept in a file across restarts, and the
    versions this process applied to the hardware and the job."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self.messages: dict[str, dict[str, Any]] = {}
        """job -> the settings message applied last (version, settings, backend, issued_at,
        trial), kept in ``path``."""
        self.live: dict[str, int] = {}
        """Versions applied to the hardware and the job by this process (after a restart, or
        after the power limits were restored, the applied version is applied again)."""
        self._load()

    def _load(self) -> None:
        if self.path is None:
            return
        try:
            saved = orjson.loads(self.path.read_bytes())
        except FileNotFoundError:
            return
        except (OSError, orjson.JSONDecodeError) as e:
            log.error("ignoring %s: %s", self.path, e)
            return
        for job, message in saved.items() if isinstance(saved, dict) else ():
            if isinstance(message, dict) and isinstance(message.get("version"), int):
                if not isinstance(message.get("settings"), dict):
                    message["settings"] = {}
                self.messages[job] = message
        if self.messages:
            log.info("settings applied before the restart: %s", self.versions)

    @property
    def versions(self) -> dict[str, int]:
        """job -> the settings version applied last."""
        return {job: m["version"] for job, m in self.messages.items()}

    def save(self) -> None:
        """Queue the applied messages for the writer thread (a fsynced file renamed over the
        old one); acks spooled after this leave only once it is on disk."""
        if self.path is None:
            return
        path, data = self.path, orjson.dumps(self.messages)

        def write() -> None:
            try:
                durable.write_file(path, data)
            except OSError as e:
                log.error("cannot save the applied settings to %s: %s", path, e)

        durable.submit(write)


def power_actuator(
    config: Config, hardware: Hardware, accelerator: AcceleratorSource | None
) -> PowerCapActuator | None:
    """The power-cap actuator over the node's GPU library, where ``actuation.power_cap`` asks
    for one (its original limits kept in ``agent.state_dir`` unless the node is replayed)."""
    devices = hardware.power_library
    if devices is None and accelerator is not None:
        devices = accelerator.library
    if not config.actuation.power_cap or devices is None:
        return None
    state_file = None if hardware.replayed else config.agent.state_dir / "power-limits.json"
    return PowerCapActuator(devices, state_file, timeout_s=config.sources.timeout_s)


def job_settings(message: dict[str, Any]) -> JobSettings:
    """What a settings message asks of the job's ranks: every knob but the power cap (the
    agent's own), and the backend's parameters."""
    knobs = {k: v for k, v in message["settings"].items() if k != "power_cap_w"}
    return JobSettings(message["version"], knobs, message.get("backend", {}))


class SettingsPath:
    """Verifies, applies and acks the coordinator's settings; owns the applied versions, the
    power actuator, the GPUs each job's settings capped and the versions waiting for a job's
    GPUs to be known."""

    def __init__(
        self,
        config: Config,
        topics: bus.Topics,
        link: bus.MqttLink | None,
        trusted_keys: TrustedKeys | None,
        actuator: PowerCapActuator | None,
        job_source: JobSource | None,
        gpus: JobGpus,
        trials: Trials,
        stats: AgentStats,
        applied_file: Path | None,
    ) -> None:
        """``trusted_keys`` are the public keys whose settings it applies (none: it refuses
        every setting); ``applied_file`` keeps the settings versions applied per job across
        restarts."""
        self.config = config
        self.node = config.node
        self.topics = topics
        self.link = link
        self.trusted_keys = trusted_keys
        self.actuator = actuator
        self.job_source = job_source
        self.gpus = gpus
        self.trials = trials
        self.stats = stats
        self.applied = AppliedSettings(applied_file)
        self.limits_w: tuple[float, float] | None = None
        """The GPUs' power-limit range, once read."""
        self._capped: dict[str, set[int]] = {}
        """job -> the GPUs its settings capped."""
        self._awaiting_gpus: dict[str, dict[str, Any]] = {}
        """job -> its latest settings message with a power cap, waiting for the job's GPUs
        on this node to be known (its ranks not attached yet, or not yet attributed)."""
        self._events: asyncio.Queue[tuple[str, str]] = asyncio.Queue()
        """(job, "left" | "lost" | "back"): its last rank left the node, it no longer holds
        GPUs it capped, or a rank (or its GPUs) came back."""
        self._logged_rejections: set[str] = set()

    # -- lifetime ------------------------------------------------------------------------

    def send_applied(self) -> None:
        """Hand each job's applied settings to the job channel, for its ranks to come."""
        if self.job_source is not None:
            for job, message in self.applied.messages.items():
                self.job_source.send_settings(job, job_settings(message))

    async def start(self) -> None:
        """Put back the power limits a crashed run left, and read the GPUs' power-limit
        range."""
        if self.actuator is None:
            return
        try:
            recovered = await asyncio.to_thread(self.actuator.recover)
        except ActuationError as e:
            log.error("cannot restore the power limits a crashed run left: %s", e)
        else:
            if recovered:
                log.warning(
                    "restored the original power limit of %d GPU(s) left by a crashed run",
                    recovered,
                )
        try:
            self.limits_w = await asyncio.to_thread(self.actuator.limits_w)
        except ActuationError as e:
            log.warning("cannot read the GPUs' power-limit range: %s", e)

    async def restore(self) -> None:
        """Put back the original power limit of every GPU this agent capped (on the way out)."""
        if self.actuator is not None and self.actuator.original_mw:
            restored = await asyncio.to_thread(self.actuator.restore)
            log.info("restored the original power limit of %d GPU(s)", restored)

    def actuation(self, gpu_model: str | None) -> dict[str, Any]:
        """What this node can apply: the coordinator narrows a job's space to it."""
        actuation = self.config.actuation
        limits = None if self.actuator is None else self.limits_w
        return {
            "power_cap": self.actuator is not None,
            "min_w": actuation.min_power_w,
            "max_w": actuation.max_power_w,
            "limits_w": list(limits) if limits else None,
            "gpu_model": gpu_model,
        }

    def follow_job(self, job: str) -> None:
        """Subscribe to ``job``'s settings topic itself: a broker that serves a retained
        message only to a subscriber of its exact topic (RabbitMQ) then gives this agent the
        job's current version, which ``settings/+`` alone would not. A repeat (mosquitto
        delivers through both subscriptions) is dropped by the version check."""
        if self.link is not None:
            self.link.follow(self.topics.settings(job), 1, self.on_settings)

    # -- settings in ---------------------------------------------------------------------

    def _reject(self, reason: str, detail: str) -> None:
        self.stats.rejected[reason] += 1
        if reason not in self._logged_rejections:
            self._logged_rejections.add(reason)
            log.warning("rejected settings (%s): %s", reason, detail)

    async def on_settings(self, topic: str, payload: bytes) -> None:
        """A settings message: verified, then applied (or applied again) and acked, or
        refused with its reason."""
        if not payload:
            return
        try:
            job = self.topics.name_in(topic)
            message = bus.decode(payload, "settings")
        except PayloadError as e:
            self.stats.invalid_payloads += 1
            self._reject("invalid", str(e))
            return
        if message["job"] != job:
            self._reject("invalid", f"topic job {job!r} differs from payload job")
            return
        nodes = message.get("nodes")
        if isinstance(nodes, list) and self.node not in nodes:
            return
        allowed = self.config.actuation.allowed_jobs
        if allowed and job not in allowed:
            self._reject("job_not_allowed", f"{job} is not in actuation.allowed_jobs")
            return
        unsigned = await self._signature_problem(message)
        if unsigned is not None:
            reason, detail = unsigned
            self._reject(reason, f"settings v{message['version']} for {job}: {detail}")
            return
        version, applied = message["version"], self.applied.versions.get(job, 0)
        if version < applied:
            self._reject("stale", f"v{version} is older than applied v{applied}")
            self._ack(
                job,
                version,
                ok=False,
                error=f"stale: v{applied} applied",
                applied={"version": applied},
                refusal="stale",
            )
            return
        if version == applied:
            if self.applied.live.get(job) != version:
                await self.apply(job, message, again=True)
            return
        problem = self._check_age(message)
        if problem is not None:
            self._reject("expired", problem)
            self._ack(job, version, ok=False, error=problem)
            return
        await self.apply(job, message)

    async def _signature_problem(self, message: dict[str, Any]) -> tuple[str, str] | None:
        """Why ``message`` is not signed by a trusted key (bus.signature_problem), or None. The
        trusted files are read again first if they changed (a key added or removed during a
        rotation; a few ``stat`` calls otherwise)."""
        keys = self.trusted_keys
        if keys is None:
            return "no_key", "no security.trusted_keys configured; refusing every setting"
        if keys.paths:
            if await asyncio.to_thread(keys.refresh):
                log.info("trusted settings keys read again: %s", keys.describe())
        if not len(keys):
            paths = ", ".join(map(str, keys.paths)) or "none configured"
            return "no_key", f"no key in security.trusted_keys ({paths}); refusing every setting"
        return bus.signature_problem(message, keys)

    def _check_age(self, message: dict[str, Any]) -> str | None:
        issued = message["issued_at"]  # a finite number: bus.decode checked it
        security = self.config.security
        age = time.time() - issued
        if age < -security.clock_skew_s:
            return f"settings issued {-age:.0f}s in the future (clock skew?)"
        if age > security.settings_max_age_s + security.clock_skew_s:
            return f"settings issued {age:.0f}s ago, over security.settings_max_age_s"
        return None

    async def coordinator_status(self, state: str | None) -> None:
        """When the coordinator is lost while a trial's power cap is applied, the cap is not
        left behind; a tuned job's final settings (no trial) stay, as its tuning chose them.
        When it comes online, the applied versions not live here are applied again."""
        attached = self.job_source.attached if self.job_source is not None else None
        trial_capped = any(
            m["settings"].get("power_cap_w") and m.get("trial") is not None
            for m in self.applied.messages.values()
        )
        if state == "offline" and trial_capped and self.actuator and self.actuator.original_mw:
            restored = await asyncio.to_thread(self.actuator.restore)
            log.warning(
                "coordinator offline: restored the original power limit of %d GPU(s)", restored
            )
            for job, applied in self.applied.messages.items():
                if applied["settings"].get("power_cap_w"):
                    self.applied.live.pop(job, None)
        elif state == "online":
            for job, message in list(self.applied.messages.items()):
                if attached is None or not attached(job):
                    continue  # no rank here: nothing to apply them to (its GPUs are unknown)
                if self.applied.live.get(job) != message["version"]:
                    log.info(
                        "coordinator online: applying v%d for %s again", message["version"], job
                    )
                    await self.apply(job, message, again=True)

    # -- applying ------------------------------------------------------------------------

    def _check_bounds(self, settings: dict[str, Any]) -> str | None:
        """Why this node can never apply ``settings``' power cap (a fact about the settings:
        the coordinator takes it as an infeasible point), or None."""
        cap = settings.get("power_cap_w")
        if cap is None:
            return None
        if isinstance(cap, bool) or not isinstance(cap, int | float) or not math.isfinite(cap):
            return f"power_cap_w {cap!r} is not a number"
        low, high = self.config.actuation.min_power_w, self.config.actuation.max_power_w
        if (low is not None and cap < low) or (high is not None and cap > high):
            return f"power_cap_w {cap} W outside this node's bounds [{low}, {high}]"
        if self.actuator is None:
            return "power capping is disabled on this node (actuation.power_cap = false)"
        return None

    async def apply(self, job: str, message: dict[str, Any], again: bool = False) -> None:
        """Apply ``message``'s settings (``again``: the version already applied, after a
        restart or after the power limits were restored) and ack them. A power cap goes on
        the GPUs the job is known to hold here, none when none is known."""
        version, settings = message["version"], message["settings"]
        waiting = self._awaiting_gpus.get(job)
        if waiting is not None and waiting["version"] <= version:
            del self._awaiting_gpus[job]  # this version is newer than the one that waited
        problem = self._check_bounds(settings)
        refusal = "settings" if problem is not None else "node"
        applied: dict[str, Any] = {}
        if problem is None and settings.get("power_cap_w") is not None and self.actuator:
            gpus, separable = self.gpus.job_gpus(job)
            if not gpus and not again and self.gpus.may_get_gpus(job):
                # its ranks are here, or coming: applied once its GPUs are known (the
                # coordinator's ack timeout bounds the wait of a trial's version)
                self._awaiting_gpus[job] = message
                log.info("settings v%d for %s wait for its GPUs here to be known", version, job)
                return
            problem = await self._cap(self.actuator, job, settings, (gpus, separable), applied)
        if problem is not None:
            self._reject("refused", problem)
            self._ack(job, version, ok=False, error=problem, refusal=refusal)
            return
        if not self._deliver(job, message, applied):
            return
        self.applied.live[job] = version
        if again:
            if not message.get("plan"):
                self._ack(job, version, ok=True, applied=applied)
            return
        self._record(job, message)
        self._ack(job, version, ok=True, applied=applied)
        log.info("applied settings v%d for %s: %s", version, job, settings)

    async def _cap(
        self,
        actuator: PowerCapActuator,
        job: str,
        settings: dict[str, Any],
        held: tuple[set[int], bool],
        applied: dict[str, Any],
    ) -> str | None:
        """Cap the GPUs ``job`` holds here (``held``: them, and whether they are its own) as
        ``settings`` say, what was applied added to ``applied``; why not, or None."""
        gpus, separable = held
        if not gpus:
            return f"no GPU of {job} is known on this node: no power cap for it"
        if not separable:
            return f"cannot tell the GPUs of {job} from another job's on this node"
        try:
            cap = float(settings["power_cap_w"])
            before = self._capped.get(job, set()) - gpus
            if before:  # GPUs its last version capped and it no longer holds
                await asyncio.to_thread(actuator.restore, before)
            caps = await asyncio.to_thread(actuator.apply, cap, gpus)
        except ActuationError as e:
            return str(e)
        self._capped[job] = gpus
        if self.job_source is not None and not self.job_source.attached(job):
            self._events.put_nowait((job, "left"))  # it left meanwhile
        applied["power_cap_w"] = [c.applied_w for c in caps]
        applied["gpus"] = [c.gpu for c in caps]
        if actuator.last_latency_s is not None and any(c.changed for c in caps):
            applied["power_cap_latency_s"] = round(actuator.last_latency_s, 4)
        return None

    def _deliver(self, job: str, message: dict[str, Any], applied: dict[str, Any]) -> bool:
        """Hand the settings to the job's ranks here (what they took added to ``applied``);
        False, refused, when a connected rank did not take them."""
        if self.job_source is None:
            return True
        version = message["version"]
        attached = self.job_source.attached(job)
        delivered = self.job_source.send_settings(job, job_settings(message))
        applied["job_reporters"] = delivered
        totals = self.job_source.jobs.get(job)
        knobs = totals.knobs() if totals is not None else None
        if knobs is not None:
            applied["knobs"] = list(knobs)
        if delivered < attached:
            problem = f"settings v{version} reached {delivered} of {attached} ranks"
            self._reject("undelivered", problem)
            self._ack(job, version, ok=False, error=problem, applied=applied, refusal="node")
            return False
        return True

    def _record(self, job: str, message: dict[str, Any]) -> None:
        """A new version applied: kept (and saved), and its trial measured if it asks for one
        (the job's trial before ends otherwise)."""
        version = message["version"]
        self.applied.messages[job] = {
            k: message.get(k) for k in ("version", "settings", "backend", "issued_at", "trial")
        }
        self.applied.save()
        self.stats.applied += 1
        plan = message.get("plan")
        if plan:
            try:
                gpus, _ = self.gpus.job_gpus(job)
                self.trials.measure(job, version, message.get("trial"), plan, gpus)
            except ValueError as e:
                log.warning("settings v%d for %s: %s; not measuring", version, job, e)
        else:
            self.trials.end(job)

    def _ack(
        self,
        job: str,
        version: int,
        ok: bool,
        error: str | None = None,
        applied: dict[str, Any] | None = None,
        refusal: str | None = None,
    ) -> None:
        """Ack (``ok``) or refuse a version; a refusal says whether it is a fact about the
        settings (``refusal`` "settings": never applicable here) or about the node now."""
        if self.link is None:
            return
        message: dict[str, Any] = {
            "job": job,
            "node": self.node,
            "version": version,
            "ok": ok,
            "error": error,
            "applied": applied or {},
            "stalled": self.trials.stalled(job),
            "ts": time.time(),
        }
        if not ok:
            message["refusal"] = refusal or "node"
        payload = bus.encode(message)
        self.link.publish(self.topics.ack(job, self.node), payload, qos=1)

    # -- the job's comings and goings ----------------------------------------------------

    def rank_attached(self, job: str, rank: int) -> None:
        self.follow_job(job)
        if self.applied.live.get(job) is None and job in self.applied.messages:
            self._events.put_nowait((job, "back"))

    def rank_left(self, job: str, rank: int) -> None:
        if self.job_source is not None and not self.job_source.attached(job):
            self._events.put_nowait((job, "left"))

    def job_released(self, job: str) -> None:
        """A job released by the job channel (no rank for ``release_after_s``): its applied
        settings go (never applied again: the job is over), its caps with them."""
        self._awaiting_gpus.pop(job, None)
        if job in self._capped:
            self._events.put_nowait((job, "left"))  # its caps go back with it
        self.applied.live.pop(job, None)
        if self.applied.messages.pop(job, None) is not None:
            self.applied.save()

    def held_changed(self, before: dict[str, set[int]], now: dict[str, set[int]]) -> None:
        """The jobs' GPUs were attributed again: a job that no longer holds a GPU it capped
        gets that GPU's limit back; a job whose GPUs became known gets its cap."""
        for job, capped in self._capped.items():
            attached = self.job_source is not None and self.job_source.attached(job)
            if attached and capped - now.get(job, set()):
                self._events.put_nowait((job, "lost"))  # e.g. Slurm gave them to a job
        now_known = {job for job, gpus in now.items() if gpus}
        for job in now_known - {job for job, gpus in before.items() if gpus}:
            if job in self._awaiting_gpus or (
                self.applied.live.get(job) is None and job in self.applied.messages
            ):
                self._events.put_nowait((job, "back"))  # its cap can go on now

    async def job_loop(self) -> None:
        """A job whose ranks all left gets its GPUs' original power limits back at once (the
        next job on them must not inherit its cap); when a rank comes back, or its GPUs become
        known, its applied settings are applied again."""
        while True:
            job, what = await self._events.get()
            if what == "left" and job in self._capped and self.actuator is not None:
                gpus = self._capped.pop(job)
                restored = await asyncio.to_thread(self.actuator.restore, gpus)
                self.applied.live.pop(job, None)
                if restored:
                    log.info("%s left: restored the power limit of %d GPU(s)", job, restored)
            elif what == "lost" and job in self._capped and self.actuator is not None:
                await self._restore_lost(self.actuator, job)
            elif what == "back" and job in self._awaiting_gpus:
                waited = self._awaiting_gpus.pop(job)
                if waited["version"] > self.applied.versions.get(job, 0):  # still the latest
                    await self.apply(job, waited)
            elif what == "back" and self.applied.live.get(job) is None:
                message = self.applied.messages.get(job)
                if message is not None and self.job_source and self.job_source.attached(job):
                    await self.apply(job, message, again=True)

    async def _restore_lost(self, actuator: PowerCapActuator, job: str) -> None:
        """The GPUs ``job`` capped and no longer holds get their original limits back."""
        lost = self._capped[job] - self.gpus.held.get(job, set())
        if not lost:
            return
        await asyncio.to_thread(actuator.restore, lost)
        log.warning(
            "%s no longer holds GPU(s) %s here: their power limit is restored",
            job,
            ", ".join(map(str, sorted(lost))),
        )
        self._capped[job] -= lost
        if not self._capped[job]:
            del self._capped[job]
            self.applied.live.pop(job, None)  # applied again if its GPUs come back
