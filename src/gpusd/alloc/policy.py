"""The fair-use policy: one root-owned file, ``/etc/gpusd/policy.json``, docs/allocation.md; ``$GPUSD_POLICY``
may name a second root-owned file, which can only make it stricter (:func:`stricter`).

JSON, every field optional::

    {"max_gpus_per_user": 2,                       # GPUs one user holds on this host (local and remote leases)
     "max_gpus_per_group": {"interns": 4},         # GPUs the members of a group hold together on this host
     "fleet_max_gpus_per_user": 8,                 # GPUs one user holds on the whole fleet (from the fleet view)
     "fair_share_days": 7,                         # opt-in: waiters of one class, fewer GPU-hours first
     "idle_warn_minutes": 30, "idle_release_minutes": 15,   # idle reservations: warned, then released
     "priorities": {"max": "high", "users": {"alice": "urgent"}, "groups": {}, "aging_minutes": 30},
     "time_limits": {"normal": {"default_minutes": 240, "max_minutes": 1440}},  # gpusd run --time per class
     "bookings": {"horizon_days": 14, "max_hours": 24, "max_per_user": 3}}   # gpusd reserve --at

``priorities`` is the priority policy of :mod:`gpusd.alloc.priority` (the old
``/etc/gpusd/priorities.json`` is still read when this file has none).  The file is believed only
when it is a regular file (not a symlink) owned by root, readable by everyone and writable by nobody
else — the checks the priority policy always had, because every process that orders the queue or
counts a cap must read the same policy; otherwise it is ignored (said once in the log) and nothing is
capped.  A user is counted by the name the lease records carry: the file owner of a local lease, the
account a remote lease was attributed to (:mod:`gpusd.daemon.users`).
"""

# Imports inside functions: start-up (quick commands import this module).
from __future__ import annotations

import json
import math
import os
import stat
from collections.abc import Callable, Iterable

# its name here stays importable
from ..errors import OverCap as OverCap
from ..record import field, record
from ..record import replace as replace_record
from ..sanitize import json_object
from . import priority
from .priority import PRIORITIES, PriorityPolicy, parse_policy, priority_name

# typing is not imported at run time: start-up time
TYPE_CHECKING = False
if TYPE_CHECKING:  # pragma: no cover
    from typing import Any, TypeVar

FAIR_USE_PATH = "/etc/gpusd/policy.json"
POLICY_ENV = "GPUSD_POLICY"
MAX_BYTES = 65536
if TYPE_CHECKING:  # pragma: no cover
    T = TypeVar("T")
# warn(path, message): how a reader of a policy file says it ignores one
Warn = Callable[[str, str], None]
FIELDS = frozenset({"max_gpus_per_user", "max_gpus_per_group", "fleet_max_gpus_per_user", "fair_share_days",
                    "idle_warn_minutes", "idle_release_minutes", "priorities", "time_limits", "bookings"})
BOOKING_FIELDS = ("horizon_days", "max_hours", "max_per_user")


@record
class Policy:
    max_gpus_per_user: int | None = None
    max_gpus_per_group: dict[str, int] = field(default_factory=dict)
    fleet_max_gpus_per_user: int | None = None
    fair_share_days: float | None = None
    idle_warn_minutes: float | None = None
    idle_release_minutes: float | None = None
    # a gpusd.alloc.priority.PriorityPolicy, or None: that module's own file
    priorities: Any = None
    # priority level -> (default, max) seconds of gpusd run --time (either None: none)
    time_limits: dict[int, tuple[float | None, float | None]] = field(default_factory=dict)
    # BOOKING_FIELDS -> bound (gpusd reserve --at)
    bookings: dict[str, float] = field(default_factory=dict)
    source: str | None = None

    def time_limit(self, priority: int, asked: float | None) -> float | None:
        """The time limit of a job of ``priority`` that asked ``asked`` seconds (None: the class's
        default, if any); ValueError naming the bound when it asks more than its class's maximum."""
        default, most = self.time_limits.get(priority, (None, None))
        # the default, never above the maximum (a maximum alone is every job's limit)
        if asked is None:
            bounds = [v for v in (default, most) if v is not None]
            return min(bounds) if bounds else None
        if most is not None and asked > most:
            from ..units import format_duration

            raise ValueError(f"--time {format_duration(asked)}: the policy ({self.source or FAIR_USE_PATH}) allows "
                             f"{priority_name(priority)} jobs at most {format_duration(most)}")
        return asked

    def refusal(self, user: str | None, count: int, held: dict[str, int],
                fleet_held: dict[str, int] | None = None) -> str | None:
        """Why ``user`` may not lease ``count`` GPUs more, holding ``held`` (user -> GPUs on this host;
        ``fleet_held``: on the fleet); None when it may."""
        if not user:
            return None
        where = self.source or FAIR_USE_PATH
        mine = held.get(user, 0)
        cap = self.max_gpus_per_user
        if cap is not None and mine + count > cap:
            return (f"{user} holds {mine} GPU(s) on this host and asks for {count} more: the policy ({where}) "
                    f"allows max_gpus_per_user {cap}")
        if self.max_gpus_per_group:
            members: dict[str, set[str]] = {}
            for g in groups_of(user):
                if g in self.max_gpus_per_group:
                    members[g] = {u for u in held if g in groups_of(u)} | {user}
            for g, names in sorted(members.items()):
                together = sum(held.get(u, 0) for u in names)
                if together + count > self.max_gpus_per_group[g]:
                    return (f"the group {g} holds {together} GPU(s) on this host and {user} asks for {count} more: "
                            f"the policy ({where}) allows max_gpus_per_group {g}: {self.max_gpus_per_group[g]}")
        fcap = self.fleet_max_gpus_per_user
        if fcap is not None and fleet_held is not None:
            total = fleet_held.get(user, 0)
            if total + count > fcap:
                return (f"{user} holds {total} GPU(s) on the fleet (as this host's fleet view shows it) and asks for "
                        f"{count} more: the policy ({where}) allows fleet_max_gpus_per_user {fcap}")
        return None


def groups_of(user: str) -> set[str]:
    try:
        import grp
        import pwd

        gid = pwd.getpwnam(user).pw_gid
    except (KeyError, ImportError):
        return set()
    out = set()
    for g in grp.getgrall():
        if g.gr_gid == gid or user in g.gr_mem:
            out.add(g.gr_name)
    return out


def held_by_user(leases: Iterable[Any]) -> dict[str, int]:
    """User -> GPUs (devices) its leases hold, from lease records (:class:`gpusd.model.LeaseInfo`)."""
    out: dict[str, int] = {}
    seen: set[tuple[str, str | None]] = set()
    for le in leases:
        if not le.user or (le.lease_id, le.device) in seen:
            continue
        seen.add((le.lease_id, le.device))
        out[le.user] = out.get(le.user, 0) + 1
    return out


def read_root_file(path: str, what: str, warn: Warn) -> tuple[tuple[int, int, int] | None, bytes | None]:
    """(the file's identity, its bytes) when ``path`` is a policy every process may believe: a regular
    file, not a symlink, owned by root, readable by everyone, writable by nobody else, at most
    :data:`MAX_BYTES`.  (None, None) when it is missing or fails a check (``warn`` is told why)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return None, None
    except OSError as exc:
        # a symlink (ELOOP), unreadable: every process must read the same policy
        warn(path, f"ignoring the {what} {path}: {exc.strerror}")
        return None, None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            warn(path, f"ignoring the {what} {path}: not a regular file")
            return None, None
        if st.st_uid != 0 or st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) or not st.st_mode & stat.S_IROTH:
            # Every process that orders the queue must see the same policy, or two waiters may each
            # wait for the other: a file only some can read, or one a user wrote, is nobody's.
            warn(path, f"ignoring the {what} {path}: it must belong to root, be readable by everyone and "
                       "writable by nobody else")
            return None, None
        raw = os.read(fd, MAX_BYTES + 1)
    except OSError:
        return None, None
    finally:
        os.close(fd)
    if len(raw) > MAX_BYTES:
        warn(path, f"ignoring the {what} {path}: larger than {MAX_BYTES} bytes")
        return None, None
    return (st.st_ino, st.st_mtime_ns, st.st_size), raw


# The one cache of policy files (the fair-use policy's and the priority policy's): (path, parser) ->
# ((inode, mtime, size), value), kept while the file is unchanged.
_cache: dict[tuple[str, object], tuple[tuple[int, int, int], Any]] = {}


def load_root_file(path: str, what: str, warn: Warn, parse: Callable[[bytes, str], T]) -> T | None:
    """``parse(bytes, path)`` of the policy file ``path`` that :func:`read_root_file` believes, kept in
    the one cache while the file is unchanged; None where there is none, it fails a check, or
    ``parse`` raises ValueError (``warn`` is told why)."""
    key, raw = read_root_file(path, what, warn)
    if key is None or raw is None:
        return None
    hit = _cache.get((path, parse))
    if hit is not None and hit[0] == key:
        value: T = hit[1]
        return value
    try:
        value = parse(raw, path)
    except ValueError as exc:
        warn(path, f"ignoring the {what} {path}: {exc}")
        return None
    _cache[(path, parse)] = (key, value)
    return value


def forget_files() -> None:
    """Read every policy file again on its next use (as a new process would)."""
    _cache.clear()


_warned: set[str] = set()


def _warn_once(path: str, message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        # lazily: the CLI's start-up time matters
        import logging

        logging.getLogger(__name__).warning("%s", message)


def policy_path() -> str:
    """The extra policy file the environment names (``$GPUSD_POLICY``), else the root policy's path."""
    return os.environ.get(POLICY_ENV) or FAIR_USE_PATH


def load(path: str | None = None) -> Policy:
    """The policy in force (cached while the files are unchanged): the root-owned
    :data:`FAIR_USE_PATH`, made stricter by the file ``$GPUSD_POLICY`` names (:func:`stricter`), whatever
    that says: a client's environment can add limits, never remove one (a missing or untrusted file
    adds nothing).  ``path``: that file alone.  No caps where there is none, or a file cannot be
    trusted or parsed (said once, in the log)."""
    if path is not None:
        return load_root_file(path, "policy", _warn_once, parse) or Policy()
    root = load_root_file(FAIR_USE_PATH, "policy", _warn_once, parse)
    extra_path = os.environ.get(POLICY_ENV)
    if not extra_path or extra_path == FAIR_USE_PATH:
        return root or Policy()
    extra = load_root_file(extra_path, "policy", _warn_once, parse)
    if extra is None:
        return root or Policy()
    return extra if root is None else stricter(root, extra)


_priority_warned: set[str] = set()


def _warn_once_per_file(path: str, message: str) -> None:
    if path not in _priority_warned:
        _priority_warned.add(path)
        # lazily: the CLI's start-up time matters
        import logging

        logging.getLogger(priority.__name__).warning("%s", message)


def load_priority_policy(path: str | None = None) -> PriorityPolicy:
    """The priority policy (cached while the file is unchanged); the defaults where there is none or
    it cannot be trusted or parsed (said once, in the log).  The administrator's (this policy's
    ``priorities``, else :data:`gpusd.alloc.priority.PRIORITY_PATH`) applies whatever the client's
    environment says: ``$GPUSD_PRIORITY_POLICY`` may only add bounds (each user's highest level the lower
    of the two, aging the slower), and is the policy alone only where the administrator has none."""
    if path is not None:
        policy = load_root_file(path, "priority policy", _warn_once_per_file, parse_policy)
        return PriorityPolicy() if policy is None else policy
    # the fair-use policy's "priorities"
    root: PriorityPolicy | None = load().priorities
    if root is None:
        root = load_root_file(priority.PRIORITY_PATH, "priority policy", _warn_once_per_file, parse_policy)
    env = os.environ.get("GPUSD_PRIORITY_POLICY")
    extra = load_root_file(env, "priority policy", _warn_once_per_file, parse_policy) if env else None
    if root is None:
        return PriorityPolicy() if extra is None else extra
    if extra is None:
        return root
    return replace_record(root, also=extra)


def _lower(a: float | None, b: float | None) -> float | None:
    if a is None:
        return b
    if b is None:
        return a
    return min(a, b)


def _lower_int(a: int | None, b: int | None) -> int | None:
    return a if b is None else b if a is None else min(a, b)


def stricter(root: Policy, extra: Policy) -> Policy:
    """``root`` (the administrator's) with ``extra``'s limits added, never one of root's removed:
    every cap (per user, per group, fleet-wide) is the lower of the two, a cap in either applies; idle
    reservations are warned and released after the shorter of the two times; what orders everyone's
    queue (``fair_share_days``, ``priorities``) is root's alone, since every waiter must read the same
    (docs/allocation.md, "The policy file")."""
    groups = dict(root.max_gpus_per_group)
    for g, n in extra.max_gpus_per_group.items():
        groups[g] = min(n, groups.get(g, n))
    return Policy(max_gpus_per_user=_lower_int(root.max_gpus_per_user, extra.max_gpus_per_user),
                  max_gpus_per_group=groups,
                  fleet_max_gpus_per_user=_lower_int(root.fleet_max_gpus_per_user,
                                                          extra.fleet_max_gpus_per_user),
                  fair_share_days=root.fair_share_days,
                  idle_warn_minutes=_lower(root.idle_warn_minutes, extra.idle_warn_minutes),
                  idle_release_minutes=_lower(root.idle_release_minutes, extra.idle_release_minutes),
                  priorities=root.priorities,
                  time_limits={k: (_lower(*(p.time_limits.get(k, (None, None))[0] for p in (root, extra))),
                                   _lower(*(p.time_limits.get(k, (None, None))[1] for p in (root, extra))))
                               for k in set(root.time_limits) | set(extra.time_limits)},
                  bookings={k: min(v for v in (root.bookings.get(k), extra.bookings.get(k)) if v is not None)
                            for k in set(root.bookings) | set(extra.bookings)},
                  source=f"{root.source} and {extra.source}")


def _count(d: dict[str, Any], name: str, top: int = 1_000_000) -> int | None:
    v = d.get(name)
    if v is None:
        return None
    if type(v) is not int or not 0 <= v <= top:
        raise ValueError(f"{name}: a whole number from 0 to {top}")
    return v


def _minutes(d: dict[str, Any], name: str) -> float | None:
    v = d.get(name)
    if v is None:
        return None
    if type(v) not in (int, float) or not math.isfinite(v) or not 0 < v <= 366 * 24 * 60:
        raise ValueError(f"{name}: a number of minutes above 0 and at most a year")
    return float(v)


def parse(raw: bytes, source: str | None = None) -> Policy:
    """A policy from its JSON; ValueError names what is wrong (unknown fields are refused)."""
    d = json_object(raw)
    unknown = set(d) - FIELDS
    if unknown:
        raise ValueError(f"unknown field(s) {', '.join(sorted(map(str, unknown)))[:200]}")
    p = Policy(source=source)
    p.max_gpus_per_user = _count(d, "max_gpus_per_user")
    p.fleet_max_gpus_per_user = _count(d, "fleet_max_gpus_per_user")
    groups = d.get("max_gpus_per_group", {})
    if not isinstance(groups, dict) or len(groups) > 4096:
        raise ValueError("max_gpus_per_group: an object of group names to numbers of GPUs")
    for name, value in groups.items():
        if not isinstance(name, str) or not 0 < len(name) <= 64 or type(value) is not int or not 0 <= value <= 10**6:
            raise ValueError(f"max_gpus_per_group: {str(name)[:64]!r} needs a whole number of GPUs")
        p.max_gpus_per_group[name] = value
    days = d.get("fair_share_days")
    if days is not None:
        if type(days) not in (int, float) or not math.isfinite(days) or not 0 < days <= 366:
            raise ValueError("fair_share_days: a number of days above 0 and at most 366")
        p.fair_share_days = float(days)
    p.idle_warn_minutes = _minutes(d, "idle_warn_minutes")
    p.idle_release_minutes = _minutes(d, "idle_release_minutes")
    p.time_limits = _time_limits(d.get("time_limits", {}))
    bookings = d.get("bookings", {})
    if not isinstance(bookings, dict) or set(bookings) - set(BOOKING_FIELDS):
        raise ValueError(f"bookings: an object of {', '.join(BOOKING_FIELDS)}")
    for name, v in bookings.items():
        if type(v) not in (int, float) or not math.isfinite(v) or not 0 < v <= 10**6:
            raise ValueError(f"bookings: {name} needs a number above 0")
        p.bookings[name] = float(v)
    if "priorities" in d:
        pri = d["priorities"]
        if not isinstance(pri, dict):
            raise ValueError("priorities: an object (the priority policy, docs/jobs.md)")
        try:
            p.priorities = parse_policy(json.dumps(pri).encode(), source)
        except ValueError as exc:
            raise ValueError(f"priorities: {exc}") from None
    return p


def _time_limits(d: object) -> dict[int, tuple[float | None, float | None]]:
    if not isinstance(d, dict):
        raise ValueError("time_limits: an object of priority classes to {default_minutes, max_minutes}")
    out: dict[int, tuple[float | None, float | None]] = {}
    for name, terms in d.items():
        if name not in PRIORITIES or not isinstance(terms, dict) or set(terms) - {"default_minutes", "max_minutes"}:
            raise ValueError(f"time_limits: {str(name)[:32]!r}: a class ({', '.join(PRIORITIES)}) and an object of "
                             "default_minutes, max_minutes")
        default, most = _minutes(terms, "default_minutes"), _minutes(terms, "max_minutes")
        out[PRIORITIES[name]] = (None if default is None else default * 60.0, None if most is None else most * 60.0)
    return out


def over_caps(leases: Iterable[Any], policy: Policy | None = None) -> dict[str, str]:
    """User -> why they hold more than the policy allows (a user cap, or a cap of a group of theirs):
    possible only with leases the authority did not grant (taken in the shared lock directory, where
    the client's own code applies the caps), so the views flag them for an administrator."""
    policy = policy or load()
    if policy.max_gpus_per_user is None and not policy.max_gpus_per_group:
        return {}
    held = held_by_user(leases)
    where = policy.source or FAIR_USE_PATH
    # each user's groups looked up once (the group database is read per lookup; this runs every sample)
    groups = {u: groups_of(u) for u in held} if policy.max_gpus_per_group else {}
    out: dict[str, str] = {}
    for user, n in sorted(held.items()):
        cap = policy.max_gpus_per_user
        if cap is not None and n > cap:
            out[user] = f"{user} holds {n} GPU(s): over max_gpus_per_user {cap} ({where})"
            continue
        for g in sorted(groups.get(user, ())):
            if g in policy.max_gpus_per_group:
                together = sum(k for u, k in held.items() if g in groups[u])
                if together > policy.max_gpus_per_group[g]:
                    out[user] = (f"the group {g} holds {together} GPU(s): over max_gpus_per_group {g}: "
                                 f"{policy.max_gpus_per_group[g]} ({where})")
                    break
    return out


def flag_over_cap(leases: list[Any], policy: Policy | None = None) -> list[Any]:
    """``leases`` (:class:`gpusd.model.LeaseInfo`) with ``over_cap`` set on every lease of a user over
    a cap (:func:`over_caps`); copies, the others as they were."""
    over = over_caps(leases, policy)
    if not over:
        return leases
    from dataclasses import replace

    return [replace(le, over_cap=True) if le.user in over and not le.unleased else le for le in leases]


def check(user: str | None, count: int, leases: Iterable[Any], policy: Policy | None = None) -> None:
    """Raise :class:`OverCap` when ``user`` may not lease ``count`` GPUs more beside ``leases``."""
    policy = policy or load()
    if policy.max_gpus_per_user is None and not policy.max_gpus_per_group:
        return
    why = policy.refusal(user, count, held_by_user(leases))
    if why is not None:
        raise OverCap(why)


# -- fair share: the daemon's summary of the usage history, read by every waiter ------------------
# The summary lives in root's daemon's state directory, never in the world-writable lock directory:
# there anyone could squat its name (a directory called fair-share.json made the daemon's rename fail
# every minute, silently turning fair share off) or race the daemon's writes.
SHARES_FILE = "fair-share.json"
MAX_SHARES_BYTES = 1 << 20
# root's daemon's state directory (gpusd.identity.state_dir for root)
ROOT_STATE_DIR = "/var/lib/gpusd"


def shares_dir() -> str:
    """Where waiters look for root's daemon's fair-share summary: ``$GPUSD_STATE_DIR`` (the daemon's
    state directory where it was moved), else root's default.  What is found there counts only when
    root owns it and no one else can write it (:func:`read_shares`)."""
    return os.environ.get("GPUSD_STATE_DIR") or ROOT_STATE_DIR


class SharesDirUnsafe(OSError):
    """The directory the summary was to go to is not the daemon's alone."""


def publish_summary(directory: str | os.PathLike[str], name: str, data: bytes, what: str,
                    unsafe: type[OSError] = PermissionError) -> None:
    """Write ``data`` as ``name`` in ``directory`` (the daemon's state directory), atomically (a new
    file renamed into place), readable by every local user; ``unsafe`` when the directory is not this
    process's own or others can write it: the daemon writes only where only it can write."""
    import secrets

    dfd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        st = os.fstat(dfd)
        if st.st_uid != os.geteuid() or st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            raise unsafe(f"{os.fspath(directory)} is not the daemon's alone (owner uid {st.st_uid}, "
                         f"mode {stat.S_IMODE(st.st_mode):04o}): {what} is not written")
        tmp = f".{name}.{secrets.token_hex(8)}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644, dir_fd=dfd)
        try:
            os.write(fd, data)
            os.fchmod(fd, 0o644)
        finally:
            os.close(fd)
        os.rename(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
    finally:
        os.close(dfd)


def write_shares(directory: str | os.PathLike[str], hours: dict[str, float], days: float,
                 now: float | None = None) -> None:
    """Write the GPU-hours of each user over the last ``days`` days into ``directory``, the daemon's
    state directory (root's daemon does, every minute, from the usage history), atomically: a new
    file renamed into place.  Refuses (:class:`SharesDirUnsafe`) a directory that is not this
    process's own or that others can write: the daemon writes only where only it can write."""
    import time

    data = json.dumps({"days": days, "at": time.time() if now is None else now,
                       "hours": {u[:64]: round(float(h), 6) for u, h in sorted(hours.items())[:10000]}}).encode()
    publish_summary(directory, SHARES_FILE, data, "the fair-share summary", SharesDirUnsafe)


def read_shares(directory: str | os.PathLike[str] | None = None) -> dict[str, float] | None:
    """The users' GPU-hours the daemon last wrote (:func:`write_shares`) in ``directory`` (default
    :func:`shares_dir`), or None: no file, or one that is not root's regular file in a directory
    only root can write."""
    try:
        dfd = os.open(shares_dir() if directory is None else directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        dst = os.fstat(dfd)
        if dst.st_uid != 0 or dst.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            # a directory others can write: its files could be anyone's swap
            return None

        fd = os.open(SHARES_FILE, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dfd)
    except OSError:
        return None
    finally:
        os.close(dfd)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != 0 or st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            return None
        raw = os.read(fd, MAX_SHARES_BYTES + 1)
    except OSError:
        return None
    finally:
        os.close(fd)
    try:
        hours = json_object(raw, MAX_SHARES_BYTES).get("hours")
    except ValueError:
        return None
    if not isinstance(hours, dict):
        return None
    return {str(u)[:64]: float(h) for u, h in hours.items()
            if isinstance(h, (int, float)) and not isinstance(h, bool) and math.isfinite(h) and h >= 0}


def shares_from_usage(answer: dict[str, Any]) -> dict[str, float]:
    """User -> GPU-hours in a usage answer (:func:`gpusd.usage.query.usage`): the hours its leases held
    GPUs and its processes ran on GPUs without a lease (what gpusd allocated, and what bypassed it)."""
    out: dict[str, float] = {}
    for u in answer.get("users") or []:
        if isinstance(u, dict) and u.get("kind") in ("hold", "unleased") and u.get("user"):
            secs = u.get("seconds")
            if isinstance(secs, (int, float)) and not isinstance(secs, bool):
                out[str(u["user"])] = out.get(str(u["user"]), 0.0) + float(secs) / 3600.0
    return out
