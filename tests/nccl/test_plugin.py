"""The tuner plugin driven as NCCL drives it: built with the C compiler, loaded with ctypes,
``init`` -> ``getCollInfo`` on a contiguous ``float[numAlgo][numProto]`` cost table passed as
``float**`` -> ``destroy``/``finalize``, through every exported interface version (v3-v6)."""

from __future__ import annotations

import ctypes
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from hyperagent.nccl import ALGORITHMS, PROTOCOLS, Choice, TunerPlugin, build, compiler

from conftest import unavailable

IGNORE = -1.0
ALLREDUCE, ALLGATHER, BROADCAST = 4, 2, 0
TREE, RING, NVLS, PAT = 0, 1, 4, 6
LL, LL128, SIMPLE = 0, 1, 2

c_size, c_int, c_float_pp = (
    ctypes.c_size_t,
    ctypes.c_int,
    ctypes.POINTER(ctypes.POINTER(ctypes.c_float)),
)
LOGGER = ctypes.CFUNCTYPE(None, c_int, ctypes.c_ulong, ctypes.c_char_p, c_int, ctypes.c_char_p)
RESULT = c_int
VOIDPP = ctypes.POINTER(ctypes.c_void_p)
INIT_V3 = ctypes.CFUNCTYPE(RESULT, c_size, c_size, LOGGER, VOIDPP)
INIT_V5 = ctypes.CFUNCTYPE(
    RESULT, VOIDPP, ctypes.c_uint64, c_size, c_size, LOGGER, ctypes.c_void_p, ctypes.c_void_p
)
COLL_V3 = ctypes.CFUNCTYPE(
    RESULT, ctypes.c_void_p, c_int, c_size, c_int, c_float_pp, c_int, c_int, ctypes.POINTER(c_int)
)
COLL_V4 = ctypes.CFUNCTYPE(
    RESULT,
    ctypes.c_void_p,
    c_int,
    c_size,
    c_int,
    c_float_pp,
    c_int,
    c_int,
    c_int,
    ctypes.POINTER(c_int),
)
DONE = ctypes.CFUNCTYPE(RESULT, ctypes.c_void_p)
CHUNK = ctypes.CFUNCTYPE(
    RESULT, ctypes.c_void_p, c_int, c_size, c_int, c_int, c_int, ctypes.POINTER(c_size)
)


class TunerV3(ctypes.Structure):
    _fields_ = (
        ("name", ctypes.c_char_p),
        ("init", INIT_V3),
        ("getCollInfo", COLL_V3),
        ("destroy", DONE),
    )


class TunerV4(ctypes.Structure):
    _fields_ = (
        ("name", ctypes.c_char_p),
        ("init", INIT_V3),
        ("getCollInfo", COLL_V4),
        ("destroy", DONE),
    )


class TunerV5(ctypes.Structure):
    _fields_ = (
        ("name", ctypes.c_char_p),
        ("init", INIT_V5),
        ("getCollInfo", COLL_V4),
        ("finalize", DONE),
    )


class TunerV6(ctypes.Structure):
    _fields_ = (
        ("name", ctypes.c_char_p),
        ("init", INIT_V5),
        ("getCollInfo", COLL_V4),
        ("finalize", DONE),
        ("getChunkSize", CHUNK),
    )


STRUCTS = {3: TunerV3, 4: TunerV4, 5: TunerV5, 6: TunerV6}


@pytest.fixture(scope="module")
def library(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if compiler() is None:
        unavailable("no C compiler (cc, gcc or clang) to build the NCCL tuner plugin")
    return build(tmp_path_factory.mktemp("plugin") / "libhyperagent_nccl_tuner.so")


@dataclass
class Nccl:
    """One communicator's view of the plugin, calling it as NCCL's tuner_v*.cc shims do."""

    version: int
    tuner: ctypes.Structure
    context: ctypes.c_void_p
    logged: list[str]
    logger: object

    def coll_info(
        self, table: list[list[float]], coll: int = ALLREDUCE, channels: int = 0
    ) -> tuple[list[list[float]], int]:
        algos, protos = len(table), len(table[0])
        flat = (ctypes.c_float * (algos * protos))(*(c for row in table for c in row))
        n_channels = c_int(channels)
        table_pp = ctypes.cast(flat, c_float_pp)
        if self.version == 3:
            rc = self.tuner.getCollInfo(
                self.context, coll, 1 << 20, 1, table_pp, algos, protos, ctypes.byref(n_channels)
            )
        else:
            rc = self.tuner.getCollInfo(
                self.context, coll, 1 << 20, 1, table_pp, algos, protos, 0, ctypes.byref(n_channels)
            )
        assert rc == 0
        return [list(flat[a * protos : (a + 1) * protos]) for a in range(algos)], n_channels.value


@pytest.fixture(params=[3, 4, 5, 6], ids=lambda v: f"v{v}")
def nccl(request: pytest.FixtureRequest, library: Path) -> Iterator[tuple[Nccl, TunerPlugin]]:
    """A fresh copy of the library (its own state) initialised through interface v3..v6."""
    version: int = request.param
    copy = library.parent / f"v{version}-{request.node.name}.so".replace("[", "_").replace("]", "")
    copy.write_bytes(library.read_bytes())
    plugin = TunerPlugin(copy)
    tuner = STRUCTS[version].in_dll(plugin.lib, f"ncclTunerPlugin_v{version}")
    assert tuner.name == b"hyperagent"
    logged: list[str] = []

    @LOGGER
    def log(level: int, flags: int, file: bytes, line: int, fmt: bytes) -> None:
        logged.append(fmt.decode())

    context = ctypes.c_void_p()
    if version <= 4:
        assert tuner.init(8, 2, log, ctypes.byref(context)) == 0
    else:
        assert tuner.init(ctypes.byref(context), 0x1234, 8, 2, log, None, None) == 0
    assert plugin.loaded_version() == version
    yield Nccl(version, tuner, context, logged, log), plugin
    done = tuner.destroy if version <= 4 else tuner.finalize
    assert done(context) == 0


def table7() -> list[list[float]]:
    """NCCL's 7 x 3 AllReduce table on a node without CollNet or NVLS: tree and ring costed,
    CollNet/NVLS/PAT rows ignored, tree LL128 unsupported."""
    ignored = [IGNORE] * 3
    return [[30.0, IGNORE, 12.0], [20.0, 15.0, 10.0], ignored, ignored, ignored, ignored, ignored]


def table6() -> list[list[float]]:
    """An older NCCL's 6 x 3 table (no PAT row), NVLS offered."""
    ignored = [IGNORE] * 3
    return [[30.0, 18.0, 12.0], [20.0, 15.0, 10.0], ignored, ignored, [5.0, IGNORE, 4.0], ignored]


def picked(table: list[list[float]]) -> tuple[int, int]:
    """What NCCL would run: the smallest entry >= 0 (first in order among equals)."""
    usable = [
        (cost, a, p) for a, row in enumerate(table) for p, cost in enumerate(row) if cost >= 0
    ]
    _, a, p = min(usable)
    return a, p


def test_without_a_choice_the_table_is_nccls(nccl: tuple[Nccl, TunerPlugin]) -> None:
    comm, plugin = nccl
    assert plugin.selected() == Choice(-1, -1, 0)
    table, channels = comm.coll_info(table7(), channels=0)
    assert table == table7() and channels == 0
    assert picked(table) == (RING, SIMPLE)
    assert plugin.fallbacks() == 0


def test_the_chosen_entry_wins(nccl: tuple[Nccl, TunerPlugin]) -> None:
    comm, plugin = nccl
    assert plugin.select(Choice(TREE, LL, 0))
    assert plugin.selected() == Choice(TREE, LL, 0)
    table, channels = comm.coll_info(table7())
    assert picked(table) == (TREE, LL)
    assert table[TREE][LL] == 0.0
    assert channels == 0, "channels 0 keeps NCCL's"
    assert plugin.fallbacks() == 0
    assert any("hyperagent tuner: AllReduce" in line for line in comm.logged)


def test_protocol_unset_takes_the_cheapest_supported_protocol_of_the_algorithm(
    nccl: tuple[Nccl, TunerPlugin],
) -> None:
    comm, plugin = nccl
    assert plugin.select(Choice(TREE, -1, 0))
    table, _ = comm.coll_info(table7())
    assert picked(table) == (TREE, SIMPLE)


def test_an_unsupported_choice_falls_back_to_nccls_and_is_counted(
    nccl: tuple[Nccl, TunerPlugin],
) -> None:
    comm, plugin = nccl
    assert plugin.select(Choice(TREE, LL128, 0))  # IGNORE in table7
    table, _ = comm.coll_info(table7())
    assert table == table7(), "the table stays as NCCL gave it"
    assert plugin.fallbacks() == 1
    assert plugin.select(Choice(NVLS, SIMPLE, 0))  # a whole ignored row
    comm.coll_info(table7())
    assert plugin.fallbacks() == 2
    assert plugin.select(Choice(PAT, SIMPLE, 0))  # no such row in a 6-algorithm table
    table, _ = comm.coll_info(table6())
    assert table == table6() and plugin.fallbacks() == 3


def test_six_algorithm_tables_and_offered_algorithms(nccl: tuple[Nccl, TunerPlugin]) -> None:
    comm, plugin = nccl
    assert plugin.select(Choice(NVLS, SIMPLE, 0))
    table, _ = comm.coll_info(table6())
    assert picked(table) == (NVLS, SIMPLE)
    assert plugin.offered() == {"tree", "ring", "nvls"}


def test_a_table_never_ends_all_negative(nccl: tuple[Nccl, TunerPlugin]) -> None:
    comm, plugin = nccl
    for algorithm in (-1, *range(7)):
        for protocol in (-1, *range(3)):
            assert plugin.select(Choice(algorithm, protocol, 0))
            for source in (table7(), table6()):
                table, _ = comm.coll_info(source)
                assert any(c >= 0 for row in table for c in row), (algorithm, protocol)


def test_other_collectives_are_untouched(nccl: tuple[Nccl, TunerPlugin]) -> None:
    comm, plugin = nccl
    assert plugin.select(Choice(TREE, LL, 16))
    for coll in (ALLGATHER, BROADCAST):
        table, channels = comm.coll_info(table7(), coll=coll, channels=0)
        assert table == table7() and channels == 0
    assert plugin.fallbacks() == 0


def test_channels_are_set_only_when_positive(nccl: tuple[Nccl, TunerPlugin]) -> None:
    comm, plugin = nccl
    assert plugin.select(Choice(RING, SIMPLE, 0))
    assert comm.coll_info(table7(), channels=0)[1] == 0
    assert plugin.select(Choice(RING, SIMPLE, 12))
    assert comm.coll_info(table7(), channels=0)[1] == 12


def test_out_of_range_values_keep_the_previous_choice(nccl: tuple[Nccl, TunerPlugin]) -> None:
    _, plugin = nccl
    assert plugin.select(Choice(RING, LL128, 4))
    for bad in (
        Choice(7, 0, 0),
        Choice(-2, 0, 0),
        Choice(0, 3, 0),
        Choice(0, -2, 0),
        Choice(0, 0, -1),
        Choice(0, 0, 65),
    ):
        assert not plugin.select(bad), bad
    assert plugin.selected() == Choice(RING, LL128, 4)


def test_a_change_is_logged_once(nccl: tuple[Nccl, TunerPlugin]) -> None:
    comm, plugin = nccl

    def choices() -> int:
        return sum("hyperagent tuner: AllReduce" in line for line in comm.logged)

    assert plugin.select(Choice(RING, LL, 0))
    for _ in range(3):
        comm.coll_info(table7())
    assert choices() == 1
    assert plugin.select(Choice(TREE, SIMPLE, 0))
    comm.coll_info(table7())
    comm.coll_info(table7())
    assert choices() == 2


def test_the_pipeline_chunk_knob_is_nccl_v6_getChunkSize(
    nccl: tuple[Nccl, TunerPlugin],
) -> None:
    comm, plugin = nccl
    if comm.version < 6:
        assert not hasattr(comm.tuner, "getChunkSize"), "v3-v5 have no chunk callback"
        return

    def ask(coll: int) -> int:
        size = c_size(131072)
        assert (
            comm.tuner.getChunkSize(
                comm.context, coll, 1 << 24, RING, SIMPLE, 8, ctypes.byref(size)
            )
            == 0
        )
        return size.value

    assert ask(ALLREDUCE) == 131072, "0 keeps NCCL's chunk"
    plugin.select_chunk(524288)
    assert plugin.selected_chunk() == 524288
    assert ask(ALLREDUCE) == 524288
    assert ask(ALLGATHER) == 131072, "other collectives keep NCCL's chunk"


def test_names_map_to_nccls_indices() -> None:
    assert (ALGORITHMS["tree"], ALGORITHMS["ring"], ALGORITHMS["nvls"], ALGORITHMS["pat"]) == (
        TREE,
        RING,
        NVLS,
        PAT,
    )
    assert PROTOCOLS == {"ll": LL, "ll128": LL128, "simple": SIMPLE}
