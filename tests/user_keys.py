"""Local accounts with SSH keys for the identity tests (issue 20, docs/security.md "Identity"): real
``useradd`` accounts with unique names and homes under the test's tmp directory (deleted by name in a
finalizer), real ``ssh-keygen`` keys listed in their ``~/.ssh/authorized_keys``, and a real
``ssh-agent`` per user.  Root only; skipped with the reason elsewhere."""

from __future__ import annotations

import os
import pwd
import secrets
import shutil
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

needs_accounts = pytest.mark.skipif(
    os.geteuid() != 0 or not all(shutil.which(t) for t in ("useradd", "userdel", "ssh-keygen", "ssh-agent",
                                                           "ssh-add")),
    reason="needs root, useradd/userdel and OpenSSH's ssh-keygen, ssh-agent and ssh-add")


@dataclass
class User:
    name: str
    uid: int
    home: Path
    key: Path  # the private key file (unencrypted)
    agent: str = ""  # its ssh-agent's socket
    agent_pid: int = 0
    extra: list[int] = field(default_factory=list)

    @property
    def pub(self) -> str:
        return Path(str(self.key) + ".pub").read_text().strip()

    def env(self) -> dict[str, str]:
        """What a login of this user has: the agent's socket, and the account its signatures act as
        (the tests run as root: a real login of this user names it by default)."""
        return {"SSH_AUTH_SOCK": self.agent, "GPUSD_ACCOUNT": self.name}

    def signer(self, account: str | None = None) -> object:
        """A signer of this user's key, acting as ``account`` (default: this user's own)."""
        from gpusd.wire.sshsig import FileSigner

        signer = FileSigner.load(str(self.key))
        signer.account = account or self.name
        return signer

    def authorize(self, *lines: str) -> None:
        ssh = self.home / ".ssh"
        ak = ssh / "authorized_keys"
        ak.write_text("".join(line + "\n" for line in lines))
        os.chown(ak, self.uid, self.uid)
        ak.chmod(0o600)


def keygen(path: Path, comment: str = "") -> Path:
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", comment or path.name, "-f", str(path)],
                   check=True)
    return path


class Accounts:
    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.users: list[User] = []

    def add(self, role: str) -> User:
        name = f"g{role[:5]}{secrets.token_hex(3)}"
        home = self.tmp / f"home-{name}"
        subprocess.run(["useradd", "-M", "-d", str(home), "-s", "/usr/sbin/nologin", "-U", name], check=True,
                       capture_output=True)
        pw = pwd.getpwnam(name)
        user = User(name, pw.pw_uid, home, self.tmp / f"key-{name}")
        self.users.append(user)
        (home / ".ssh").mkdir(parents=True, mode=0o700)
        home.chmod(0o755)
        os.chown(home, pw.pw_uid, pw.pw_gid)
        os.chown(home / ".ssh", pw.pw_uid, pw.pw_gid)
        keygen(user.key, f"{role}@laptop")
        user.authorize(user.pub)
        sock = self.tmp / f"agent-{name}.sock"
        proc = subprocess.Popen(["ssh-agent", "-D", "-a", str(sock)], stdout=subprocess.DEVNULL)
        user.agent, user.agent_pid = str(sock), proc.pid
        deadline = time.monotonic() + 10
        while not sock.exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        subprocess.run(["ssh-add", "-q", str(user.key)], env={"SSH_AUTH_SOCK": str(sock)}, check=True,
                       capture_output=True)
        return user

    def close(self) -> None:
        for user in self.users:
            if user.agent_pid:
                try:
                    os.kill(user.agent_pid, 15)
                    os.waitpid(user.agent_pid, 0)
                except (ProcessLookupError, ChildProcessError):
                    pass
            subprocess.run(["userdel", "-f", user.name], capture_output=True)  # by name (-f: even with a process left)


@pytest.fixture
def accounts(tmp_path: Path) -> Iterator[Accounts]:
    acc = Accounts(tmp_path)
    try:
        yield acc
    finally:
        acc.close()
