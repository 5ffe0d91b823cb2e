"""Issue 17, attack 2: a second local uid holding flocks on everything in the lock directory, before/after.

    sudo python bench/bench_trust_locks.py [--before /tmp/base-worktree] [--hold sh|ex]

Needs root (it plays a second user, ``nobody``, with a forked child that drops to uid 65534).  For each
code version (this tree's ``src/``, and with ``--before`` the ``src/`` of another worktree, e.g. one of
commit 1d43830), a worker process on a fake NVML with 2 GPUs and a lock directory in a fresh
world-writable directory under /tmp:

1. leaves the lock directory as gpusd 0.2 does (``gpu-*.lock``, ``select.lock``, ``queue.seq``, mode 0666);
2. **daemon**: serves the lease socket in-process (the daemon's part, as root), takes one lease
   through it (so the daemon's own files exist), then lets ``nobody`` open every file it can under
   the lock directory and hold a flock on it (``--hold``: LOCK_SH, the default, or LOCK_EX), and
   times root's ``gpusd run -n 1 -- true`` (and, first, the same command with no attacker: the floor);
3. **no daemon** (``GPUSD_LEASE_SOCKET=off``), the same attack, the same command;
4. **no daemon, GPU locks only**: ``nobody`` holds only the ``gpu-*.lock`` files (not the mutex).

Printed per version and case: whether the command got a GPU (exit 0), how long it took, whether the
error and ``gpusd leases`` name the holder (its pid and uid), and the error's last line.  Every command
has a timeout (60 s); nothing leaves the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
NOBODY = 65534


def worker(hold: str) -> None:
    sys.path.insert(0, str(REPO / "bench"))
    sys.path.insert(0, str(REPO / "tests"))
    from _common import FakeEnv, make_gpus
    from other_user import AsUser

    fake = FakeEnv(make_gpus(2))
    shared = Path(tempfile.mkdtemp(prefix="gpusd-bench-locks-", dir="/tmp"))
    os.chmod(shared, 0o1777)
    locks = shared / "locks"
    fake.env["GPUSD_LOCK_DIR"] = str(locks)
    fake.activate_in_process()
    os.environ["GPUSD_LOCK_DIR"] = str(locks)
    env = dict(fake.env)
    flock_only = dict(env, GPUSD_LEASE_SOCKET="off")
    gpusd = [sys.executable, "-m", "gpusd"]

    def cli(args: list[str], e: dict[str, str]) -> tuple[subprocess.CompletedProcess[str], float]:
        t0 = time.monotonic()
        r = subprocess.run([*gpusd, *args], env=e, capture_output=True, text=True, timeout=60)
        return r, time.monotonic() - t0

    def hold_all(only_gpus: bool) -> object:
        import fcntl

        n = 0
        for where, _dirs, files in os.walk(locks):
            for name in files:
                if only_gpus and not name.startswith("gpu-"):
                    continue
                fd = -1
                for flags in (os.O_RDWR, os.O_RDONLY):
                    try:
                        fd = os.open(os.path.join(where, name), flags | os.O_NOFOLLOW | os.O_NONBLOCK)
                        break
                    except OSError:
                        continue
                if fd < 0:
                    continue
                try:
                    fcntl.flock(fd, (fcntl.LOCK_EX if hold == "ex" else fcntl.LOCK_SH) | fcntl.LOCK_NB)
                    n += 1
                except OSError:
                    os.close(fd)
        return n

    def attack(case: str, e: dict[str, str], only_gpus: bool = False) -> dict[str, object]:
        mallory = AsUser(NOBODY, lambda: hold_all(only_gpus), stay=True)
        try:
            r, took = cli(["run", "-n", "1", "--", "true"], e)
            leases, _ = cli(["leases"], e)
            who = f"uid {NOBODY}"
            last = (r.stderr.strip().splitlines() or [""])[-1]
            return {"case": case, "files_locked": mallory.result, "got_gpu": r.returncode == 0, "rc": r.returncode,
                    "seconds": round(took, 2),
                    "error_names_holder": str(mallory.pid) in r.stderr and (who in r.stderr or "nobody" in r.stderr),
                    "leases_names_holder": str(mallory.pid) in leases.stdout,
                    "message": last[:300]}
        finally:
            mallory.stop()

    try:
        assert cli(["run", "-n", "2", "--", "true"], flock_only)[0].returncode == 0
        assert cli(["run", "--wait", "--timeout", "10", "--", "true"], flock_only)[0].returncode == 0
        import asyncio
        import threading

        from gpusd.alloc.authority import socket_path
        from gpusd.daemon.leasesock import LeaseServer

        loop = asyncio.new_event_loop()
        server = LeaseServer(socket_path())  # type: ignore[arg-type]
        thread = threading.Thread(target=loop.run_forever, daemon=True)
        thread.start()
        asyncio.run_coroutine_threadsafe(server.start(), loop).result(30)
        try:
            assert cli(["run", "-n", "2", "--", "true"], env)[0].returncode == 0
            r, took = cli(["run", "-n", "1", "--", "true"], env)  # the floor: the same command, no attacker
            results: list[dict[str, object]] = [{
                "case": "daemon, no attack (floor)", "files_locked": 0, "got_gpu": r.returncode == 0,
                "rc": r.returncode, "seconds": round(took, 2), "error_names_holder": False,
                "leases_names_holder": False, "message": ""}]
            results.append(attack("daemon", env))
        finally:
            asyncio.run_coroutine_threadsafe(server.stop(), loop).result(30)
            loop.call_soon_threadsafe(loop.stop)
            thread.join(10)
        results.append(attack("no daemon", flock_only))
        results.append(attack("no daemon, GPU locks only", flock_only, only_gpus=True))
        for row in results:
            print(json.dumps(row), flush=True)
    finally:
        shutil.rmtree(shared, ignore_errors=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--before", type=Path, help="a worktree of the code before (e.g. commit 1d43830)")
    ap.add_argument("--hold", choices=("sh", "ex"), default="sh", help="nobody's locks: LOCK_SH (default) or LOCK_EX")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args.hold)
        return 0
    if os.geteuid() != 0:
        print("needs root (it plays a second user, nobody)", file=sys.stderr)
        return 2
    versions = [("after", REPO / "src")]
    if args.before is not None:
        versions.insert(0, ("before", args.before / "src"))
    print(f"attack 2: uid {NOBODY} (nobody) holds {'LOCK_EX' if args.hold == 'ex' else 'LOCK_SH'} on every file "
          "it can open in the lock directory; root runs `gpusd run -n 1 -- true` (2 GPUs, fake NVML)")
    print("| version | case | files nobody locked | root got a GPU | time | error names pid+uid | "
          "`gpusd leases` names pid | message |")
    print("|---|---|---|---|---|---|---|---|")
    for name, src in versions:
        env = dict(os.environ, PYTHONPATH=str(src))
        r = subprocess.run([sys.executable, __file__, "--worker", "--hold", args.hold], env=env, capture_output=True,
                           text=True, timeout=300)
        rows = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
        if not rows:
            print(f"| {name} | worker failed: {r.stderr.strip().splitlines()[-1:]} |")
        for row in rows:
            got = "yes" if row["got_gpu"] else f"no (exit {row['rc']})"
            print(f"| {name} | {row['case']} | {str(row['files_locked']).removeprefix('ok ')} | "
                  f"{got} | {row['seconds']:.2f} s | "
                  f"{'yes' if row['error_names_holder'] else ('-' if row['got_gpu'] else 'no')} | "
                  f"{'yes' if row['leases_names_holder'] else 'no'} | {row['message'] or '-'} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
