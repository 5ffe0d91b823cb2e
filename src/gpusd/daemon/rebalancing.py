"""The daemon's side of rebalancing (docs/jobs.md): decisions from :mod:`gpusd.jobs.rebalance` on
every sample, carried out through each job's control socket, each one an event with its reason.

Events on ``/api/v1/events`` (and in the log): ``job`` with ``{"action": "move"|"pause"|"resume",
"job": ..., "gpu": UUID, "index": N, "to": N|null, "reason": "...", "ok": bool, "result": "..."}``.
The daemon acts as the job's owner may: it runs as root, or as the owner (the job refuses anyone else).
"""

# Imports inside functions: memory at rest (loaded on request).
from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol

from ..errors import GpusdError
from ..jobs.rebalance import Decision, Policy, Rebalancer
from ..jobs.record import list_jobs
from ..model import HostSnapshot

log = logging.getLogger(__name__)


class _Daemon(Protocol):
    config: Any
    on_sample: list[Any]

    def publish(self, event: str, data: Any) -> None: ...


class Rebalancing:
    def __init__(self, daemon: _Daemon, policy: Policy) -> None:
        self.daemon = daemon
        self.rebalancer = Rebalancer(policy)
        self.executor = ThreadPoolExecutor(1, thread_name_prefix="gpusd-rebalance")
        self.busy = False
        # the last ones, for GET /api/v1/jobs readers
        self.decisions: list[dict[str, Any]] = []

    def on_sample(self, snap: HostSnapshot) -> None:
        # the previous round is still acting (a move takes a lease): skip this sample
        if self.busy:
            return
        self.busy = True
        loop = asyncio.get_running_loop()
        fut = loop.run_in_executor(self.executor, self.round, snap)
        fut.add_done_callback(lambda f: self._done(f))

    def _done(self, fut: "asyncio.Future[list[dict[str, Any]]]") -> None:
        self.busy = False
        try:
            for event in fut.result():
                self.daemon.publish("job", event)
        except Exception:
            log.exception("rebalancing failed")

    def round(self, snap: HostSnapshot) -> list[dict[str, Any]]:
        from ..jobs.control import request

        jobs = list_jobs()
        out: list[dict[str, Any]] = []
        for d in self.rebalancer.decide(snap, jobs):
            event = self.act(d, request)
            out.append(event)
        return out

    def act(self, d: Decision, request: Any) -> dict[str, Any]:
        message: dict[str, Any]
        if d.action == "move":
            message = {"op": "move", "avoid": [d.gpu], "reason": d.reason}
        else:
            message = {"op": d.action, "reason": d.reason}
        started = time.monotonic()
        try:
            answer = request(d.job, d.uid, message, timeout=60.0)
        except GpusdError as exc:
            answer = {"ok": False, "message": str(exc)}
        event = {**d.to_dict(), "ok": bool(answer.get("ok")),
                 "result": str(answer.get("message") or answer.get("devices") or "")[:300],
                 "ts": time.time(), "took_s": round(time.monotonic() - started, 3)}
        log.log(logging.INFO if event["ok"] else logging.WARNING, "rebalance: %s (%s%s; asked in %.0f ms)", d.reason,
                "done" if event["ok"] else "failed", f": {event['result']}" if event["result"] else "",
                event["took_s"] * 1000)
        self.decisions = (self.decisions + [event])[-50:]
        return event

    def close(self) -> None:
        self.executor.shutdown(wait=False)


def install(daemon: _Daemon) -> Rebalancing:
    cfg = daemon.config
    policy = Policy.load(cfg.rebalance_policy) if cfg.rebalance_policy is not None else Policy()
    r = Rebalancing(daemon, policy)
    daemon.on_sample.append(r.on_sample)
    log.info("rebalancing on: %s", policy.to_dict())
    return r
