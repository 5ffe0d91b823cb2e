"""Lease-socket requests, checked field by field (docs/allocation.md, "The daemon as lease authority").

Part of the lease authority (:mod:`gpusd.daemon.leasesock`); the daemon's remote leases
(:mod:`gpusd.daemon.pool`) check their constraints with the same :func:`request`.  Anything that is
not a well-formed request is a :class:`~gpusd.errors.ConfigError` (answered ``usage``), never a
traceback.
"""

from __future__ import annotations

import math
from typing import Any

from ..errors import ConfigError, IdError
from ..ids import JobId
from ..inventory.vendors import INHERITED_OTHERS
from ..sanitize import json_object

# the highest version this daemon speaks (docs/allocation.md)
PROTOCOL = 2


def parse(line: bytes) -> dict[str, Any]:
    try:
        return json_object(line)
    except ValueError:
        raise ConfigError("a request is one JSON object on one line") from None


def version(d: dict[str, Any]) -> int:
    """The protocol both sides speak: the client's ``v`` (1 when absent), at most ours."""
    v = d.get("v", 1)
    if type(v) is not int or v < 1:
        raise ConfigError("bad 'v' in the lease request")
    return min(v, PROTOCOL)


def job_of(d: dict[str, Any]) -> str | None:
    """The client's job id (:class:`gpusd.ids.JobId`), a label for the lease record; believed as nothing more."""
    job = d.get("job")
    if job is None:
        return None
    if not JobId.is_valid(job):
        raise IdError(f"bad 'job' in the lease request ({JobId.what} is {JobId.rule})")
    return job


def priority_of(d: dict[str, Any]) -> int | None:
    """The client's priority (0 low .. 3 urgent, docs/jobs.md): a claim, believed up to the priority
    policy's bound for the client's uid where it is used (``allocate(uid=...)``)."""
    level = d.get("priority")
    if level is None:
        return None
    if type(level) is not int or not 0 <= level <= 3:
        raise ConfigError("bad 'priority' in the lease request (0 low, 1 normal, 2 high, 3 urgent)")
    return level


def request(line: bytes) -> dict[str, Any]:
    """Validate a lease request into keyword arguments for :meth:`Constraints.build` (plus wait,
    timeout, command, visible: the client's inherited device-list variables, or None); ConfigError when it is
    not one."""
    return constraints(parse(line))


def constraints(d: dict[str, Any], op: str = "lease") -> dict[str, Any]:
    """:func:`request` of a parsed request (``op`` ``lease``, or ``grow`` on a held connection)."""
    if d.get("op") != op:
        raise ConfigError(f'unknown request (expected {{"op": "{op}", ...}})')

    def opt(key: str, types: tuple[type, ...], what: str = "") -> Any:
        v = d.get(key)
        if v is None:
            return None
        # type() and not isinstance(): true/false are not numbers here; NaN and infinities are refused
        if type(v) not in types or (isinstance(v, float) and not math.isfinite(v)):
            raise ConfigError(f"bad {key!r} in the lease request" + (f": {what}" if what else ""))
        return v

    def bounded(key: str, types: tuple[type, ...], top: float, what: str) -> Any:
        """A number from 0 to ``top``."""
        v = opt(key, types, what)
        if v is not None and not 0 <= v <= top:
            raise ConfigError(f"bad {key!r} in the lease request: {what}")
        return v

    def amount(key: str, types: tuple[type, ...], what: str) -> Any:
        """A number of bytes (or a ratio, for min_free): 0 or more, at most 2**53."""
        return bounded(key, types, 2**53, what)

    def ids(key: str) -> list[str] | None:
        v = d.get(key)
        if v is None:
            return None
        if not isinstance(v, list) or len(v) > 64 or not all(isinstance(x, str) and len(x) <= 128 for x in v):
            raise ConfigError(f"bad {key!r} in the lease request")
        return v

    count = d.get("count", 1)
    if type(count) is not int or not 0 < count <= 256:
        raise ConfigError("bad 'count' in the lease request: a whole number of GPUs from 1 to 256")
    timeout = opt("timeout", (int, float))
    if timeout is not None and not 0 <= timeout <= 10**7:
        raise ConfigError("bad 'timeout' in the lease request")
    by = opt("by", (str,)) or "load"
    # added in 0.3: an older client sends none
    topology = opt("topology", (str,)) or "auto"
    command, visible = opt("command", (str,)), opt("visible", (str,))
    env = {"CUDA_VISIBLE_DEVICES": visible[:1024]} if visible is not None else None
    # added in 0.4: the client's inherited AMD/Intel device lists
    others = d.get("visible_vars")
    if others is not None:
        if (not isinstance(others, dict) or not set(others) <= set(INHERITED_OTHERS)
                or not all(isinstance(v, str) and len(v) <= 1024 for v in others.values())):
            raise ConfigError("bad 'visible_vars' in the lease request: an object of "
                              f"{', '.join(INHERITED_OTHERS)} to their values")
        env = {**(env or {}), **others}
    return {
        "count": count,
        "min_free": amount("min_free", (int, float), "bytes as a whole number, or a ratio from 0 to 1"),
        "memory": amount("memory", (int,), "a whole number of bytes, 0 or more"),
        "max_util": bounded("max_util", (int, float), 100, "a percentage from 0 to 100"),
        "max_processes": bounded("max_processes", (int,), 2**31, "a whole number, 0 or more"),
        "include": ids("include"), "exclude": ids("exclude"), "mig": d.get("mig") is True, "by": by[:16],
        "shared": d.get("shared") is True, "topology": topology[:16], "wait": d.get("wait") is True, "timeout": timeout,
        "command": command[:1024] if command else None, "visible": env,
        # validated by Constraints.build
        "vendor": opt("vendor", (str,)),
        # seconds the GPUs are needed at most (backfill before a booking, gpusd.alloc.bookings)
        "time_limit": bounded("time_limit", (int, float), 20 * 365 * 86400, "seconds, above 0") or None,
    }
