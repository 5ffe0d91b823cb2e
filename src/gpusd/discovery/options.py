"""``DiscoveryOptions``: what a discovery client is asked to find, as one value.

Both clients take it -- the asyncio :class:`~gpusd.discovery.client.AsyncClient` and the threaded
:class:`~gpusd.discovery.sync.Client` -- either as ``options=`` or built from the same keyword
arguments (``AsyncClient(hostname="gpu-*")`` builds ``DiscoveryOptions(hostname="gpu-*")``).  The
value is checked and normalised once, where it is made, so a bad argument raises in the caller
(:class:`~gpusd.errors.ConfigError`, ``ValueError`` for a memory size without a unit), and a sync
client that restarts its asyncio client hands it the same value.  ``tests/discovery/test_sources.py``
checks that both clients accept exactly these fields.
"""

# Imports inside functions: optional or heavy packages.
from __future__ import annotations

import os
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any, Sequence

from ..errors import ConfigError
from ..units import parse_memory
from ..wire.sse import check_pace
from ..wire.txt import DEFAULT_SESSION
from . import beyond
from .types import Filters

if TYPE_CHECKING:  # pragma: no cover
    from ..wire.signing import FleetKey
    from .beyond import PeerSpec

# services followed at most (a flood of fake announcements beyond is dropped)
MAX_HOSTS = 1024


@dataclass(frozen=True)
class DiscoveryOptions:
    """Which hosts and GPUs a client finds and reports, and how it trusts them (see ``AsyncClient``).

    ``session``: only hosts of this session (``None`` or ``all_sessions``: all).  ``hostname``,
    ``model`` (substring or glob), ``min_free_memory`` (bytes or ``"20GiB"``, kept as bytes) filter what
    is reported.  ``interfaces``: IPv4 addresses or interface names for mDNS.  ``liveness_timeout``: a
    host silent this long is reported removed.  ``include_hwsd``: list GPU-SD/hwsd hosts too.
    ``max_hosts``: services followed at most.  ``token`` (the fleet secret: turned into ``key`` at once
    and not kept) or ``key`` (a :class:`~gpusd.wire.signing.FleetKey`).  ``allow_loopback``: follow hosts
    announcing loopback or link-local addresses (None: only when bound to loopback).  Beyond the mDNS
    link: ``peers`` (default ``$GPUSD_PEERS``), ``peers_file`` (default ``$GPUSD_PEERS_FILE``),
    ``dns_sd_domain`` (default ``$GPUSD_DNS_SD_DOMAIN``, kept with a trailing dot) and ``dns_server``.
    ``pace`` (seconds, 2 to 60): ask each host for changes of readings alone at most that often
    (docs/wire-format.md, "Event stream"); a change of leases, processes or health still comes at once.
    For a reader that waits for GPUs to change hands (``gpusd notify --fleet``), not one that shows
    readings; its hosts' liveness bound grows with it."""

    session: str | None = DEFAULT_SESSION
    interfaces: Sequence[str] | None = None
    hostname: str | None = None
    model: str | None = None
    min_free_memory: int | str | None = None
    all_sessions: bool = False
    liveness_timeout: float = 10.0
    include_hwsd: bool = True
    token: str | None = field(default=None, repr=False, compare=False)
    max_hosts: int = MAX_HOSTS
    key: FleetKey | None = field(default=None, repr=False)
    allow_loopback: bool | None = None
    peers: Sequence[str] | None = None
    peers_file: str | None = None
    dns_sd_domain: str | None = None
    dns_server: str | None = None
    pace: float | None = None
    # derived, checked values (not arguments)
    peer_specs: tuple[PeerSpec, ...] = field(init=False, default=())

    def __post_init__(self) -> None:
        def put(name: str, value: Any) -> None:
            object.__setattr__(self, name, value)

        # "20GiB"; a bare "20" is refused (did you mean 20GiB?)
        if isinstance(self.min_free_memory, str):

            put("min_free_memory", int(parse_memory(self.min_free_memory, ratio=False)))
        if self.interfaces is not None:
            put("interfaces", tuple(self.interfaces))
        # The fleet secret never leaves this process: requests are signed with keys derived from it,
        # and only daemons that sign their answers back are trusted with private fields (verified).
        if self.token:
            if self.key is None:
                from ..wire.signing import FleetKey, check_secret

                check_secret(self.token)
                put("key", FleetKey(self.token))
        put("token", None)
        put("liveness_timeout", float(self.liveness_timeout))
        put("max_hosts", max(1, int(self.max_hosts)))
        # hosts beyond the mDNS link (validated here: bad values raise ConfigError in the caller)
        peers = list(self.peers) if self.peers is not None else beyond.peers_from_env()
        put("peers", tuple(peers))
        put("peer_specs", tuple(beyond.parse_peers(peers)))
        put("peers_file", self.peers_file or os.environ.get("GPUSD_PEERS_FILE") or None)
        domain = self.dns_sd_domain if self.dns_sd_domain is not None else os.environ.get("GPUSD_DNS_SD_DOMAIN", "")
        put("dns_sd_domain", beyond.valid_domain(domain) if domain else None)
        put("dns_server", beyond.valid_dns_server(self.dns_server) if self.dns_server else None)
        if self.pace is not None:
            try:
                put("pace", check_pace(self.pace))
            except ValueError as why:
                raise ConfigError(str(why)) from None

    def filters(self) -> Filters:
        """The host and GPU filters of these options (a new value: a client may keep it)."""
        return Filters(session=None if self.all_sessions else self.session, hostname=self.hostname, model=self.model,
                       min_free_memory=self.min_free_memory if isinstance(self.min_free_memory, int) else None)


OPTION_NAMES = tuple(f.name for f in fields(DiscoveryOptions) if f.init)
_DEFAULTS = {f.name: f.default for f in fields(DiscoveryOptions) if f.init}


def options_of(options: DiscoveryOptions | None, arguments: dict[str, Any]) -> DiscoveryOptions:
    """``options``, or the value a client's ``arguments`` (its ``locals()`` on entry: the options' fields
    and its own) build; both at once (an options value and a keyword argument that is not its default)
    is a ``TypeError``."""
    given = {name: arguments[name] for name in OPTION_NAMES}
    if options is None:
        return DiscoveryOptions(**given)
    extra = sorted(k for k, v in given.items() if v != _DEFAULTS[k])
    if extra:
        raise TypeError(f"give options= or keyword arguments, not both (also given: {', '.join(extra)})")
    return options


__all__ = ["DiscoveryOptions", "MAX_HOSTS", "OPTION_NAMES", "options_of"]
