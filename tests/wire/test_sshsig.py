"""The SSHSIG format of users' signatures (gpusd.wire.sshsig) against OpenSSH's own ssh-keygen and ssh-agent."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpusd.wire import sshsig

pytestmark = pytest.mark.skipif(shutil.which("ssh-keygen") is None or shutil.which("ssh-agent") is None,
                                reason="needs OpenSSH's ssh-keygen and ssh-agent")

KINDS = [("ed25519", []), ("ecdsa", ["-b", "256"]), ("ecdsa", ["-b", "384"]), ("rsa", ["-b", "3072"])]


def keygen(path: Path, kind: str, extra: list[str]) -> Path:
    subprocess.run(["ssh-keygen", "-q", "-t", kind, *extra, "-N", "", "-C", "test@gpusd", "-f", str(path)],
                   check=True)
    return path


@pytest.fixture
def agent(tmp_path: Path) -> Iterator[dict[str, str]]:
    sock = tmp_path / "agent.sock"
    proc = subprocess.Popen(["ssh-agent", "-D", "-a", str(sock)], stdout=subprocess.DEVNULL)
    try:
        for _ in range(100):
            if sock.exists():
                break
            subprocess.run(["sleep", "0.05"])
        yield {**os.environ, "SSH_AUTH_SOCK": str(sock)}
    finally:
        proc.terminate()
        proc.wait(5)


@pytest.mark.parametrize("kind,extra", KINDS)
def test_our_signature_verifies_with_ssh_keygen_and_theirs_with_ours(tmp_path: Path, kind: str,
                                                                     extra: list[str]) -> None:
    key = keygen(tmp_path / "id", kind, extra)
    message = b'"@method": POST\n"@signature-params": ("@method");created=1;nonce="x"'
    signer = sshsig.FileSigner.load(str(key))
    blob = sshsig.sign(signer, message)
    (tmp_path / "msg").write_bytes(message)
    (tmp_path / "msg.sig").write_text(sshsig.armor(blob))
    pub = (tmp_path / "id.pub").read_text()
    (tmp_path / "allowed").write_text("who@example " + pub)
    ok = subprocess.run(["ssh-keygen", "-Y", "verify", "-f", str(tmp_path / "allowed"), "-I", "who@example",
                         "-n", "gpusd", "-s", str(tmp_path / "msg.sig")], input=message, capture_output=True)
    assert ok.returncode == 0, ok.stderr
    # ssh-keygen's own signature, checked by gpusd: the signer's key comes back
    (tmp_path / "msg.sig").unlink()
    subprocess.run(["ssh-keygen", "-q", "-Y", "sign", "-n", "gpusd", "-f", str(key), str(tmp_path / "msg")],
                   check=True, capture_output=True)
    theirs = sshsig.unarmor((tmp_path / "msg.sig").read_text())
    assert sshsig.verify(theirs, message) == sshsig.parse_public(pub)
    # another message, another namespace: refused
    with pytest.raises(sshsig.SshSigError, match="does not match"):
        sshsig.verify(theirs, message + b"!")
    with pytest.raises(sshsig.SshSigError, match="namespace"):
        sshsig.verify(sshsig.sign(signer, message, "file"), message)


def test_the_agent_signs_and_an_identity_file_picks_the_agents_key(tmp_path: Path, agent: dict[str, str]) -> None:
    first = keygen(tmp_path / "first", "ed25519", [])
    second = keygen(tmp_path / "second", "rsa", ["-b", "2048"])
    for k in (first, second):
        subprocess.run(["ssh-add", "-q", str(k)], env=agent, check=True, capture_output=True)
    (tmp_path / "second").unlink()  # only the agent has it now: ssh -i second.pub would still work
    signer = sshsig.load_signer(environ=agent)
    assert isinstance(signer, sshsig.AgentSigner)
    assert signer.public_blob == sshsig.parse_public((tmp_path / "first.pub").read_text())
    picked = sshsig.load_signer(str(tmp_path / "second"), environ=agent)
    assert isinstance(picked, sshsig.AgentSigner)
    assert picked.public_blob == sshsig.parse_public((tmp_path / "second.pub").read_text())
    blob = sshsig.sign(picked, b"hello")
    assert sshsig.verify(blob, b"hello") == picked.public_blob
    # without an agent and without an identity: no signer; an encrypted file: a clear error
    assert sshsig.load_signer(environ={}) is None
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "secret-pass", "-f", str(tmp_path / "enc")],
                   check=True)
    with pytest.raises(sshsig.SshSigError, match="ssh-add"):
        sshsig.load_signer(str(tmp_path / "enc"), environ={})


def test_malformed_signatures_are_refused_with_a_reason() -> None:
    for blob in (b"", b"SSHSIG", b"SSHSIG\x00\x00\x00\x02", b"x" * 9000):
        with pytest.raises(sshsig.SshSigError):
            sshsig.verify(blob, b"m")
