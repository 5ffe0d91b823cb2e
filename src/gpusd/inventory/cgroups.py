"""Which container (or Slurm job) a process runs in, from ``/proc/PID/cgroup`` (docs/inventory.md,
"Containers").

The cgroup path names it, each runtime its own way, with the systemd cgroup driver or without:

* docker: ``.../docker-<id>.scope``, ``/docker/<id>``;
* podman: ``.../libpod-<id>.scope``, ``/libpod_parent/libpod-<id>`` (``libpod-conmon-`` is podman's
  monitor, not the container);
* containerd (nerdctl, Kubernetes' CRI): ``.../nerdctl-<id>.scope``, ``cri-containerd-<id>.scope``,
  ``/<namespace>/<id>``; CRI-O: ``crio-<id>.scope``;
* Kubernetes: a pod's cgroup (``kubepods-...-pod<uid>.slice``, ``/kubepods/<class>/pod<uid>/``) around
  the container's; the pod's UID is reported too;
* Slurm: ``.../job_<N>/step_<S>/...`` (cgroup v2 under ``slurmstepd.scope``, v1 under ``/slurm/``).

A process in another PID namespace is still named by its host pid (NVML reports host pids), so its
container is read here like any other.  The file is another user's process's: it is read bounded
(8 KiB, 64 lines), only hex ids of 12 to 64 digits are believed, and a pod UID only in its own form.
"""

from __future__ import annotations

import re

from ..ids import PodUid, SlurmJobId
from ..record import record

MAX_BYTES = 8192
MAX_LINES = 64

_HEX = r"([0-9a-f]{12,64})"
# (runtime, pattern on one path component)
_SCOPES = (
    ("docker", re.compile(rf"^docker-{_HEX}\.scope$")),
    ("podman", re.compile(rf"^libpod-{_HEX}(?:\.scope)?$")),
    ("containerd", re.compile(rf"^(?:cri-containerd|nerdctl)-{_HEX}\.scope$")),
    ("cri-o", re.compile(rf"^crio-{_HEX}\.scope$")),
)
_POD = re.compile(r"^(?:kubepods(?:-[a-z]+)?-)?pod([0-9a-f_-]{36})(?:\.slice)?$")  # the UID: ids.PodUid
# a cgroupfs driver's directory: the whole id, under a known parent
_BARE = re.compile(r"^([0-9a-f]{64})$")
# the parents such a directory has: docker's, podman's, containerd's namespaces (nerdctl, docker's own, CRI)
_PARENTS = {"docker": "docker", "libpod_parent": "podman", "default": "containerd", "moby": "containerd",
            "k8s.io": "containerd", "buildkit": "containerd"}


@record(frozen=True, slots=True)
class Container:
    """Where a process runs: ``runtime`` (docker, podman, containerd, cri-o, kubernetes, slurm) and
    ``id`` (the container's hex id; a Slurm job's number); ``pod``: a Kubernetes pod's UID."""

    runtime: str
    id: str
    pod: str | None = None


def parse(text: str) -> Container | None:
    """The container a ``/proc/PID/cgroup`` text names, or None (a process of the host)."""
    for line in text.splitlines()[:MAX_LINES]:
        path = line.split(":", 2)[-1]
        found = _from_path(path)
        if found is not None:
            return found
    return None


def _from_path(path: str) -> Container | None:
    parts = [p for p in path.split("/") if p][:32]
    pod: str | None = None
    for i, part in enumerate(parts):
        if len(part) > 128:
            return None
        m = _POD.match(part)
        if m is not None and PodUid.is_valid(m.group(1).replace("_", "-")):
            pod = m.group(1).replace("_", "-")
            continue
        for runtime, pattern in _SCOPES:
            m = pattern.match(part)
            if m is not None:
                return Container("kubernetes" if pod else runtime, m.group(1), pod)
        m = _BARE.match(part)
        # cgroupfs: /docker/<id>, pod.../<id>
        if m is not None and i > 0 and (pod or parts[i - 1] in _PARENTS):
            return Container("kubernetes" if pod else _PARENTS[parts[i - 1]], m.group(1), pod)
        if (part.startswith("job_") and part[4:].isdigit() and SlurmJobId.is_valid(part[4:])
                and ("slurmstepd.scope" in parts[:i] or "slurm" in parts[:i])):
            return Container("slurm", part[4:])
    return None


def of_pid(pid: int) -> Container | None:
    """The container of ``pid`` on this host, or None (none, or it cannot be read here)."""
    try:
        with open(f"/proc/{pid}/cgroup", "rb") as f:
            raw = f.read(MAX_BYTES)
    except OSError:
        return None
    return parse(raw.decode("ascii", "replace"))
