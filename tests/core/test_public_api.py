"""gpusd's public API, pinned (docs/api.md, "Public API"): the names of ``gpusd.__all__``, that each
resolves, and the parameters of the entry points and the public members of the classes users hold.

This runs everywhere (no mypy needed).  A difference here is a change of the public API: make it on
purpose, then update docs/api.md and the tables below together.
"""

from __future__ import annotations

import inspect
from typing import Any

import gpusd

PUBLIC = [
    "AlreadyRunning", "AsyncClient", "BackendUnavailable", "Client", "ConfigError", "Constraints",
    "CudaAlreadyInitializedWarning", "DaemonStartFailed", "Device", "DiskFull", "DiscoveryEvent", "DiscoveryOptions",
    "GpuInfo", "GpuLink", "GpusdError", "HostSnapshot", "IdError", "LeaseInfo", "LockBusy", "MigInstance",
    "NoDaemon", "NoGpuAvailable", "ProcessInfo", "RemoteHost", "Reservation", "SSEError", "SecretError",
    "Selection", "SourceError", "TxtError", "WaitTimeout", "WireError", "__version__", "local_snapshot",
    "reserve", "select", "set_cuda_visible_devices",
]

# name -> its parameters as a caller sees them (names, kinds, defaults; annotations are not pinned).
ENTRY_POINTS = {
    "select": "count=1, *, min_free=None, memory=None, max_util=None, max_processes=None, include=None, "
              "exclude=None, mig=False, by='load', share=False, topology='auto', lease=True, wait=False, "
              "timeout=None, use_uuid=False, within_visible=True, simulate=None, vendor=None, time_limit=None",
    "local_snapshot": "simulate=None, leases=True",
    "set_cuda_visible_devices": "devices, vendor=None",
    "reserve": "count=1, *, per_host=None, host=None, model=None, session=None, ttl=30.0, holder=None, note=None, "
               "wait=False, timeout=None, key=None, token=None, token_file=None, client=None, interfaces=None, "
               "discover=3.0, constraints=None, job=None, **keywords",
    "Client": "session='default', *, interfaces=None, hostname=None, model=None, min_free_memory=None, "
              "all_sessions=False, liveness_timeout=10.0, include_hwsd=True, daemon_thread=False, token=None, "
              "max_hosts=1024, key=None, allow_loopback=None, peers=None, peers_file=None, dns_sd_domain=None, "
              "dns_server=None, options=None, pace=None",
    "AsyncClient": "session='default', *, interfaces=None, hostname=None, model=None, min_free_memory=None, "
                   "all_sessions=False, liveness_timeout=10.0, include_hwsd=True, zeroconf=None, token=None, "
                   "max_hosts=1024, key=None, allow_loopback=None, peers=None, peers_file=None, "
                   "dns_sd_domain=None, dns_server=None, options=None, sources=(), pace=None",
    "Constraints": "count=1, min_free=None, memory=None, max_util=None, max_processes=None, include=None, "
                   "exclude=None, mig=False, by='load', shared=False, topology='auto', within_visible=True, "
                   "vendor=None, time_limit=None",
}

# Class.member -> its parameters, or None for a property or an attribute.
MEMBERS: dict[str, str | None] = {
    "Client.events": "timeout=None",
    "Client.hosts": None,  # property
    "Client.list_devices": "timeout=3.0",
    "Client.listening": None,  # property
    "Client.register_event_handler": "event, fn",
    "Client.scan": "timeout=2.0",
    "Client.start_listening": "",
    "Client.stop_listening": "",
    "Client.unregister_event_handler": "event, fn",
    "Client.wait_settled": "timeout=3.0",
    "AsyncClient.announced": "",
    "AsyncClient.answered": None,  # property
    "AsyncClient.events": "maxsize=10000",
    "AsyncClient.hosts": None,  # property
    "AsyncClient.list_devices": "",
    "AsyncClient.listening": None,  # property
    "AsyncClient.register_event_handler": "event, fn",
    "AsyncClient.scan": "timeout=2.0",
    "AsyncClient.service_types": None,  # property
    "AsyncClient.start_listening": "",
    "AsyncClient.stop_listening": "",
    "AsyncClient.unregister_event_handler": "event, fn",
    "AsyncClient.wait_settled": "timeout=3.0, quiet=0.3, minimum=1.5, early=None, give_up=None",
    # what a host source (``AsyncClient(sources=[...])``, gpusd.discovery.source) and a follower call on
    # their client: the source protocol's side, documented in docs/api.md as such
    "AsyncClient.add": "name, source, *, service_type='_gpusd._tcp.local.', spec=None, from_file=False, hold=0.0, "
                       "answer=False, capped=True",
    "AsyncClient.drop": "peer, reason",
    "AsyncClient.emit": "event",
    "AsyncClient.follower": "name",
    "AsyncClient.followers": "",
    "AsyncClient.report": "peer, host, gpus, snap=None",
    "AsyncClient.report_removed": "peer, reason",
    "AsyncClient.shadowing": "peer, host",
    "AsyncClient.spawn": "coro",
    # snapshots parsed when read (defer_snapshots, a daemon's large fleet view): the follower's side
    "AsyncClient.defer": "peer, text",
    "AsyncClient.deferring": "",
    "AsyncClient.undefer": "peer",
    # ... and the reader's: the hosts as last parsed, or caught up first
    "AsyncClient.catch_up": "older_than=0.0",
    "AsyncClient.followed": None,  # property
    "AsyncClient.host_list": "catch_up=True",
    # what it was asked (read-only views of its DiscoveryOptions)
    "AsyncClient.dns_sd_domain": None,  # property
    "AsyncClient.dns_server": None,  # property
    "AsyncClient.include_hwsd": None,  # property
    "AsyncClient.peer_specs": None,  # property
    "AsyncClient.peers_file": None,  # property
    "Selection.apply": "use_uuid=None",
    "Selection.env": "use_uuid=None",
    "Selection.gpus": None,  # property
    "Selection.indices": None,  # property
    "Selection.release": "",
    "Selection.to_dict": "",
    "Selection.uuids": None,  # property
    "Selection.visible": None,  # property
    "Reservation.devices": None,  # property
    "Reservation.env": None,  # property
    "Reservation.host": None,  # property
    "Reservation.lease_id": None,  # property
    "Reservation.left": "",  # 0.4: seconds left of --for, on the monotonic clock
    "Reservation.release": "",
    "Reservation.renew": "ttl=None",
    "Reservation.start_renewing": "until=None",
    "Reservation.to_dict": "",
    "Reservation.to_placement": "job_id=None",
    "Reservation.to_placement_dict": "job_id=None",
    "Reservation.until": None,  # property (0.4: kept on the monotonic clock, shown as a wall time)
}


def parameters(fn: Any) -> str:
    """``fn``'s parameters as a caller writes them: ``a, b=1, *, c=None, **rest`` (no annotations)."""
    out: list[str] = []
    star = False
    for p in inspect.signature(fn).parameters.values():
        if p.name == "self":
            continue
        if p.kind is p.VAR_POSITIONAL:
            out.append(f"*{p.name}")
            star = True
        elif p.kind is p.VAR_KEYWORD:
            out.append(f"**{p.name}")
        else:
            if p.kind is p.KEYWORD_ONLY and not star:
                out.append("*")
                star = True
            out.append(p.name if p.default is p.empty else f"{p.name}={p.default!r}")
    return ", ".join(out)


def test_the_public_names_are_the_recorded_ones() -> None:
    assert sorted(gpusd.__all__) == sorted(PUBLIC)
    assert len(set(gpusd.__all__)) == len(gpusd.__all__)


def test_every_public_name_resolves_to_what_its_module_defines() -> None:
    for name in gpusd.__all__:
        value = getattr(gpusd, name)
        assert value is not None, name
        if name != "__version__":
            module = __import__(gpusd._LAZY[name], fromlist=[name])
            assert value is getattr(module, name), name


def test_the_entry_points_take_the_recorded_parameters() -> None:
    got = {name: parameters(getattr(gpusd, name)) for name in ENTRY_POINTS}
    assert got == ENTRY_POINTS


def test_the_classes_users_hold_have_the_recorded_members() -> None:
    classes = {key.split(".")[0] for key in MEMBERS}
    got: dict[str, str | None] = {}
    for cls_name in sorted(classes):
        cls = getattr(gpusd, cls_name)
        for member in sorted(vars(cls)):
            if member.startswith("_"):
                continue
            static = inspect.getattr_static(cls, member)
            got[f"{cls_name}.{member}"] = parameters(getattr(cls, member)) if callable(static) else None
    assert got == MEMBERS


def test_the_returned_types_are_public() -> None:
    """What the entry points return, and what a client hands its handlers, can be named from ``gpusd``."""
    hints = {name: inspect.signature(getattr(gpusd, name)).return_annotation for name in
             ("select", "local_snapshot", "reserve")}
    assert hints == {"select": "Selection", "local_snapshot": "HostSnapshot", "reserve": "Reservation"}
    for name in hints.values():
        assert name in gpusd.__all__
    assert "Device" in gpusd.__all__ and "DiscoveryEvent" in gpusd.__all__  # list_devices(), event handlers


JOB_MEMBERS: dict[str, str | None] = {
    "Job.active": None,
    "Job.cuda_visible_devices": None,
    "Job.devices": None,
    "Job.env": None,
    "Job.generation": None,
    "Job.id": None,
    "Job.refresh": "",
    "Job.restart": "",
    "Job.should_stop": None,
    "Job.state": None,
}


def test_the_job_side_of_the_job_protocol_is_pinned() -> None:
    """``gpusd.job`` (docs/jobs.md) runs inside users' jobs: its entry points and ``Job``'s members."""
    import gpusd.job as job

    assert job.RESTART_ME == 75
    assert {name: parameters(getattr(job, name)) for name in ("Job", "current", "gpu_count", "read_job_file")} == {
        "Job": "on_change=None, *, install=True, path=None", "current": "on_change=None",
        "gpu_count": "path=None", "read_job_file": "path=None"}
    got = {f"Job.{m}": parameters(getattr(job.Job, m)) if callable(inspect.getattr_static(job.Job, m)) else None
           for m in sorted(vars(job.Job)) if not m.startswith("_")}
    assert got == JOB_MEMBERS
