"""Issue 17, attack 1: a stranger without the fleet secret copies a real daemon's announcement under a
name of its choosing.  Does the name get the "verified" label, an ssh connection, a hostfile line?

On a LAN of network namespaces (tests/netns.py): one daemon ``node-1`` (2 fake GPUs, fleet secret, TLS
on), a client holding the secret, and a stranger (tests/copycat.py) that re-announces node-1's TXT
(node id, address, port, TLS fingerprint) under another service name with ``host=NAME``, for each of
the three names of the issue, one at a time.  For each name the client runs

* ``gpusd list --json``: is NAME listed with ``"verified": true``?
* ``gpusd run --fleet -n 1 -- python train.py --wandb-key=SECRET`` with a logging fake ``ssh`` on PATH:
  is NAME the ssh target?
* ``gpusd hostfile -n 1 --format mpi -- true``: is NAME in the hostfile (and did the command work)?

``--src DIR`` runs every gpusd process (daemon, client) from that source tree instead of this one, for
the "before" figures: ``git worktree add /tmp/base 1d43830`` then ``--src /tmp/base/src``.  Namespaces
only, bounded (about a minute; every command has a timeout).  Root and ``ip netns`` needed.

    sudo python3 bench/bench_trust_names.py [--src DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import REPO, make_gpus  # noqa: E402

sys.path.insert(0, str(REPO / "tests"))
from netns import Lan, Node, read_lines, unavailable  # noqa: E402

NAMES = ["aaa-evil.example.com", "attacker@198.18.0.2", "ssh://victim@198.18.0.2:2222"]
BIN = str(Path(sys.executable).parent)


def fake_ssh(bindir: Path, log: Path) -> None:
    bindir.mkdir(parents=True, exist_ok=True)
    script = bindir / "ssh"
    script.write_text(f"#!{sys.executable}\nimport json, sys\n"
                      f"with open({str(log)!r}, 'a') as f:\n    f.write(json.dumps(sys.argv[1:]) + '\\n')\n")
    script.chmod(0o755)


def ssh_targets(log: Path) -> list[str]:
    if not log.exists():
        return []
    calls = [json.loads(ln) for ln in log.read_text().splitlines()]
    return [argv[argv.index("--") + 1] for argv in calls if "--" in argv]


def with_src(env: dict[str, str], src: str | None) -> dict[str, str]:
    if src:
        env = dict(env, PYTHONPATH=src)
    return env


def one_name(lan: Lan, client: Node, evil: Node, env: dict[str, str], name: str, log: Path,  # noqa: F811
             src: str | None) -> dict[str, Any]:
    copycat = lan.popen(evil, [sys.executable, str(REPO / "tests" / "copycat.py"), evil.ip, name],
                        env=with_src(lan.base_env(evil, GPUSD_MDNS_FAST="1"), src),
                        stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert copycat.stdout is not None
    lines = read_lines(copycat.stdout.fileno(), 1, 45)
    if not lines or not lines[0].startswith("ready"):
        raise SystemExit(f"the copycat did not start: {lines}")
    try:
        seen: dict[str, Any] = {}
        deadline = time.monotonic() + 40
        while time.monotonic() < deadline:
            r = lan.gpusd(client, ["list", "--json", "--browse", "6"], env=env, timeout=60)
            if r.returncode == 0:
                seen = {d["hostname"]: d.get("verified") for d in json.loads(r.stdout)}
                if name in seen and "node-1" in seen:
                    break
            time.sleep(0.5)
        before = len(ssh_targets(log))
        run = lan.gpusd(client, ["run", "--fleet", "-n", "1", "--ttl", "6", "--", "python", "train.py",
                                 "--wandb-key=SECRET"], env=env, timeout=90)
        targets = ssh_targets(log)[before:]
        hostfile = lan.gpusd(client, ["hostfile", "-n", "1", "--ttl", "6", "--format", "mpi", "--", "true"],
                             env=env, timeout=90)
        return {"name": name, "listed": name in seen, "verified": seen.get(name) is True,
                "real_verified": seen.get("node-1") is True, "ssh_to_name": name in targets, "ssh": targets,
                "run_rc": run.returncode, "hostfile_has_name": name in hostfile.stdout,
                "hostfile": hostfile.stdout.strip(), "hostfile_rc": hostfile.returncode,
                "hostfile_err": hostfile.stderr.strip().splitlines()[-1:] if hostfile.returncode else []}
    finally:
        copycat.terminate()
        try:
            copycat.wait(10)
        except subprocess.TimeoutExpired:
            copycat.kill()
        time.sleep(1.5)  # its goodbyes reach the client before the next name is announced


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--src", help="run gpusd from this source tree (the 'before' figures)")
    args = ap.parse_args()
    why = unavailable()
    if why:
        print(f"skipped: {why}")
        return 0
    src = str(Path(args.src).resolve()) if args.src else None
    t0 = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="gpusd-bench-names-"))
    key = work / "fleet.key"
    fd = os.open(key, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32) + "\n")
    results = []
    with Lan() as lan:
        h1 = lan.add_gpu_host("node-1", make_gpus(2), fast=True, node_name="h1",
                              args=["--token-file", str(key), "--interval", "0.2"],
                              extra_env={"GPUSD_LEASE_SOCKET": str(lan.workdir / "h1-lease.sock")})
        h1.env = with_src(h1.env, src)
        h1.start()
        client, evil = lan.add_node("client"), lan.add_node("evil")
        log = work / "ssh-calls.jsonl"
        fake_ssh(work / "bin", log)
        (work / "client-state").mkdir()
        env = with_src(lan.base_env(client, GPUSD_MDNS_FAST="1", GPUSD_TOKEN_FILE=str(key),
                                    GPUSD_STATE_DIR=str(work / "client-state"),
                                    PATH=f"{work / 'bin'}:{BIN}:/usr/sbin:/usr/bin:/sbin:/bin"), src)
        for name in NAMES:
            results.append(one_name(lan, client, evil, env, name, log, src))
    which = f"gpusd from {src}" if src else f"gpusd from {REPO / 'src'}"
    print(f"attack 1, a copied announcement ({which}; {time.monotonic() - t0:.0f} s)")
    print(f"  {'name the stranger chose':32} {'listed verified':>15} {'ssh target':>10} {'in hostfile':>11}  "
          "what the client did")
    for r in results:
        did = (f"ssh to {r['ssh'] or 'nobody'} (exit {r['run_rc']}); hostfile "
               + (repr(r['hostfile']) if r['hostfile_rc'] == 0 else f"failed: {' '.join(r['hostfile_err'])[:90]}"))
        print(f"  {r['name']:32} {'YES' if r['verified'] else 'no':>15} {'YES' if r['ssh_to_name'] else 'no':>10} "
              f"{'YES' if r['hostfile_has_name'] else 'no':>11}  {did}")
    print(f"  node-1 listed verified in every round: {all(r['real_verified'] for r in results)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
