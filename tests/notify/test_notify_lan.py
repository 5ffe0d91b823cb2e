"""``gpusd notify --fleet`` on a LAN of network namespaces (tests/netns.py): a notifier on a client
machine, woken by the hosts' event streams, fires exactly once — with --exec and with --webhook —
after the holder of a host's GPUs ended and not before, and only for verified hosts.  Skipped (with
the reason) without root or ``ip netns``."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from notify_helpers import Holder, notifier, when_said

from fakenvml import make_gpus
from netns import GpuHost, Lan, lan, netns_ok  # noqa: F401

HERE = Path(__file__).resolve().parent


def secret_file(path: Path) -> Path:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32) + "\n")
    return path


def gpu_host(lan: Lan, name: str, n: int, key: Path) -> GpuHost:  # noqa: F811
    node_name = f"h{len(lan.nodes) + 1}"
    return lan.add_gpu_host(name, make_gpus(n), fast=True, node_name=node_name,
                            args=["--token-file", str(key), "--interval", "0.2"],
                            extra_env={"GPUSD_LEASE_SOCKET": str(lan.workdir / f"{node_name}-lease.sock")})


def in_node(lan: Lan, node: Any) -> Any:  # noqa: F811
    return lambda argv, env, **kw: lan.popen(node, argv, env=env, **kw)


@pytest.mark.timeout(240)
def test_fleet_notify_fires_once_by_exec_and_webhook_after_the_holder_ends(lan: Lan, tmp_path: Path) -> None:  # noqa: F811
    key = secret_file(tmp_path / "fleet.key")
    h1 = gpu_host(lan, "node-1", 2, key)
    h1.start()
    client = lan.add_node("client")
    env = lan.base_env(client, GPUSD_MDNS_FAST="1")

    # the receiver listens on the client's own loopback (its namespace's)
    posts = tmp_path / "posts"
    rx = lan.popen(client, [sys.executable, str(HERE / "notify_receiver.py"), str(posts)], env=env,
                   stdout=subprocess.PIPE, text=True)
    assert rx.stdout is not None
    port = int(rx.stdout.readline())

    holder = Holder(tmp_path, 2, h1.env, popen=in_node(lan, h1.node))  # both GPUs, through node-1's daemon
    out = tmp_path / "fired"
    common = ["--fleet", "-n", "2", "--token-file", str(key)]
    by_exec = notifier([*common, "--exec", when_said(out)], env, popen=in_node(lan, client))
    by_hook = notifier([*common, "--webhook", f"http://127.0.0.1:{port}/gpus"], env, popen=in_node(lan, client))
    try:
        for n in (by_exec, by_hook):
            n.wait_for("watching until they are free", timeout=60)
            assert any("not free now on 1 verified host(s)" in ln for ln in n.lines), "".join(n.lines)
        assert not out.exists() and not posts.exists()
        holder.end()
        assert by_exec.finish(60) == 0, "".join(by_exec.lines)
        assert by_hook.finish(60) == 0, "".join(by_hook.lines)
    finally:
        by_exec.stop()
        by_hook.stop()
    fired = out.read_text().splitlines()
    assert len(fired) == 1, fired
    when, count, gpus, uuids, seq = fired[0].split()
    assert (when, count, gpus, seq) == ("after", "2", "0,1", "1")
    sent = [json.loads(ln) for ln in posts.read_text().splitlines()]
    assert len(sent) == 1
    body = json.loads(sent[0]["body"])
    assert body["fleet"] is True and body["host"]["name"] == "node-1" and body["count"] == 2
    assert sorted(g["uuid"] for g in body["gpus"]) == sorted(uuids.split(","))
    assert any("on node-1" in ln for ln in by_hook.lines)


@pytest.mark.timeout(180)
def test_fleet_notify_needs_the_secret_and_ignores_hosts_it_cannot_verify(lan: Lan, tmp_path: Path) -> None:  # noqa: F811
    key = secret_file(tmp_path / "fleet.key")
    other = secret_file(tmp_path / "other.key")
    h1 = gpu_host(lan, "node-1", 2, key)
    h1.start()
    client = lan.add_node("client")
    env = lan.base_env(client, GPUSD_MDNS_FAST="1")
    r = lan.gpusd(client, ["notify", "--fleet", "-n", "1", "--exec", "true"], env=env)
    assert r.returncode == 2 and "fleet secret" in r.stderr and r.stderr.count("\n") == 1, r.stderr
    out = tmp_path / "fired"
    # node-1's GPUs are free, but it cannot prove the secret this client holds: never told
    r = lan.gpusd(client, ["notify", "--fleet", "-n", "1", "--token-file", str(other), "--timeout", "4",
                           "--exec", f"touch {out}"], env=env)
    assert r.returncode == 5, r.stderr
    assert not out.exists()
