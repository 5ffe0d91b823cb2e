#!/usr/bin/env python3
"""The fault campaign (docs/faults.md): gpusd's leases under the faults real machines see, checked offline.

Root daemons serve fake NVIDIA GPUs (tests/fakenvml) as the lease authorities of a namespace LAN
(tests/netns.py); short jobs run through every path a user has (local ``gpusd run``, ``run --wait``,
``run --fleet`` over SSH from another namespace host, ``reserve`` from that host and a command run under
the reservation) while a seeded random schedule of faults hits the daemons: kill -9 and restart,
SIGSTOP/SIGCONT, the link down for less or more than the TTL, a full disk under the state and lock
directories, blanked or overwritten lease records, a second daemon on the same lock directory, and a
wall-clock step of the daemon (libfaketime).  Each job's command writes its own start and end lines
(``time.monotonic_ns()``, one clock for every namespace, and the GPUs it was given) to a job log; the
campaign also writes what each launcher said, every fault, and the leases each host showed twice a
second.  bench/faults_check.py then checks those records, after the fact: double grants, lost jobs,
lost leases, leases that outlived their holder, jobs missing from the usage history.  It prints a table
per fault kind and exits 1 on any violation (2: could not run).

    sudo python3 bench/bench_faults.py --duration 1800 --seed 7 --hosts 3

Everything stays inside the namespaces; every process is stopped by its pid and every namespace deleted,
on Ctrl-C too; the tmpfs disks live in a private mount namespace (the campaign re-executes itself under
``unshare --mount``) and vanish with it.
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import random
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
from typing import Any

REPO = Path(__file__).resolve().parent.parent
for _p in (REPO / "tests", REPO / "bench"):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

import faults_check  # noqa: E402
from fakenvml import fake_uuid, make_gpus  # noqa: E402

FAULT_KINDS = ("kill9", "sigstop", "split_short", "split_long", "disk_full", "corrupt", "second_daemon",
               "clock_step")
JOB_KINDS = ("run", "wait", "fleet", "reserve")
FAKETIME_LIBS = ("/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1",
                 "/usr/lib/aarch64-linux-gnu/faketime/libfaketime.so.1",
                 "/usr/lib/faketime/libfaketime.so.1", "/usr/local/lib/faketime/libfaketime.so.1")
MNT_MARK = "GPUSD_FAULTS_PRIVATE_MNT"

JOB_SCRIPT = r'''
import json, os, signal, sys, time
log, job, dur = sys.argv[1], sys.argv[2], float(sys.argv[3])
def line(ev, **kw):
    rec = {"ev": ev, "job": job, "pid": os.getpid(), "t": time.monotonic_ns(), "wall": time.time(),
           "cvd": os.environ.get("CUDA_VISIBLE_DEVICES", ""), "epoch": os.environ.get("GPUSD_LEASE_EPOCH"),
           "net": str(os.stat("/proc/self/ns/net").st_ino), **kw}
    fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (json.dumps(rec) + "\n").encode())
    finally:
        os.close(fd)
def stopped(signum, frame):
    line("end", how=signal.Signals(signum).name)
    os._exit(128 + signum)
signal.signal(signal.SIGTERM, stopped)
signal.signal(signal.SIGHUP, stopped)
line("start")
time.sleep(dur)
line("end", how="end")
'''

POLLER = r'''
import json, os, sys, time
from gpusd.alloc.leases import LeaseStore
dirs, every = json.loads(sys.argv[1]), float(sys.argv[2])
while True:
    for host, d in dirs.items():
        os.environ["GPUSD_LOCK_DIR"] = d
        t = time.monotonic_ns()
        try:
            rec = {"t": t, "host": host, "ok": True,
                   "leases": [{"device": le.device, "lease_id": le.lease_id, "pid": le.pid}
                              for le in LeaseStore().leases() if not getattr(le, "unleased", False)]}
        except Exception as exc:
            rec = {"t": t, "host": host, "ok": False, "error": repr(exc)[:200]}
        print(json.dumps(rec), flush=True)
    time.sleep(every)
'''


def now() -> int:
    return time.monotonic_ns()


def faketime_lib() -> str | None:
    return next((p for p in FAKETIME_LIBS if os.path.exists(p)), None)


@dataclass
class Host:
    """One GPU host of the campaign: its namespace daemon, its tmpfs disk and what it needs to restart."""

    name: str
    gpu: Any  # netns.GpuHost
    disk: Path
    log: Path
    clock: Path | None  # libfaketime's offset file, when the clock_step kind runs
    uuids: list[str]
    lock: threading.Lock = field(default_factory=threading.Lock)  # one fault at a time touches the daemon


class Campaign:
    def __init__(self, args: argparse.Namespace, out: Path) -> None:
        self.args = args
        self.out = out
        self.rng = random.Random(args.seed)
        self.stop = threading.Event()
        self.faults_on = threading.Event()
        self.records: dict[str, list[dict[str, Any]]] = {"launches": [], "faults": [], "leases": []}
        self.rec_lock = threading.Lock()
        self.hosts: list[Host] = []
        self.lan: Any = None
        self.ssh: Any = None
        self.poller: subprocess.Popen[str] | None = None
        self.mounts: list[Path] = []
        self.job_log = out / "jobs.jsonl"
        self.script = out / "job.py"
        self.script.write_text(JOB_SCRIPT)
        self.key = out / "fleet.key"
        fd = os.open(self.key, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32) + "\n")
        self.seq = 0
        self.skipped: dict[str, str] = {}
        self.renewers: set[int] = set()  # reservations' renewers (they detach from their launcher)

    # -- records ------------------------------------------------------------------------------------
    def record(self, what: str, rec: dict[str, Any]) -> None:
        with self.rec_lock:
            self.records[what].append(rec)
            with open(self.out / f"{what}.jsonl", "a") as f:
                f.write(json.dumps(rec) + "\n")

    def next_job(self) -> str:
        with self.rec_lock:
            self.seq += 1
            return f"j{self.seq:05d}"

    # -- the LAN ------------------------------------------------------------------------------------
    def setup(self) -> None:
        from netns import Lan

        a = self.args
        self.lan = Lan(tag="flt", workdir=self.out / "lan")
        clock_lib = faketime_lib() if "clock_step" in a.kinds else None
        for i in range(a.hosts):
            name = f"node-{i + 1}"
            gpus = make_gpus(a.gpus)
            for k, g in enumerate(gpus):  # unique across hosts: a job's GPUs name its host
                g.uuid = fake_uuid(k, seed=f"campaign-{a.seed}-{name}")
            node_name = f"h{i + 1}"
            disk = self.out / f"{node_name}-disk"
            disk.mkdir()
            self.mount_tmpfs(disk, a.disk_mib)
            (disk / "state").mkdir()
            sock = self.out / f"{node_name}-lease.sock"
            env = {"GPUSD_LEASE_SOCKET": str(sock), "GPUSD_LOCK_DIR": str(disk / "locks")}
            gh = self.lan.add_gpu_host(name, gpus, fast=True, node_name=node_name,
                                       args=["--token-file", str(self.key), "--interval", "0.5"], extra_env=env)
            gh.state_dir = disk / "state"
            gh.env["GPUSD_STATE_DIR"] = str(gh.state_dir)
            clock = None
            if clock_lib is not None:
                clock = self.out / f"{node_name}-faketime"
                clock.write_text("+0\n")
            h = Host(name, gh, disk, self.out / f"{node_name}-gpusd.log", clock, [g.uuid for g in gpus if g.uuid])
            self.hosts.append(h)
        if "clock_step" in a.kinds and clock_lib is None:
            self.skipped["clock_step"] = "libfaketime is not installed (apt-get install faketime)"
        threads = [threading.Thread(target=self.start_daemon, args=(h,)) for h in self.hosts]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for h in self.hosts:
            if h.gpu.proc is None or h.gpu.proc.poll() is not None:
                raise RuntimeError(f"daemon {h.name} did not start:\n{self.tail(h)}")
        self.client = self.lan.add_node("client")
        if "fleet" in a.jobs:
            from sshd import SshFleet, unavailable

            why = unavailable()
            if why:
                self.skipped["fleet"] = why
            else:
                bin_dir = str(Path(sys.executable).parent)
                there = {h.name: {"PATH": f"{bin_dir}:/usr/sbin:/usr/bin:/sbin:/bin", "PYTHONPATH": str(REPO / "src"),
                                  "GPUSD_LOCK_DIR": h.gpu.env["GPUSD_LOCK_DIR"],
                                  "GPUSD_LEASE_SOCKET": h.gpu.env["GPUSD_LEASE_SOCKET"]} for h in self.hosts}
                self.ssh = SshFleet(self.lan, [(h.gpu.node, h.name) for h in self.hosts], workdir=self.out / "ssh",
                                    host_env=there)  # started: one sshd per host
        dirs = {h.name: h.gpu.env["GPUSD_LOCK_DIR"] for h in self.hosts}
        env = dict(os.environ, PYTHONPATH=str(REPO / "src"))
        self.poller = subprocess.Popen([sys.executable, "-c", POLLER, json.dumps(dirs), "0.5"], env=env,
                                       stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                                       stdin=subprocess.DEVNULL)
        threading.Thread(target=self.read_poller, daemon=True).start()

    def mount_tmpfs(self, path: Path, mib: int) -> None:
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={mib}m,mode=0755", "tmpfs", str(path)],
                           capture_output=True, text=True, timeout=30)
        if r.returncode != 0:
            raise RuntimeError(f"mount tmpfs on {path}: {r.stderr.strip()}")
        self.mounts.append(path)

    def daemon_env(self, h: Host) -> dict[str, str]:
        env = dict(h.gpu.env)
        lib = faketime_lib()
        if h.clock is not None and lib is not None:
            # only the wall clock steps: the monotonic clock is the one leases must run on
            env.update(LD_PRELOAD=lib, FAKETIME_TIMESTAMP_FILE=str(h.clock), FAKETIME_DONT_FAKE_MONOTONIC="1",
                       FAKETIME_CACHE_DURATION="1")
        return env

    def start_daemon(self, h: Host, state_dir: Path | None = None, log: Path | None = None,
                     timeout: float = 60.0, extra: tuple[str, ...] = ()) -> subprocess.Popen[bytes] | None:
        """``gpusd start --foreground`` in the host's namespace; the process once it said it is ready,
        None if it did not (it is then stopped)."""
        from netns import read_lines

        gh = h.gpu
        r, w = os.pipe()
        argv = [sys.executable, "-m", "gpusd", "start", "--foreground", "--interface", gh.ip, "--session",
                gh.session, "--hostname", gh.hostname, "--state-dir", str(state_dir or gh.state_dir), *gh.args,
                *extra, "--ready-fd", str(w)]
        with open(log or h.log, "ab") as f:
            try:
                p = self.lan.popen(gh.node, argv, env=self.daemon_env(h), stdout=f, stderr=f, pass_fds=(w,))
            finally:
                os.close(w)
        try:
            ready = read_lines(r, 1, timeout)
        finally:
            os.close(r)
        if not ready or not ready[0]:
            self.kill(p)
            return None
        if state_dir is None:
            gh.proc = p
        return p

    def kill(self, p: subprocess.Popen[Any], sig: int = signal.SIGKILL) -> None:
        if p.poll() is None:
            try:
                p.send_signal(sig)
            except ProcessLookupError:
                pass
        try:
            p.wait(15)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(5)

    def tail(self, h: Host, n: int = 20) -> str:
        try:
            return "\n".join(h.log.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no log)"

    def read_poller(self) -> None:
        assert self.poller is not None and self.poller.stdout is not None
        for raw in self.poller.stdout:
            try:
                rec = json.loads(raw)
            except ValueError:
                continue
            if self.faults_on.is_set() or not self.stop.is_set():
                self.record("leases", rec)

    # -- jobs ---------------------------------------------------------------------------------------
    def job_argv(self, job: str, dur: float) -> list[str]:
        return [sys.executable, str(self.script), str(self.job_log), job, f"{dur:.2f}"]

    def communicate(self, p: subprocess.Popen[str], timeout: float) -> tuple[int | None, str, str]:
        try:
            out, err = p.communicate(timeout=timeout)
            return p.returncode, out or "", err or ""
        except subprocess.TimeoutExpired:
            self.kill(p)
            out, err = p.communicate()
            return None, out or "", (err or "") + f"\n(campaign: the launcher hung past {timeout:.0f} s, killed)"

    def launch(self, kind: str, rng: random.Random) -> None:
        a = self.args
        job, dur = self.next_job(), rng.uniform(a.job_min, a.job_max)
        bound = dur + 90
        rec: dict[str, Any] = {"job": job, "kind": kind, "t0": now()}
        gpusd = [sys.executable, "-m", "gpusd"]
        if kind in ("run", "wait"):
            h = rng.choice(self.hosts)
            rec["host"] = h.name
            wait = ["--wait", "--timeout", "30"] if kind == "wait" else []
            p = self.lan.popen(h.gpu.node, [*gpusd, "run", "-n", "1", "--uuid", *wait, "--", *self.job_argv(job, dur)],
                               env=h.gpu.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            rc, _, err = self.communicate(p, bound)
        elif kind == "fleet":
            env = self.ssh.env(self.client, GPUSD_MDNS_FAST="1")
            p = self.lan.popen(self.client, [*gpusd, "run", "--fleet", "-n", "1", "--uuid", "--ttl", str(a.ttl),
                                             "--token-file", str(self.key), "--", *self.job_argv(job, dur)],
                               env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            rc, _, err = self.communicate(p, bound)
        else:
            rc, err = self.reserve(job, dur, rec)
        rec.update(t1=now(), rc=rc, reason=last_line(err))
        rec.setdefault("holder_end", rec["t1"])
        self.record("launches", rec)

    def reserve(self, job: str, dur: float, rec: dict[str, Any]) -> tuple[int | None, str]:
        """``gpusd reserve`` from the client host, the job run on the reserved host with the reserved
        GPUs, then ``gpusd release``; the holder (the reservation's renewer) is gone at the end."""
        a = self.args
        env = self.lan.base_env(self.client, GPUSD_MDNS_FAST="1")
        tok = ["--token-file", str(self.key)]
        p = self.lan.popen(self.client, [sys.executable, "-m", "gpusd", "reserve", "-n", "1", "--ttl", str(a.ttl),
                                         "--for", "300s", "--json", *tok],
                           env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        rc, out, err = self.communicate(p, 60)
        if rc != 0:
            return rc, err
        try:
            res = json.loads(out)
            lease = res["leases"][0]
            lease_id, renewer = str(lease["lease_id"]), int(res["renewer_pid"])
            uuids = [str(d["uuid"]) for d in lease["devices"]]
            h = next(x for x in self.hosts if x.name == res["host"])
        except (ValueError, KeyError, IndexError, TypeError, StopIteration) as exc:
            return 1, f"campaign: unreadable reservation ({exc!r}): {out[:200]}"
        rec.update(host=h.name, lease_id=lease_id)
        with self.rec_lock:
            self.renewers.add(renewer)
        # the job runs as a user runs it, with the variables `gpusd reserve` gives (GPUSD_LEASE names the
        # lease its processes run under: the host's daemon fences them if the lease ends without a release)
        given = lease.get("env") if isinstance(lease.get("env"), dict) else {}
        lease_vars = {k: str(v) for k, v in given.items() if k in ("GPUSD_LEASE", "GPUSD_LEASE_EPOCH")}
        jenv = self.lan.base_env(h.gpu.node, CUDA_VISIBLE_DEVICES=",".join(uuids), **lease_vars)
        jp = self.lan.popen(h.gpu.node, self.job_argv(job, dur), env=jenv, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
        jrc, _, jerr = self.communicate(jp, dur + 30)
        r = self.lan.popen(self.client, [sys.executable, "-m", "gpusd", "release", lease_id, *tok], env=env,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        rrc, _, rerr = self.communicate(r, 60)
        deadline = time.monotonic() + 10
        while pid_alive(renewer) and time.monotonic() < deadline:
            time.sleep(0.1)
        if pid_alive(renewer):  # a release that did not end the renewer: end it (its lease then expires)
            try:
                os.kill(renewer, signal.SIGKILL)
            except ProcessLookupError:
                pass
            rerr += f"\n(campaign: renewer {renewer} outlived the release; killed)"
        rec["holder_end"] = now()
        with self.rec_lock:
            self.renewers.discard(renewer)
        if jrc != 0:
            return jrc, jerr
        return (0 if rrc == 0 else rrc), ("" if rrc == 0 else rerr)

    def worker(self, seed: int) -> None:
        rng = random.Random(seed)
        kinds = [k for k in self.args.jobs if k not in self.skipped]
        while not self.stop.is_set():
            try:
                self.launch(rng.choice(kinds), rng)  # each worker its own seeded generator
            except Exception as exc:  # the campaign's own failure: recorded, the worker goes on
                self.record("launches", {"job": self.next_job(), "kind": "error", "t0": now(), "t1": now(),
                                         "rc": None, "reason": f"campaign error: {exc!r}"[:300]})
                time.sleep(0.5)

    # -- faults -------------------------------------------------------------------------------------
    def inject(self, kind: str, h: Host) -> dict[str, Any]:
        a, rng = self.args, self.rng
        extra: dict[str, Any] = {}
        gh = h.gpu
        if kind == "kill9":
            assert gh.proc is not None
            self.kill(gh.proc)
            time.sleep(rng.uniform(0.5, 3.0))
            extra["restarted"] = self.start_daemon(h) is not None
        elif kind == "sigstop":
            assert gh.proc is not None
            os.kill(gh.proc.pid, signal.SIGSTOP)
            try:
                time.sleep(rng.uniform(1.0, max(1.5, 0.6 * a.ttl)))
            finally:
                os.kill(gh.proc.pid, signal.SIGCONT)
        elif kind in ("split_short", "split_long"):
            gh.unplug()
            try:
                time.sleep(rng.uniform(1.0, max(1.5, 0.5 * a.ttl)) if kind == "split_short"
                           else a.ttl * 1.5 + rng.uniform(0, 2))
            finally:
                gh.plug()
        elif kind == "disk_full":
            filler = h.disk / "filler"
            extra["filled_bytes"] = fill(filler)
            try:
                time.sleep(rng.uniform(2.0, 4.0))
            finally:
                filler.unlink(missing_ok=True)
        elif kind == "corrupt":
            extra["records"] = corrupt(Path(gh.env["GPUSD_LOCK_DIR"]), rng)
            time.sleep(a.job_max)  # a damaged record lasts as long as its lease: this is its window
        elif kind == "second_daemon":
            second = self.out / f"{gh.node.name}-second-{now()}"
            second.mkdir()
            # its own ports (the first holds 4780/4781 in this namespace): only the lock directory is shared
            p = self.start_daemon(h, state_dir=second, log=self.out / f"{gh.node.name}-second.log",
                                  extra=("--port", "0", "--tls-port", "0"))
            extra["second_started"] = p is not None
            if p is not None:
                time.sleep(rng.uniform(2.0, 4.0))
                self.kill(p, signal.SIGTERM)
        elif kind == "clock_step":
            assert h.clock is not None
            step = rng.choice((-1, 1)) * int(a.ttl * 3 + rng.uniform(0, 60))
            extra["step_s"] = step
            write_atomic(h.clock, f"{step:+d}\n")
            try:
                time.sleep(rng.uniform(3.0, 6.0))
            finally:
                write_atomic(h.clock, "+0\n")  # and back: a second step
            time.sleep(1.5)  # libfaketime rereads the file at most once a second
        if gh.proc is None or gh.proc.poll() is not None:  # a daemon that died of the fault: restarted
            extra["died"] = True
            self.start_daemon(h)
        return extra

    def fault_loop(self) -> None:
        a = self.args
        kinds = [k for k in a.kinds if k not in self.skipped]
        if not kinds:
            return
        time.sleep(min(5.0, a.gap))
        bag: list[str] = []
        while not self.stop.wait(self.rng.uniform(0.5 * a.gap, 1.5 * a.gap)):
            if not bag:  # every kind once per round, in a seeded order: even a short run sees each
                bag = self.rng.sample(kinds, len(kinds))
            kind, h = bag.pop(), self.rng.choice(self.hosts)
            t0 = now()
            with h.lock:
                try:
                    extra = self.inject(kind, h)
                except Exception as exc:
                    extra = {"error": repr(exc)[:300]}
            self.record("faults", {"kind": kind, "host": h.name, "t0": t0, "t1": now(), **extra})

    # -- the run ------------------------------------------------------------------------------------
    def run(self) -> faults_check.Report:
        a = self.args
        self.setup()
        self.faults_on.set()
        start = time.monotonic()
        workers = [threading.Thread(target=self.worker, args=(a.seed * 1000 + i,), daemon=True)
                   for i in range(a.workers)]
        faults = threading.Thread(target=self.fault_loop, daemon=True)
        for t in [*workers, faults]:
            t.start()
        n_kinds = len([k for k in a.kinds if k not in self.skipped])
        while True:
            elapsed = time.monotonic() - start
            with self.rec_lock:
                injected = len(self.records["faults"])
            short = injected < a.min_rounds * n_kinds  # every kind its --min-rounds, within 3 x --duration
            if elapsed >= a.duration and not (short and elapsed < 3 * a.duration):
                break
            time.sleep(0.5)
        self.stop.set()
        faults.join(120)
        for t in workers:
            t.join(a.job_max + 150)
        # let the last leases end (TTL + delay), still watched, then stop watching
        time.sleep(min(a.ttl + a.delay, 10.0))
        self.faults_on.clear()
        horizon = now()
        history = self.history() if not a.no_history else None
        meta = {"gpu_host": {u: h.name for h in self.hosts for u in h.uuids},
                # a job that got indices (not UUIDs) names its host by its network namespace
                "indices": {str(os.stat(f"/run/netns/{h.gpu.node.ns}").st_ino): dict(enumerate(h.uuids))
                            for h in self.hosts},
                "ttl": a.ttl, "delay": a.delay, "horizon": horizon, "sample": a.history_sample, "seed": a.seed,
                "kinds": [k for k in a.kinds if k not in self.skipped]}
        (self.out / "meta.json").write_text(json.dumps(meta))
        if history is not None:
            (self.out / "history.json").write_text(json.dumps(history))
        return recheck(self.out)

    def history(self) -> list[dict[str, Any]]:
        """Every job record of every host's usage history, once its daemon stopped (so all is written)."""
        import sqlite3

        rows: list[dict[str, Any]] = []
        for h in self.hosts:
            if h.gpu.proc is not None:
                self.kill(h.gpu.proc, signal.SIGTERM)
            db = h.gpu.state_dir / "history.sqlite"
            if not db.exists():
                continue
            try:  # kept with the records: the tmpfs goes with the campaign
                shutil.copyfile(db, self.out / f"{h.gpu.node.name}-history.sqlite")
            except OSError:
                pass
            try:
                conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5)
                try:
                    for gpus, st, last, ended in conn.execute("SELECT gpus, start, last, ended FROM jobs"):
                        try:
                            rows.append({"host": h.name, "gpus": json.loads(gpus), "start": st, "last": last,
                                         "ended": ended})
                        except ValueError:
                            continue
                finally:
                    conn.close()
            except sqlite3.Error as exc:
                print(f"history of {h.name} unreadable: {exc}", file=sys.stderr)
        return rows

    def close(self) -> None:
        self.stop.set()
        with self.rec_lock:
            left = list(self.renewers)
        for pid in left:  # still ours: its command line names the reservation's renewer
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    if b"gpusd" in f.read():
                        os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        if self.poller is not None:
            self.kill(self.poller, signal.SIGTERM)
        if self.ssh is not None:
            self.ssh.close()
        if self.lan is not None:
            self.lan.close()  # every process it started, by pid; then the namespaces
        for m in self.mounts:
            subprocess.run(["umount", "-l", str(m)], capture_output=True, timeout=30)


def recheck(out: Path) -> faults_check.Report:
    """The checks on a campaign's records in ``out`` (what ``--recheck DIR`` runs)."""
    meta = json.loads((out / "meta.json").read_text())
    indices = {net: {str(i): u for i, u in table.items()} for net, table in meta["indices"].items()}
    lines = faults_check.resolve_indices(faults_check.read_jsonl(out / "jobs.jsonl"), indices)
    hist = out / "history.json"
    history = json.loads(hist.read_text()) if hist.exists() else None
    rd = faults_check.read_jsonl
    return faults_check.check(lines, rd(out / "launches.jsonl"), rd(out / "faults.jsonl"), rd(out / "leases.jsonl"),
                              history, meta["gpu_host"], meta["ttl"], meta["delay"], meta["horizon"],
                              sample=meta["sample"], seed=meta["seed"], kinds=meta["kinds"])


def last_line(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return lines[-1][:300] if lines else ""


def pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[-1].split()[0] != "Z"
    except OSError:
        return False


def write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def fill(path: Path) -> int:
    """Write ``path`` until the file system is full; the bytes written."""
    n = 0
    chunk = b"\0" * (1 << 20)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    try:
        while True:
            try:
                n += os.write(fd, chunk[: max(4096, len(chunk) if n < (1 << 34) else 0)])
            except OSError as exc:
                if exc.errno != errno.ENOSPC:
                    raise
                if len(chunk) <= 4096:
                    return n
                chunk = chunk[: len(chunk) // 16]
    finally:
        os.close(fd)


def corrupt(lock_dir: Path, rng: random.Random) -> list[str]:
    """Blank or overwrite with junk up to two lease records of the host (the shared lock directory and
    the authority's own); the names done."""
    records = sorted(p for d in (lock_dir, lock_dir / "authority") if d.is_dir() for p in d.glob("lease-*.json"))
    done = []
    for p in rng.sample(records, min(2, len(records))):
        junk = b"" if rng.random() < 0.5 else bytes(rng.randrange(256) for _ in range(rng.randrange(1, 200)))
        try:
            fd = os.open(p, os.O_WRONLY | os.O_TRUNC | os.O_NOFOLLOW)
        except OSError:
            continue  # ended meanwhile
        try:
            os.write(fd, junk)
        finally:
            os.close(fd)
        done.append(f"{p.parent.name}/{p.name}:{'blank' if not junk else 'junk'}")
    return done


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    ap.add_argument("--duration", type=float, default=120.0, help="seconds of jobs and faults (default 120)")
    ap.add_argument("--seed", type=int, default=1, help="the schedule's seed (default 1)")
    ap.add_argument("--hosts", type=int, default=2, help="GPU hosts (default 2)")
    ap.add_argument("--gpus", type=int, default=2, help="GPUs per host (default 2)")
    ap.add_argument("--workers", type=int, default=0, help="jobs launched at once (default hosts x GPUs + 1)")
    ap.add_argument("--fault-kinds", default=",".join(FAULT_KINDS),
                    help=f"comma-separated, from {','.join(FAULT_KINDS)} (default all; 'none': no faults)")
    ap.add_argument("--job-kinds", default=",".join(JOB_KINDS), help=f"comma-separated, from {','.join(JOB_KINDS)}")
    ap.add_argument("--min-rounds", type=int, default=0,
                    help="go on past --duration (up to 3 x) until every fault kind ran this many times (default 0)")
    ap.add_argument("--gap", type=float, default=6.0, help="mean seconds between faults (default 6)")
    ap.add_argument("--ttl", type=float, default=4.0, help="TTL of remote leases, s (default 4)")
    ap.add_argument("--delay", type=float, default=10.0,
                    help="the documented delay past the TTL before a lease of a gone holder must be gone (default 10)")
    ap.add_argument("--job-min", type=float, default=2.0)
    ap.add_argument("--job-max", type=float, default=7.0, help="jobs last --job-min to --job-max s (default 2 to 7: "
                    "longer than the TTL, so a cut-off holder's job outlives its lease)")
    ap.add_argument("--disk-mib", type=int, default=64, help="size of each host's state/lock tmpfs (default 64)")
    ap.add_argument("--history-sample", type=int, default=50, help="jobs checked against the history (default 50)")
    ap.add_argument("--no-history", action="store_true", help="do not check the usage history")
    ap.add_argument("--out", type=Path, help="keep the records here (default: a temporary directory, removed "
                                              "when nothing was violated)")
    ap.add_argument("--json", action="store_true", help="end with one JSON line of the counts")
    ap.add_argument("--recheck", type=Path, metavar="DIR",
                    help="run only the checks, on the records a campaign kept in DIR (no root needed)")
    a = ap.parse_args(argv)
    a.kinds = [] if a.fault_kinds.strip() == "none" else [k.strip() for k in a.fault_kinds.split(",") if k.strip()]
    a.jobs = [k.strip() for k in a.job_kinds.split(",") if k.strip()]
    for k in a.kinds:
        if k not in FAULT_KINDS:
            ap.error(f"unknown fault kind {k!r} (known: {', '.join(FAULT_KINDS)})")
    for k in a.jobs:
        if k not in JOB_KINDS:
            ap.error(f"unknown job kind {k!r} (known: {', '.join(JOB_KINDS)})")
    if not a.jobs or a.hosts < 1 or a.gpus < 1 or a.duration <= 0 or not 0 < a.job_min <= a.job_max:
        ap.error("needs a job kind, --hosts and --gpus >= 1, --duration > 0 and 0 < --job-min <= --job-max")
    a.workers = a.workers or a.hosts * a.gpus + 1
    return a


def private_mounts(argv: list[str]) -> int | None:
    """Run again in a private mount namespace (the tmpfs disks never show outside it); its exit status,
    or None when this already is that run."""
    if os.environ.get(MNT_MARK) == "1":
        return None
    if shutil.which("unshare") is None:
        print("bench_faults: needs unshare (util-linux)", file=sys.stderr)
        return 2
    env = dict(os.environ, **{MNT_MARK: "1"})
    # --kill-child: if unshare itself is killed, the campaign gets SIGTERM and cleans up
    p = subprocess.Popen(["unshare", "--mount", "--propagation", "private", "--fork", "--kill-child=SIGTERM",
                          sys.executable, __file__, *argv], env=env)

    stopped: list[int] = []

    def terminated(signum: int, frame: Any) -> None:
        stopped.append(signum)
        p.kill()  # unshare's end sends the campaign SIGTERM (--kill-child): it cleans up

    signal.signal(signal.SIGTERM, terminated)
    while True:
        try:
            rc = p.wait()
            return 128 + signal.SIGTERM if stopped else rc
        except KeyboardInterrupt:  # the child got it too (same terminal group): wait for its clean-up
            continue


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.recheck is not None:
        try:
            report = recheck(args.recheck)
        except (OSError, ValueError, KeyError) as exc:
            print(f"bench_faults: no campaign records in {args.recheck}: {exc}", file=sys.stderr)
            return 2
        return show(report, args, args.recheck, {})
    from netns import unavailable

    why = unavailable()
    if why:
        print(f"bench_faults: cannot run: {why}", file=sys.stderr)
        return 2
    rc = private_mounts(argv)
    if rc is not None:
        return rc

    def terminated(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, terminated)
    out = args.out or Path(tempfile.mkdtemp(prefix="gpusd-faults-"))
    out.mkdir(parents=True, exist_ok=True)
    camp = Campaign(args, out)
    report: faults_check.Report | None = None
    try:
        report = camp.run()
    except KeyboardInterrupt:
        print("bench_faults: interrupted; cleaning up", file=sys.stderr)
        return 130
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):  # a second Ctrl-C must not cut the clean-up short
            signal.signal(sig, signal.SIG_IGN)
        camp.close()
    if report.total() == 0 and args.out is None:
        shutil.rmtree(out, ignore_errors=True)
    return show(report, args, out, camp.skipped)


def show(report: faults_check.Report, args: argparse.Namespace, out: Path, skipped: dict[str, str]) -> int:
    """Print the table and the violations (and with ``--json`` a last line of counts); the exit status."""
    for kind, why in skipped.items():
        print(f"skipped {kind}: {why}")
    print(report.table())
    for v in report.violations[:40]:
        print(f"  {v.what}: {v.detail} [{', '.join(v.faults) or 'no fault'}]")
    if len(report.violations) > 40:
        print(f"  ... {len(report.violations) - 40} more in {out}")
    if report.total():
        print(f"records kept in {out}")
    if args.json:  # the last line
        print(json.dumps({"violations": report.total(), "counts": report.counts(), "injected": report.injected,
                          "jobs": report.jobs, "started": report.started, "skipped": skipped,
                          "records": str(out)}))
    return 1 if report.total() else 0


if __name__ == "__main__":
    sys.exit(main())
