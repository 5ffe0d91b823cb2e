"""A LAN on one machine, built from Linux network namespaces, for discovery tests and benchmarks.

One namespace holds a bridge (the switch); every host is a namespace with a veth pair plugged into
it and an address from 198.18.0.0/15 (RFC 2544 benchmarking space).  The veth pairs are created
inside the bridge namespace, so nothing ever touches the machine's own namespace: multicast flows
between the hosts and cannot leave.  Each daemon also pins its mDNS interface to its veth address.

Names carry the creating pid and a random tag, so concurrent runs never collide; everything is torn
down in :meth:`Lan.close` (processes killed by pid, namespaces deleted), which the ``lan`` fixture
calls even when the test fails.  Namespaces left by a killed run (whose pid is gone) are swept.

Needs root and ``ip netns``; :func:`unavailable` says why not, for ``pytest.skip``.

Usable from benchmarks too (no pytest needed)::

    with Lan() as lan:
        h = lan.add_gpu_host("node-1", gpus=make_gpus(8))
        h.start()
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from fakenvml import FakeGPU, build_fake_nvml, fake_env, write_state  # noqa: E402

PREFIX = "gsd"  # namespace names: gsd-<pid>-<tag>-<role>


def unavailable() -> str | None:
    """Why namespace tests cannot run here, or None."""
    if sys.platform != "linux":
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "network namespace tests need root (ip netns add)"
    if shutil.which("ip") is None:
        return "the ip command (iproute2) is not installed"
    probe = f"{PREFIX}-{os.getpid()}-probe{secrets.token_hex(2)}"
    r = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if r.returncode != 0:
        return f"ip netns add failed: {r.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    r = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and r.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {r.stderr.strip()}")
    return r


def sweep_stale() -> None:
    """Delete namespaces of earlier runs whose creating process is gone."""
    r = _ip("netns", "list", check=False)
    for line in r.stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        parts = name.split("-")
        if len(parts) < 3 or parts[0] != PREFIX or not parts[1].isdigit():
            continue
        if not Path(f"/proc/{parts[1]}").exists():
            _ip("netns", "del", name, check=False)


@dataclass
class Node:
    name: str  # short role name, e.g. "h1" or "client"
    ns: str  # namespace name
    ip: str
    index: int


@dataclass
class GpuHost:
    """A namespace host running one gpusd daemon on its own fake NVML state."""

    lan: "Lan"
    node: Node
    hostname: str
    state_dir: Path
    nvml_state: Path
    gpus: list[FakeGPU]
    session: str = "default"
    args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    proc: subprocess.Popen[bytes] | None = None
    started_at: float = 0.0

    @property
    def ip(self) -> str:
        return self.node.ip

    def write(self, gpus: Sequence[FakeGPU] | None = None) -> float:
        """Write the fake NVML state (atomically); returns the time it was written."""
        if gpus is not None:
            self.gpus = list(gpus)
        write_state(self.nvml_state, self.gpus)
        return time.time()

    def start(self, wait: bool = True, timeout: float = 30.0) -> float:
        """Start the daemon in the foreground (as systemd would); with ``wait``, return once it is
        announced.  Returns the time the start began."""
        r, w = os.pipe()
        argv = [sys.executable, "-m", "gpusd", "start", "--foreground", "--interface", self.ip,
                "--session", self.session, "--hostname", self.hostname, "--state-dir", str(self.state_dir),
                *self.args, "--ready-fd", str(w)]
        log = open(self.state_dir / "gpusd.log", "ab")
        self.started_at = time.time()
        try:
            self.proc = self.lan.popen(self.node, argv, env=self.env, stdout=log, stderr=log, pass_fds=(w,))
        finally:
            os.close(w)
            log.close()
        try:
            if wait:
                line = _read_line(r, timeout)
                if not line:
                    raise RuntimeError(f"daemon {self.hostname} did not come up:\n{self.log_tail()}")
        finally:
            os.close(r)
        return self.started_at

    def log_tail(self, n: int = 30) -> str:
        try:
            return "\n".join((self.state_dir / "gpusd.log").read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no log)"

    def stop(self, timeout: float = 15.0) -> subprocess.CompletedProcess[str]:
        """``gpusd stop`` for this host's state directory (the way a user stops it)."""
        r = subprocess.run([sys.executable, "-m", "gpusd", "stop", "--state-dir", str(self.state_dir)],
                           capture_output=True, text=True, timeout=timeout, env=self.env)
        if self.proc is not None:
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        return r

    def kill(self) -> float:
        """SIGKILL the daemon: no goodbye of any kind.  Returns the time of the kill."""
        assert self.proc is not None
        t = time.time()
        self.proc.kill()
        self.proc.wait(10)
        return t

    def unplug(self) -> float:
        """Pull the cable: take the host's port on the bridge down.  Returns the time."""
        t = time.time()
        _ip("-n", self.lan.switch, "link", "set", f"v{self.node.index}", "down")
        return t

    def plug(self) -> None:
        _ip("-n", self.lan.switch, "link", "set", f"v{self.node.index}", "up")


def read_lines(fd: int, count: int, timeout: float) -> list[str]:
    """Up to ``count`` lines from ``fd``, waiting at most ``timeout`` seconds (never blocking past it)."""
    import select

    deadline = time.monotonic() + timeout
    buf = b""
    while buf.count(b"\n") < count and time.monotonic() < deadline:
        ready, _, _ = select.select([fd], [], [], 0.2)
        if ready:
            chunk = os.read(fd, 4096)
            if not chunk:
                break
            buf += chunk
    return buf.decode(errors="replace").split("\n")[:count] if buf else []


def _read_line(fd: int, timeout: float) -> str:
    lines = read_lines(fd, 1, timeout)
    return lines[0] if lines else ""


class Watcher:
    """``gpusd watch --json`` running in a namespace; events collected with their arrival time."""

    def __init__(self, lan: "Lan", node: Node, args: Sequence[str], env: dict[str, str]) -> None:
        argv = [sys.executable, "-m", "gpusd", "watch", "--json", "--interface", node.ip, *args]
        self.proc = lan.popen(node, argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        self.events: list[dict[str, Any]] = []
        self.bad_lines: list[str] = []
        self.stderr: list[str] = []
        self._cond = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()
        threading.Thread(target=self._read_err, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            try:
                ev = json.loads(raw)
                ev["_received"] = time.time()
            except ValueError:
                self.bad_lines.append(raw.decode(errors="replace"))
                continue
            with self._cond:
                self.events.append(ev)
                self._cond.notify_all()

    def _read_err(self) -> None:
        assert self.proc.stderr is not None
        for raw in self.proc.stderr:
            self.stderr.append(raw.decode(errors="replace").rstrip())

    def _wait(self, find: Callable[[list[dict[str, Any]]], Any], timeout: float, what: str) -> Any:
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                found = find(self.events)
                if found is not None:
                    return found
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise AssertionError(f"{what} within {timeout} s; last events: "
                                         f"{[(e['event'], e.get('hostname')) for e in self.events[-20:]]}\n"
                                         f"stderr: {self.stderr[-10:]}")
                self._cond.wait(min(remaining, 0.2))

    def wait_for(self, pred: Callable[[dict[str, Any]], bool], timeout: float, start: int = 0) -> dict[str, Any]:
        """The first event (from index ``start``) matching ``pred``; AssertionError after ``timeout``."""
        return self._wait(lambda events: next((e for e in events[start:] if pred(e)), None), timeout,
                          "no matching event")

    def wait_count(self, pred: Callable[[dict[str, Any]], bool], n: int, timeout: float) -> list[dict[str, Any]]:
        """At least ``n`` events matching ``pred``; AssertionError after ``timeout``."""
        def find(events: list[dict[str, Any]]) -> list[dict[str, Any]] | None:
            found = [e for e in events if pred(e)]
            return found if len(found) >= n else None

        return self._wait(find, timeout, f"fewer than {n} matching events")

    def mark(self) -> int:
        with self._cond:
            return len(self.events)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


class Lan:
    """A bridge namespace plus host namespaces; see the module docstring."""

    def __init__(self, tag: str = "", workdir: Path | None = None, net: int | None = None) -> None:
        # net: this LAN is 198.18.<net>.0/24 (hosts .1-.250, a router .254) for routed setups (join());
        # None: the default 198.18.0.0/16
        self.net = net
        self.gateway: str | None = None
        sweep_stale()
        self.id = f"{PREFIX}-{os.getpid()}-{tag or ''}{secrets.token_hex(2)}"
        self.switch = f"{self.id}-lan"
        self.nodes: list[Node] = []
        self.hosts: list[GpuHost] = []
        self.procs: list[subprocess.Popen[Any]] = []
        self._own_workdir = workdir is None
        self.workdir = Path(workdir) if workdir is not None else Path(tempfile.mkdtemp(prefix=f"{self.id}-"))
        self._libdir: Path | None = None
        self.routers: list[str] = []  # router namespaces this LAN deletes on close (join())
        self.closed = False
        _ip("netns", "add", self.switch)
        self._exec_checked(self.switch, "ip", "link", "add", "br0", "type", "bridge")
        self._exec_checked(self.switch, "ip", "link", "set", "br0", "up")

    def __enter__(self) -> "Lan":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _exec_checked(self, ns: str, *argv: str) -> None:
        r = subprocess.run(["ip", "netns", "exec", ns, *argv], capture_output=True, text=True, timeout=30)
        if r.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} in {ns}: {r.stderr.strip()}")

    def add_node(self, name: str) -> Node:
        index = len(self.nodes) + 1
        ns = f"{self.id}-{name}"
        ip = f"198.18.{index // 250}.{index % 250 + 1}" if self.net is None else f"198.18.{self.net}.{index}"
        prefix = 16 if self.net is None else 24
        _ip("netns", "add", ns)
        try:
            # Both ends are born in the switch namespace, then one moves into the host: the veth
            # pair never exists in the machine's own namespace.
            _ip("-n", self.switch, "link", "add", f"v{index}", "type", "veth", "peer", "name", "eth0", "netns", ns)
            _ip("-n", self.switch, "link", "set", f"v{index}", "master", "br0")
            _ip("-n", self.switch, "link", "set", f"v{index}", "up")
            _ip("-n", ns, "addr", "add", f"{ip}/{prefix}", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            if self.gateway is not None:
                _ip("-n", ns, "route", "add", "default", "via", self.gateway)
        except Exception:
            _ip("netns", "del", ns, check=False)
            raise
        node = Node(name=name, ns=ns, ip=ip, index=index)
        self.nodes.append(node)
        return node

    def base_env(self, node: Node, **extra: str) -> dict[str, str]:
        """Environment for gpusd processes in ``node``: mDNS pinned to its address, nothing shared."""
        env = dict(os.environ)
        for var in ("GPUSD_SIMULATE", "CUDA_VISIBLE_DEVICES", "GPUSD_TOKEN", "NOTIFY_SOCKET"):
            env.pop(var, None)
        env["GPUSD_INTERFACES"] = node.ip
        env["PYTHONUNBUFFERED"] = "1"
        src = str(HERE.parent / "src")
        env["PYTHONPATH"] = src + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        env.update(extra)
        return env

    def popen(self, node: Node, argv: Sequence[str], env: dict[str, str] | None = None,
              **kw: Any) -> subprocess.Popen[Any]:
        """Start ``argv`` inside ``node``'s namespace (``ip netns exec`` execs it: the pid is the
        command's own)."""
        p = subprocess.Popen(["ip", "netns", "exec", node.ns, *argv],
                             env=env if env is not None else self.base_env(node), stdin=subprocess.DEVNULL, **kw)
        self.procs.append(p)
        return p

    def run(self, node: Node, argv: Sequence[str], env: dict[str, str] | None = None, timeout: float = 60,
            **kw: Any) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["ip", "netns", "exec", node.ns, *argv],
                              env=env if env is not None else self.base_env(node),
                              capture_output=True, text=True, timeout=timeout, **kw)

    def gpusd(self, node: Node, args: Sequence[str], env: dict[str, str] | None = None,
              timeout: float = 60) -> subprocess.CompletedProcess[str]:
        """Run the gpusd CLI in ``node``, mDNS pinned to its address."""
        return self.run(node, [sys.executable, "-m", "gpusd", *args], env=env, timeout=timeout)

    @property
    def libdir(self) -> Path:
        if self._libdir is None:
            self._libdir = build_fake_nvml()
        return self._libdir

    def add_gpu_host(self, hostname: str, gpus: Iterable[FakeGPU], *, session: str = "default",
                     args: Sequence[str] = (), fast: bool = False, node_name: str | None = None,
                     extra_env: dict[str, str] | None = None) -> GpuHost:
        """A namespace with a fake-NVML state and a state directory (the daemon is not started).
        ``fast``: shrink mDNS probe/announce intervals (``$GPUSD_MDNS_FAST``)."""
        node = self.add_node(node_name or f"h{len(self.nodes) + 1}")
        state_dir = self.workdir / f"{node.name}-state"
        state_dir.mkdir(parents=True)
        nvml_state = self.workdir / f"{node.name}-nvml.txt"
        host = GpuHost(self, node, hostname, state_dir, nvml_state, list(gpus), session=session, args=list(args))
        host.write()
        env = fake_env(self.libdir, nvml_state, self.base_env(node))
        env["GPUSD_STATE_DIR"] = str(state_dir)
        env["GPUSD_LOCK_DIR"] = str(self.workdir / f"{node.name}-locks")
        env["GPUSD_HOSTNAME"] = hostname
        if fast:
            env["GPUSD_MDNS_FAST"] = "1"
        env.update(extra_env or {})
        host.env = env
        self.hosts.append(host)
        return host

    def watch(self, node: Node, args: Sequence[str] = (), fast: bool = False) -> Watcher:
        env = self.base_env(node, **({"GPUSD_MDNS_FAST": "1"} if fast else {}))
        return Watcher(self, node, args, env)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for p in self.procs:
            if p.poll() is None:
                try:
                    p.send_signal(signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + 5
        for p in self.procs:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                try:
                    p.wait(5)
                except subprocess.TimeoutExpired:
                    pass
        for node in self.nodes:
            _ip("netns", "del", node.ns, check=False)
        _ip("netns", "del", self.switch, check=False)
        for ns in self.routers:
            _ip("netns", "del", ns, check=False)
        if self._own_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)


def join(a: Lan, b: Lan) -> str:
    """Join two LANs (made with ``net=``) by a router namespace with IP forwarding: unicast crosses
    it, multicast (mDNS) does not.  The router is .254 on both; every host (now and later) routes the
    other LAN through it.  Returns the router's namespace name (deleted by ``a.close()``)."""
    assert a.net is not None and b.net is not None and a.net != b.net
    ns = f"{a.id}-rtr"
    _ip("netns", "add", ns)
    a.routers.append(ns)
    for i, lan in enumerate((a, b)):
        gw = f"198.18.{lan.net}.254"
        _ip("-n", lan.switch, "link", "add", "vr", "type", "veth", "peer", "name", f"eth{i}", "netns", ns)
        _ip("-n", lan.switch, "link", "set", "vr", "master", "br0")
        _ip("-n", lan.switch, "link", "set", "vr", "up")
        _ip("-n", ns, "addr", "add", f"{gw}/24", "dev", f"eth{i}")
        _ip("-n", ns, "link", "set", f"eth{i}", "up")
        lan.gateway = gw
        for node in lan.nodes:
            _ip("-n", node.ns, "route", "add", "default", "via", gw)
    r = subprocess.run(["ip", "netns", "exec", ns, "sysctl", "-qw", "net.ipv4.ip_forward=1"],
                       capture_output=True, text=True, timeout=30)
    if r.returncode != 0:
        raise RuntimeError(f"ip_forward in {ns}: {r.stderr.strip()}")
    return ns


# -- pytest fixtures (import them into a test module: ``from netns import lan``) --------------------
try:
    import pytest
except ImportError:  # pragma: no cover - benchmarks without pytest
    pytest = None  # type: ignore[assignment]

if pytest is not None:

    @pytest.fixture(scope="session")
    def netns_ok() -> None:
        reason = unavailable()
        if reason:
            pytest.skip(reason)

    @pytest.fixture
    def lan(netns_ok: None, tmp_path: Path) -> Iterable[Lan]:
        lan = Lan(workdir=tmp_path / "lan")
        (tmp_path / "lan").mkdir(exist_ok=True)
        try:
            yield lan
        finally:
            lan.close()

    @pytest.fixture
    def lans(netns_ok: None, tmp_path: Path) -> Iterable[tuple[Lan, Lan]]:
        """Two LANs (nets 1 and 2) joined by a router: hosts of one reach the other's only by address."""
        a = Lan(workdir=tmp_path / "lan-a", net=1)
        b = Lan(workdir=tmp_path / "lan-b", net=2)
        try:
            join(a, b)
            yield a, b
        finally:
            b.close()
            a.close()
