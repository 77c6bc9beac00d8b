"""Command-line entry points: agent, coordinator, demo, record, report, metrics, check-config,
keys, nccl-plugin."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import errno
import importlib.util
import logging
import os
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Coroutine, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hyperagent import __version__
from hyperagent.config import Config, load_config
from hyperagent.errors import ConfigError, ConfigProblem, HyperagentError
from hyperagent.signing import (
    KeyFileError,
    SigningKey,
    TrustedKeys,
    key_id,
    load_signing_key,
    public_key_of,
    write_key_pair,
)

if TYPE_CHECKING:
    from hyperagent.agent import Agent
    from hyperagent.exporter import MetricsServer
    from hyperagent.replay import Recorder

log = logging.getLogger("hyperagent")

_COORDINATOR_MODULES = (
    ("skopt", "scikit-optimize"),
    ("sklearn", "scikit-learn"),
    ("numpy", "numpy"),
    ("scipy", "scipy"),
    ("threadpoolctl", "threadpoolctl"),
)
_REPORT_MODULES = (("matplotlib", "matplotlib"),)
EXTRAS: dict[str, tuple[tuple[str, str], ...]] = {
    "coordinator": _COORDINATOR_MODULES,
    "report": _REPORT_MODULES,
    "demo": (*_COORDINATOR_MODULES, *_REPORT_MODULES, ("iotcore", "iotcore"), ("rich", "rich")),
}
"""What each extra of the package installs that its commands import (module, distribution).
The agent (agent, record, check-config, metrics) needs none of them."""


def missing_extra(command: str, extra: str, *, except_modules: Sequence[str] = ()) -> str | None:
    """The one-line error for ``hyperagent COMMAND`` when a module of ``extra`` is not
    installed (naming the distributions and the pip command), None when all are."""
    missing = [
        distribution
        for module, distribution in EXTRAS[extra]
        if module not in except_modules and importlib.util.find_spec(module) is None
    ]
    if not missing:
        return None
    return f"hyperagent {command}: needs {', '.join(missing)}: pip install 'hyperagent[{extra}]'"


def _require_extra(command: str, extra: str, *, except_modules: Sequence[str] = ()) -> bool:
    """Say on stderr what ``command`` needs and return False when its extra is missing."""
    error = missing_extra(command, extra, except_modules=except_modules)
    if error is not None:
        print(error, file=sys.stderr)
    return error is None


class LogfmtFormatter(logging.Formatter):
    """One event per line: time, level, logger and message as logfmt (journald-friendly)."""

    def format(self, record: logging.LogRecord) -> str:
        message = record.getMessage().replace("\\", "\\\\").replace('"', '\\"')
        line = (
            f"ts={self.formatTime(record, '%Y-%m-%dT%H:%M:%S')} level={record.levelname.lower()} "
            f'logger={record.name} msg="{message}"'
        )
        if record.exc_info:
            error = self.formatException(record.exc_info).replace("\n", "\\n").replace('"', "'")
            line += f' error="{error}"'
        return line


def _setup_logging(level: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(LogfmtFormatter())
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)


def _positive(unit: str) -> Callable[[str], float]:
    """An argparse type for a positive, finite number of ``unit`` (0 is not "as fast as
    possible")."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a {unit}: {text!r}") from None
        if not 0 < value < float("inf"):
            raise argparse.ArgumentTypeError(f"must be a positive {unit}, not {text}")
        return value

    return parse


_speed = _positive("number")
_interval = _positive("number of seconds")


def _overrides(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if getattr(args, "node", None):
        out["node"] = args.node
    if getattr(args, "cluster", None):
        out["cluster"] = args.cluster
    if getattr(args, "broker", None):
        out["mqtt.url"] = args.broker
        out["mqtt.enabled"] = True
    if getattr(args, "no_broker", False):
        out["mqtt.enabled"] = False
    if getattr(args, "metrics_address", None) is not None:
        out["agent.metrics_address"] = args.metrics_address
    if getattr(args, "interval", None) is not None:
        out["agent.interval_s"] = args.interval
    return out


def read_signing_key(config: Config) -> SigningKey:
    """The coordinator's private key (``security.signing_key_file``); ConfigError when none is
    configured or the file is not a private Ed25519 key only its owners can read."""
    path = config.security.signing_key_file
    if path is None:
        raise ConfigError(
            [
                ConfigProblem(
                    "security.signing_key_file",
                    "required by the coordinator (make one: hyperagent keys generate --out DIR)",
                )
            ]
        )
    try:
        return load_signing_key(path)
    except KeyFileError as e:
        raise ConfigError([ConfigProblem("security.signing_key_file", str(e))]) from e


def read_trusted_keys(config: Config) -> TrustedKeys:
    """The public keys an agent takes settings from (``security.trusted_keys``)."""
    try:
        return TrustedKeys(paths=config.security.trusted_keys)
    except KeyFileError as e:
        raise ConfigError([ConfigProblem("security.trusted_keys", str(e))]) from e


def _run(main: Coroutine[Any, Any, Any]) -> int:
    """Run ``main`` until it ends or SIGTERM/SIGINT cancels it (its cleanup runs)."""

    async def wrapper() -> None:
        task = asyncio.current_task()
        assert task is not None
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, task.cancel)
        await main

    try:
        asyncio.run(wrapper())
    except asyncio.CancelledError:
        log.info("stopped")
    return 0


def _agent(args: argparse.Namespace, config: Config, recorder: Recorder | None = None) -> Agent:
    from hyperagent.agent import Agent
    from hyperagent.capture.directory import capture_sources

    trusted = read_trusted_keys(config)
    if args.replay is None:
        return Agent.from_config(config, trusted_keys=trusted, recorder=recorder)
    sources, hardware = capture_sources(args.replay, config, speed=args.speed)
    return Agent.from_config(config, hardware, trusted, sources=sources, recorder=recorder)


def _state_dir(config: Config, file: Path | None) -> None:
    """Create ``agent.state_dir`` where the agent keeps what it sends the broker and the
    settings it applied; a user that may not gets told what to do instead of a traceback."""
    path = config.agent.state_dir
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        reason = f"cannot create {path}: {e.strerror or e}"
        if isinstance(e, PermissionError):
            reason += (
                "; run the agent as its service user (hyperagent, as the shipped unit does, "
                "which creates it) or set agent.state_dir to a folder this user may write"
            )
        where = str(file) if file is not None else None
        raise ConfigError([ConfigProblem("agent.state_dir", reason)], where) from e


def cmd_agent(args: argparse.Namespace) -> int:
    config = load_config(args.config, _overrides(args))
    if config.mqtt.enabled:
        _state_dir(config, args.config)
    return _run(_agent(args, config).run())


def cmd_record(args: argparse.Namespace) -> int:
    from hyperagent.replay import RECORDING_FILE, Recorder

    if args.duration <= 0:
        raise ConfigError([ConfigProblem("--duration", "must be positive")])
    overrides = {**_overrides(args), "mqtt.enabled": False, "agent.metrics_address": ""}
    config = load_config(args.config, overrides)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / RECORDING_FILE
    with path.open("wb") as out:
        recorder = Recorder(out, config.node, config.agent.interval_s)
        agent = _agent(args, config, recorder)

        async def record() -> None:
            try:
                async with asyncio.timeout(args.duration):
                    await agent.run()
            except TimeoutError:
                pass

        _run(record())
    print(
        f"recorded {recorder.frames} frames of {', '.join(s.name for s in agent.runner.sources)}"
        f" to {path}"
    )
    return 0


def cmd_coordinator(args: argparse.Namespace) -> int:
    if not _require_extra("coordinator", "coordinator"):
        return 2
    from hyperagent.coordinator import Coordinator, coordinator_link
    from hyperagent.exporter import MetricsServer
    from hyperagent.tuner.journal import JournalError

    config = load_config(args.config, _overrides(args))
    if args.recommend:
        section = config.coordinator
        jobs = tuple(job.model_copy(update={"mode": "recommend"}) for job in section.jobs)
        defaults = section.defaults.model_copy(update={"mode": "recommend"})
        config = config.model_copy(
            update={"coordinator": section.model_copy(update={"jobs": jobs, "defaults": defaults})}
        )
        named = [job for job in jobs if job.exact and job.nodes]
        if named:
            for job in named:
                settings, why = recommend(config.coordinator, job.id)
                print(f"{job.id}: would set {_describe(settings)}, because {why}")
            return 0
    if not config.mqtt.enabled:
        raise ConfigError(
            [ConfigProblem("mqtt.enabled", "the coordinator needs the broker")], str(args.config)
        )
    try:
        key = read_signing_key(config)
        trusted = read_trusted_keys(config)
    except ConfigError as e:
        raise ConfigError(e.problems, str(args.config)) from e
    log.info("signing settings with key %s (%s)", key.key_id, config.security.signing_key_file)
    link = coordinator_link(config)
    coordinator = Coordinator(config, link, key, trusted_keys=trusted)
    try:
        address = config.coordinator.metrics_address
        if not address:
            return _run(coordinator.run())
        metrics = MetricsServer(address, coordinator.collector)
        metrics.start()
        try:
            return _run(coordinator.run())
        finally:
            metrics.stop()
    except (JournalError, BaseExceptionGroup) as e:
        # a journal that cannot be read or written ends the coordinator with one line
        journal = e.subgroup(JournalError) if isinstance(e, BaseExceptionGroup) else e
        if journal is None:
            raise
        while isinstance(journal, BaseExceptionGroup):
            journal = journal.exceptions[0]
        print(f"hyperagent coordinator: tuning journal: {journal}", file=sys.stderr)
        return 2


def recommend(section: Any, job: str) -> tuple[dict[str, Any], str]:
    """What the coordinator would set for ``job`` (a rule naming it with its nodes), and why:
    the last finished tuning of it (its journal), else the table over the starting settings."""
    from hyperagent.tuner import tuning
    from hyperagent.tuner.discovery import plan_space
    from hyperagent.tuner.journal import Journal

    cfg = section.tuning(job, section.rule_for(job).nodes)
    journal = Journal(section.state_dir / f"{job}.jsonl").load()
    machine = tuning.JobTuning(job, cfg, journal)
    start = cfg.start.model_dump()
    if start["power_cap_w"] is None and cfg.power_limits_w:
        start["power_cap_w"] = cfg.power_limits_w[1]
    machine.handle(tuning.Begin(0.0, cfg, plan_space(cfg), start))
    return dict(machine.recommendation or {}), machine.why


def cmd_report(args: argparse.Namespace) -> int:
    if not _require_extra("report", "report"):
        return 2
    if args.job is not None:
        return _job_report(args)
    if args.journal is None:
        print("hyperagent report: give a JOURNAL, or --job ID --prometheus URL", file=sys.stderr)
        return 2
    from hyperagent.report import ReportError, render_report

    out = args.out or args.journal.with_suffix(".png")
    try:
        summary = render_report(args.journal, out)
    except ReportError as e:
        print(f"hyperagent report: {e}", file=sys.stderr)
        return 1
    print(f"{out}: {summary.trials} trials, {summary.outcome()}")
    return 0


def _job_report(args: argparse.Namespace) -> int:
    """``hyperagent report --job ID --prometheus URL``: the job's summary on stdout, its
    picture in ``--out``."""
    from hyperagent import job_report

    if args.journal is not None or args.prometheus is None:
        print("hyperagent report: --job needs --prometheus URL and no JOURNAL", file=sys.stderr)
        return 2
    try:
        end = job_report.parse_time(args.end) if args.end else None
        start = job_report.parse_time(args.start) if args.start else None
        if args.since:
            since = job_report.parse_duration(args.since)
            start = (end if end is not None else time.time()) - since
    except ValueError as e:
        print(f"hyperagent report: {e}", file=sys.stderr)
        return 2
    out = args.out or job_report.default_out(args.job)
    try:
        api = job_report.PrometheusApi(args.prometheus)
        report = job_report.job_report(api, args.job, start, end, cluster=args.cluster)
        job_report.write_picture(report, out)
    except job_report.JobReportError as e:
        print(f"hyperagent report: {e}", file=sys.stderr)
        return 1
    print(report.text())
    print(f"  picture:       {out}")
    return 0


def cmd_metrics(args: argparse.Namespace) -> int:
    from hyperagent.catalog import HELP

    for name in sorted(HELP):
        print(f"{name}  {HELP[name]}")
    return 0


def cmd_check_config(args: argparse.Namespace) -> int:
    config = load_config(args.file)
    trusted = read_trusted_keys(config)
    signs = "no signing key (an agent's host)"
    if config.security.signing_key_file is not None:
        try:
            signs = f"signs with key {read_signing_key(config).key_id}"
        except ConfigError as e:
            cause = e.__cause__
            if not isinstance(cause, KeyFileError) or cause.reason not in _NOT_HERE:
                raise
            signs = f"no signing key here ({cause.reason}; the coordinator's host needs it)"
    rules = len(config.coordinator.jobs)
    print(
        f"{args.file}: OK (node {config.node}, cluster {config.cluster}, "
        f"jobs found by the agents, tune = {config.coordinator.defaults.tune!r}, "
        f"{rules} job rule(s); settings keys trusted: {trusted.describe()}; {signs})"
    )
    return 0


_NOT_HERE = (os.strerror(errno.ENOENT), os.strerror(errno.EACCES))
"""Why a signing key may be absent from a host that is not the coordinator's."""


def _describe(settings: dict[str, Any]) -> str:
    parts = []
    if "bucket_mb" in settings:
        parts.append(f"bucket {settings['bucket_mb']} MiB")
    if "chunk_kb" in settings:
        parts.append(f"chunk {settings['chunk_kb']} KiB")
    if "allreduce" in settings:
        parts.append(str(settings["allreduce"]))
    if settings.get("power_cap_w") is not None:
        parts.append(f"cap {settings['power_cap_w']} W")
    return ", ".join(parts)


def _trial_label(state: Any, record: Any) -> str:
    """``  3/30`` for a trial of the budget, ``confirm 2/4`` for a re-measurement after it."""
    if record.confirmation:
        from hyperagent.coordinator import CONFIRM_ROUNDS

        return f"confirm {len(state.confirmations)}/{2 * CONFIRM_ROUNDS}"
    return f"{record.index + 1:>3}/{state.config.trials}"


def _on_broker(args: argparse.Namespace, console: Any, demo: Any) -> Any:
    """Run ``demo(url)`` on ``--broker``, or on an embedded broker started for it."""
    from hyperagent.demo import embedded_broker

    if args.broker:
        return asyncio.run(demo(args.broker))
    with embedded_broker() as url:
        console.print(f"embedded MQTT broker on {url}")
        return asyncio.run(demo(url))


def _demo_problems(args: argparse.Namespace) -> list[ConfigProblem]:
    """What is wrong with the demo's ``--metrics-port`` and ``--linger``."""
    problems = []
    if args.metrics_port is not None and not 0 <= args.metrics_port <= 65535:
        problems.append(ConfigProblem("--metrics-port", "must be between 0 and 65535"))
    if args.linger is not None and args.metrics_port is None:
        problems.append(ConfigProblem("--linger", "keeps /metrics served: give --metrics-port"))
    return problems


def _demo_state_dir(path: Path | None, job: str) -> Path | None:
    """``--state-dir`` made ready for the demo's coordinator and agents (absolute); ConfigError
    when it cannot be written, or holds a tuning of ``job`` already (the coordinator would
    take it up again instead of tuning from the start)."""
    if path is None:
        return None
    from hyperagent.tuner.journals import Journals

    path = path.absolute()
    journal = Journals(path / "coordinator").path(job)
    if journal.exists():
        reason = f"{journal} holds an earlier tuning: give a new or empty directory"
        raise ConfigError([ConfigProblem("--state-dir", reason)])
    try:
        journal.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=journal.parent):
            pass
    except OSError as e:
        raise ConfigError(
            [ConfigProblem("--state-dir", f"cannot write {path}: {e.strerror or e}")]
        ) from e
    return path


@contextlib.contextmanager
def _demo_metrics(port: int | None) -> Iterator[MetricsServer | None]:
    """The demo coordinator's /metrics served on 127.0.0.1:``port`` (0: a free one) while the
    block runs; None without a port."""
    if port is None:
        yield None
        return
    from hyperagent.exporter import MetricsServer

    server = MetricsServer(f"127.0.0.1:{port}")
    try:
        server.start()
    except ConfigError as e:
        raise ConfigError([ConfigProblem("--metrics-port", p.reason) for p in e.problems]) from e
    try:
        yield server
    finally:
        server.stop()


def _metrics_url(server: MetricsServer) -> str:
    return f"http://{server.host}:{server.port}/metrics"


def _demo_end(
    console: Any, args: argparse.Namespace, journal: Path | None, metrics: MetricsServer | None
) -> None:
    """Say where the kept journal is; with ``--linger``, serve /metrics that long more."""
    if args.state_dir is not None and journal is not None:
        console.print(
            f"the tuning's journal: {journal} (draw it: hyperagent report {journal})",
            markup=False,
            soft_wrap=True,
        )
    if metrics is None or args.linger is None:
        return
    ended = threading.Event()
    previous = signal.signal(signal.SIGTERM, lambda *_: ended.set())
    try:
        console.print(
            f"serving the coordinator's /metrics on {_metrics_url(metrics)} for "
            f"{args.linger:g} s more (Ctrl-C or SIGTERM ends it)",
            soft_wrap=True,
        )
        ended.wait(args.linger)
    except KeyboardInterrupt:
        pass
    finally:
        signal.signal(signal.SIGTERM, previous)


def cmd_demo_torch(args: argparse.Namespace) -> int:
    from rich.console import Console

    from hyperagent.demo_torch import (
        DEFAULT_TRIALS,
        JOB,
        MODEL_DESCRIPTION,
        require_torch,
        run_torch_demo,
    )

    trials = args.trials or DEFAULT_TRIALS
    problems = _demo_problems(args)
    if not 1 <= trials <= 500:
        problems.insert(0, ConfigProblem("--trials", "must be between 1 and 500"))
    if problems:
        raise ConfigError(problems)
    console = Console()
    try:
        require_torch()
    except HyperagentError as e:
        console.print(f"[red]{e}[/red]")
        return 1
    state_dir = _demo_state_dir(args.state_dir, JOB)

    def on_trial(state: Any, record: Any) -> None:
        s = record.settings
        score = f"{record.score:.1f}" if record.score is not None else "-"
        console.print(
            f"{_trial_label(state, record)}  v{record.version:<3} bucket {s['bucket_mb']:>3} MiB"
            f"  chunk {s['chunk_kb']:>5} KiB  {record.status:<8} {score:>8} samples/s"
        )

    with _demo_metrics(args.metrics_port) as metrics:

        async def demo(url: str) -> Any:
            return await run_torch_demo(
                url, trials, args.seed, on_trial=on_trial, state_dir=state_dir, metrics=metrics
            )

        console.print(
            "hyperagent demo: 2 PyTorch DDP ranks (gloo on 127.0.0.1), "
            f"{MODEL_DESCRIPTION}, objective throughput (samples/s), {trials} trials"
        )
        if metrics is not None:
            console.print(f"the coordinator's /metrics: {_metrics_url(metrics)}", soft_wrap=True)
        try:
            result = _on_broker(args, console, demo)
        except HyperagentError as e:
            console.print(f"[red]{e}[/red]")
            return 1
        for line in result.summary():
            console.print(line)
        _demo_end(console, args, result.journal, metrics)
    return 0 if result.ranks_consistent and result.gain is not None else 1


def cmd_demo(args: argparse.Namespace) -> int:
    if not _require_extra("demo", "demo", except_modules=("iotcore",) if args.broker else ()):
        return 2
    if args.workload == "torch-ddp":
        return cmd_demo_torch(args)
    args.trials = args.trials or 30
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from hyperagent.demo import JOB, run_demo

    problems = []
    if not 1 <= args.nodes <= 64:
        problems.append(ConfigProblem("--nodes", "must be between 1 and 64"))
    if not 1 <= args.trials <= 500:
        problems.append(ConfigProblem("--trials", "must be between 1 and 500"))
    problems += _demo_problems(args)
    if problems:
        raise ConfigError(problems)
    state_dir = _demo_state_dir(args.state_dir, JOB)
    console = Console()
    progress = Progress(
        TextColumn("[bold]trial"),
        MofNCompleteColumn(),
        BarColumn(),
        TextColumn("{task.description}"),
        TimeElapsedColumn(),
        console=console,
    )
    task = progress.add_task("starting", total=args.trials)

    def on_trial(state: Any, record: Any) -> None:
        best = f"{state.best[1]:.1f}" if state.best else "-"
        gain = f"{state.gain:+.1%}" if state.gain is not None else "-"
        score = f"{record.score:.1f}" if record.score is not None else record.status
        s = {"bucket_mb": "-", "chunk_kb": "-", **record.settings}
        if record.confirmation:
            best, gain = "-", "confirming"
        progress.console.print(
            f"{_trial_label(state, record)}  v{record.version:<3} bucket {s['bucket_mb']:>3} MiB  "
            f"chunk {s['chunk_kb']:>5} KiB  {s.get('allreduce', ''):<16.16} "
            f"{s.get('power_cap_w', '-')!s:>4} W  {score:>8}"
        )
        progress.update(task, completed=len(state.trials), description=f"best {best}  gain {gain}")

    unit = "samples/s" if args.objective == "throughput" else "samples/J"
    with _demo_metrics(args.metrics_port) as metrics:

        async def demo(url: str) -> Any:
            with progress:
                return await run_demo(
                    url,
                    args.nodes,
                    args.trials,
                    args.seed,
                    on_trial=on_trial,
                    objective=args.objective,
                    report=args.report,
                    state_dir=state_dir,
                    metrics=metrics,
                )

        console.print(
            f"hyperagent demo: {args.nodes} simulated nodes x 8 GPUs, "
            f"objective {args.objective} ({unit}), {args.trials} trials"
        )
        if metrics is not None:
            console.print(f"the coordinator's /metrics: {_metrics_url(metrics)}", soft_wrap=True)
        result = _on_broker(args, console, demo)
        code = _demo_summary(console, args, result, unit)
        _demo_end(console, args, result.journal, metrics)
    return code


def _demo_summary(console: Any, args: argparse.Namespace, result: Any, unit: str) -> int:
    """Print what the simulated demo's tuning found and cost; 1 when nothing was measured."""
    state = result.state
    if state.best is None or state.gain is None:
        console.print("[red]no trial produced a measurement[/red]")
        return 1
    console.print(
        f"starting settings: {_describe(result.start_settings)}: {state.baseline:.1f} {unit}"
    )
    console.print(
        f"best settings:     {_describe(result.best_settings)}: {state.best[1]:.1f} {unit}"
    )
    runs = f"{len(state.trials)} trials"
    if state.confirmations:
        runs += f" and {len(state.confirmations)} confirmations"
    if state.confirmed is not None and not state.confirmed.better:
        console.print(
            "[bold]no setting was better than the starting settings[/bold]: the best candidate "
            f"measured {state.confirmed.describe()} against them when re-measured "
            f"interleaved; {runs}, the starting settings published as v{state.final_version}"
        )
    else:
        interval = f" ({state.confirmed.interval()})" if state.confirmed is not None else ""
        console.print(
            f"[bold green]gain over the starting settings: {state.gain:+.1%}[/bold green]"
            f"{interval} measured ({result.simulated_gain:+.1%} on the noiseless model), "
            f"{runs}, published as settings v{state.final_version}"
        )
    spent = state.cost()
    if spent is not None:
        console.print(f"cost: {spent.describe()}")
    console.print(f"a picture of the tuning: {args.report}")
    return 0


def cmd_keys_generate(args: argparse.Namespace) -> int:
    """Make the coordinator's signing key pair: NAME.key (private) and NAME.pub (public)."""
    try:
        key, private, public = write_key_pair(args.out, args.name, args.group)
    except KeyFileError as e:
        print(f"hyperagent keys generate: {e}", file=sys.stderr)
        return 1
    mode = "0640, group " + args.group if args.group else "0600"
    print(f"key id {key.key_id}")
    print(f"{private}: the private key ({mode}): on the coordinator's host only")
    print(f"{public}: the public key: copy it to every node's security.trusted_keys")
    return 0


def cmd_keys_id(args: argparse.Namespace) -> int:
    """Print the key id of each key file (public or private)."""
    status = 0
    for path in args.files:
        try:
            public, private = public_key_of(path)
        except KeyFileError as e:
            print(f"hyperagent keys id: {e}", file=sys.stderr)
            status = 1
            continue
        print(f"{key_id(public)}  {path}{'  (private key)' if private else ''}")
    return status


def cmd_nccl_plugin(args: argparse.Namespace) -> int:
    """Print the NCCL tuner plugin's absolute path, building it into the cache if needed."""
    from hyperagent.nccl import PluginBuildError, library_path

    try:
        print(library_path())
    except PluginBuildError as e:
        print(f"hyperagent nccl-plugin: {e}", file=sys.stderr)
        return 1
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The command line: one subcommand per daemon or tool."""
    parser = argparse.ArgumentParser(
        prog="hyperagent", description="GPU-cluster monitoring agent and closed-loop tuner."
    )
    parser.add_argument("--version", action="version", version=f"hyperagent {__version__}")
    parser.add_argument(
        "--log-level", default="info", choices=["debug", "info", "warning", "error"]
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for add in (_add_agent, _add_record, _add_coordinator, _add_demo, _add_report, _add_tools):
        add(sub)
    return parser


def _add_agent(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``agent``: the node agent."""
    agent = sub.add_parser("agent", help="run the node agent")
    agent.add_argument("--config", type=Path, help="TOML configuration file")
    agent.add_argument(
        "--replay",
        type=Path,
        metavar="DIR",
        help="replay a capture directory (DIR/nvidia-smi.xml) instead of hardware",
    )
    agent.add_argument(
        "--speed",
        type=_speed,
        default=1.0,
        metavar="FACTOR",
        help="with --replay: play recordings and timestamped day files FACTOR times as fast",
    )
    agent.add_argument(
        "--metrics-address", metavar="HOST:PORT", help='serve /metrics here ("" disables)'
    )
    broker = agent.add_mutually_exclusive_group()
    broker.add_argument("--broker", metavar="URL", help="MQTT broker, mqtt://HOST:PORT")
    broker.add_argument("--no-broker", action="store_true", help="do not connect to MQTT")
    agent.add_argument("--node", help="node name (default: hostname)")
    agent.add_argument("--cluster", help="cluster name")
    agent.add_argument("--interval", type=_interval, help="seconds between collections")
    agent.set_defaults(func=cmd_agent)


def _add_record(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``record``: every source into a capture directory."""
    record = sub.add_parser("record", help="record every source into a capture directory")
    record.add_argument("--out", type=Path, required=True, metavar="DIR")
    record.add_argument("--duration", type=float, required=True, metavar="SECONDS")
    record.add_argument("--config", type=Path)
    record.add_argument("--replay", type=Path, metavar="DIR", help="record a capture directory")
    record.add_argument(
        "--speed", type=_speed, default=1.0, metavar="FACTOR", help="replay speed with --replay"
    )
    record.add_argument("--node")
    record.add_argument("--interval", type=_interval, help="seconds between collections")
    record.set_defaults(func=cmd_record)


def _add_coordinator(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``coordinator``: the cluster coordinator."""
    coordinator = sub.add_parser("coordinator", help="run the cluster coordinator")
    coordinator.add_argument("--config", type=Path, required=True)
    coordinator.add_argument("--broker", metavar="URL")
    coordinator.add_argument("--cluster")
    coordinator.add_argument(
        "--recommend",
        action="store_true",
        help="tune nothing: report what would be set for each job, and why",
    )
    coordinator.set_defaults(func=cmd_coordinator)


def _add_demo(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``demo``: the whole loop on this machine."""
    demo = sub.add_parser("demo", help="the whole loop on this machine, on simulated nodes")
    demo.add_argument("--nodes", type=int, default=4)
    demo.add_argument(
        "--workload",
        choices=["simulated", "torch-ddp"],
        default="simulated",
        help="simulated nodes, or two real PyTorch DDP ranks (gloo) on this machine",
    )
    demo.add_argument("--trials", type=int, help="trial budget (30 simulated, 10 torch-ddp)")
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--objective", choices=["throughput", "energy"], default="throughput")
    demo.add_argument(
        "--report",
        type=Path,
        metavar="FILE.png|FILE.html",
        default=Path(tempfile.gettempdir()) / "hyperagent-demo.png",
        help="where to draw the tuning (default: %(default)s)",
    )
    demo.add_argument("--broker", metavar="URL", help="use this broker instead of an embedded one")
    demo.add_argument(
        "--state-dir",
        type=Path,
        metavar="DIR",
        help="keep the coordinator's journal (DIR/coordinator) and the agents' state in DIR "
        "(default: a temporary directory, removed at the end)",
    )
    demo.add_argument(
        "--metrics-port",
        type=int,
        metavar="PORT",
        help="serve the coordinator's /metrics on 127.0.0.1:PORT (0: a free port)",
    )
    demo.add_argument(
        "--linger",
        type=_interval,
        metavar="SECONDS",
        help="with --metrics-port: serve /metrics this long after the tuning "
        "(Ctrl-C or SIGTERM ends it)",
    )
    demo.set_defaults(func=cmd_demo)


def _add_report(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``report``: a tuning drawn from its journal, or a job summarised from Prometheus."""
    report = sub.add_parser(
        "report",
        help="draw a tuning from its journal (PNG or HTML), or summarise a job from Prometheus",
    )
    report.add_argument(
        "journal", type=Path, metavar="JOURNAL", nargs="?", help="a tuning's journal to draw"
    )
    report.add_argument(
        "--out",
        type=Path,
        metavar="FILE.png|FILE.html",
        help="the picture (default: the journal's name as .png; with --job job-ID.png)",
    )
    report.add_argument(
        "--job", metavar="ID", help="a job's GPUs, utilisation, memory and energy (job_id label)"
    )
    report.add_argument("--prometheus", metavar="URL", help="with --job: Prometheus' base URL")
    report.add_argument("--cluster", help="with --job: only this cluster label")
    when = report.add_mutually_exclusive_group()
    when.add_argument("--since", metavar="DURATION", help="with --job: the last 6h, 7d, ... (7d)")
    when.add_argument("--start", metavar="TIME", help="with --job: Unix seconds or RFC 3339")
    report.add_argument("--end", metavar="TIME", help="with --job: Unix seconds or RFC 3339 (now)")
    report.set_defaults(func=cmd_report)


def _add_tools(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``metrics``, ``check-config``, ``keys`` and ``nccl-plugin``."""
    metrics = sub.add_parser("metrics", help="list every metric hyperagent exposes")
    metrics.set_defaults(func=cmd_metrics)

    check = sub.add_parser("check-config", help="validate a configuration file")
    check.add_argument("file", type=Path)
    check.set_defaults(func=cmd_check_config)

    keys = sub.add_parser("keys", help="make and inspect the keys that sign settings")
    keys_sub = keys.add_subparsers(dest="keys_command", required=True)
    generate = keys_sub.add_parser(
        "generate", help="make an Ed25519 key pair: NAME.key (private) and NAME.pub (public)"
    )
    generate.add_argument("--out", type=Path, required=True, metavar="DIR")
    generate.add_argument("--name", default="settings", help="file name (default: %(default)s)")
    generate.add_argument(
        "--group", help="make the private key 0640 in this group (default: 0600, no group)"
    )
    generate.set_defaults(func=cmd_keys_generate)
    ids = keys_sub.add_parser("id", help="print the key id of key files")
    ids.add_argument("files", type=Path, nargs="+", metavar="FILE")
    ids.set_defaults(func=cmd_keys_id)

    plugin = sub.add_parser(
        "nccl-plugin",
        help="print the NCCL tuner plugin's path (for NCCL_TUNER_PLUGIN), building it if needed",
    )
    plugin.set_defaults(func=cmd_nccl_plugin)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    _setup_logging(args.log_level if args.command != "demo" else "warning")
    try:
        return int(args.func(args))
    except BrokenPipeError:  # `hyperagent metrics | head`
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except ConfigError as e:
        where = f"{e.file}: " if e.file else ""
        for problem in e.problems:
            print(f"{where}{problem.key}: {problem.reason}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
