"""TOML configuration -> typed, frozen models. Strict: every problem names its key and the file.

One file configures both daemons; each reads the sections it needs. Command-line flags are
applied as overrides on the raw mapping before validation, so they are checked the same way.
"""

from __future__ import annotations

import fnmatch
import socket
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from hyperagent.errors import ConfigError, ConfigProblem
from hyperagent.names import check_name, name_problem, safe_name

DEFAULT_METRICS_PORT = 10478
"""Outside 9100-9999, which the Prometheus exporter port registry has fully allocated."""

QUANTUM_COEFFICIENTS_FILE = "quantum_coefficients.toml"
"""Package data: each model's coefficient with its basis and source (see the file)."""


def load_quantum_coefficients() -> dict[str, float]:
    """The shipped coefficients by model key (``hyperagent/data/quantum_coefficients.toml``)."""
    text = resources.files("hyperagent").joinpath("data", QUANTUM_COEFFICIENTS_FILE).read_text()
    return {key: float(entry["q"]) for key, entry in tomllib.loads(text)["models"].items()}


DEFAULT_QUANTUM_COEFFICIENTS: dict[str, float] = load_quantum_coefficients()

Name = Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")]
TopicName = Annotated[str, AfterValidator(check_name)]
"""A cluster, node or job name: one MQTT topic level on every supported broker
(:mod:`hyperagent.names`)."""
PositiveSeconds = Annotated[float, Field(gt=0, le=3600)]


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def _check_address(value: str) -> str:
    if value == "":
        return value
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f'expected HOST:PORT (or "" to disable), got {value!r}')
    return value


class AgentSection(_Model):
    interval_s: PositiveSeconds = 1.0
    """A collection cycle this often: every source read (or its last readings repeated, for a source
    with its own interval), the indicators computed, /metrics updated."""
    telemetry_interval_s: PositiveSeconds = 1.0
    """Publish telemetry over MQTT at most this often (the latest cycle's): an agent collecting
    at 10 Hz serves /metrics from every cycle but costs the broker and the coordinator one
    message a second."""
    metrics_address: str = f"127.0.0.1:{DEFAULT_METRICS_PORT}"
    """Where /metrics listens, HOST:PORT; "" serves none. The shipped file listens on all addresses
    (``0.0.0.0:10478``) for Prometheus."""
    state_dir: Path = Path("/var/lib/hyperagent")
    """The agent's state: the original power limits it changed (``power-limits.json``), the
    settings applied per job (``applied-settings.json``) and the on-disk spool of acks and
    reports (``spool/``); an agent that may not create it exits 2."""

    _address = field_validator("metrics_address")(_check_address)


@dataclass(frozen=True)
class BrokerUrl:
    """One broker address of ``mqtt.url``."""

    url: str
    host: str
    port: int
    tls: bool


def _broker_url(value: str) -> BrokerUrl:
    """``value`` parsed, or ValueError naming it."""
    parts = urlsplit(value)
    if parts.scheme not in ("mqtt", "mqtts", "tcp") or not parts.hostname:
        raise ValueError(f"expected mqtt://HOST[:PORT] or mqtts://HOST[:PORT], got {value!r}")
    try:
        port = parts.port
    except ValueError as e:
        raise ValueError(f"bad port in {value!r}") from e
    tls = parts.scheme == "mqtts"
    return BrokerUrl(value, parts.hostname, port or (8883 if tls else 1883), tls)


class MqttSection(_Model):
    enabled: bool = True
    """Connect to the broker; false (``--no-broker``): /metrics only, no telemetry and no tuning."""
    url: str | tuple[str, ...] = "mqtt://127.0.0.1:1883"
    """The broker, or several addresses of one (clustered) broker: the daemons connect to
    them in turn, and to the next one at once when the connection drops."""
    client_id: str | None = None
    """The MQTT client id (default: ``hyperagent-agent-<node>`` or
    ``hyperagent-coordinator-<cluster>``; on RabbitMQ leave it unset: the broker's permissions name
    these ids)."""
    username: str | None = None
    """The broker user (default: the node name on an agent, ``coordinator`` on the coordinator),
    used with ``password_file``."""
    password_file: Path | None = None
    """A file holding the broker user's password; none: connect without one."""
    tls_ca_file: Path | None = None
    """CA that signed the broker's certificate; required by mqtts:// URLs."""
    tls_cert_file: Path | None = None
    """This client's certificate, when the broker asks for one."""
    tls_key_file: Path | None = None
    """The key of ``tls_cert_file``."""
    keepalive_s: Annotated[int, Field(ge=5, le=3600)] = 30
    """MQTT keep-alive: the broker drops (and publishes the last will of) a client it has not heard
    from in 1.5 times this."""
    outbox_size: Annotated[int, Field(ge=1, le=1_000_000)] = 1000
    """Telemetry messages waiting for the broker at most; beyond it the oldest is dropped
    (``hyperagent_mqtt_dropped_total``). Acks and reports wait in the on-disk spool instead."""
    reconnect_min_s: PositiveSeconds = 0.5
    """The first wait after every address of ``url`` failed in a row ..."""
    reconnect_max_s: PositiveSeconds = 30.0
    """... doubling up to this (jittered)."""
    persistent_session: bool | None = None
    """Keep the MQTT session (subscriptions, queued messages) across connections; default: the
    coordinator does, an agent does not. On a RabbitMQ cluster set it on the agents too: a
    session's queue is then a quorum queue (``mqtt.durable_queue_type = quorum``) that any node
    serves after one dies, where a clean session's queue on the dead node keeps the agent from
    subscribing anywhere until that node is back."""

    @field_validator("url")
    @classmethod
    def _url(cls, value: str | tuple[str, ...]) -> str | tuple[str, ...]:
        urls = (value,) if isinstance(value, str) else value
        if not urls:
            raise ValueError("lists no broker: give one URL or a list of them")
        for index, url in enumerate(urls):
            try:
                _broker_url(url)
            except ValueError as e:
                where = "" if isinstance(value, str) else f"entry {index}: "
                raise ValueError(f"{where}{e}") from None
        if len(set(urls)) < len(urls):
            raise ValueError("lists a URL twice")
        return value

    @model_validator(mode="after")
    def _tls(self) -> MqttSection:
        secured = [b.url for b in self.brokers if b.tls]
        if secured and self.tls_ca_file is None:
            raise ValueError(f"an mqtts:// url needs tls_ca_file ({', '.join(secured)})")
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ValueError("tls_cert_file and tls_key_file go together")
        return self

    @property
    def brokers(self) -> tuple[BrokerUrl, ...]:
        """Each address of ``url``, in the order given."""
        urls = (self.url,) if isinstance(self.url, str) else self.url
        return tuple(_broker_url(url) for url in urls)

    @property
    def tls(self) -> bool:
        """The first address uses TLS."""
        return self.brokers[0].tls

    @property
    def host(self) -> str:
        """The first address's host."""
        return self.brokers[0].host

    @property
    def port(self) -> int:
        """The first address's port."""
        return self.brokers[0].port


class NvmlSection(_Model):
    enabled: bool = True
    """Read NVIDIA GPUs through NVML (``nvidia-ml-py``); without a driver the source is up 0."""
    dump: Path | None = None
    """Replay this ``nvidia-smi -q -x`` dump (or query-gpu capture) instead of the driver."""
    health_interval_s: Annotated[float, Field(ge=0, le=3600)] = 10.0
    """Read ECC counts, retired pages, remapped rows, the power limit range and NVLink errors
    at most this often (they change rarely; 0 reads them every cycle), and GPU temperature,
    memory, clocks, PCIe throughput and MIG devices too: the NVML calls without a field id
    (power, energy, utilisation and throttling are read every cycle)."""


class AcceleratorSection(_Model):
    """A vendor library of the device layer (``[sources.amdsmi]``, ``[sources.hlml]``): off
    unless enabled; enabled where the library is missing, it reports no devices (up 0)."""

    enabled: bool = False
    """Read this vendor's devices (needs its library: ``hyperagent[amd]`` or
    ``hyperagent[gaudi]``)."""


class SmiTextSection(_Model):
    """A vendor tool read as text (``[sources.npu_smi]``, ``[sources.cnmon]``,
    ``[sources.xpu_smi]``): telemetry only."""

    enabled: bool = False
    """Read this vendor tool's table (telemetry only: no power caps)."""
    command: tuple[str, ...] = ()
    """The command line (default: the tool's own, ``npu-smi info``, ``cnmon`` or ``xpu-smi dump
    -d -1 -m 0,1,2,3,4,8,17,18 -n 1``)."""
    timeout_s: PositiveSeconds = 1.5
    """Bound of one run of the tool (below ``sources.timeout_s``)."""
    interval_s: PositiveSeconds = 5.0
    """Run the tool at most this often; cycles in between repeat its last readings."""


class HostSection(_Model):
    enabled: bool = True
    """Read the host's CPU, memory, swap, memory stall time and NUMA balancing from procfs."""


class JobSection(_Model):
    enabled: bool = True
    """Serve the job channel: training ranks report steps and take settings over ``socket``."""
    socket: Path = Path("/run/hyperagent/job.sock")
    """The job channel's unix socket (``SOCK_SEQPACKET``); the ranks' ``HYPERAGENT_JOB_SOCKET``
    names another. An agent that cannot listen on it exits 2."""
    allowed_users: tuple[str | int, ...] = ()
    """Users (names or uids) whose processes may report jobs, besides the agent's own user."""
    allowed_groups: tuple[str | int, ...] = ()
    """Groups (names or gids) whose members may report jobs (primary or supplementary)."""
    max_jobs: Annotated[int, Field(ge=1, le=4096)] = 16
    """Live jobs (a rank connected) at most; a new job over the bound releases the oldest dead job
    at once, and is refused (``too_many_jobs``) only while live jobs hold every slot."""
    max_ranks: Annotated[int, Field(ge=1, le=4096)] = 64
    """Connected ranks per job at most."""
    max_jobs_per_user: Annotated[int, Field(ge=1, le=4096)] = 8
    """Live jobs of one user at most (so that one user cannot take every job slot)."""
    max_connections_per_user: Annotated[int, Field(ge=1, le=65536)] = 128
    """Connections of one user at most, whether they said hello or not."""
    release_after_s: Annotated[float, Field(ge=0)] = 600.0
    """A job id stays bound to its user this long after its last rank disconnected."""
    scontrol: tuple[str, ...] = ("scontrol",)
    """How to ask Slurm's controller about a job whose ranks' cgroup names one (``scontrol
    show job -d``: its user, nodes and GPUs); empty: never ask."""
    squeue: tuple[str, ...] = ("squeue",)
    """How to list the jobs Slurm runs on this node (``squeue``), whose GPUs no rank outside
    them may be given."""
    slurm_node: str | None = None
    """This node's name in Slurm (default: ``node``)."""


class IpmiSection(_Model):
    enabled: bool = True
    """Without a BMC (no /dev/ipmi0 for the local interface) the source is quietly up 0."""
    backend: Literal["ipmitool", "rmcp"] = "ipmitool"
    """ipmitool: runs `ipmitool sdr elist` and `dcmi power reading`; rmcp: python-ipmi."""
    interface: Literal["open", "lan", "lanplus"] = "open"
    """``open``: the local BMC (``/dev/ipmi0``); ``lan``/``lanplus``: a BMC over the network at
    ``host``."""
    host: str | None = None
    """The BMC's address, for ``lan``/``lanplus``."""
    port: Annotated[int, Field(gt=0, lt=65536)] = 623
    """The BMC's RMCP port."""
    username: str | None = None
    """The BMC user, over the LAN."""
    password_file: Path | None = None
    """A file holding the BMC user's password (given to ipmitool as ``-f``, never on its command
    line)."""
    cipher_suite: Literal[1, 2, 3, 15, 16, 17] | None = None
    """RMCP+ cipher suite (``lanplus``); unset: ipmitool's default, python-ipmi tries 17 then 3."""
    privilege: Literal["user", "operator", "administrator"] = "user"
    """The privilege level asked for over the LAN (sensor reads need ``user``)."""
    timeout_s: PositiveSeconds = 1.5
    """Bound of one read; keep it below sources.timeout_s."""
    dcmi: bool = True
    """Also read the DCMI power reading (a BMC that refuses DCMI is not asked again)."""
    interval_s: PositiveSeconds = 5.0
    """Read the BMC at most this often: its fans, temperatures and DCMI power change over
    seconds, and a full SDR read over KCS keeps many BMCs busy for a second or more. Cycles in
    between repeat the last readings."""

    @model_validator(mode="after")
    def _lan(self) -> IpmiSection:
        if self.interface != "open" and not self.host:
            raise ValueError(f"interface {self.interface} needs a host")
        if self.backend == "rmcp" and self.interface == "open":
            raise ValueError("the rmcp backend talks to a BMC over the LAN: set interface and host")
        return self


class RdmaSection(_Model):
    enabled: bool = True
    """Without /sys/class/infiniband the source is quietly up 0."""
    sysfs_root: Path = Path("/sys")
    """Where ``class/infiniband`` and ``class/net`` are read (a replay reads its capture's copy)."""
    netdevs: tuple[str, ...] = ()
    """RoCE netdevs the sysfs tree does not link to a port (added to the discovered ones)."""
    commands: bool = True
    """Run `rdma -j resource show` and `ethtool -S`; false reads sysfs only."""
    command_timeout_s: PositiveSeconds = 1.5
    """Bound of one run of ``rdma`` or ``ethtool`` (below ``sources.timeout_s``)."""
    commands_interval_s: Annotated[float, Field(ge=0, le=3600)] = 5.0
    """Run the commands at most this often (each run starts processes); the sysfs counters are
    read every cycle. 0 runs them every cycle."""
    interval_s: PositiveSeconds | None = None
    """Read at most this often; None reads every collection cycle."""
    rescan_interval_s: Annotated[float, Field(ge=0, le=3600)] = 10.0
    """Walk the sysfs tree again this often (devices and ports that come or go, firmware,
    netdevs, MTUs); in between each read is one pread(2) per held counter or port-state file.
    0 walks it on every read."""


class PduTargetSection(_Model):
    name: Name
    """The PDU's name: the ``pdu`` label of its series, unique among the targets."""
    host: Annotated[str, Field(min_length=1)]
    """The PDU's address (SNMPv2c)."""
    port: Annotated[int, Field(gt=0, lt=65536)] = 161
    """The PDU's SNMP port."""
    community: str = "public"
    """SNMPv2c community."""
    vendor: Literal[
        "auto",
        "apc",
        "raritan",
        "raritan-px1",
        "servertech",
        "servertech-sentry3",
        "eaton",
        "eaton-revelation",
        "vertiv",
        "tripplite",
        "hpe",
        "hpe-pdu3",
        "dell",
        "enlogic",
        "panduit",
        "schleifenbauer",
        "entity",
    ] = "auto"
    """The PDU's MIB profile; ``auto`` chooses it from the PDU's sysObjectID (a PDU no profile knows
    reports ENTITY-SENSOR-MIB sensors, if any)."""
    outlets: tuple[str, ...] = ()
    """This node's outlets on the PDU (ids or names): their sum is the node's wall power. The
    node reads only these rows; ``["*"]`` reads every outlet."""
    inlets: bool = False
    """Read the PDU's inlet and phase figures: set on one node per PDU."""

    @model_validator(mode="after")
    def _reads_something(self) -> PduTargetSection:
        if not self.outlets and not self.inlets:
            raise ValueError("lists no outlets and inlets is false: this node would read nothing")
        if "*" in self.outlets and len(self.outlets) > 1:
            raise ValueError('outlets = ["*"] reads every outlet and stands alone')
        return self


class PduSection(_Model):
    enabled: bool = True
    """Read the ``targets``; with none, the source reads nothing."""
    timeout_s: Annotated[float, Field(gt=0, le=30)] = 1.0
    """Bound of one SNMP request (a node's read is one or two GETs; the inlets node walks its
    inlet and phase tables, a few requests more)."""
    retries: Annotated[int, Field(ge=0, le=5)] = 1
    """SNMP retries of a request that timed out."""
    targets: tuple[PduTargetSection, ...] = ()
    """The PDUs this node reads (``[[sources.pdu.targets]]``)."""
    interval_s: PositiveSeconds = 5.0
    """Poll the PDUs at most this often: PDU agents are slow and update their meters every
    few seconds, and every node of a rack asks the same PDU."""


class SourcesSection(_Model):
    timeout_s: PositiveSeconds = 2.0
    """Bound of every source's read and of every NVML call; a source or call over it is reported (up
    0, ``hyperagent_device_call_failures_total``), never waited on."""
    nvml: NvmlSection = NvmlSection()
    host: HostSection = HostSection()
    job: JobSection = JobSection()
    ipmi: IpmiSection = IpmiSection()
    rdma: RdmaSection = RdmaSection()
    pdu: PduSection = PduSection()
    amdsmi: AcceleratorSection = AcceleratorSection()
    hlml: AcceleratorSection = AcceleratorSection()
    npu_smi: SmiTextSection = SmiTextSection()
    cnmon: SmiTextSection = SmiTextSection()
    xpu_smi: SmiTextSection = SmiTextSection()

    @property
    def intervals(self) -> dict[str, float]:
        """Source name -> the least time between two reads, where one is set."""
        slowed = {
            "ipmi": self.ipmi.interval_s,
            "rdma": self.rdma.interval_s,
            "pdu": self.pdu.interval_s,
            "npu_smi": self.npu_smi.interval_s if self.npu_smi.enabled else None,
            "cnmon": self.cnmon.interval_s if self.cnmon.enabled else None,
            "xpu_smi": self.xpu_smi.interval_s if self.xpu_smi.enabled else None,
        }
        return {name: interval for name, interval in slowed.items() if interval is not None}

    @model_validator(mode="after")
    def _bounds(self) -> SourcesSection:
        bounds = {
            "ipmi.timeout_s": self.ipmi.timeout_s if self.ipmi.enabled else 0.0,
            "rdma.command_timeout_s": self.rdma.command_timeout_s if self.rdma.enabled else 0.0,
            "npu_smi.timeout_s": self.npu_smi.timeout_s if self.npu_smi.enabled else 0.0,
            "cnmon.timeout_s": self.cnmon.timeout_s if self.cnmon.enabled else 0.0,
            "xpu_smi.timeout_s": self.xpu_smi.timeout_s if self.xpu_smi.enabled else 0.0,
        }
        for name, bound in bounds.items():
            if bound >= self.timeout_s:
                raise ValueError(
                    f"sources.{name} must be below sources.timeout_s, so a slow device is cut "
                    "off by its own bound"
                )
        return self


class IndicatorsSection(_Model):
    quantum_coefficients: dict[str, Annotated[float, Field(gt=0, le=100)]] = Field(
        default_factory=lambda: dict(DEFAULT_QUANTUM_COEFFICIENTS)
    )
    """Compute quanta one fully busy GPU of a model is worth (A100 = 1), by model key (a model
    matches the longest key in its name); these replace the shipped table, so name every model the
    cluster has. A model no key matches counts as 1 and is warned about."""


class ActuationSection(_Model):
    power_cap: bool = True
    """Apply the coordinator's power caps through the device library (and give the original limits
    back); false: this node leaves the power cap out of its jobs' tuning."""
    min_power_w: Annotated[float, Field(gt=0)] | None = None
    """This node's lowest power cap (W): settings below it are refused."""
    max_power_w: Annotated[float, Field(gt=0)] | None = None
    """This node's highest power cap (W): settings above it are refused."""
    allowed_jobs: tuple[TopicName, ...] = ()
    """Jobs whose settings this node applies; empty means every job in its cluster."""

    @model_validator(mode="after")
    def _bounds(self) -> ActuationSection:
        if self.min_power_w and self.max_power_w and self.min_power_w > self.max_power_w:
            raise ValueError("min_power_w is above max_power_w")
        return self


class AttributionSection(_Model):
    """Which scheduler job holds each GPU, for jobs that never report through the job channel
    (docs/telemetry/attribution.md, "Jobs on GPUs")."""

    mode: Literal["cgroup", "mapping", "off"] = "cgroup"
    """``cgroup``: the Slurm cgroup of the processes NVML shows on each GPU (under
    ``proc_root``); ``mapping``: a dcgm-exporter ``--hpc-job-mapping-dir`` directory
    (``mapping_dir``); ``off``: only the jobs that report through the job channel."""
    proc_root: Path = Path("/proc")
    """Where the processes' ``cgroup``, ``status`` and ``environ`` files are (a replay with a
    ``proc/`` folder reads that one unless this is set)."""
    mapping_dir: Path | None = None
    """The job-mapping directory: one file per GPU index (or ``GPU.MIG`` index) holding the ids
    of the jobs on that GPU, one per line, as the scheduler's prolog writes them."""
    interval_s: PositiveSeconds = 5.0
    """How often the GPUs' processes (or the mapping directory) are looked at again."""

    @model_validator(mode="after")
    def _mapping(self) -> AttributionSection:
        if self.mode == "mapping" and self.mapping_dir is None:
            raise ValueError('mode = "mapping" needs mapping_dir (the job-mapping directory)')
        if self.mode == "mapping" and self.mapping_dir is not None:
            if self.mapping_dir.exists() and not self.mapping_dir.is_dir():
                raise ValueError(f"mapping_dir {self.mapping_dir} is not a directory")
        return self


class SecuritySection(_Model):
    signing_key_file: Path | None = None
    """The coordinator's Ed25519 private key (PEM) that signs settings: on the coordinator's
    host only, readable by it alone. Agents never read it."""
    trusted_keys: tuple[Path, ...] = ()
    """Public keys whose settings an agent applies: files, or directories of ``*.pub`` files
    (two keys during a rotation); none: the agent refuses every setting."""
    settings_max_age_s: Annotated[float, Field(gt=0)] = 86400.0
    """A new settings version issued longer ago than this is refused (a replayed or left-over
    message); the version an agent already applies is re-applied whatever its age."""
    clock_skew_s: Annotated[float, Field(ge=0)] = 60.0
    """Tolerated clock difference between coordinator and agents: settings issued up to this
    far in the future, or this much past the maximum age, are still taken."""

    @model_validator(mode="before")
    @classmethod
    def _no_shared_key(cls, data: Any) -> Any:
        if isinstance(data, dict) and "settings_key_file" in data:
            raise ValueError(
                "settings_key_file (an HMAC key every node held) is replaced by signing_key_file "
                "on the coordinator and trusted_keys on the agents (docs/operations/keys.md)"
            )
        return data


Backend = Literal["nccl", "gloo", "mpi", "horovod", "deepspeed"]
Objective = Literal["throughput", "energy"]


class StartSettings(_Model):
    bucket_mb: Annotated[int, Field(ge=1, le=256)] = 25
    """DDP gradient bucket (MiB) the job runs before tuning: the baseline measured first, kept
    unless a setting is confirmed better (the same user's finished tuning of the same fingerprint
    starts from its result instead)."""
    chunk_kb: Annotated[int, Field(ge=64, le=65536)] = 4096
    """Gradient chunk (KiB) the job starts with."""
    power_cap_w: Annotated[float, Field(gt=0)] | None = None
    """GPU power cap (W) the job starts with; unset: the top of ``power_limits_w``."""
    allreduce: Literal["ring", "tree", "halving_doubling"] = "ring"
    """AllReduce algorithm the job starts with."""


class TrialPlanSection(_Model):
    settle_steps: Annotated[int, Field(ge=0)] = 10
    """After a settings change, let at least this many steps pass ..."""
    settle_s: Annotated[float, Field(ge=0)] = 3.0
    """... and this many seconds (a power change waits longer: the slowest cap latency measured,
    plus NVML's averaging window) before measuring."""
    measure_steps: Annotated[int, Field(ge=1)] = 40
    """Measure at least this many steps in all ..."""
    measure_s: Annotated[float, Field(ge=0)] = 5.0
    """... and this many seconds, split over ``windows`` windows."""
    windows: Annotated[int, Field(ge=1, le=64)] = 4
    """Windows measured at least: their spread gives the score's standard error, which the optimiser
    is told."""
    target_rel_se: Annotated[float, Field(ge=0, le=1)] = 0.02
    """After ``windows`` windows, measure on until the score's standard error is this fraction
    of it ..."""
    max_windows: Annotated[int, Field(ge=0, le=1024)] = 0
    """... or this many windows are done (0: four times ``windows``)."""


WILDCARDS = frozenset("*?[")


def _check_pattern(pattern: str) -> str:
    """A job name, where shell wildcards (``*``, ``?``, ``[!...]``) may stand."""
    problem = name_problem(pattern, also="*?[]!")
    if problem is not None:
        raise ValueError(problem)
    return pattern


JobPattern = Annotated[str, AfterValidator(_check_pattern)]
"""A job id, or a shell-style pattern of ids (``slurm-*``, ``llama-?``)."""


class JobPolicy(_Model):
    """How the coordinator tunes the jobs it finds: ``[coordinator.defaults]``, and what a
    ``[[coordinator.jobs]]`` rule overrides for the ids it matches."""

    tune: Literal["asked", "all", "never"] = "asked"
    """Which jobs are tuned: "asked", those whose ranks ask (TunedDDP does; JobReporter with
    ``tune=True`` or ``HYPERAGENT_TUNE=1``); "all", every job whose ranks do not refuse
    (``tune=False``); "never", none (they are still seen, on /metrics). A rule naming one job
    id exactly (no wildcard) tunes that job unless it says otherwise."""
    users: tuple[str | int, ...] = ()
    """The users (names or uids) whose jobs may be tuned; empty: anyone's."""
    backend: Backend | None = None
    """The job's collective backend; None: as its ranks say (nccl when they do not)."""
    gradient_dtype: Literal["fp32", "fp16", "bf16"] = "fp32"
    """Gradient element type (DeepSpeed's bucket sizes are in elements)."""
    objective: Objective = "throughput"
    """throughput: samples per second; energy: samples per joule of the job's GPUs."""
    mode: Literal["tune", "recommend"] = "tune"
    """recommend: publish nothing; report what would be set, and why."""
    power_budget_w: Annotated[float, Field(gt=0)] | None = None
    """Throughput under a power budget: trials whose GPUs average more than this per node are
    infeasible (a constraint, not a weighted sum)."""
    search_power_cap: bool | None = None
    """Search the power cap (needs ``power_limits_w``). Default: for the energy objective and
    under ``power_budget_w``; for plain throughput the cap stays at the highest limit."""
    abort_below: Annotated[float, Field(ge=0, le=1)] = 0.7
    """Abort a trial as soon as its partial score is below this fraction of the baseline."""
    early_stop: bool = True
    """Stop a search trial's measurement (not the baseline's, never a confirmation's) once its
    windows show, at the confirmations' confidence, that it is worse than the best trial so
    far, or better by more than the noise; the tuner is told the windows' mean with its
    standard error (:mod:`hyperagent.tuner.early`). False: every trial runs its whole plan."""
    confirm_best: bool = True
    """Measure the best settings once more before declaring them best."""
    drift_threshold: Annotated[float, Field(gt=0, le=1)] = 0.15
    """Re-tune when the job's throughput stays this fraction below the tuned score ..."""
    drift_sustained_s: PositiveSeconds = 300.0
    """... for this long."""
    model_params_b: Annotated[float, Field(gt=0)] | None = None
    """The model's size in billions of parameters, part of the job's fingerprint (default: as the
    ranks say)."""
    gpu_model: str | None = None
    """With the node count and backend, identify the job: a finished tuning of the same
    fingerprint warm-starts the same user's next one (default: as the ranks and the nodes
    say)."""
    trials: Annotated[int, Field(ge=1, le=10_000)] = 30
    """Search trials at most in a tuning round (the confirmations come on top)."""
    patience: Annotated[int, Field(ge=1)] = 10
    """End the search early when the best score has not improved by more than 1% over this many
    trials."""
    power_limits_w: tuple[float, float] | None = None
    """The power caps searched (W); default: the range every node's GPUs take, as the agents
    say."""
    start: StartSettings = StartSettings()
    """The settings a job starts from."""
    plan: TrialPlanSection = TrialPlanSection()
    """How each trial settles and measures."""
    ack_timeout_s: PositiveSeconds = 30.0
    """Every node acks a settings version within this, or the trial is a pause, not a trial (the
    time counts only while connected to the broker)."""
    trial_timeout_s: PositiveSeconds = 600.0
    """A trial whose nodes measure nothing within this is a pause, not a trial."""
    seed: int = 0
    """The optimiser's random seed (each round adds its number)."""
    ranks_wait_s: PositiveSeconds = 120.0
    """A job tunes once every rank of its world size is attached; after this long without
    them it says which are missing (and keeps waiting)."""
    end_after_s: PositiveSeconds = 10.0
    """A job none of whose ranks has been attached anywhere for this long has ended."""
    release_after_s: Annotated[float, Field(ge=0, le=86400)] = 300.0
    """An ended or failed job's state (and series) stays this long, then goes."""
    max_retries: Annotated[int, Field(ge=0, le=10_000)] = 20
    """A run that cannot be measured is retried this many times (with back-off up to 5
    minutes apart), then the job fails with the reason."""

    @field_validator("power_limits_w")
    @classmethod
    def _limits(cls, value: tuple[float, float] | None) -> tuple[float, float] | None:
        if value is not None and not 0 < value[0] <= value[1]:
            raise ValueError("expected [low, high] watts with 0 < low <= high")
        return value


class JobRule(JobPolicy):
    """``[[coordinator.jobs]]``: the jobs whose id matches ``id`` (a name or a pattern; the
    first rule that matches applies), with what they override of the defaults."""

    id: JobPattern
    """The jobs this rule applies to: one job id, or a shell pattern of ids (``slurm-*``)."""
    nodes: tuple[TopicName, ...] = ()
    """A fixed node set (optional: a job's nodes are the agents that carry it)."""

    @property
    def exact(self) -> bool:
        """The rule names one job (no wildcard)."""
        return not WILDCARDS & set(self.id)

    def matches(self, job: str) -> bool:
        return self.id == job if self.exact else fnmatch.fnmatchcase(job, self.id)


class JobTuningSection(JobPolicy):
    """One job's tuning as resolved: the defaults, the rule that matches it, what its ranks
    said (:meth:`CoordinatorSection.tuning`)."""

    id: TopicName
    nodes: Annotated[tuple[TopicName, ...], Field(min_length=1)]
    backend: Backend = "nccl"

    @model_validator(mode="after")
    def _power_search(self) -> JobTuningSection:
        if self.search_power_cap and self.power_limits_w is None:
            raise ValueError("search_power_cap = true needs power_limits_w = [low, high]")
        return self


class CoordinatorSection(_Model):
    metrics_address: str = f"127.0.0.1:{DEFAULT_METRICS_PORT + 1}"
    """Where the coordinator's /metrics listens, HOST:PORT; "" serves none."""
    state_dir: Path = Path("/var/lib/hyperagent-coordinator")
    """Where the tuning journals live (one file per job)."""
    defaults: JobPolicy = JobPolicy()
    """How every job found is tuned (``[coordinator.defaults]``)."""
    jobs: tuple[JobRule, ...] = ()
    """Rules by job id that override the defaults (``[[coordinator.jobs]]``): optional, jobs are
    found without them."""
    max_jobs: Annotated[int, Field(ge=1, le=100_000)] = 1000
    """Jobs tuned at once at most; a job found beyond it waits for a slot (said once)."""
    journal_keep_days: Annotated[float, Field(gt=0)] = 30.0
    """Journals of jobs that are no longer live are deleted this long after their last entry
    ..."""
    journal_keep: Annotated[int, Field(ge=1, le=1_000_000)] = 1000
    """... and beyond this many files, the oldest first (a live job's journal is kept)."""

    _address = field_validator("metrics_address")(_check_address)

    def rule_for(self, job: str) -> JobRule | None:
        """The first ``[[coordinator.jobs]]`` rule that matches ``job``."""
        return next((rule for rule in self.jobs if rule.matches(job)), None)

    def tuning(
        self, job: str, nodes: Sequence[str], said: Mapping[str, Any] | None = None
    ) -> JobTuningSection:
        """The tuning of ``job`` on ``nodes``: the defaults, overridden by what its rule sets,
        then what the ranks and nodes said (``backend``, ``model_params_b``, ``gpu_model``,
        ``power_limits_w``) where neither the defaults nor the rule set it. Raises ValueError
        (pydantic's) when the combination is invalid."""
        rule = self.rule_for(job)
        merged = self.defaults.model_dump()
        explicit = set(self.defaults.model_fields_set)
        if rule is not None:
            for key in rule.model_fields_set - {"id", "nodes"}:
                merged[key] = getattr(rule, key)
            explicit |= rule.model_fields_set
            if rule.nodes:
                nodes = rule.nodes
        for key, value in (said or {}).items():
            if key not in explicit and value is not None:
                merged[key] = value
        if merged.get("backend") is None:
            merged["backend"] = "nccl"
        return JobTuningSection.model_validate({**merged, "id": job, "nodes": tuple(nodes)})

    def tune_policy(self, job: str) -> str:
        """Which of the job's own wishes decide (:attr:`JobPolicy.tune`) for ``job``."""
        rule = self.rule_for(job)
        if rule is None:
            return self.defaults.tune
        if "tune" in rule.model_fields_set:
            return rule.tune
        return "all" if rule.exact else self.defaults.tune

    def users_for(self, job: str) -> tuple[str | int, ...]:
        rule = self.rule_for(job)
        if rule is not None and "users" in rule.model_fields_set:
            return rule.users
        return self.defaults.users


class Config(_Model):
    """The whole configuration. Unknown keys are errors."""

    node: TopicName = Field(default_factory=lambda: safe_name(socket.gethostname().split(".")[0]))
    """This node's name: its topic level and its broker user (default: the short host name)."""
    cluster: TopicName = "default"
    """The cluster's name: every topic lives under ``hyperagent/v1/<cluster>/``, so a coordinator
    tunes the jobs of its cluster only."""
    agent: AgentSection = AgentSection()
    mqtt: MqttSection = MqttSection()
    sources: SourcesSection = SourcesSection()
    indicators: IndicatorsSection = IndicatorsSection()
    actuation: ActuationSection = ActuationSection()
    attribution: AttributionSection = AttributionSection()
    security: SecuritySection = SecuritySection()
    coordinator: CoordinatorSection = CoordinatorSection()


def _problems(error: ValidationError) -> list[ConfigProblem]:
    problems = []
    for item in error.errors():
        key = ".".join(str(part) for part in item["loc"]) or "(top level)"
        reason = item["msg"]
        if item["type"] == "extra_forbidden":
            reason = "unknown key"
        elif item["type"] == "value_error" and "error" in item.get("ctx", {}):
            reason = str(item["ctx"]["error"])
        problems.append(ConfigProblem(key, reason))
    return problems


def _set_dotted(data: dict[str, Any], dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node = data
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError([ConfigProblem(dotted, f"{part} is not a table")])
        node = child
    node[parts[-1]] = value


def build_config(
    data: Mapping[str, Any], overrides: Mapping[str, Any] | None = None, file: str | None = None
) -> Config:
    """Validate a raw mapping (plus dotted-key overrides) into a Config, or raise ConfigError."""
    raw = _deep_copy(data)
    for dotted, value in (overrides or {}).items():
        _set_dotted(raw, dotted, value)
    try:
        config = Config.model_validate(raw)
    except ValidationError as e:
        raise ConfigError(_problems(e), file) from None
    problems = _duplicates(
        config.sources.pdu.targets,
        "sources.pdu.targets",
        "name",
        "two targets of one name would expose the same series",
    ) + _duplicates(
        config.coordinator.jobs,
        "coordinator.jobs",
        "id",
        "two jobs of one id would share one journal file and one settings topic",
    )
    problems += _unresolvable(config.coordinator)
    if problems:
        raise ConfigError(problems, file)
    return config


def _unresolvable(coordinator: CoordinatorSection) -> list[ConfigProblem]:
    """A problem for the defaults, and for each rule, that no job could be tuned with (each
    tried alone, for a job on one node)."""
    trials = [("coordinator.defaults", coordinator.model_copy(update={"jobs": ()}))]
    for index, rule in enumerate(coordinator.jobs):
        alone = (rule.model_copy(update={"id": "job"}),)
        trials.append((f"coordinator.jobs.{index}", coordinator.model_copy(update={"jobs": alone})))
    problems = []
    for key, section in trials:
        try:
            section.tuning("job", ["node"])
        except ValidationError as e:
            problems += [ConfigProblem(key, problem.reason) for problem in _problems(e)]
    return problems


def _duplicates(items: Sequence[BaseModel], key: str, field: str, why: str) -> list[ConfigProblem]:
    """A problem for each item of ``items`` whose ``field`` an earlier item has already."""
    first: dict[Any, int] = {}
    problems = []
    for index, item in enumerate(items):
        value = getattr(item, field)
        if value in first:
            problems.append(
                ConfigProblem(
                    f"{key}.{index}.{field}",
                    f"duplicate {field} {value!r} (also {key}.{first[value]}.{field}): {why}",
                )
            )
        else:
            first[value] = index
    return problems


def load_config(path: Path | None, overrides: Mapping[str, Any] | None = None) -> Config:
    """Read and validate a TOML file (None means defaults only)."""
    data: dict[str, Any] = {}
    if path is not None:
        try:
            data = tomllib.loads(path.read_text(encoding="utf-8"))
        except OSError as e:
            raise ConfigError([ConfigProblem("(file)", e.strerror or str(e))], str(path)) from e
        except tomllib.TOMLDecodeError as e:
            raise ConfigError([ConfigProblem("(syntax)", str(e))], str(path)) from e
    return build_config(data, overrides, str(path) if path else None)


def _deep_copy(data: Mapping[str, Any]) -> dict[str, Any]:
    return {k: _deep_copy(v) if isinstance(v, Mapping) else v for k, v in data.items()}
