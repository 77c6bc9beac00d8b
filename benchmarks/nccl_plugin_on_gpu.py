"""On a GPU node: NCCL loads hyperagent's tuner plugin and runs the AllReduce it selects.

    python benchmarks/nccl_plugin_on_gpu.py [--gpus N] [--out DIR]

Builds the plugin (``hyperagent.nccl.library_path``), then runs one rank per GPU (at most
``--gpus``) with ``NCCL_TUNER_PLUGIN`` set, ``NCCL_ALGO``/``NCCL_PROTO`` unset and
``NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,TUNING`` written to one file per rank. Every rank
selects the same (algorithm, protocol) before each round, in program order, as TunedDDP does;
each round allreduces its own message size, so rank 0's NCCL line ``AllReduce: <bytes> Bytes ->
Algo <A> proto <P>`` tells which choice NCCL ran for which round. The script prints, per round,
the choice and what NCCL ran, the plugin's fallback count, and a verdict; ``--out`` also gets
``summary.json`` and the NCCL logs.

With one GPU NCCL runs a one-rank communicator without consulting the tuner
(``ncclLaunchOneRank``): the script then shows the plugin loaded and initialised, and says that
the choice could not be shown. Exit status: 0 when everything that could be shown was.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hyperagent.nccl import ALGORITHMS, PROTOCOLS, Choice, TunerPlugin, library_path

ROUNDS: list[tuple[str, str | None, str | None]] = [
    ("nccl's own", None, None),
    ("ring/simple", "ring", "simple"),
    ("tree/simple", "tree", "simple"),
    ("ring/ll", "ring", "ll"),
    ("tree/ll128", "tree", "ll128"),
    ("ring/ll128", "ring", "ll128"),
]
BASE_BYTES = 4 * 1024 * 1024
"""Round i allreduces BASE_BYTES + i * 4096 bytes of float32."""
REPEATS = 3
NCCL_NAMES = {
    "RING": "ring",
    "TREE": "tree",
    "NVLS": "nvls",
    "NVLS_TREE": "nvls_tree",
    "COLLNET_DIRECT": "collnet_direct",
    "COLLNET_CHAIN": "collnet_chain",
    "PAT": "pat",
    "LL": "ll",
    "LL128": "ll128",
    "SIMPLE": "simple",
}
LINE = re.compile(r"AllReduce: (\d+) Bytes -> Algo (\w+) proto (\w+)")


def rank_main(rank: int, world: int, port: int, library: Path, result: Path) -> None:
    import torch
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    dist.init_process_group(
        "nccl",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        device_id=torch.device("cuda", rank),
    )
    plugin = TunerPlugin(library)
    warm = torch.ones(1024, device="cuda")
    dist.all_reduce(warm)  # creates the communicator: NCCL loads and initialises the tuner
    torch.cuda.synchronize()
    rounds = []
    for i, (name, algorithm, protocol) in enumerate(ROUNDS):
        choice = Choice(
            -1 if algorithm is None else ALGORITHMS[algorithm],
            -1 if protocol is None else PROTOCOLS[protocol],
        )
        assert plugin.select(choice)
        before = plugin.fallbacks()
        data = torch.ones((BASE_BYTES + i * 4096) // 4, device="cuda")
        for _ in range(REPEATS):
            dist.all_reduce(data)
        torch.cuda.synchronize()
        assert float(data[0]) == world**REPEATS
        rounds.append(
            {"round": name, "bytes": data.numel() * 4, "fallbacks": plugin.fallbacks() - before}
        )
    summary = {
        "rank": rank,
        "loaded_version": plugin.loaded_version(),
        "offered": sorted(plugin.offered()),
        "rounds": rounds,
        "nccl_version": ".".join(map(str, torch.cuda.nccl.version())),
    }
    result.write_text(json.dumps(summary))
    dist.barrier()
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", type=int, default=8, help="at most this many ranks")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", tempfile.mkdtemp())))
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--world", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--library", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank is not None:
        rank_main(
            args.rank, args.world, args.port, args.library, args.out / f"rank{args.rank}.json"
        )
        return 0

    try:
        import torch
    except ModuleNotFoundError:
        print("cannot show anything: PyTorch is not installed (a CUDA build is needed)")
        return 1
    if not torch.cuda.is_available() or not torch.distributed.is_nccl_available():
        print(f"cannot show anything: torch {torch.__version__} has no CUDA device or no NCCL")
        return 1
    library = library_path()
    print(f"plugin: {library}")
    world = max(1, min(args.gpus, torch.cuda.device_count()))
    args.out.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k not in ("NCCL_ALGO", "NCCL_PROTO")}
    env.update(
        NCCL_TUNER_PLUGIN=str(library),
        NCCL_DEBUG="INFO",
        NCCL_DEBUG_SUBSYS="INIT,TUNING",
        NCCL_DEBUG_FILE=str(args.out / "nccl.%h.%p.log"),
    )
    port = free_port()
    ranks = [
        subprocess.Popen(
            [
                sys.executable,
                __file__,
                "--rank",
                str(r),
                "--world",
                str(world),
                "--port",
                str(port),
                "--library",
                str(library),
                "--out",
                str(args.out),
            ],
            env=env,
        )
        for r in range(world)
    ]
    codes = [p.wait(timeout=300) for p in ranks]
    if codes != [0] * world:
        print(f"ranks failed: exit codes {codes}")
        return 1
    logs = "".join(p.read_text(errors="replace") for p in sorted(args.out.glob("nccl.*.log")))
    summary = json.loads((args.out / "rank0.json").read_text())
    loaded = "TUNER/Plugin: Using hyperagent" in logs
    initialised = summary["loaded_version"] > 0
    print(
        f"NCCL {summary['nccl_version']}, {world} rank(s): NCCL loaded the plugin: {loaded}; "
        f"initialised it through interface v{summary['loaded_version']}"
    )
    print(f"algorithms NCCL offered for AllReduce: {', '.join(summary['offered']) or '-'}")
    ran: dict[int, tuple[str, str]] = {}
    for size, algo, proto in LINE.findall(logs):
        ran[int(size)] = (NCCL_NAMES.get(algo, algo.lower()), NCCL_NAMES.get(proto, proto.lower()))
    verdicts = []
    for (name, algorithm, protocol), measured in zip(ROUNDS, summary["rounds"], strict=True):
        got = ran.get(measured["bytes"])
        if algorithm is None:
            ok = got is not None or world == 1
        elif measured["fallbacks"]:
            ok = got is not None
        else:
            ok = got == (algorithm, protocol)
        verdicts.append(ok)
        measured["nccl_ran"] = got
        print(
            f"  {name:<12} {measured['bytes']:>9} B: NCCL ran "
            f"{'/'.join(got) if got else 'no tuned plan (one rank)'}; "
            f"{measured['fallbacks']} fallback(s) to NCCL's choice"
        )
    summary.update(world=world, plugin_loaded=loaded)
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1))
    if world == 1:
        print(
            "one GPU: NCCL runs a one-rank communicator without consulting the tuner "
            "(ncclLaunchOneRank), so whether NCCL runs the selected algorithm is NOT shown here; "
            "shown: NCCL loads the plugin and initialises it. Needs >= 2 GPUs for the rest."
        )
        return 0 if loaded and initialised else 1
    shown = loaded and initialised and all(verdicts)
    print(
        "NCCL ran the selected algorithm and protocol in every round where the entry was supported"
        if shown
        else "NOT every round ran the selection: see above"
    )
    return 0 if shown else 1


if __name__ == "__main__":
    if shutil.which("nvidia-smi") is None and "--rank" not in sys.argv:
        print("note: no nvidia-smi on PATH")
    sys.exit(main())
