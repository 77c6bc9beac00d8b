"""SNMP access for the PDU source: the client interface, recorded walks and a live SNMPv2c agent.

:class:`SnmpClient` is the narrow interface the PDU source reads through: :class:`PysnmpClient`
talks SNMPv2c to a PDU with pysnmp 7's asyncio API, :class:`SnmprecClient` answers from a recorded
walk (an snmpsim ``.snmprec`` file, or net-snmp ``snmpwalk -On`` output saved as ``.snmpwalk``),
so a capture directory replays through the same code.
"""

from __future__ import annotations

import asyncio
import bisect
import functools
import re
from collections.abc import Sequence
from enum import Enum
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Protocol

from hyperagent.errors import SourceError, SourceTimeout, SourceUnavailable

Oid = tuple[int, ...]


class Missing(Enum):
    """An SNMP exception value: the agent has no such object, instance, or nothing further."""

    NO_SUCH_OBJECT = "noSuchObject"
    NO_SUCH_INSTANCE = "noSuchInstance"
    END_OF_MIB_VIEW = "endOfMibView"


SnmpValue = int | bytes | str | Missing
"""Integers (all integer types), octet strings as bytes, OIDs and IP addresses as dotted text."""

VarBind = tuple[str, SnmpValue]


class SnmpError(SourceError):
    """The PDU answered with an SNMP error; ``status`` is the SNMP error-status code."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class SnmpTimeout(SourceTimeout):
    """The PDU did not answer an SNMP request within its timeout and retries."""


class SnmpClient(Protocol):
    """The SNMP operations a PDU profile needs, against a live agent or a recording."""

    async def open(self) -> None:
        """Prepare once (engine, address, recording); requests open the client if needed."""
        ...

    async def get(self, oids: Sequence[str]) -> list[VarBind]:
        """The value of each OID, in order; absent ones are a :class:`Missing` value."""
        ...

    async def walk(self, oid: str) -> list[VarBind]:
        """Every object below ``oid``, in OID order."""
        ...

    async def close(self) -> None:
        """Release sockets and dispatchers."""
        ...


@functools.lru_cache(maxsize=32768)
def parse_oid(text: str) -> Oid:
    """``"1.3.6.1"`` or ``".1.3.6.1"`` as a tuple of ints; ValueError when it is not an OID.

    Memoised (bounded): every read parses the same few hundred OIDs of a PDU's walk."""
    parts = text.strip().lstrip(".").split(".")
    if not parts or not all(p.isdigit() for p in parts):
        raise ValueError(f"not an OID: {text!r}")
    return tuple(int(p) for p in parts)


def format_oid(oid: Oid) -> str:
    return ".".join(str(n) for n in oid)


# ---------------------------------------------------------------------------------------------
# Recorded walks: snmpsim .snmprec and net-snmp snmpwalk output


_SNMPREC_INTEGER_TAGS = {"2", "65", "66", "67", "70"}
_SNMPREC_MISSING = {
    "128": Missing.NO_SUCH_OBJECT,
    "129": Missing.NO_SUCH_INSTANCE,
    "130": Missing.END_OF_MIB_VIEW,
}
_ESCAPES = {"\\": 92, "'": 39, '"': 34, "a": 7, "b": 8, "f": 12, "n": 10, "r": 13, "t": 9, "v": 11}


def _unescape(text: str) -> bytes:
    out = bytearray()
    i = 0
    while i < len(text):
        char = text[i]
        if char != "\\":
            out.append(ord(char) & 0xFF)
            i += 1
            continue
        code = text[i + 1 : i + 2]
        if code == "x":
            out.append(int(text[i + 2 : i + 4], 16))
            i += 4
        elif code in _ESCAPES:
            out.append(_ESCAPES[code])
            i += 2
        else:
            raise ValueError(f"unknown escape \\{code}")
    return bytes(out)


def _snmprec_value(tag: str, text: str) -> SnmpValue | None:
    encoding = tag[-1] if tag[-1] in "xe" else ""
    base = tag[:-1] if encoding else tag
    if base in _SNMPREC_MISSING:
        return _SNMPREC_MISSING[base]
    if base in _SNMPREC_INTEGER_TAGS and not encoding:
        return int(text)
    if base in ("4", "68"):
        if encoding == "x":
            return bytes.fromhex(text)
        if encoding == "e":
            return _unescape(text)
        return text.encode("iso-8859-1")
    if base == "6" and not encoding:
        return format_oid(parse_oid(text))
    if base == "64":
        return ".".join(str(b) for b in bytes.fromhex(text)) if encoding == "x" else text
    return None


def decode_snmprec(text: str) -> list[VarBind]:
    """Records of an snmpsim ``.snmprec`` file (``OID|TAG|VALUE`` lines).

    Malformed lines and values computed by snmpsim variation modules (``TAG:module``, other
    than ``writecache`` which stores a plain value) are skipped: they are not recorded data.
    """
    out: list[VarBind] = []
    for line in text.splitlines():
        parts = line.strip().split("|", 2)
        if len(parts) != 3:
            continue
        oid, tag, value_text = parts
        tag, _, module = tag.partition(":")
        if module and module != "writecache":
            continue
        try:
            value = _snmprec_value(tag, value_text) if tag else None
            oid = format_oid(parse_oid(oid))
        except (ValueError, IndexError):
            continue
        if value is not None:
            out.append((oid, value))
    return out


_WALK_VALUE = re.compile(r"^(\w+(?:[\-\ ]\w+)?):\ ?(.*)$")
_MAC_LIKE = re.compile(r"^[0-9a-fA-F]{1,2}(:[0-9a-fA-F]{1,2})+$")
_LEADING_INT = re.compile(r"^(-?\d+)(?:\s.*)?$")
_PARENTHESISED_INT = re.compile(r"^.*?\((-?\d+)\)")
_HEX_BYTES = re.compile(r"^([0-9a-fA-F]{2}(?:\s+[0-9a-fA-F]{2})*)")


def _walk_integer(text: str) -> int:
    match = _LEADING_INT.match(text) or _PARENTHESISED_INT.match(text)
    if match is None:
        raise ValueError(f"not an integer: {text!r}")
    return int(match.group(1))


def _walk_value(kind: str, text: str) -> SnmpValue | None:
    kind = kind.upper()
    if kind in ("INTEGER", "GAUGE32", "COUNTER32", "COUNTER64", "UNSIGNED32"):
        return _walk_integer(text)
    if kind == "TIMETICKS":
        match = _PARENTHESISED_INT.match(text)
        return int(match.group(1)) if match else int(text)
    if kind == "STRING":
        if len(text) >= 2 and text[0] == text[-1] == '"':
            return text[1:-1].encode("iso-8859-1")
        if _MAC_LIKE.match(text):
            return bytes(int(x, 16) for x in text.split(":"))
        return text.encode("iso-8859-1")
    if kind in ("HEX-STRING", "BITS"):
        if not text:
            return b""
        match = _HEX_BYTES.match(text)
        if match is None:
            raise ValueError(f"not hex: {text!r}")
        return bytes(int(x, 16) for x in match.group(1).split())
    if kind == "OID":
        return format_oid(parse_oid(text))
    if kind == "IPADDRESS":
        return text
    return None


def decode_snmpwalk(text: str) -> list[VarBind]:
    """Records of net-snmp ``snmpwalk -On`` output (``.OID = TYPE: value`` lines).

    Reads values the way snmpsim serves such a file; lines it cannot read are skipped.
    """
    out: list[VarBind] = []
    for raw in text.splitlines():
        line = raw.encode("ascii", "ignore").decode().strip()
        oid, sep, rest = line.partition(" = ")
        if not sep:
            continue
        match = _WALK_VALUE.match(rest)
        try:
            if match:
                value = _walk_value(match.group(1), match.group(2).strip())
            elif rest == '""':
                value = b""
            else:
                value = None
            oid = format_oid(parse_oid(oid))
        except ValueError:
            continue
        if value is not None:
            out.append((oid, value))
    return out


class SnmprecClient:
    """Answers SNMP requests from a recorded walk, for capture-directory replay and tests.

    ``NAME.snmprec`` is read as snmpsim records, any other name as net-snmp ``snmpwalk -On``
    output. A missing file is :class:`SourceUnavailable`; a file without a single readable
    record is a :class:`SourceError`.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self._oids: list[Oid] = []
        self._binds: list[VarBind] = []

    async def open(self) -> None:
        if self._binds:
            return
        try:
            text = await asyncio.to_thread(self.path.read_bytes)
        except FileNotFoundError as e:
            raise SourceUnavailable(f"no recorded SNMP walk at {self.path}") from e
        except OSError as e:
            raise SourceError(f"reading {self.path}: {e}") from e
        decode = decode_snmprec if self.path.suffix == ".snmprec" else decode_snmpwalk
        records = {parse_oid(oid): (oid, value) for oid, value in decode(text.decode("iso-8859-1"))}
        if not records:
            raise SourceError(f"{self.path}: no readable SNMP records")
        self._oids = sorted(records)
        self._binds = [records[oid] for oid in self._oids]

    async def get(self, oids: Sequence[str]) -> list[VarBind]:
        await self.open()
        out: list[VarBind] = []
        for oid in oids:
            key = parse_oid(oid)
            at = bisect.bisect_left(self._oids, key)
            found = at < len(self._oids) and self._oids[at] == key
            out.append(self._binds[at] if found else (format_oid(key), Missing.NO_SUCH_INSTANCE))
        return out

    async def walk(self, oid: str) -> list[VarBind]:
        await self.open()
        prefix = parse_oid(oid)
        at = bisect.bisect_right(self._oids, prefix)
        out: list[VarBind] = []
        while at < len(self._oids) and self._oids[at][: len(prefix)] == prefix:
            out.append(self._binds[at])
            at += 1
        return out

    async def close(self) -> None:
        return None


# ---------------------------------------------------------------------------------------------
# A live PDU over SNMPv2c (pysnmp 7, asyncio)


@functools.cache
def _pysnmp() -> SimpleNamespace:
    """pysnmp, imported on first use: it takes about a second to import."""
    import pysnmp.hlapi.v3arch.asyncio as hlapi  # type: ignore[import-untyped]
    from pyasn1.type import univ  # type: ignore[import-untyped]
    from pysnmp.error import PySnmpError  # type: ignore[import-untyped]
    from pysnmp.proto import errind, rfc1902, rfc1905  # type: ignore[import-untyped]
    from pysnmp.smi import builder, view  # type: ignore[import-untyped]

    return SimpleNamespace(
        hlapi=hlapi,
        univ=univ,
        PySnmpError=PySnmpError,
        errind=errind,
        rfc1902=rfc1902,
        rfc1905=rfc1905,
        builder=builder,
        view=view,
    )


@functools.cache
def _mib_view() -> Any:
    """One MIB view for every engine of the process.

    pysnmp builds a MIB compiler into each engine's view on its first request when pysmi is
    installed (about a second); requests here use numeric OIDs only, so one view serves all.
    """
    snmp = _pysnmp()
    return snmp.view.MibViewController(snmp.builder.MibBuilder())


def _from_pysnmp(name: Any, value: Any) -> VarBind | None:
    """A pysnmp (name, value) pair as a VarBind; None for NULL and unknown types."""
    snmp = _pysnmp()
    oid = str(name)
    if isinstance(value, snmp.rfc1905.NoSuchObject):
        return oid, Missing.NO_SUCH_OBJECT
    if isinstance(value, snmp.rfc1905.NoSuchInstance):
        return oid, Missing.NO_SUCH_INSTANCE
    if isinstance(value, snmp.rfc1905.EndOfMibView):
        return oid, Missing.END_OF_MIB_VIEW
    if isinstance(value, snmp.rfc1902.IpAddress):
        return oid, ".".join(str(b) for b in value.asNumbers())
    if isinstance(value, snmp.univ.OctetString):
        return oid, bytes(value.asOctets())
    if isinstance(value, snmp.univ.ObjectIdentifier):
        return oid, str(value)
    if isinstance(value, snmp.univ.Integer):
        return oid, int(value)
    return None


class PysnmpClient:
    """SNMPv2c GET and GETBULK walks against one agent.

    Every request is bounded by ``timeout_s`` x (``retries`` + 1); no answer raises
    :class:`SnmpTimeout`, an SNMP error-status :class:`SnmpError` with the code.
    """

    def __init__(
        self,
        host: str,
        port: int = 161,
        community: str = "public",
        timeout_s: float = 1.0,
        retries: int = 1,
        max_repetitions: int = 25,
    ) -> None:
        self.host = host
        self.port = port
        self.community = community
        self.timeout_s = timeout_s
        self.retries = retries
        self.max_repetitions = max_repetitions
        self._engine: Any = None
        self._target: Any = None

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    async def open(self) -> None:
        await self._session()

    async def _session(self) -> tuple[Any, Any]:
        if self._engine is None:
            # importing pysnmp and building an engine take CPU seconds: not on the event loop
            mib_view = await asyncio.to_thread(_mib_view)
            engine = await asyncio.to_thread(_pysnmp().hlapi.SnmpEngine)
            engine.cache["mibViewController"] = mib_view
            self._engine = self._engine or engine
        snmp = _pysnmp()
        if self._target is None:
            try:
                self._target = await snmp.hlapi.UdpTransportTarget.create(
                    (self.host, self.port), timeout=self.timeout_s, retries=self.retries
                )
            except snmp.PySnmpError as e:
                raise SourceError(f"SNMP agent {self.address}: {e}") from e
        return self._engine, self._target

    def _check(self, what: str, indication: Any, status: Any, index: Any) -> None:
        if isinstance(indication, _pysnmp().errind.RequestTimedOut):
            raise SnmpTimeout(
                f"SNMP agent {self.address}: no response to {what} "
                f"within {self.timeout_s:g}s x {self.retries + 1} tries"
            )
        if indication:
            raise SnmpError(f"SNMP agent {self.address}: {what}: {indication}")
        code = int(status) if status else 0
        if code:
            name = status.prettyPrint() if hasattr(status, "prettyPrint") else str(code)
            raise SnmpError(
                f"SNMP agent {self.address}: {what}: {name} (error-status {code}, index {index})",
                status=code,
            )

    async def get(self, oids: Sequence[str]) -> list[VarBind]:
        hlapi = _pysnmp().hlapi
        engine, target = await self._session()
        what = f"GET {', '.join(oids)}"
        try:
            indication, status, index, binds = await hlapi.get_cmd(
                engine,
                hlapi.CommunityData(self.community, mpModel=1),
                target,
                hlapi.ContextData(),
                *(hlapi.ObjectType(hlapi.ObjectIdentity(oid)) for oid in oids),
                lookupMib=False,
            )
        except _pysnmp().PySnmpError as e:
            raise SnmpError(f"SNMP agent {self.address}: {what}: {e}") from e
        self._check(what, indication, status, index)
        return [
            _from_pysnmp(name, value) or (str(name), Missing.NO_SUCH_OBJECT)
            for name, value in binds
        ]

    async def walk(self, oid: str) -> list[VarBind]:
        hlapi = _pysnmp().hlapi
        engine, target = await self._session()
        prefix = parse_oid(oid)
        cursor = prefix
        out: list[VarBind] = []
        while True:
            what = f"GETBULK {format_oid(cursor)}"
            try:
                indication, status, index, binds = await hlapi.bulk_cmd(
                    engine,
                    hlapi.CommunityData(self.community, mpModel=1),
                    target,
                    hlapi.ContextData(),
                    0,
                    self.max_repetitions,
                    hlapi.ObjectType(hlapi.ObjectIdentity(format_oid(cursor))),
                    lookupMib=False,
                )
            except _pysnmp().PySnmpError as e:
                raise SnmpError(f"SNMP agent {self.address}: {what}: {e}") from e
            self._check(what, indication, status, index)
            last = cursor
            for name, value in binds:
                current = parse_oid(str(name))
                bind = _from_pysnmp(name, value)
                if current[: len(prefix)] != prefix or (bind and isinstance(bind[1], Missing)):
                    return out
                if current <= last:
                    raise SnmpError(f"SNMP agent {self.address}: OIDs not increasing at {name}")
                last = current
                if bind is not None:
                    out.append(bind)
            if last == cursor:
                return out
            cursor = last

    async def close(self) -> None:
        engine, self._engine, self._target = self._engine, None, None
        if engine is not None:
            engine.close_dispatcher()
