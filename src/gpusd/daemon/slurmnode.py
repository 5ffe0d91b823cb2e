"""The daemon's part in a Slurm cluster (docs/slurm.md): with ``--slurm``, find the controller and run
slurmd as a dynamic configless node (:class:`gpusd.slurm.node.SlurmNode`), drain it when a GPU is lost,
remove it when the daemon stops; with ``--slurmctld``, say in ``GET /api/v1/host`` that slurmctld runs
here (a signed answer to a signed request: a joining daemon believes only a verified host).

The controller is looked for among the fleet's verified hosts (the daemon's fleet secret), every 5 s
until one answers; ``--slurm-controller HOST[:PORT]`` names it instead."""

# Imports inside functions: memory at rest (loaded on request).
from __future__ import annotations

import asyncio
import logging
import threading
import time
from typing import Any

from ..errors import ConfigError
from ..model import HostSnapshot
from ..wire.signing import FleetKey
from .slurmjobs import recheck, restore

log = logging.getLogger("gpusd.slurm")

FIND_EVERY = 5.0


def find_controller(session: str, interfaces: list[str] | None, token: str, wait: float = 3.0
                    ) -> tuple[str, int] | None:
    """(address, port) of slurmctld from a verified host of the fleet that says it runs there."""
    from ..discovery.sync import Client
    from ..wire.http import SourceError, fetch_json

    key = FleetKey(token)
    client = Client(session, interfaces=interfaces, key=key)
    try:
        client.wait_settled(wait)
        hosts = client.hosts
    finally:
        client.stop_listening()
    for h in sorted(hosts, key=lambda h: h.hostname):
        if h.verified is not True or h.identity is None or not h.url or not h.signed_addresses:
            continue
        try:
            a = fetch_json(h.url.rstrip("/") + "/host", key, node_id=h.identity.node_id)
        except SourceError:
            continue
        data = a.data if a.verified is True and isinstance(a.data, dict) else {}
        ctld = data.get("slurmctld")
        if isinstance(ctld, dict) and type(ctld.get("port")) is int and 0 < ctld["port"] < 65536:
            host = ctld.get("host") if isinstance(ctld.get("host"), str) and ctld.get("host") else None
            from ..slurm.node import parse_controller

            try:
                address = parse_controller(host)[0] if host else h.signed_addresses[0]
            except ConfigError:
                continue
            return address, int(ctld["port"])
    return None


def _log_failure(task: "asyncio.Task[None]") -> None:
    """A join that failed says why in the log (a task's exception is otherwise never seen)."""
    if not task.cancelled() and task.exception() is not None:
        log.error("Slurm: joining failed: %r", task.exception())


class SlurmPart:
    """What a daemon started with ``--slurm`` and/or ``--slurmctld`` does for Slurm."""

    def __init__(self, daemon: Any) -> None:
        self.daemon = daemon
        self.node: Any = None
        self.task: asyncio.Task[None] | None = None
        self.stopping = False

    def host_info(self) -> dict[str, Any] | None:
        """``slurmctld`` of ``GET /api/v1/host``: where this host's slurmctld listens (None: it runs none)."""
        spec = self.daemon.config.slurmctld
        if spec is None:
            return None
        from ..slurm.node import parse_controller

        host, port = parse_controller(spec)
        return {"port": port, "host": host or None}

    async def start(self) -> None:
        cfg = self.daemon.config
        loop = asyncio.get_running_loop()
        if cfg.slurmctld is not None and not cfg.slurm:
            # the cluster's gres.conf includes /run/gpusd/slurm/gres.conf: on the controller it must exist
            from ..slurm.node import gres_dir, write_gres

            if not (gres_dir() / "gres.conf").exists():
                try:
                    await loop.run_in_executor(None, write_gres, HostSnapshot(self.daemon.hostname, "", 0.0))
                except (OSError, ConfigError) as exc:
                    log.warning("Slurm: cannot write %s/gres.conf: %s", gres_dir(), exc)
        server = getattr(self.daemon, "_lease_server", None)
        # the Slurm jobs' leases survive a restart of the daemon
        if cfg.slurm and server is not None:
            from ..slurm.node import find_conf, job_state

            cache = self.cache_dir()
            server.slurm_jobs.state = self.daemon.state_dir / "slurm-jobs.json"
            back = await loop.run_in_executor(None, restore, server.slurm_jobs,
                                              lambda req: server.slurm_answer(req, 0),
                                              lambda job: job_state(job, find_conf(cache)))
            if back:
                log.info("Slurm: leases of running job(s) %s held again", ", ".join(back))
        if cfg.slurm:
            if server is None:
                log.error("Slurm: this daemon is not the lease authority (not root, or $GPUSD_LEASE_SOCKET=off): "
                          "Slurm's prolog cannot record jobs and gpusd leases are not refused here")
            self.task = asyncio.ensure_future(self._join())
            self.task.add_done_callback(_log_failure)

    def cache_dir(self) -> Any:
        """Where the daemon keeps its copy of the controller's config (slurmd's configless cache)."""
        from ..slurm.node import CACHE

        return self.daemon.state_dir / CACHE

    async def _join(self) -> None:
        from ..slurm.conf import node_name
        from ..slurm.node import SlurmNode, parse_controller

        cfg = self.daemon.config
        loop = asyncio.get_running_loop()
        name = node_name(self.daemon.hostname)
        if name is None:
            log.error("Slurm: %r is not a Slurm node name: not joining", self.daemon.hostname)
            return
        controller: tuple[str, int] | None = parse_controller(cfg.slurm_controller) if cfg.slurm_controller else None
        while controller is None and not self.stopping:
            if not cfg.token:
                log.error("Slurm: no --slurm-controller and no fleet secret to find one with: not joining")
                return
            controller = await loop.run_in_executor(None, find_controller, cfg.session, self.daemon.interfaces,
                                                    cfg.token)
            if controller is None:
                log.info("Slurm: no verified host announces slurmctld yet; looking again in %gs", FIND_EVERY)
                await asyncio.sleep(FIND_EVERY)
        if self.stopping or controller is None:
            return
        snap = self.daemon.snapshot
        node = SlurmNode(controller, name, self.daemon.state_dir / "slurmd.log", cache_dir=self.cache_dir())
        try:
            await loop.run_in_executor(None, node.start, snap)
        except (OSError, ConfigError) as exc:
            log.error("Slurm: cannot join: %s", exc)
            return
        self.node = node
        server = getattr(self.daemon, "_lease_server", None)
        # the prolog's GPU numbers are positions in the gres.conf just written
        if server is not None:
            server.slurm_jobs.order = list(node.order)

        # a GPU lost already drains the node; all there lifts gpusd's own drain
        def first() -> None:
            if snap is not None and any(not g.healthy for g in snap.gpus):
                node.watch(snap)
            else:
                node.resume_if_ours()

        threading.Thread(target=first, daemon=True, name="gpusd-slurm-drain").start()

        # never blocks the sampling loop: scontrol runs on a thread
        def on_sample(s: Any) -> None:
            if any(not g.healthy and g.uuid not in node.lost for g in s.gpus):
                threading.Thread(target=node.watch, args=(s,), daemon=True, name="gpusd-slurm-drain").start()
            elif node.lost and all(g.healthy for g in s.gpus):
                node.lost = set()

        hooks = getattr(self.daemon, "on_sample", None)
        if isinstance(hooks, list):
            hooks.append(on_sample)
        if server is not None:
            await self._recheck(node, server.slurm_jobs)

    async def _recheck(self, node: Any, jobs: Any) -> None:
        """Jobs held again without the controller's word (it could not be asked at start): ask again,
        every FIND_EVERY s, now that slurmd's configless cache tells scontrol where the controller is."""
        from ..slurm.node import job_state

        loop = asyncio.get_running_loop()
        while jobs.unsure and not self.stopping:
            await asyncio.sleep(FIND_EVERY)
            left = await loop.run_in_executor(None, recheck, jobs, lambda job: job_state(job, node.conf()))
            if not left:
                log.info("Slurm: the controller answered for every job held again")

    async def stop(self) -> None:
        self.stopping = True
        if self.task is not None:
            self.task.cancel()
        if self.node is not None:
            # its drain/resume tries end now
            self.node.stopping.set()
            await asyncio.get_running_loop().run_in_executor(None, self.node.stop)
            self.node = None


class NoGpus:
    """The inventory of a host that runs slurmctld and no slurmd (``--slurmctld`` without ``--slurm``):
    no GPU, and no GPU library opened -- the controller needs none (docs/slurm.md)."""

    backend = "none"
    vendors: tuple[str, ...] = ()

    def __init__(self, hostname: str, node_id: str) -> None:
        self.hostname = hostname
        self.node_id = node_id

    def snapshot(self, util_since: Any = None, detail: bool = True) -> Any:
        return HostSnapshot(hostname=self.hostname, node_id=self.node_id, timestamp=time.time(), gpus=[],
                            backend=self.backend)

    def close(self) -> None:
        pass

    def __enter__(self) -> "NoGpus":
        return self

    def __exit__(self, *exc: object) -> None:
        pass
