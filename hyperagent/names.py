"""Names that become MQTT topic levels: clusters, nodes and jobs.

A name is one level of ``hyperagent/v1/<cluster>/node/<node>/...``, on every broker the README
supports: so no ``/`` (MQTT's level separator), no ``+`` or ``#`` (MQTT's wildcards) and no
``.`` (RabbitMQ maps it to a level separator: ``gpu-017.example`` would publish under
``node/gpu-017/example/status``). Names use ``[A-Za-z0-9_-]``, at most 64 characters, as
:func:`hyperagent.scheduler.safe_id` makes job ids.
"""

from __future__ import annotations

import re

MAX_NAME = 64
NAME_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_-")
_NAME = re.compile(f"[{re.escape(''.join(sorted(NAME_CHARS)))}]{{1,{MAX_NAME}}}")
SEPARATORS = {
    "/": "the MQTT topic level separator",
    "+": "an MQTT wildcard",
    "#": "an MQTT wildcard",
    ".": "a topic level separator on RabbitMQ",
}


def name_problem(name: str, also: str = "") -> str | None:
    """Why ``name`` cannot be a cluster, node or job name (saying the name), or None;
    ``also``: characters allowed besides (a pattern's wildcards)."""
    if not also and _NAME.fullmatch(name):
        return None
    if not 0 < len(name) <= MAX_NAME:
        return f"{name!r} is not 1 to {MAX_NAME} characters long"
    bad = [char for char in name if char not in NAME_CHARS and char not in also]
    if not bad:
        return None
    for char in bad:
        if char in SEPARATORS:
            fix = re.sub(r"[^A-Za-z0-9_-]+", "-", name).strip("-")
            return (
                f"{name!r} holds {char!r}, {SEPARATORS[char]}: names become MQTT topic levels"
                + (f" (say {fix!r})" if fix and not also else "")
            )
    return f"{name!r} holds {bad[0]!r}: names use only letters, digits, '_' and '-'"


def check_name(name: str) -> str:
    """``name`` if it is a valid cluster, node or job name; raises ValueError saying why not."""
    problem = name_problem(name)
    if problem is not None:
        raise ValueError(problem)
    return name


def safe_name(text: str, default: str = "node") -> str:
    """``text`` as a name: each run of other characters made ``-``, cut to 64 characters."""
    return re.sub(r"[^A-Za-z0-9_-]+", "-", text).strip("-")[:MAX_NAME] or default
