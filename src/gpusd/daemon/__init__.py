"""The gpusd daemon: samples the local GPUs, serves them over HTTP, announces the host with mDNS (docs/daemon.md).

* :mod:`.config` — :class:`DaemonConfig`, every knob in one place;
* :mod:`.service` — :class:`Daemon`: the sampling loop, event publishing;
* :mod:`.process` — pid file, background start, stop, status, systemd notification;
* :mod:`.logs` — the log, bounded in rate and size; :mod:`.tls` — the daemon's TLS key and certificate;
* :mod:`.http` — the aiohttp application (``build_app``) and server-sent event streams;
* :mod:`.guard` — connection limits (header timeout, open connections); :mod:`.events` — the event hub;
* :mod:`.bypeer` — members counted per peer (the guard's and the event hub's unsigned shares);
* :mod:`.recent` — the recent samples (ring buffers of ``GET /api/v1/history``);
* :mod:`.recording` — the usage history (:mod:`gpusd.usage`) wired in, and its routes;
* :mod:`.monitoring` — metrics, dashboard, alerts and threshold evaluation wired into the app;
* :mod:`.metrics` — Prometheus text format of the daemon's snapshot (and DCGM's names), loaded on the first scrape;
* :mod:`.gpuseconds` — the GPU-seconds used and held per GPU and user, counted from every sample;
* :mod:`.access` — who may read private fields and write (the access rules every route runs, redaction);
* :mod:`.users` — who signed a remote write (``authorized_keys``, the users file);
* :mod:`.announce` — the DNS-SD announcement; :mod:`.hwsd` — what a ``--gpusd-compat`` host tells hwsd clients;
* :mod:`.fleet` — the fleet view (an :class:`~gpusd.discovery.client.AsyncClient` in the daemon);
* :mod:`.leasesock` — the lease authority on its Unix socket; :mod:`.leaseconn` — one connection;
  :mod:`.leasereq` — its requests checked; :mod:`.slurmjobs` — the leases it holds for Slurm jobs;
* :mod:`.fence` — a lease ended without a release: its processes stopped before its GPUs are granted again;
* :mod:`.pool` — remote leases of the fleet pool; :mod:`.rebalancing` — acting on the jobs' policy;
* :mod:`.bookings` — GPUs booked ahead (``gpusd reserve --at``): kept, published, held from their start;
* :mod:`.poolstate` — the remote leases written down for a restarted daemon; :mod:`.keeper` — the process
  that co-holds their locks; :mod:`.fdstore` — systemd's file descriptor store, which does so under systemd;
* :mod:`.slurmnode` — with ``--slurm``, slurmd run beside the daemon as a dynamic node;
* :mod:`.backend` — the one inventory backend the sampling loop, the lease authority and the pool share;
* :mod:`.routes` — the HTTP route tables each part builds from its own dependencies, each route
  behind the access rules (checked when the app starts).

Internal (docs/api.md): no public API beyond the command and the wire formats.
"""

# Imports inside functions: optional or heavy packages.
from __future__ import annotations

from typing import Any

__all__ = ["Daemon", "DaemonConfig"]


def __getattr__(name: str) -> Any:
    if name == "Daemon":
        from .service import Daemon

        return Daemon
    if name == "DaemonConfig":
        from .config import DaemonConfig

        return DaemonConfig
    raise AttributeError(f"module 'gpusd.daemon' has no attribute {name!r}")
