"""A host is what it proved (issue 17, attack 1; docs/security.md, "What a client believes, and from
whom"), on a LAN of network namespaces: a stranger without the fleet secret re-announces node-1's TXT
(node id, address, port, TLS fingerprint) under other service names, with ``host=`` of its choosing.
node-1's daemon answers every proof; the names the stranger chose still get no ssh connection (a
logging fake ``ssh`` on PATH: ``run --fleet``, ``launch``), no hostfile line and no "verified" label.
Skipped (with the reason) without root or ``ip netns``."""

from __future__ import annotations

import json
import os
import secrets
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from fakenvml import make_gpus
from netns import Lan, Node, lan, netns_ok, read_lines  # noqa: F401
from tests_paths import TESTS
from waiting import wait_until_sync

NAMES = ["aaa-evil.example.com", "attacker@198.18.0.2", "ssh://victim@198.18.0.2:2222"]
BIN = str(Path(sys.executable).parent)


def _secret(path: Path) -> Path:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32) + "\n")
    return path


def fake_ssh(bindir: Path, log: Path) -> None:
    """An ``ssh`` that records its argv (one JSON line per call) and connects nowhere."""
    bindir.mkdir(parents=True, exist_ok=True)
    script = bindir / "ssh"
    script.write_text(f"#!{sys.executable}\nimport json, sys\n"
                      f"with open({str(log)!r}, 'a') as f:\n    f.write(json.dumps(sys.argv[1:]) + '\\n')\n")
    script.chmod(script.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)


def start_copycat(lan: Lan, node: Node, names: list[str]) -> subprocess.Popen[bytes]:  # noqa: F811
    """tests/copycat.py in ``node`` (the stranger), once its copies are announced."""
    p = lan.popen(node, [sys.executable, str(TESTS / "copycat.py"), node.ip, *names],
                  env=lan.base_env(node, GPUSD_MDNS_FAST="1"), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert p.stdout is not None
    lines = read_lines(p.stdout.fileno(), 1, 45)
    assert lines and lines[0].startswith("ready "), (lines, p.poll())
    return p


def ssh_targets(log: Path) -> list[str]:
    """The host each ssh call was for (the word after ``--``)."""
    if not log.exists():
        return []
    calls = [json.loads(ln) for ln in log.read_text().splitlines()]
    return [argv[argv.index("--") + 1] for argv in calls]


@pytest.mark.timeout(300)
def test_a_copied_announcement_gets_no_ssh_no_hostfile_line_and_no_verified_label(lan: Lan, tmp_path: Path) -> None:  # noqa: F811
    key = _secret(tmp_path / "fleet.key")
    h1 = lan.add_gpu_host("node-1", make_gpus(2), fast=True, node_name="h1",
                          args=["--token-file", str(key), "--interval", "0.2"],
                          extra_env={"GPUSD_LEASE_SOCKET": str(lan.workdir / "h1-lease.sock")})
    h1.start()
    client, evil = lan.add_node("client"), lan.add_node("evil")
    start_copycat(lan, evil, NAMES)
    log = tmp_path / "ssh-calls.jsonl"
    fake_ssh(tmp_path / "bin", log)
    (tmp_path / "client-state").mkdir()
    env = lan.base_env(client, GPUSD_MDNS_FAST="1", GPUSD_TOKEN_FILE=str(key),
                       GPUSD_STATE_DIR=str(tmp_path / "client-state"),
                       PATH=f"{tmp_path / 'bin'}:{BIN}:/usr/sbin:/usr/bin:/sbin:/bin")

    # gpusd list --json: the copies are listed (a stranger may announce anything), never verified
    def listed() -> list[dict[str, Any]] | None:
        r = lan.gpusd(client, ["list", "--json", "--timeout", "6"], env=env)
        assert r.returncode == 0, r.stderr
        devices: list[dict[str, Any]] = json.loads(r.stdout)
        return devices if {d["hostname"] for d in devices} >= {"node-1", *NAMES} else None

    devices = wait_until_sync(listed, 60, step=0.5, what="node-1 and the stranger's copies in gpusd list")
    verdict = {d["hostname"]: d["verified"] for d in devices}
    assert verdict == {"node-1": True, **dict.fromkeys(NAMES, False)}, verdict
    assert {d["hostname"]: d.get("copy_of") for d in devices} == {"node-1": None, **dict.fromkeys(NAMES, "node-1")}
    table = lan.gpusd(client, ["list", "--timeout", "6"], env=env).stdout
    for name in NAMES:
        assert "[unverified" in next(ln for ln in table.splitlines() if ln.startswith(name[:20])), table

    # gpusd run --fleet: the job (and the secret on its command line) goes to node-1's signed name only
    r = lan.gpusd(client, ["run", "--fleet", "-n", "1", "--ttl", "6", "--", "python", "train.py",
                           "--wandb-key=SECRET"], env=env, timeout=90)
    assert r.returncode == 0, (r.returncode, r.stderr)
    assert ssh_targets(log) == ["node-1"], log.read_text() if log.exists() else "no ssh call"
    assert "--wandb-key=SECRET" in log.read_text()

    # gpusd hostfile (MPI's format, and the placement as JSON): node-1's signed name and address
    r = lan.gpusd(client, ["hostfile", "-n", "1", "--ttl", "6", "--format", "mpi", "--", "true"], env=env)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == ["node-1 slots=1"], r.stdout
    r = lan.gpusd(client, ["hostfile", "-n", "2", "--ttl", "6", "--format", "json", "--", "true"], env=env)
    assert r.returncode == 0, r.stderr
    (host,) = json.loads(r.stdout)["hosts"]
    assert (host["hostname"], host["address"], host["ssh_target"]) == ("node-1", h1.ip, "node-1"), host
    for name in NAMES:
        assert name not in r.stdout
    # gpusd launch: the engine is started over ssh on node-1 alone
    r = lan.gpusd(client, ["launch", "-n", "1", "--ttl", "6", "torchrun", "--", "train.py"], env=env, timeout=90)
    assert r.returncode == 0, (r.returncode, r.stderr)
    assert ssh_targets(log) == ["node-1", "node-1"], log.read_text()
    assert "Traceback" not in (h1.state_dir / "gpusd.log").read_text()
