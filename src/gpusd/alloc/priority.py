"""Priorities: their names, who may claim which, and how waiting ages a job (docs/jobs.md).

Four named levels, ``low`` < ``normal`` < ``high`` < ``urgent``.  A priority orders the ``--wait``
queue (:mod:`gpusd.alloc.queue`) and decides who may preempt whom (:mod:`gpusd.jobs.supervisor`).

A priority is a claim another user makes in a file we read, so it is believed only up to what the
**priority policy** allows that user: root may claim any level; everyone else at most ``high`` by
default (``urgent`` is for root and for the users or groups the administrator names).  The policy is
the ``priorities`` object of the fair-use policy ``/etc/gpusd/policy.json`` (:mod:`gpusd.alloc.policy`,
which absorbs it), else ``/etc/gpusd/priorities.json``; ``$GPUSD_PRIORITY_POLICY`` may name another
root-owned file that only adds bounds to the administrator's (it is the policy alone where the
administrator has none: a client's environment never raises what a user may claim), JSON::

    {"max": "high", "users": {"alice": "urgent"}, "groups": {"interns": "normal"}, "aging_minutes": 30}

It is read only when it is a regular file (not a symlink) owned by root, readable by everyone and
writable by nobody else; otherwise every process ignores it (saying so once) and uses the defaults.
Every process that orders the queue must read the same policy, or two waiters could each wait for the
other: a policy only root can read, or one a user wrote, is therefore nobody's.

Aging: a waiting job rises one level for every ``aging_minutes`` it has waited, up to ``high`` (never
to ``urgent``), so a ``low`` job is passed by newcomers for at most twice that long.
"""

from __future__ import annotations

import math

from ..record import field, record
from ..sanitize import json_object

PRIORITIES: dict[str, int] = {"low": 0, "normal": 1, "high": 2, "urgent": 3}
LOW, NORMAL, HIGH, URGENT = 0, 1, 2, 3
DEFAULT_MAX = HIGH
DEFAULT_AGING_S = 1800.0
PRIORITY_PATH = "/etc/gpusd/priorities.json"


def priority_name(level: int) -> str:
    for name, value in PRIORITIES.items():
        if value == level:
            return name
    return str(level)


def capped(claimed: object, bound: int) -> int:
    """A claimed level (a missing or malformed claim: normal), at most ``bound``."""
    level = claimed if type(claimed) is int and claimed in PRIORITIES.values() else NORMAL
    assert isinstance(level, int)
    return min(level, bound)


def parse_level(value: object) -> int | None:
    if isinstance(value, str) and value in PRIORITIES:
        return PRIORITIES[value]
    return None


@record
class PriorityPolicy:
    max_default: int = DEFAULT_MAX
    users: dict[str, int] = field(default_factory=dict)
    groups: dict[str, int] = field(default_factory=dict)
    aging_s: float = DEFAULT_AGING_S
    # the file it came from; None: the defaults
    source: str | None = None
    # a policy whose bounds apply too (``$GPUSD_PRIORITY_POLICY`` beside root's: it may only restrict)
    also: PriorityPolicy | None = None

    def max_for(self, uid: int) -> int:
        """The highest priority the user ``uid`` may claim (the lower of this policy's and :attr:`also`'s)."""
        if uid == 0:
            return URGENT
        name = _user(uid)
        if name is not None and name in self.users:
            mine = self.users[name]
        else:
            levels = [self.groups[g] for g in _groups(uid, name) if g in self.groups]
            mine = max(levels) if levels else self.max_default
        return mine if self.also is None else min(mine, self.also.max_for(uid))

    def believed(self, claimed: object, uid: int) -> int:
        """The priority a file of ``uid`` is believed to claim (a missing or malformed claim: normal)."""
        return capped(claimed, self.max_for(uid))

    def aged(self, level: int, waited: float) -> int:
        """``level`` after waiting ``waited`` seconds: one level up per aging period, up to high."""
        if level >= HIGH or not waited > 0:
            return level
        aging = self.aging_s if self.also is None else max(self.aging_s, self.also.aging_s)  # the slower
        return min(HIGH, level + int(waited // aging))


def _user(uid: int) -> str | None:
    try:
        import pwd

        return pwd.getpwuid(uid).pw_name
    except (KeyError, ImportError):
        return None


def _groups(uid: int, name: str | None) -> list[str]:
    try:
        import grp
        import pwd

        gid = pwd.getpwuid(uid).pw_gid
        out = [g.gr_name for g in grp.getgrall() if g.gr_gid == gid or (name is not None and name in g.gr_mem)]
        return out
    except (KeyError, ImportError):
        return []


def parse_policy(raw: bytes, source: str | None = None) -> PriorityPolicy:
    """A policy from its JSON; ValueError names what is wrong (unknown fields are refused)."""
    d = json_object(raw)
    unknown = set(d) - {"max", "users", "groups", "aging_minutes"}
    if unknown:
        raise ValueError(f"unknown field(s) {', '.join(sorted(map(str, unknown)))[:200]}")
    policy = PriorityPolicy(source=source)
    if "max" in d:
        level = parse_level(d["max"])
        if level is None:
            raise ValueError(f"max: one of {', '.join(PRIORITIES)}")
        policy.max_default = level
    for key, target in (("users", policy.users), ("groups", policy.groups)):
        table = d.get(key, {})
        if not isinstance(table, dict) or len(table) > 4096:
            raise ValueError(f"{key}: an object of names to priorities")
        for name, value in table.items():
            level = parse_level(value)
            if level is None or not isinstance(name, str) or not 0 < len(name) <= 64:
                raise ValueError(f"{key}: {str(name)[:64]!r} needs one of {', '.join(PRIORITIES)}")
            target[name] = level
    if "aging_minutes" in d:
        m = d["aging_minutes"]
        if type(m) not in (int, float) or not math.isfinite(m) or not 0 < m <= 10 * 24 * 60:
            raise ValueError("aging_minutes: a number of minutes above 0 and at most 14400")
        policy.aging_s = float(m) * 60.0
    return policy
