"""Everything a daemon can be told, with the defaults documented in docs/daemon.md."""

# Imports inside functions: optional or heavy packages; memory at rest (loaded on request).
from __future__ import annotations

import hashlib
import os
import resource
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..alloc.authority import socket_path
from ..errors import ConfigError, SecretError
from ..usage.db import Retention
from ..usage.idle import IdlePolicy
from ..wire.txt import DEFAULT_SESSION, valid_session

DEFAULT_PORT = 4780
# descriptors kept for everything but incoming connections (mDNS, fleet client, files)
FD_RESERVE = 128
# seconds: the bounds of a remote lease's TTL (docs/pool.md)
MIN_TTL, MAX_TTL = 2.0, 3600.0


def open_file_limit() -> int | None:
    """The process's soft limit on open files, or None where there is none (or it cannot be read)."""
    try:
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    except (OSError, ValueError):
        return None
    return None if soft == resource.RLIM_INFINITY or soft <= 0 else soft


def lease_socket_option(leases: bool = True) -> str | None:
    """Where a daemon would serve as lease authority (``$GPUSD_LEASE_SOCKET``), None: turned off."""
    if not leases:
        return None

    path = socket_path()
    return None if path is None else str(path)


@dataclass
class DaemonConfig:
    # IPv4 addresses or interface names; None: all (or $GPUSD_INTERFACES)
    interfaces: list[str] | None = None
    # HTTP port; 0: any free port (announced as chosen)
    port: int = DEFAULT_PORT
    session: str = DEFAULT_SESSION
    # seconds between samples
    interval: float = 1.0
    # seconds of history kept per GPU
    history: float = 300.0
    # simulated GPUs (see gpusd.inventory.simulated)
    simulate: str | None = None
    # default: gpusd.identity.hostname()
    hostname: str | None = None
    # default: gpusd.identity.state_dir()
    state_dir: Path | None = None
    # also announce _gpu-sd._tcp with hwsd's keys
    gpusd_compat: bool = False
    # the fleet secret: trust on (daemon/access.py, docs/security.md); never from argv
    token: str | None = None
    # serve HTTPS with a self-signed, pinned certificate; None: when a secret is set
    tls: bool | None = None
    # HTTPS port; None: the HTTP port + 1 (any free port when that is 0)
    tls_port: int | None = None
    # seconds of silence before an event stream sends a heartbeat
    heartbeat: float = 2.0
    # seconds between TXT updates (RFC 6762 §8.4: <= 10 a minute)
    txt_min_interval: float = 6.0
    # "auto": start the fleet client on first use; "on"; "off"
    fleet: str = "auto"
    # "auto": stop the fleet client after this long unused
    fleet_idle: float = 300.0
    # attach this machine's GPU leases to every sample
    leases: bool = True
    # /metrics also serves the DCGM exporter's names (DCGM_FI_DEV_*)
    dcgm_metrics: bool = True
    # /metrics: GPU-seconds per user, for readers who may see private data
    user_metrics: bool = False
    # seconds between checks for changed network interfaces (0: never)
    netwatch: float = 5.0
    # threshold rules (gpusd.thresholds, wired in daemon/monitoring.py)
    thresholds: list[str] = field(default_factory=list)
    # default: kept in the state directory (gpusd.identity.node_id)
    node_id: str | None = None
    # Limits against hostile peers (docs/daemon.md, "Limits"):
    # seconds from connect until the first request's headers are complete
    header_timeout: float = 10.0
    # seconds an idle keep-alive connection (or its next request head) may take
    keepalive_timeout: float = 30.0
    # open HTTP connections at most (also bounded by the open-file limit)
    max_connections: int = 1024
    # readers per event stream (/api/v1/events, /api/v1/fleet/events)
    max_subscribers: int = 256
    # seconds an event-stream write may wait for a reader before it is dropped
    write_timeout: float = 10.0
    # services the fleet view follows at most (more are dropped, counted, logged once)
    fleet_max_hosts: int = 1024
    # Shares that unsigned readers cannot take, and per-peer limits (docs/daemon.md "Limits"):
    # unsigned readers per event stream from one peer address (IPv6: /64)
    max_subscribers_per_peer: int = 32
    # of max_subscribers, kept for signed readers (unsigned ones get the rest)
    reserved_subscribers: int = 64
    # connections not (yet) signed from one peer address (IPv6: /64)
    max_connections_per_peer: int = 128
    # of max_connections, kept for signed connections
    reserved_connections: int = 64
    # The remote-lease policy (docs/pool.md "Bounds"); a holder is the signing key and the peer address
    # seconds: a longer ttl (up to 3600) is granted as this; renew within it
    lease_max_ttl: float = 300.0
    # seconds from the grant: no renewal extends a lease past it
    lease_max_lifetime: float = 7 * 86400.0
    # remote leases this daemon holds at most
    lease_max_total: int = 64
    # remote leases one holder holds here at most
    lease_max_per_holder: int = 16
    # GPUs one holder holds here at most (None: any number)
    lease_max_gpus_per_holder: int | None = None
    # users' SSH keys on remote writes (docs/security.md "Identity", daemon/users.py)
    # refuse a remote write that carries no user signature
    require_user_key: bool = False
    # default: $GPUSD_USERS, else /etc/gpusd/users
    users_file: str | None = None
    # hosts beyond the mDNS link (discovery/beyond.py, docs/daemon.md "Beyond one link"); None: from the
    # environment ($GPUSD_PEERS, $GPUSD_PEERS_FILE, $GPUSD_DNS_SD_DOMAIN)
    peers: list[str] | None = None
    peers_file: str | None = None
    dns_sd_domain: str | None = None
    dns_server: str | None = None
    # usage history (docs/history.md; wired in daemon/recording.py)
    # record usage history in an SQLite database
    record: bool = True
    # default: history.sqlite in the state directory
    history_db: Path | None = None
    # seconds of coarse (5 min) history and job records kept
    retention: float = 365 * 86400.0
    # bytes: the database's size bound (the oldest data goes first)
    history_size: int = 1 << 30
    # seconds a lease may hold GPUs under 5 % before it is marked idle
    idle_after: float = 900.0
    # opt-in: release idle reservations (never a running job's lease)
    idle_release: bool = False
    # seconds between the release notice and the release
    idle_grace: float = 900.0
    # rebalancing of gpusd jobs (docs/jobs.md; wired in daemon/rebalancing.py): opt-in
    rebalance: bool = False
    # a JSON file with the fields of gpusd.jobs.rebalance.Policy
    rebalance_policy: Path | None = None
    # Slurm (docs/slurm.md): join as a dynamic node (slurmd -Z), whose GPUs Slurm then allocates
    slurm: bool = False
    # HOST[:PORT] of slurmctld; None: the daemon announcing one
    slurm_controller: str | None = None
    # announce slurmctld on this host: "[HOST:]PORT"
    slurmctld: str | None = None

    def options(self) -> dict[str, Any]:
        """What ``gpusd start`` was told, as recorded in the state directory so that a second start
        can tell whether it asks for the same daemon (the token is left out: it is a secret)."""
        return {"interfaces": self.interfaces, "port": self.port, "session": self.session,
                "interval": self.interval, "history": self.history, "simulate": self.simulate,
                "hostname": self.hostname, "gpusd_compat": self.gpusd_compat, "fleet": self.fleet,
                "txt_interval": self.txt_min_interval, "thresholds": list(self.thresholds),
                "dcgm_metrics": self.dcgm_metrics, "user_metrics": self.user_metrics,
                "no_record": not self.record, "retention_days": self.retention / 86400,
                "history_size_mib": self.history_size / 2**20, "idle_after": self.idle_after,
                "idle_release": self.idle_release, "idle_grace": self.idle_grace,
                "rebalance": self.rebalance or self.rebalance_policy is not None,
                "rebalance_policy": str(self.rebalance_policy) if self.rebalance_policy else None,
                "slurm": self.slurm, "slurm_controller": self.slurm_controller, "slurmctld": self.slurmctld,
                # added in 0.4: what the daemon trusts and where it serves it (a second start compares them)
                "secret": self.secret_id(), "tls": self.serves_tls(), "tls_port": self.tls_port,
                "peers": sorted(self.peers) if self.peers is not None else None, "peers_file": self.peers_file,
                "dns_sd_domain": self.dns_sd_domain, "dns_server": self.dns_server,
                "lease_socket": lease_socket_option(self.leases)}

    def serves_tls(self) -> bool:
        return bool(self.tls or (self.tls is None and self.token))

    def secret_id(self) -> str | None:
        """Which secret the daemon trusts, as a one-way fingerprint (never the secret: the state
        directory's info file is readable), so that a second start can tell the same secret from another."""
        if self.token is None:
            return None

        return hashlib.sha256(b"gpusd secret id\0" + self.token.encode()).hexdigest()[:16]

    def validate(self) -> None:
        if not valid_session(self.session):
            raise ConfigError(f"bad session name {self.session!r}: letters, digits, '.', '_', '-' (at most 64)")
        if not 0 <= self.port < 65536:
            raise ConfigError(f"bad port {self.port}")
        if not 0.05 <= self.interval <= 3600:
            raise ConfigError(f"--interval must be between 0.05 and 3600 seconds, not {self.interval}")
        # also refuses nan and inf
        if not 0 <= self.history <= 10 * 365 * 86400:
            raise ConfigError(f"--sample-window must be between 0 and 10 years of seconds, not {self.history}")
        if not 0 <= self.txt_min_interval <= 86400:
            raise ConfigError(f"--txt-interval must be between 0 and 86400 seconds, not {self.txt_min_interval}")
        if self.tls_port is not None and not 0 <= self.tls_port < 65536:
            raise ConfigError(f"bad TLS port {self.tls_port}")
        if self.token is not None:
            from ..wire.signing import check_secret

            try:
                check_secret(self.token)
            except SecretError as exc:
                raise ConfigError(str(exc)) from None

        Retention(retention=self.retention, max_bytes=self.history_size).validate()
        IdlePolicy(self.idle_after, self.idle_release, self.idle_grace).validate()
        if self.rebalance_policy is not None:
            from ..jobs.rebalance import Policy

            # a bad policy file fails the start, with its reason
            Policy.load(self.rebalance_policy)
        if self.slurm_controller is not None and not self.slurm:
            raise ConfigError("--slurm-controller goes with --slurm (it names the controller the node joins)")
        if self.slurm_controller is not None or self.slurmctld is not None:
            from ..slurm.node import parse_controller

            for v in (self.slurm_controller, self.slurmctld):
                if v is not None:
                    # ConfigError with the reason
                    parse_controller(v)
        if self.fleet not in ("auto", "on", "off"):
            raise ConfigError(f"bad fleet mode {self.fleet!r}")
        for name in ("header_timeout", "keepalive_timeout", "write_timeout"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and 0.01 <= value <= 86400):  # also refuses nan
                raise ConfigError(f"{name} must be between 0.01 and 86400 seconds, not {value!r}")
        for name in ("max_connections", "max_subscribers", "fleet_max_hosts", "max_subscribers_per_peer",
                     "max_connections_per_peer", "lease_max_total", "lease_max_per_holder"):
            value = getattr(self, name)
            if not (isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= 1_000_000):
                raise ConfigError(f"{name} must be a whole number between 1 and 1000000, not {value!r}")
        for name in ("reserved_subscribers", "reserved_connections"):
            value = getattr(self, name)
            if not (isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= 1_000_000):
                raise ConfigError(f"{name} must be a whole number between 0 and 1000000, not {value!r}")
        if not isinstance(self.require_user_key, bool):
            raise ConfigError(f"require_user_key must be true or false, not {self.require_user_key!r}")
        if self.users_file is not None and not (isinstance(self.users_file, str) and self.users_file.startswith("/")):
            raise ConfigError(f"users_file must be an absolute path, not {self.users_file!r}")
        cap = self.lease_max_gpus_per_holder
        if cap is not None and not (isinstance(cap, int) and not isinstance(cap, bool) and 1 <= cap <= 4096):
            raise ConfigError(f"lease_max_gpus_per_holder must be None or a whole number from 1 to 4096, not {cap!r}")
        ttl, life = self.lease_max_ttl, self.lease_max_lifetime
        if not (isinstance(ttl, (int, float)) and not isinstance(ttl, bool) and MIN_TTL <= ttl <= MAX_TTL):
            raise ConfigError(f"lease_max_ttl must be between {MIN_TTL:g} and {MAX_TTL:g} seconds, not {ttl!r}")
        if not (isinstance(life, (int, float)) and not isinstance(life, bool) and ttl <= life <= 10 * 365 * 86400):
            raise ConfigError(f"lease_max_lifetime must be between lease_max_ttl and 10 years of seconds, not {life!r}")
        self._validate_thresholds()
        self._validate_beyond()

    def _validate_beyond(self) -> None:
        """Static peers, the peers file's name, the DNS-SD domain and server (discovery/beyond.py)."""
        domain = self.dns_sd_domain if self.dns_sd_domain is not None else os.environ.get("GPUSD_DNS_SD_DOMAIN")
        if self.peers is None and not os.environ.get("GPUSD_PEERS") and not domain and not self.dns_server:
            # nothing to check: discovery/beyond.py stays unloaded (memory at rest)
            return
        from ..discovery import beyond

        # also what the fleet view would take from the environment: a bad $GPUSD_PEERS fails the start
        beyond.parse_peers(list(self.peers) if self.peers is not None else beyond.peers_from_env())
        if domain:
            beyond.valid_domain(domain)
        if self.dns_server:
            beyond.valid_dns_server(self.dns_server)

    def _validate_thresholds(self) -> None:
        """Parse the threshold rules with the command line's parser (:mod:`gpusd.thresholds`): a rule
        with a typo fails here, before anything starts, from the Python API as from the CLI."""
        rules = self.thresholds
        if isinstance(rules, (str, bytes)) or not isinstance(rules, (list, tuple)):
            raise ConfigError(f"thresholds must be a list of rules such as [\"temperature>85\"], not {rules!r}")
        # nothing to parse: the rules' parser stays unloaded (memory at rest)
        if not rules:
            return
        from ..thresholds import Rule, load_rules

        for rule in rules:
            if not isinstance(rule, (str, Rule)):
                raise ConfigError(f"bad threshold rule {rule!r}: a rule is a string such as \"temperature>85\"")
        # raises ConfigError with the parser's one-line message
        load_rules(rules)
