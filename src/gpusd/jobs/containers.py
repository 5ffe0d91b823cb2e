"""Leased GPUs into containers: ``gpusd run -n N -- docker run ...`` (docs/allocation.md, "Containers").

A job's variables do not cross into a container that a daemon starts (``docker``, ``podman``,
``nerdctl``), and apptainer shows every GPU it binds.  :func:`parse` recognises such a command (by
the base name of the runtime, also behind ``sudo``), refuses the options that would bypass the lease
(``--gpus``, a GPU ``--device``, ``--privileged``, a variable that chooses GPUs, ``-d`` unless the
container is followed), and :meth:`ContainerRun.command` rewrites it for the GPUs leased, each vendor
its way (:mod:`gpusd.inventory.vendors`: device files, CDI kinds, variables).

The lease lasts as long as the container: the rewritten ``run`` writes the container's id to a file
(``--cidfile``), and as soon as it is there, ``<runtime> wait <id>`` is started with the lease's
descriptors in a session of its own (:func:`start_holder`).  It exits when the container does, and so
the lease ends then -- not before, even if ``gpusd run`` and the runtime's client are killed.

Which options take a value is known per runtime for the common ones; an unknown long option without
``=`` is taken to have one.  This guards against mistakes: anyone who may use docker is root on the
machine anyway.
"""

# Imports inside functions: start-up (quick commands import this module).
from __future__ import annotations

import json
import os

from ..errors import ConfigError
from ..inventory import vendors
from ..record import record

# typing is not imported at run time: start-up time
TYPE_CHECKING = False
if TYPE_CHECKING:  # pragma: no cover
    import subprocess
    from typing import Sequence

    from ..model import HostSnapshot
    from .record import JobRecord

DAEMON_RUNTIMES = ("docker", "podman", "nerdctl")
APPTAINERS = ("apptainer", "singularity")
CDI_DIRS = ("/etc/cdi", "/var/run/cdi")
DOCKER_CONFIG = "/etc/docker/daemon.json"
# bytes of one CDI spec read at most
MAX_SPEC = 4 << 20
MAX_SPECS = 64

# Options of `run` that take a value (the rest of the common ones are switches).  Short ones with a
# value end a bundle (-it is two switches; -e X a value).
_VALUE_SHORT = {"docker": set("acehlmpuvw"), "podman": set("acehlmpuvw"), "nerdctl": set("acehlmpuvw"),
                "apptainer": set("BHWSo"), "singularity": set("BHWSo")}
_SWITCH_LONG = {
    "docker": {"--detach", "--interactive", "--tty", "--rm", "--privileged", "--init", "--read-only",
               "--publish-all", "--no-healthcheck", "--oom-kill-disable", "--disable-content-trust", "--help",
               "--quiet", "--sig-proxy", "--use-api-socket"},
    "podman": {"--detach", "--interactive", "--tty", "--rm", "--privileged", "--init", "--read-only",
               "--publish-all", "--no-healthcheck", "--oom-kill-disable", "--help", "--quiet", "--sig-proxy",
               "--replace", "--rmi", "--env-host", "--http-proxy", "--no-hosts", "--read-only-tmpfs",
               "--passwd", "--tls-verify"},
    "apptainer": {"--nv", "--rocm", "--nvccli", "--cleanenv", "--contain", "--containall", "--ipc", "--pid",
                  "--userns", "--fakeroot", "--writable", "--writable-tmpfs", "--no-home", "--no-init",
                  "--compat", "--no-privs", "--keep-privs", "--allow-setuid", "--no-mount", "--no-umask",
                  "--no-eval", "--disable-cache", "--no-https", "--boot", "--help", "--nonet", "--no-setgroups",
                  "--unsquash", "--oci", "--no-oci", "--uts", "--net"},
}
_SWITCH_LONG["nerdctl"] = _SWITCH_LONG["docker"]
_SWITCH_LONG["singularity"] = _SWITCH_LONG["apptainer"]
_GLOBAL_VALUE = {"-H", "--host", "--context", "-c", "--config", "--log-level", "-l", "--tlscacert", "--tlscert",
                 "--tlskey", "--root", "--runroot", "--url", "--connection", "--storage-driver",
                 "--cgroup-manager", "--namespace", "-n", "--address", "-a", "--snapshotter", "--cni-path",
                 "--data-root", "--runtime", "--identity", "--module", "--events-backend"}
_SUDO_VALUE = {"-u", "-g", "-C", "-h", "-p", "-r", "-t", "-U", "-D", "-R", "-T"}
_APPTAINER_RUNS = ("run", "exec", "shell", "test")


@record(frozen=True, slots=True)
class Leased:
    """One GPU of the lease as a container needs it."""

    vendor: str
    # the vendor runtime's number on the host
    index: int
    uuid: str | None
    pci_bus_id: str | None = None
    is_slice: bool = False


@record(frozen=True, slots=True)
class ContainerRun:
    """A container command ``gpusd run`` recognised: ``argv[:sub]`` is the runtime (and ``sudo`` and
    global options before it), ``argv[sub]`` its ``run`` (``exec`` ...), ``argv[sub + 1:]`` the rest."""

    argv: tuple[str, ...]
    # docker, podman, nerdctl, apptainer, singularity
    runtime: str
    sub: int
    detached: bool = False
    user_cidfile: str | None = None

    @property
    def daemon(self) -> bool:
        """Whether a daemon runs the container (docker, podman, nerdctl), not the client itself."""
        return self.runtime in DAEMON_RUNTIMES

    def base(self) -> list[str]:
        return list(self.argv[:self.sub])

    def wait_command(self, cid: str) -> list[str]:
        return [*self.base(), "wait", cid]

    def stop_command(self, cid: str, grace: float) -> list[str]:
        return [*self.base(), "stop", "-t", str(max(0, int(grace))), cid]

    def command(self, devices: Sequence[Leased], cidfile: str | None = None,
                labels: dict[str, str] | None = None) -> tuple[list[str], dict[str, str]]:
        """The rewritten command line for ``devices``, and variables to add to its environment."""
        visible = [vendors.Visible(d.vendor, d.index, d.uuid, d.is_slice) for d in devices]
        head, rest = list(self.argv[:self.sub + 1]), list(self.argv[self.sub + 1:])
        if not self.daemon:
            flags = sorted({f for d in devices if (f := vendors.rule(d.vendor).apptainer_flag)} - set(rest))
            inner = vendors.container_env(visible, isolated=False)
            env = {f"{prefix}{k}": v for k, v in inner.items() for prefix in ("APPTAINERENV_", "SINGULARITYENV_")}
            return head + flags + rest, {**inner, **env}
        added: list[str] = []
        if cidfile is not None and self.user_cidfile is None:
            added += ["--cidfile", cidfile]
        for k, v in (labels or {}).items():
            added += ["--label", f"{k}={v}"]
        added += gpu_options(self.runtime, devices)
        for k, v in vendors.container_env(visible, isolated=True).items():
            added += ["-e", f"{k}={v}"]
        return head + added + rest, {}


def parse(cmd: Sequence[str], follow: bool = False) -> ContainerRun | None:
    """The container run ``cmd`` is, or None (not one: it runs as it is).  Raises :class:`ConfigError`
    (one line) for an option that would give the container GPUs outside the lease, and for a detached
    run unless ``follow``."""
    argv = list(cmd)
    i = 0
    if argv and os.path.basename(argv[0]) == "sudo":
        i = 1
        while i < len(argv) and argv[i].startswith("-"):
            i += 2 if argv[i] in _SUDO_VALUE else 1
    if i >= len(argv):
        return None
    runtime = os.path.basename(argv[i])
    if runtime not in DAEMON_RUNTIMES + APPTAINERS:
        return None
    j = i + 1
    while j < len(argv) and argv[j].startswith("-"):
        j += 2 if argv[j] in _GLOBAL_VALUE and runtime in DAEMON_RUNTIMES else 1
    if j < len(argv) and argv[j] == "container" and runtime in DAEMON_RUNTIMES:
        j += 1
    if j >= len(argv):
        return None
    sub = argv[j]
    if runtime in APPTAINERS and sub == "instance":
        raise ConfigError(f"{runtime} instance runs in the background, where gpusd cannot follow it: use "
                          f"{runtime} exec or run under gpusd run (docs/allocation.md, \"Containers\")")
    if sub not in (_APPTAINER_RUNS if runtime in APPTAINERS else ("run",)):
        return None
    detached, cidfile = _check_options(runtime, argv[j + 1:])
    if detached and not follow:
        raise ConfigError(f"{runtime} run -d: the container would outlive its lease; add --follow-container (gpusd "
                          f"then waits for it with {runtime} wait and ends the lease when it exits), or run it "
                          "attached")
    return ContainerRun(tuple(argv), runtime, j, detached, cidfile)


def _refuse(runtime: str, what: str) -> ConfigError:
    return ConfigError(f"{runtime}: {what} would give the container GPUs outside its lease; gpusd run passes "
                       "exactly the leased GPUs itself (or run it with --no-lease)")


def _check_options(runtime: str, args: list[str]) -> tuple[bool, str | None]:
    """(detached, the user's --cidfile) after checking the options before the image."""
    short_values, switches = _VALUE_SHORT[runtime], _SWITCH_LONG[runtime]
    detached, cidfile = False, None
    k = 0
    while k < len(args):
        a = args[k]
        if a == "--" or not a.startswith("-") or a == "-":
            # the image: what follows is the container's command
            break
        if a.startswith("--"):
            name, eq, value = a.partition("=")
            if not eq and name not in switches:
                value = args[k + 1] if k + 1 < len(args) else ""
                k += 1
            _check_one(runtime, name, value)
            if name == "--detach" and value.lower() not in ("false", "0"):
                detached = True
            if name == "--cidfile":
                cidfile = value
        else:
            letters = a[1:]
            for n, c in enumerate(letters):
                # the rest of the bundle, or the next word, is its value
                if c in short_values:
                    value = letters[n + 1:] or (args[k + 1] if k + 1 < len(args) else "")
                    if not letters[n + 1:]:
                        k += 1
                    _check_one(runtime, "-" + c, value)
                    break
                if c == "d" and runtime in DAEMON_RUNTIMES:
                    detached = True
        k += 1
    return detached, cidfile


def _check_one(runtime: str, name: str, value: str) -> None:
    if runtime in APPTAINERS:
        if name == "--env" and any(vendors.selects_gpus(v.split("=", 1)[0]) for v in value.split(",")):
            raise _refuse(runtime, f"--env {value[:60]}")
        return
    if name == "--gpus":
        raise _refuse(runtime, f"--gpus {value[:60]}")
    if name == "--device" and vendors.is_gpu_device(value):
        raise _refuse(runtime, f"--device {value[:60]}")
    if name == "--privileged":
        raise _refuse(runtime, "--privileged (every device of the host)")
    if name in ("-e", "--env") and vendors.selects_gpus(value.split("=", 1)[0]):
        raise _refuse(runtime, f"-e {value.split('=', 1)[0][:60]}")


def gpu_options(runtime: str, devices: Sequence[Leased]) -> list[str]:
    """The options that give a docker/podman/nerdctl container exactly ``devices``, per vendor: CDI
    names where the runtime takes them (podman always, docker where CDI is on) and the vendor has CDI
    specs here; docker's ``--gpus`` for NVIDIA otherwise; device files (render nodes) for the rest."""
    out: list[str] = []
    specs: dict[str, dict[str, tuple[str, ...]]] | None = None
    by_vendor: dict[str, list[Leased]] = {}
    for d in devices:
        by_vendor.setdefault(d.vendor, []).append(d)
    for vendor, group in by_vendor.items():
        r = vendors.rule(vendor)
        names: list[str] | None = None
        if r.cdi_kind and (runtime == "podman" or cdi_enabled(runtime)):
            if specs is None:
                specs = cdi_specs()
            names = cdi_names(r.cdi_kind, group, specs.get(r.cdi_kind, {}), always=runtime == "podman"
                              and r.docker_gpus)
        if names is not None:
            out += [x for n in names for x in ("--device", n)]
        elif r.docker_gpus:
            if runtime == "podman":  # pragma: no cover -- cdi_names(always=True) answers for podman
                raise ConfigError("podman takes NVIDIA GPUs by CDI only")
            ids = ",".join(d.uuid or str(d.index) for d in group)
            out += ["--gpus", f'"device={ids}"']
        else:
            for f in r.device_files:
                out += ["--device", f]
            for d in group:
                node = vendors.render_node(d.pci_bus_id) if r.render_nodes else None
                if node is None:
                    raise ConfigError(f"cannot pass GPU {d.index} ({(d.uuid or '?')[:48]}) into a container: no "
                                      f"render node for PCI {str(d.pci_bus_id)[:32]} under /sys/bus/pci/devices")
                out += ["--device", node]
            for g in r.groups:
                out += ["--group-add", g]
    return out


def cdi_enabled(runtime: str, config: str | None = None) -> bool:
    """Whether ``runtime`` resolves CDI names: podman and nerdctl always; docker where its daemon's
    configuration turns the ``cdi`` feature on."""
    if runtime != "docker":
        return True
    path = config or os.environ.get("GPUSD_DOCKER_CONFIG") or DOCKER_CONFIG
    try:
        with open(path, "rb") as f:
            # here: a job waiting for GPUs needs none
            from ..sanitize import json_object

            conf = json_object(f.read(1 << 20))
    except (OSError, ValueError):
        return False
    features = conf.get("features")
    return isinstance(features, dict) and features.get("cdi") is True


def cdi_specs(dirs: Sequence[str] | None = None) -> dict[str, dict[str, tuple[str, ...]]]:
    """kind -> device name -> its device nodes, from the CDI spec files (JSON; YAML where PyYAML is
    installed) in ``dirs`` (``$GPUSD_CDI_DIRS``, colon-separated; default /etc/cdi, /var/run/cdi).  A
    file that cannot be read or parsed is skipped."""
    if dirs is None:
        env = os.environ.get("GPUSD_CDI_DIRS")
        dirs = env.split(":") if env else CDI_DIRS
    out: dict[str, dict[str, tuple[str, ...]]] = {}
    files: list[str] = []
    for d in dirs:
        try:
            files += sorted(os.path.join(d, n) for n in os.listdir(d) if n.endswith((".json", ".yaml", ".yml")))
        except OSError:
            continue
    for path in files[:MAX_SPECS]:
        spec = _load(path)
        if not isinstance(spec, dict) or not isinstance(spec.get("kind"), str):
            continue
        devs = spec.get("devices")
        if not isinstance(devs, list):
            continue
        table = out.setdefault(spec["kind"], {})
        for dev in devs[:1024]:
            if not isinstance(dev, dict) or not isinstance(dev.get("name"), str):
                continue
            edits = dev.get("containerEdits")
            nodes = edits.get("deviceNodes") if isinstance(edits, dict) else None
            paths = tuple(n["path"] for n in nodes if isinstance(n, dict) and isinstance(n.get("path"), str)) \
                if isinstance(nodes, list) else ()
            table[dev["name"][:128]] = paths
    return out


def _load(path: str) -> object:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        with os.fdopen(fd, "rb") as f:
            raw = f.read(MAX_SPEC + 1)
    except OSError:
        return None
    if len(raw) > MAX_SPEC:
        return None
    try:
        if path.endswith(".json"):
            return json.loads(raw)
        import yaml  # type: ignore[import-untyped,unused-ignore]  # not a dependency: read where installed

        return yaml.safe_load(raw)
    except Exception:  # noqa: BLE001 -- a damaged spec (or no PyYAML) costs that spec
        return None


def cdi_names(kind: str, group: Sequence[Leased], table: dict[str, tuple[str, ...]],
              always: bool = False) -> list[str] | None:
    """The CDI names of ``group`` in ``kind``'s specs: the device named by the GPU's UUID, or whose
    device nodes include its render node; None where one is missing (then the runtime's other way),
    unless ``always`` (podman, NVIDIA: by UUID, as nvidia-ctk names them)."""
    out: list[str] = []
    for d in group:
        name = None
        if d.uuid and d.uuid in table:
            name = d.uuid
        else:
            node = vendors.render_node(d.pci_bus_id)
            if node is not None:
                name = next((n for n, paths in sorted(table.items()) if n != "all" and node in paths), None)
        if name is None:
            if not always or not d.uuid:
                return None
            name = d.uuid
        out.append(f"{kind}={name}")
    return out


def read_cid(path: str) -> str | None:
    """The container id in a ``--cidfile`` (hex, as the runtimes write it), or None."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as f:
        raw = f.read(256).strip().decode("ascii", "replace")
    from ..ids import ContainerId

    return ContainerId.optional(raw.lower())


def start_holder(run: ContainerRun, cid: str, fds: Sequence[int], out_path: str,
                 env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    """``<runtime> wait <cid>`` holding the lease's descriptors, in a session of its own (a signal to
    ``gpusd run``'s process group does not reach it): the lease ends when the container does.  What
    it prints (the container's exit status) goes to ``out_path``."""
    import subprocess

    with open(out_path, "wb") as out:
        return subprocess.Popen(run.wait_command(cid), stdin=subprocess.DEVNULL, stdout=out,
                                stderr=subprocess.DEVNULL, pass_fds=list(fds), start_new_session=True, env=env)


def exit_status(out_path: str) -> int | None:
    """The container's exit status as ``<runtime> wait`` printed it."""
    try:
        with open(out_path, "rb") as f:
            text = f.read(64).decode("ascii", "replace").strip().splitlines()
    except OSError:
        return None
    try:
        return int(text[-1]) if text else None
    except ValueError:
        return None


def name_containers(snap: HostSnapshot, records: Sequence[JobRecord] | None = None) -> None:
    """Name who started each GPU process's container where a gpusd job did (its record's ``container``):
    ``container_owner`` is that job's user, and the process counts as covered by the job's lease when
    that lease is on its GPU (it is not the lease holder's descendant: a daemon runs it).  A record is
    another user's claim: a container two records claim is believed of neither."""
    if not any(p.container for g in snap.gpus for p in g.processes):
        # nothing to read (the usual case: no job files are opened)
        return
    if records is None:
        from .record import list_jobs

        records = list_jobs()
    claims: dict[str, list[JobRecord]] = {}
    for rec in records:
        if rec.container:
            claims.setdefault(rec.container, []).append(rec)
    for g in snap.gpus:
        leases = {le.lease_id for le in g.leases if not le.unleased and not le.unreadable}
        for p in g.processes:
            got = claims.get(p.container or "")
            if got is None or len(got) != 1:
                continue
            rec = got[0]
            p.container_owner = rec.user
            if rec.lease is not None and rec.lease in leases:
                p.unleased = False
