"""Fleet selection and reservations: the client side of the pool (docs/pool.md)."""

# Imports inside functions: optional or heavy packages.
from __future__ import annotations

import fnmatch
import getpass
import logging
import os
import socket
import threading
import time
from copy import copy
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Callable, Iterable
from urllib.parse import urlsplit

from ..alloc.select import Candidate, Constraints, choose, score
from ..engines.placement import Placement, valid_cpulist
from ..errors import (
    REFUSED_STATUSES,
    ConfigError,
    DiskFull,
    GpusdError,
    NoGpuAvailable,
    OverCap,
    SourceError,
    WaitTimeout,
    from_wire,
)
from ..identity import node_id
from ..ids import LeaseId, PlacementId
from ..inventory.vendors import DEFAULT_VENDOR, SET_VARIABLES
from ..sanitize import for_terminal
from ..wire import http
from ..wire.txt import API_PREFIX

if TYPE_CHECKING:  # pragma: no cover
    from ..discovery.sync import Client
    from ..discovery.types import RemoteHost
    from ..wire.http import Reply
    from ..wire.signing import FleetKey

log = logging.getLogger("gpusd.pool")

DEFAULT_TTL = 30.0
WAKE_EVENTS = ("device_updated", "device_added", "host_added")
# seconds: a waiting reserve() tries again at least this often
RETRY_EVERY = 10.0


@dataclass
class HostLease:
    """One lease a host's daemon holds for us."""

    lease_id: str
    hostname: str
    node_id: str
    # the daemon's API base (https where it serves TLS)
    url: str
    # its announced certificate fingerprint (over https)
    pin: str | None
    devices: list[dict[str, Any]]
    env: dict[str, str]
    ttl: float
    expires: float
    addresses: list[str] = field(default_factory=list)
    # the host is this machine (no SSH needed)
    local: bool = False

    def to_dict(self) -> dict[str, Any]:
        return {"lease_id": self.lease_id, "host": self.hostname, "node_id": self.node_id, "url": self.url,
                "devices": self.devices, "env": self.env, "ttl": self.ttl, "expires": self.expires,
                "addresses": self.addresses, "local": self.local, "pin": self.pin}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> HostLease:
        return cls(str(d["lease_id"]), str(d["host"]), str(d["node_id"]), str(d["url"]), d.get("pin"),
                   list(d.get("devices") or []), dict(d.get("env") or {}), float(d.get("ttl") or DEFAULT_TTL),
                   float(d.get("expires") or 0), list(d.get("addresses") or []), bool(d.get("local")))


def _call(method: str, lease: HostLease, path: str, key: FleetKey, body: Any = None,
          timeout: float = 5.0) -> Any:
    reply = http.request_json(method, lease.url + path, body, key=key, node_id=lease.node_id, pin=lease.pin,
                         timeout=timeout)
    if reply.verified is False:
        raise SourceError(f"{lease.hostname}: the answer carries no proof of the fleet secret")
    return reply


class Reservation:
    """Leases on one host or more (``per_host``), renewed in a background thread while held."""

    def __init__(self, parts: list[HostLease], key: FleetKey) -> None:
        self.parts = parts
        self.key = key
        # a daemon no longer knows a lease (expired, daemon restarted)
        self.lost = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.released = False
        self._until: float | None = None
        self._until_mono: float | None = None

    @property
    def until(self) -> float | None:
        """When the holder stops renewing (epoch, as given), told to the daemons as ``left``."""
        return self._until

    @until.setter
    def until(self, value: float | None) -> None:
        # kept as a deadline on the monotonic clock: a wall-clock step must not end it early or late
        self._until = value
        self._until_mono = None if value is None else time.monotonic() + (value - time.time())

    def left(self) -> float | None:
        """Seconds until :attr:`until` (monotonic; None: renew until released)."""
        return None if self._until_mono is None else max(0.0, self._until_mono - time.monotonic())

    # the common single-host case
    @property
    def host(self) -> str:
        return self.parts[0].hostname

    @property
    def env(self) -> dict[str, str]:
        return dict(self.parts[0].env)

    @property
    def lease_id(self) -> str:
        return self.parts[0].lease_id

    @property
    def devices(self) -> list[dict[str, Any]]:
        return [d for p in self.parts for d in p.devices]

    def renew(self, ttl: float | None = None) -> None:
        """One heartbeat for every part; sets :attr:`lost` (and raises) when a daemon forgot one."""
        for p in self.parts:
            body: dict[str, float] = {"ttl": ttl} if ttl else {}
            left = self.left()
            # a duration, never a time: the daemon's clock decides
            if left is not None:
                body["left"] = round(left, 1)
            reply = _call("POST", p, f"/leases/{p.lease_id}/renew", self.key, body)
            if reply.status == 404:
                self.lost.set()
                raise GpusdError(f"the lease {p.lease_id} on {p.hostname} is gone "
                                 "(released, expired, or its host rebooted)")
            data = reply.data if isinstance(reply.data, dict) else {}
            if reply.status == OverCap.http_status and data.get("reason") == "fleet_cap":
                # among the newest leases above the fleet-wide cap: never renewed again, it ends at its expiry
                self.lost.set()
            if reply.status != 200:
                raise refusal(reply, f"{p.hostname}: renewing failed (HTTP {reply.status})")
            if isinstance(reply.data, dict) and type(reply.data.get("expires")) in (int, float):
                p.expires = float(reply.data["expires"])

    def start_renewing(self, until: float | None = None) -> None:
        """Renew every ttl/3 seconds in a daemon thread; stop (and release) at ``until`` (epoch)."""
        if self._thread is not None:
            return
        if until is not None:
            self.until = until

        def loop() -> None:
            period = max(0.5, min(p.ttl for p in self.parts) / 3)
            while not self._stop.wait(period):
                if self.left() == 0.0:
                    self.release()
                    return
                try:
                    self.renew()
                except GpusdError as exc:
                    log.warning("%s", exc)
                    if self.lost.is_set():
                        return
                except Exception as exc:  # noqa: BLE001 - a missed heartbeat; the TTL allows two more
                    log.warning("renewing failed: %s", exc)

        self._thread = threading.Thread(target=loop, name="gpusd-renew", daemon=True)
        self._thread.start()

    def release(self) -> None:
        if self.released:
            return
        self.released = True
        self._stop.set()
        for p in self.parts:
            try:
                _call("DELETE", p, f"/leases/{p.lease_id}", self.key)
            except GpusdError as exc:
                # it ends with its TTL anyway
                log.warning("cannot release %s on %s: %s (it expires within %gs)", p.lease_id, p.hostname, exc,
                            p.ttl)

    def __enter__(self) -> Reservation:
        self.start_renewing()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def to_dict(self) -> dict[str, Any]:
        return {"leases": [p.to_dict() for p in self.parts], "host": self.host, "env": self.env}

    def to_placement(self, job_id: str | None = None) -> Placement:
        """The engines' :class:`~gpusd.engines.placement.Placement` of this reservation (validated:
        PlacementError for a host name that is not safe in a hostfile or an ssh argument)."""

        return Placement.from_dict(self.to_placement_dict(job_id))

    def to_placement_dict(self, job_id: str | None = None) -> dict[str, Any]:
        """The JSON form of an engine placement (``gpusd.engines.placement.Placement.from_dict``):
        one slot per host, with the NVML indices and UUIDs leased there.  Host name, address and ssh
        target are what each host's daemon signed (``HostLease.hostname``, ``addresses``)."""
        return {"job_id": job_id or PlacementId.new(), "hosts": [
            {"hostname": p.hostname, "address": (p.addresses or [p.hostname])[0], "ssh_target": p.hostname,
             **_slot_gpus(p)} for p in self.parts]}


def refusal(reply: Reply, what: str) -> GpusdError:
    """A daemon's HTTP error answer as the error to raise: ``WHAT: MESSAGE`` (sanitised), always a
    :class:`GpusdError` (exit 1, as in 0.2, whatever the daemon's ``code``), its ``__cause__`` the error
    the daemon named (:func:`gpusd.errors.from_wire`, docs/errors.md)."""
    data = reply.data if isinstance(reply.data, dict) else {}
    if not data.get("error"):
        return GpusdError(what)
    named = from_wire(data, what + ": ")
    exc = GpusdError(str(named)[:len(what) + 302])
    exc.__cause__ = named
    return exc


def _slot_gpus(p: HostLease) -> dict[str, Any]:
    """A host's GPUs in a placement: its vendor's own numbers (a daemon before 0.3 sends no
    vendor: NVIDIA's, which are its indices).  A host's part of a reservation is of one vendor."""
    vendors = {d.get("vendor") or DEFAULT_VENDOR for d in p.devices}
    if len(vendors) > 1:
        raise GpusdError(f"{p.hostname}: the GPUs reserved there are of several vendors "
                         f"({', '.join(sorted(vendors))}): "
                         "a host of a placement has one (reserve with --vendor)")
    numbers = [d["vendor_index"] if type(d.get("vendor_index")) is int else d["index"]
               for d in p.devices]
    out: dict[str, Any] = {"gpus": numbers, "uuids": [d["uuid"] for d in p.devices]}

    # each GPU's local CPUs as the host claims them (a daemon before 0.3 says nothing): a CPU list
    # that does not parse is unknown; the rank's host intersects it with what it may use
    cpus = [d.get("local_cpus") if valid_cpulist(d.get("local_cpus")) else None for d in p.devices]
    if any(c is not None for c in cpus):
        out["local_cpus"] = cpus
    vendor = vendors.pop() if vendors else DEFAULT_VENDOR
    if vendor != DEFAULT_VENDOR:
        out["vendor"] = vendor
    return out


# -- ranking --------------------------------------------------------------------------------------
def rank_hosts(hosts: Iterable[RemoteHost], c: Constraints, *, host: str | None = None,
               model: str | None = None) -> list[tuple[tuple[float, ...], RemoteHost, list[Candidate]]]:
    """Verified hosts that can give ``c.count`` GPUs, best first: each host's best ``c.count`` as
    local selection chooses them, the host ranked by its worst chosen GPU's score (ties: by the host
    name its daemon signed).  Only hosts whose daemon signed its name and addresses
    (``RemoteHost.identity``) are ranked: an announcement's name is never a tie-break or a target."""

    out = []
    for h in hosts:
        # a host is what it proved: its signed name ranks it, breaks ties and is where jobs go
        if h.verified is not True or h.identity is None or h.snapshot is None or not h.url or not h.alive:
            continue
        if host is not None and not fnmatch.fnmatch(h.hostname, host):
            continue
        snap = h.snapshot
        if model is not None:
            snap = copy(snap)
            snap.gpus = [g for g in snap.gpus if g.name and (fnmatch.fnmatch(g.name, model) or
                                                             model.lower() in g.name.lower())]
        leases = [le for g in snap.gpus for le in g.leases]
        try:
            chosen = choose(snap, c, leases, env={})
        except NoGpuAvailable:
            continue
        worst = max(score(x, c) for x in chosen)
        out.append((worst, h, chosen))
    out.sort(key=lambda t: (t[0], t[1].hostname))
    return out


def api_url(h: RemoteHost) -> tuple[str, str | None]:
    """Where to send signed writes to ``h``, and the certificate to pin: its HTTPS port where it
    announces one (a daemon with TLS refuses writes over plain HTTP), at the address discovery
    reached it on; else its plain HTTP API."""

    assert h.url is not None
    if h.txt.tls_port and h.txt.cert_fp:
        address = urlsplit(h.url).hostname or ""
        host = f"[{address}]" if ":" in address else address
        return f"https://{host}:{h.txt.tls_port}{API_PREFIX}", h.txt.cert_fp
    return h.url, None


def _local_node() -> str | None:
    try:
        return node_id()
    except Exception:  # noqa: BLE001
        return None


def default_holder() -> str:
    try:
        user = getpass.getuser()
    except Exception:  # noqa: BLE001
        user = str(os.geteuid())
    return f"{user}@{socket.gethostname()}"[:64]


# in a refusal's reason: the host's GPUs are Slurm's to give (docs/slurm.md)
SLURM_NODE = " (a Slurm node)"


def _ask(h: RemoteHost, chosen: list[Candidate], c: Constraints, key: FleetKey, holder: str, note: str | None,
         ttl: float, job: str | None = None, reasons: list[tuple[int, str]] | None = None) -> HostLease | None:
    """One lease request to ``h`` (None on 409: the GPUs just went)."""

    assert h.url is not None
    body: dict[str, Any] = {"count": c.count, "min_free": c.min_free, "memory": c.memory, "max_util": c.max_util,
                            "max_processes": c.max_processes, "mig": c.mig, "by": c.by, "shared": c.shared,
                            "topology": c.topology,
                            "include": list(c.include) if c.include else None,
                            "exclude": list(c.exclude) if c.exclude else None,
                            "holder": holder, "note": note, "ttl": ttl}
    # older daemons ignore it (and the client's ranking has filtered already)
    if c.vendor is not None:
        body["vendor"] = c.vendor
    # backfill before a booking (older daemons ignore it)
    if c.time_limit is not None:
        body["time_limit"] = c.time_limit
    # a fleet run's job id: the daemon's lease record names it (older daemons ignore it)
    if job is not None:
        body["job"] = job
    url, pin = api_url(h)
    try:
        reply = http.request_json("POST", url + "/leases", body, key=key, node_id=h.node_id, pin=pin)
    except SourceError as exc:
        log.info("%s: %s", h.hostname, exc)
        return None
    if reply.verified is not True:
        log.warning("%s did not prove it holds the fleet secret (HTTP %d %s: %s): not using it", h.hostname,
                    reply.status, h.url, str(reply.data)[:200])
        # an impostor's "lease" is worthless: nothing to release either
        return None
    if reply.status in REFUSED_STATUSES:
        err = (reply.data or {}).get("error") if isinstance(reply.data, dict) else None
        log.info("%s: %s", h.hostname, err)
        # every refusal's reason (a cap, a full disk, a Slurm node, the GPUs just taken): said when
        # nothing is granted
        if reasons is not None and err:
            slurm = reply.status == 409 and isinstance(reply.data, dict) and reply.data.get("reason") == "slurm"
            reasons.append((reply.status, f"{for_terminal(h.hostname, 64)}{SLURM_NODE if slurm else ''}: "
                                          f"{for_terminal(str(err), 300)}"))
        return None
    if reply.status != 201 or not isinstance(reply.data, dict):
        raise refusal(reply, f"{h.hostname} refused the lease (HTTP {reply.status})")
    d = reply.data
    lease_id = d.get("lease_id")
    if not LeaseId.is_valid(lease_id):
        raise GpusdError(f"{h.hostname} answered a lease without a usable id ({str(lease_id)[:40]!r}): not used")
    try:
        lease = HostLease(lease_id, h.hostname, h.node_id, url, pin, list(d.get("devices") or []),
                          _remote_env(d.get("env")), float(d.get("ttl") or ttl),
                          float(d.get("expires") or 0), h.signed_addresses)
    except (TypeError, ValueError) as exc:
        raise GpusdError(f"{h.hostname} answered a lease that cannot be read ({exc}): not used") from None
    lease.local = h.node_id == _local_node()
    return lease


# what a daemon's lease answer sets
REMOTE_ENV = ("GPUSD_LEASE", "GPUSD_LEASE_EPOCH", *SET_VARIABLES)


def _remote_env(raw: object) -> dict[str, str]:
    """The variables of a daemon's lease answer that a job may get: only those a daemon sets (the
    names go into a remote shell's ``export`` lines and into the command's environment), with
    bounded printable values; the others are dropped."""
    if not isinstance(raw, dict):
        return {}
    return {k: v for k, v in raw.items()
            if k in REMOTE_ENV and isinstance(v, str) and len(v) <= 4096 and v.isprintable()}


def reserve(count: int = 1, *, per_host: int | None = None, host: str | None = None, model: str | None = None,
            session: str | None = None, ttl: float = DEFAULT_TTL, holder: str | None = None,
            note: str | None = None, wait: bool = False, timeout: float | None = None,
            key: FleetKey | None = None, token: str | None = None, token_file: str | None = None,
            client: Client | None = None, interfaces: list[str] | None = None, discover: float = 3.0,
            constraints: Constraints | None = None, job: str | None = None, **keywords: Any) -> Reservation:
    """Reserve ``count`` GPUs on the fleet's verified hosts (all on one host unless ``per_host``
    divides them: ``count=8, per_host=4`` is 4 GPUs on each of 2 hosts).  The constraint keywords
    are :func:`gpusd.select`'s (``min_free``, ``memory``, ``max_util``, ...); ``host`` is a glob of
    host names, ``model`` a glob or substring of GPU names.  Tries the best-ranked host first and the
    next one when its daemon answers 409; with ``wait``, waits for discovery events (a GPU's load or
    leases changed, a host appeared) and tries again, until ``timeout``.  Raises NoGpuAvailable
    (WaitTimeout with ``wait``).  ``job``: the id of the gpusd job the reservation is for (``gpusd run
    --fleet``), named in each host's lease record."""
    from ..wire.signing import FleetKey, load_secret

    if key is None:
        secret = token or load_secret(token_file)
        if not secret:
            raise ConfigError("reserving GPUs on other hosts needs the fleet secret (--token-file or $GPUSD_TOKEN)")
        key = FleetKey(secret)
    per = per_host or count
    if per <= 0 or count % per:
        raise ConfigError(f"per_host={per} must divide count={count}")
    if not MIN_TTL <= ttl <= MAX_TTL:
        raise ConfigError(f"ttl must be between {MIN_TTL:g} and {MAX_TTL:g} seconds")
    c = constraints or Constraints.from_keywords(count=per, **keywords)
    if c.count != per:
        c = replace(c, count=per)
    holder = (holder or default_holder())[:64]
    own = client is None
    if client is None:
        from ..discovery.sync import Client

        client = Client(session, interfaces=interfaces, key=key) if session else Client(interfaces=interfaces, key=key)
    wake = threading.Event()

    def poke(_: Any) -> None:
        wake.set()

    for ev in WAKE_EVENTS:
        client.register_event_handler(ev, poke)
    deadline = time.monotonic() + timeout if timeout is not None else None
    try:
        if not client.listening:
            client.wait_settled(discover)
        while True:
            wake.clear()
            reasons: list[tuple[int, str]] = []
            got = _try_once(client.hosts, c, count // per, key, holder, note, ttl, host, model, job, reasons)
            if got is not None:
                return Reservation(got, key)
            # their disks, not GPUs
            if reasons and not wait and all(status == DiskFull.http_status for status, _ in reasons):
                raise DiskFull("; ".join(why for _, why in reasons[:4]))
            # Slurm allocates there: ask it
            if reasons and all(SLURM_NODE in why for _, why in reasons):
                raise NoGpuAvailable("; ".join(why for _, why in reasons[:4]))
            if not wait:
                raise NoGpuAvailable(f"no verified host has {per} GPU(s) free for this request"
                                     + (f" (hosts matching {host!r})" if host else "")
                                     + _largest(client.hosts, per, host, per_host is None)
                                     + (f"; {'; '.join(why for _, why in reasons[:4])}" if reasons else ""))
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise WaitTimeout(f"gave up waiting after {timeout:g}s: no verified host had {per} GPU(s) free")
            # woken by the fleet's events; RETRY_EVERY only as a safety net (a 409 for a reason the
            # snapshots do not show, such as a job queued on that host, changes no event)
            wake.wait(min(left, RETRY_EVERY) if left is not None else RETRY_EVERY)
    finally:
        for ev in WAKE_EVENTS:
            client.unregister_event_handler(ev, poke)
        if own:
            client.stop_listening()


MIN_TTL, MAX_TTL = 2.0, 3600.0


def _largest(hosts: Iterable[RemoteHost], per: int, host: str | None, spread: bool) -> str:
    """Why no host can ever qualify, when that is why: none is verified, or the largest has fewer
    GPUs than one host was asked for (``reserve -n 5`` on hosts of 2)."""

    ok = [h for h in hosts if h.verified is True and h.snapshot is not None and h.alive
          and (host is None or fnmatch.fnmatch(h.hostname, host))]
    if not ok:
        return ": no verified host was found (is the fleet secret the daemons' own?)"
    big = max(ok, key=lambda h: (len(h.gpus()), h.hostname))
    if len(big.gpus()) >= per:
        return ""
    hint = "; --per-host N spreads them over several hosts" if spread else ""
    return f": the largest verified host, {for_terminal(big.hostname, 64)}, has {len(big.gpus())}{hint}"


def _try_once(hosts: list[RemoteHost], c: Constraints, n_hosts: int, key: FleetKey, holder: str,
              note: str | None, ttl: float, host: str | None, model: str | None,
              job: str | None = None, reasons: list[tuple[int, str]] | None = None) -> list[HostLease] | None:
    ranked = rank_hosts(hosts, c, host=host, model=model)
    got: list[HostLease] = []
    for _, h, chosen in ranked:
        lease = _ask(h, chosen, c, key, holder, note, ttl, job, reasons)
        if lease is not None:
            got.append(lease)
            if len(got) == n_hosts:
                return got
    # not enough hosts this time: give the partial set back
    if got:
        Reservation(got, key).release()
    return None


def reservations(key: FleetKey, hosts: Iterable[RemoteHost], mine: Callable[[dict[str, Any]], bool] | None = None
                 ) -> list[dict[str, Any]]:
    """The remote leases of every verified host (``GET /api/v1/leases``), optionally filtered."""
    return _listed(key, hosts, "leases", mine, lambda h: {"addresses": h.signed_addresses})


def _listed(key: FleetKey, hosts: Iterable[RemoteHost], what: str, mine: Callable[[dict[str, Any]], bool] | None,
            extra: Callable[[RemoteHost], dict[str, Any]]) -> list[dict[str, Any]]:
    """Every verified host's ``GET /api/v1/<what>`` list (optionally filtered), each item with the
    host's URL and pin (and ``extra``) to act on it later."""

    out: list[dict[str, Any]] = []
    for h in hosts:
        if h.verified is not True or not h.url:
            continue
        url, pin = api_url(h)
        try:
            ans = http.fetch_json(f"{url}/{what}", key=key, node_id=h.node_id, pin=pin)
        except SourceError as exc:
            log.info("%s: %s", h.hostname, exc)
            continue
        if ans.verified is not True or not isinstance(ans.data, dict):
            continue
        for d in ans.data.get(what) or []:
            if isinstance(d, dict) and (mine is None or mine(d)):
                d.update({"url": url, "pin": pin, **extra(h)})
                out.append(d)
    return out


# -- bookings (gpusd reserve --at: docs/pool.md, "Time") ---------------------------------------------
def book(count: int, start: float, duration: float, hosts: Iterable[RemoteHost], key: FleetKey, *,
         host: str | None = None, note: str | None = None, include: list[str] | None = None) -> dict[str, Any]:
    """Book ``count`` GPUs of one verified host from ``start`` (wall-clock) for ``duration`` seconds,
    signed with the user's SSH key; the first host (by name) that has them free then.  Raises
    ConfigError for what every host would refuse (the request itself, the policy), NoGpuAvailable
    naming the conflicting bookings when no host has room."""

    body = {"count": count, "start": start, "duration": duration, "note": note, "include": include}
    conflicts: list[str] = []
    tried = 0
    for h in sorted(hosts, key=lambda h: h.hostname):
        if h.verified is not True or h.identity is None or not h.url or not h.alive or h.snapshot is None:
            continue
        if host is not None and not fnmatch.fnmatch(h.hostname, host):
            continue
        if len(h.snapshot.gpus) < count:
            continue
        tried += 1
        url, pin = api_url(h)
        try:
            reply = http.request_json("POST", url + "/bookings", body, key=key, node_id=h.node_id, pin=pin)
        except SourceError as exc:
            log.info("%s: %s", h.hostname, exc)
            continue
        if reply.verified is not True:
            continue
        where = for_terminal(h.hostname, 64)
        if reply.status == 201 and isinstance(reply.data, dict):
            return reply.data
        err = (reply.data or {}).get("error") if isinstance(reply.data, dict) else None
        if reply.status == 409:
            conflicts.append(f"{where}: {for_terminal(str(err), 400)}")
            continue
        # a daemon from before bookings
        if reply.status == 404:
            conflicts.append(f"{where}: its gpusd takes no bookings (older than 0.4.1)")
            continue
        if reply.status in (400, 429):
            raise ConfigError(f"{where}: {for_terminal(str(err), 400)}")
        raise refusal(reply, f"{where} refused the booking (HTTP {reply.status})")
    if not tried:
        raise NoGpuAvailable(f"no verified host has {count} GPU(s)" + (f" (hosts matching {host!r})" if host else ""))
    raise NoGpuAvailable(f"no host has {count} GPU(s) free for that time: " + "; ".join(conflicts[:4]))


def bookings(key: FleetKey, hosts: Iterable[RemoteHost], mine: Callable[[dict[str, Any]], bool] | None = None
             ) -> list[dict[str, Any]]:
    """The bookings of every verified host (``GET /api/v1/bookings``), optionally filtered."""
    return _listed(key, hosts, "bookings", mine, lambda h: {"node_id": h.node_id})


def cancel_booking(d: dict[str, Any], key: FleetKey) -> Any:
    """``DELETE /api/v1/bookings/ID`` at the host of the listed booking ``d``; the reply."""

    return http.request_json("DELETE", f"{d['url']}/bookings/{d['booking_id']}", None, key=key,
                        node_id=d.get("node_id"), pin=d.get("pin"))
