"""The SSH test fixture (tests/sshd.py): one sshd per namespace host, key-only, host keys checked."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from netns import Lan, lan, netns_ok  # noqa: F401
from sshd import SshFleet, sshd_ok  # noqa: F401


def test_ssh_into_two_namespace_hosts(lan: Lan, sshd_ok: None, tmp_path: Path) -> None:
    """From a client namespace, ``ssh -F CONFIG node-N`` reaches each host: the server side of the
    connection is that host's namespace address, and the remote exit status comes back."""
    h1, h2, client = lan.add_node("h1"), lan.add_node("h2"), lan.add_node("client")
    with SshFleet(lan, [(h1, "node-1"), (h2, "node-2")], workdir=tmp_path / "ssh") as fleet:
        for node, name in ((h1, "node-1"), (h2, "node-2")):
            r = fleet.ssh(client, name, 'echo "$SSH_CONNECTION"; exit 7')
            assert r.returncode == 7, r.stderr
            fields = r.stdout.split()
            assert fields[0] == client.ip and fields[2] == node.ip
        # the hosts reach each other too (what a launcher on the head does)
        r = fleet.ssh(h1, "node-2", 'echo "$SSH_CONNECTION"')
        assert r.returncode == 0 and r.stdout.split()[2] == h2.ip


def test_ssh_refuses_an_unknown_key_and_a_changed_host_key(lan: Lan, sshd_ok: None, tmp_path: Path) -> None:
    """Only the test's user key gets in, and the client checks host keys: the fixture does not open
    a root login to anyone, nor trust whoever answers."""
    h1, client = lan.add_node("h1"), lan.add_node("client")
    with SshFleet(lan, [(h1, "node-1")], workdir=tmp_path / "ssh") as fleet:
        other = tmp_path / "other_key"
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(other)], check=True)
        opts = [f"IdentityFile={other}", "IdentitiesOnly=yes", "IdentityAgent=none", "BatchMode=yes",
                f"UserKnownHostsFile={fleet.known_hosts}", "StrictHostKeyChecking=yes"]
        argv = ["ssh", "-F", "/dev/null", *[a for o in opts for a in ("-o", o)], f"{fleet.user}@{h1.ip}", "true"]
        r = lan.run(client, argv, timeout=30)
        assert r.returncode == 255 and "Permission denied" in r.stderr
        fleet.known_hosts.write_text(fleet.known_hosts.read_text().replace("AAAA", "AAAB", 1))
        r = fleet.ssh(client, "node-1", "true")
        assert r.returncode == 255


@pytest.mark.parametrize("missing", ["ssh-keygen"])
def test_unavailable_says_why(monkeypatch: pytest.MonkeyPatch, missing: str) -> None:
    import shutil

    import sshd

    real = shutil.which
    monkeypatch.setattr(shutil, "which", lambda name: None if name == missing else real(name))
    assert missing in (sshd.unavailable() or "")
