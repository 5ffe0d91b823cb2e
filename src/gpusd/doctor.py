"""``gpusd doctor``: is this host set up as gpusd needs, and what to do where it is not.

Each check says what it found and, where it fails, what to do. In order: the GPU libraries of each
vendor, the daemon (running, lease authority or not, its ports), the lease socket and the lock
directory (owners, modes), multicast on each interface the daemon announces on, the fleet secret
(its file's owner and mode), this clock against the fleet's verified daemons, and the systemd unit.

Nothing here leaves the machine that the daemon does not already send: multicast is tried with a
TTL of 0 (the kernel loops the datagram back to this host's sockets and never transmits it), on a port
of its own, not mDNS's; the clock is compared with the snapshots the local daemon already receives.
"""

# Imports inside functions: optional or heavy packages; start-up (a command's own module).
from __future__ import annotations

import ctypes
import importlib.util
import os
import socket
import stat
import time
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

from .alloc.authority import connect, socket_path
from .alloc.leases import lock_dir as lease_lock_dir
from .alloc.lockdir import check_dir, owner_name, process_uid
from .errors import GpusdError
from .inventory import nvmlfast
from .localdaemon import api_bases, status
from .record import field, record
from .sanitize import for_terminal
from .wire.mdns import local_ipv4_addresses, resolve_interfaces

# a check that does not apply here (no secret, no systemd) is skipped
PASS, FAIL, SKIP = "ok", "fail", "skip"
# seconds: well within the signatures' window (docs/security.md), beyond a sample's age
CLOCK_SKEW = 10.0


@record
class Check:
    """One check's outcome: what was checked, what was found, and what to do where it failed."""

    name: str
    status: str  # PASS, FAIL or SKIP
    found: str
    fix: str | None = None
    details: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"check": self.name, "status": self.status, "found": self.found, "fix": self.fix,
                "details": self.details}


def run_checks(state_dir: Path, interfaces: list[str] | None = None, token_file: str | None = None) -> list[Check]:
    """Every check, in order (docs/daemon.md, "gpusd doctor")."""

    st = status(state_dir)
    info = st.info if st.running else {}
    return [gpu_libraries(), daemon(state_dir, st.running, st.pid, info), lease_socket(st.running), lock_dir(),
            multicast(interfaces if interfaces is not None else list(info.get("interfaces") or []) or None),
            secret(token_file), clock(info), systemd_unit()]


def gpu_libraries() -> Check:
    """Which vendor libraries load here, with their versions."""
    found: dict[str, str] = {}
    try:
        nvmlfast.nvmlInit()
        try:
            found["nvidia"] = f"NVML, driver {nvmlfast.nvmlSystemGetDriverVersion()}"
        finally:
            nvmlfast.nvmlShutdown()
    except Exception as exc:
        # no library, no driver: named below
        missing = {"nvidia": f"no NVML ({_short(exc)})"}
    else:
        missing = {}
    for vendor, module, lib in (("amd", "amdsmi", "libamd_smi.so"), ("intel", "pyzes", "libze_loader.so.1")):
        version = _package_version(module)
        if version is None:
            missing[vendor] = f"no {module} package"
        elif not _loads(lib):
            missing[vendor] = f"{module} {version}, but no {lib}"
        else:
            found[vendor] = f"{module} {version} with {lib}"
    words = "; ".join(f"{v}: {t}" for v, t in found.items()) or "no GPU library loads"
    if found:
        return Check("gpu-libraries", PASS, words, details={"found": found, "missing": missing})
    return Check("gpu-libraries", FAIL, f"{words} ({'; '.join(f'{v}: {t}' for v, t in missing.items())})",
                 "install the NVIDIA driver (libnvidia-ml.so.1); for AMD `pip install 'gpusd[amd]'` and ROCm; for "
                 "Intel `pip install 'gpusd[intel]'` and libze1; without GPUs, `gpusd demo` or `--simulate`",
                 details={"found": found, "missing": missing})


def daemon(state_dir: Path, running: bool, pid: int | None, info: dict[str, Any]) -> Check:
    if not running:
        return Check("daemon", FAIL, f"not running (state directory {state_dir})",
                     "start it: `sudo gpusd start` (or `systemctl enable --now gpusd`, docs/gpusd.service)")

    ports = [p for p in (info.get("port"), info.get("tls_port")) if isinstance(p, int)]
    sock = connect()
    authority = sock is not None
    if sock is not None:
        sock.close()
    found = f"running, pid {pid}, ports {', '.join(map(str, ports)) or '?'}"
    details = {"pid": pid, "ports": ports, "authority": authority}
    if authority:
        return Check("daemon", PASS, found + "; the lease authority (its lease socket answers)", details=details)

    uid = process_uid(pid) if pid is not None else None
    why = ("it does not run as root" if uid not in (None, 0) else
           "its lease socket is missing or not trusted (owned by root or you, a socket)")
    return Check("daemon", FAIL, f"{found}; not the lease authority: {why}",
                 "run the daemon as root (systemd: docs/gpusd.service, with RuntimeDirectory=gpusd) so that every "
                 "lease goes through it", details=details)


def lease_socket(daemon_running: bool) -> Check:
    path = socket_path()
    if path is None:
        return Check("lease-socket", SKIP, "turned off ($GPUSD_LEASE_SOCKET=off): leases in the lock directory")
    try:
        st = os.lstat(path)
        parent = os.lstat(path.parent)
    except FileNotFoundError:
        if not daemon_running:
            return Check("lease-socket", SKIP, f"{path}: none (no daemon runs)")
        return Check("lease-socket", FAIL, f"{path}: missing while the daemon runs",
                     "run the daemon as root, allowed to make the socket's directory (RuntimeDirectory=gpusd)")
    except OSError as exc:
        return Check("lease-socket", FAIL, f"{path}: {_short(exc)}", "check the path's directories")
    found = (f"{path}: {_mode(st)} {_owner(st.st_uid)}; directory {_mode(parent)} {_owner(parent.st_uid)}")
    if not stat.S_ISSOCK(st.st_mode) or st.st_uid not in (0, os.geteuid()):
        return Check("lease-socket", FAIL, found + " (not a socket of root's or yours: never used)",
                     f"remove {path}: only the daemon should make it")
    if parent.st_uid != 0 or parent.st_mode & 0o022:
        return Check("lease-socket", FAIL, found + " (its directory is not root's alone: anyone could replace it)",
                     f"`sudo chown root:root {path.parent} && sudo chmod 755 {path.parent}`")
    return Check("lease-socket", PASS, found)


def lock_dir() -> Check:
    path = lease_lock_dir()
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return Check("lock-dir", PASS, f"{path}: not made yet (the first lease makes it, mode 1777)")
    except OSError as exc:
        return Check("lock-dir", FAIL, f"{path}: {_short(exc)}", "set GPUSD_LOCK_DIR to a directory you can use")
    found = f"{path}: {_mode(st)} {_owner(st.st_uid)}"
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        return Check("lock-dir", FAIL, found + " (not a directory: refused)", f"remove {path}; gpusd makes it")
    try:
        check_dir(path, st)
    except GpusdError as exc:
        return Check("lock-dir", FAIL, found, str(exc))
    return Check("lock-dir", PASS, found)


def multicast(interfaces: list[str] | None) -> Check:
    """A datagram to 224.0.0.251 on each interface, with a TTL of 0: delivered back to this host, never
    transmitted. What fails here (no multicast on the interface, no route, a firewall on the host)
    keeps mDNS from working on it."""

    if not interfaces:
        interfaces = resolve_interfaces(None) or local_ipv4_addresses(include_loopback=True)
    addrs = interfaces
    if not addrs:
        return Check("multicast", FAIL, "no IPv4 interface is up", "bring up a network interface")
    results: dict[str, str] = {}
    for addr in addrs:
        results[addr] = _loop_multicast(socket, addr)
    bad = {a: r for a, r in results.items() if r != PASS}
    found = ", ".join(f"{a} {'ok' if r == PASS else r}" for a, r in results.items())
    if bad:
        return Check("multicast", FAIL, found, "allow multicast (UDP 5353 to 224.0.0.251) on these interfaces, or "
                     "give the daemon the ones that work (--interface)", details={"interfaces": results})
    return Check("multicast", PASS, found, details={"interfaces": results})


def _loop_multicast(socket: Any, addr: str) -> str:
    group = "224.0.0.251"
    recv = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    send = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        recv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        recv.bind((group, 0))
        port = recv.getsockname()[1]
        recv.setsockopt(socket.IPPROTO_IP, socket.IP_ADD_MEMBERSHIP, socket.inet_aton(group) + socket.inet_aton(addr))
        recv.settimeout(1.0)
        # never transmitted: looped back only
        send.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_TTL, 0)
        send.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_LOOP, 1)
        send.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_IF, socket.inet_aton(addr))
        token = os.urandom(8)
        send.sendto(b"gpusd-doctor " + token, (group, port))
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:
            data, _ = recv.recvfrom(64)
            if data.endswith(token):
                return PASS
        return "no loopback"
    except OSError as exc:
        return _short(exc)
    finally:
        recv.close()
        send.close()


def secret(token_file: str | None) -> Check:
    path = token_file or os.environ.get("GPUSD_TOKEN_FILE")
    if not path:
        if os.environ.get("GPUSD_TOKEN"):
            return Check("secret", PASS, "from $GPUSD_TOKEN (prefer a file of mode 600: the environment is "
                         "readable by your other processes)")
        return Check("secret", SKIP, "no fleet secret (--token-file, $GPUSD_TOKEN_FILE): trust is off",
                     "for a fleet pool and private fields, share one secret: docs/security.md")
    try:
        st = os.stat(path)
    except OSError as exc:
        return Check("secret", FAIL, f"{path}: {_short(exc)}", "check the path")
    found = f"{path}: {_mode(st)} {_owner(st.st_uid)}"
    if st.st_mode & 0o077 or st.st_uid != os.geteuid():
        return Check("secret", FAIL, found + " (others may read it, or it is not yours)",
                     f"`chmod 600 {path}` as its owner")
    from .wire.signing import read_secret_file

    try:
        read_secret_file(path)
    except GpusdError as exc:
        return Check("secret", FAIL, f"{found}: {_short(exc)}", "write the secret again (docs/security.md)")
    return Check("secret", PASS, found)


def clock(info: dict[str, Any]) -> Check:
    """This clock against the sample times of the fleet's verified daemons, as the local daemon's fleet
    view holds them (each snapshot's time, on its host's clock, and when it arrived, on ours)."""

    bases = api_bases(info)
    if not bases:
        return Check("clock", SKIP, "no local daemon to ask for the fleet's times")
    from .wire.http import SourceError, fetch_json

    data: Any = None
    why = ""
    # loopback first where it serves every address, else the addresses it serves
    for base in bases:
        try:
            data = fetch_json(f"{base}/fleet", timeout=3).data
            break
        except SourceError as exc:
            why = _short(exc)
    else:
        return Check("clock", SKIP, f"the local daemon's fleet view did not answer ({why})")
    offsets: dict[str, float] = {}
    hosts = data.get("hosts") if isinstance(data, dict) else None
    for h in hosts if isinstance(hosts, list) else []:
        if not isinstance(h, dict) or h.get("verified") is not True:
            continue
        snap = h.get("snapshot")
        ts = snap.get("timestamp") if isinstance(snap, dict) else None
        seen = h.get("last_seen")
        if (isinstance(ts, (int, float)) and isinstance(seen, (int, float)) and not isinstance(ts, bool)
                and h.get("node_id") != info.get("node_id")):
            offsets[str(h.get("hostname"))[:64]] = round(float(ts) - float(seen), 1)
    if not offsets:
        return Check("clock", SKIP, "no other verified daemon in the fleet view to compare with")
    off = {k: v for k, v in offsets.items() if abs(v) > CLOCK_SKEW}
    found = ", ".join(f"{k} {v:+.1f}s" for k, v in offsets.items())
    if off:
        return Check("clock", FAIL, f"clocks differ by more than {CLOCK_SKEW:g} s: {found}",
                     "run an NTP client (chrony, systemd-timesyncd) on every host: signed requests allow a small "
                     "skew only", details={"offsets": offsets})
    return Check("clock", PASS, f"within {CLOCK_SKEW:g} s of {len(offsets)} verified host(s)",
                 details={"offsets": offsets})


def systemd_unit() -> Check:
    if not Path("/run/systemd/system").is_dir():
        return Check("systemd", SKIP, "systemd is not running here")
    for d in ("/etc/systemd/system", "/lib/systemd/system", "/usr/lib/systemd/system"):
        unit = Path(d) / "gpusd.service"
        if unit.is_file():
            text = unit.read_text(errors="replace")
            if "RuntimeDirectory=gpusd" not in text:
                return Check("systemd", FAIL, f"{unit} has no RuntimeDirectory=gpusd",
                             "the daemon cannot make /run/gpusd under ProtectSystem=strict: use docs/gpusd.service")
            return Check("systemd", PASS, f"{unit}")
    return Check("systemd", FAIL, "no gpusd.service unit", "install docs/gpusd.service as "
                 "/etc/systemd/system/gpusd.service and `systemctl enable --now gpusd`")


def _package_version(module: str) -> str | None:
    if importlib.util.find_spec(module) is None:
        return None
    try:
        return version(module)
    except PackageNotFoundError:
        return "?"


def _loads(lib: str) -> bool:
    try:
        ctypes.CDLL(lib)
        return True
    except OSError:
        return False


def _mode(st: os.stat_result) -> str:
    return stat.filemode(st.st_mode)


def _owner(uid: int) -> str:
    return owner_name(uid)


def _short(exc: BaseException) -> str:
    return for_terminal(str(exc) or type(exc).__name__, 160)
