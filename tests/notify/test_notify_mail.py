"""``gpusd notify --mail``: through the local MTA's sendmail (a fake one on PATH) or an SMTP server
(a small one on 127.0.0.1); one plain address only, and a server that never answers is bounded."""

from __future__ import annotations

import os
import socket
import stat
import threading
from email import message_from_bytes
from pathlib import Path

import pytest

from conftest import gpusd_cli


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    return dict(os.environ, GPUSD_SIMULATE="2xA100-80GB")


def fake_sendmail(bin_dir: Path, out: Path, status: int = 0) -> None:
    bin_dir.mkdir()
    script = bin_dir / "sendmail"
    script.write_text(f'#!/bin/sh\necho "$@" > {out}.args\ncat > {out}\nexit {status}\n')
    script.chmod(script.stat().st_mode | stat.S_IXUSR)


def test_mail_goes_through_sendmail_with_the_notice(tmp_path: Path, env: dict[str, str]) -> None:
    out = tmp_path / "mail"
    fake_sendmail(tmp_path / "bin", out)
    env = dict(env, PATH=f"{tmp_path / 'bin'}:{env['PATH']}")
    r = gpusd_cli(["notify", "-n", "2", "--mail", "alice@example.org", "--mail-from", "gpus@lab.example"], env=env)
    assert r.returncode == 0, r.stderr
    assert out.with_name("mail.args").read_text().split() == ["-oi", "alice@example.org"]
    msg = message_from_bytes(out.read_bytes())
    assert msg["To"] == "alice@example.org" and msg["From"] == "gpus@lab.example"
    assert msg["Subject"].startswith("gpusd: 2 GPU(s) free on this machine")
    body = msg.get_payload()
    assert "GPU 0" in body and "GPU 1" in body and "not a lease" in body


def test_a_failing_sendmail_is_one_line_exit_1(tmp_path: Path, env: dict[str, str]) -> None:
    out = tmp_path / "mail"
    fake_sendmail(tmp_path / "bin", out, status=75)
    env = dict(env, PATH=f"{tmp_path / 'bin'}:{env['PATH']}")
    r = gpusd_cli(["notify", "-n", "1", "--mail", "alice@example.org"], env=env)
    assert r.returncode == 1 and r.stderr.count("\n") == 1 and "sendmail exited with status 75" in r.stderr, r.stderr


def test_no_sendmail_is_said_before_watching(tmp_path: Path, env: dict[str, str]) -> None:
    from gpusd.notify.deliver import find_sendmail

    if find_sendmail("/nonexistent") is not None:
        pytest.skip("this machine has a sendmail in /usr/sbin or /usr/lib")
    r = gpusd_cli(["notify", "-n", "1", "--mail", "alice@example.org"], env=dict(env, PATH="/nonexistent"))
    assert r.returncode == 2 and "no sendmail found" in r.stderr and r.stderr.count("\n") == 1, r.stderr


class Smtp:
    """A very small SMTP server on 127.0.0.1 (one message per connection; ``silent``: says nothing)."""

    def __init__(self, silent: bool = False) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.silent = silent
        self.messages: list[tuple[str, list[str], bytes]] = []
        self.connections = 0
        self._stop = threading.Event()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        self.sock.settimeout(0.2)
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            self.connections += 1
            threading.Thread(target=self._one, args=(conn,), daemon=True).start()

    def _one(self, conn: socket.socket) -> None:
        with conn, conn.makefile("rb") as f:
            if self.silent:
                self._stop.wait(30)
                return
            conn.sendall(b"220 test ESMTP\r\n")
            sender, rcpts, data = "", [], b""
            for raw in f:
                line = raw.decode().rstrip("\r\n")
                cmd = line[:4].upper()
                if cmd in ("EHLO", "HELO"):
                    conn.sendall(b"250 test\r\n")
                elif cmd == "MAIL":
                    sender = line.split(":", 1)[1].strip(" <>")
                    conn.sendall(b"250 ok\r\n")
                elif cmd == "RCPT":
                    rcpts.append(line.split(":", 1)[1].strip(" <>"))
                    conn.sendall(b"250 ok\r\n")
                elif cmd == "DATA":
                    conn.sendall(b"354 go on\r\n")
                    for body in f:
                        if body == b".\r\n":
                            break
                        data += body
                    self.messages.append((sender, rcpts, data))
                    conn.sendall(b"250 queued\r\n")
                elif cmd == "QUIT":
                    conn.sendall(b"221 bye\r\n")
                    return
                else:
                    conn.sendall(b"250 ok\r\n")

    def close(self) -> None:
        self._stop.set()
        self.sock.close()


def test_mail_through_an_smtp_server(env: dict[str, str]) -> None:
    srv = Smtp()
    try:
        r = gpusd_cli(["notify", "-n", "1", "--mail", "bob@example.org", "--smtp", f"127.0.0.1:{srv.port}",
                       "--mail-from", "gpus@lab.example"], env=env)
    finally:
        srv.close()
    assert r.returncode == 0, r.stderr
    assert len(srv.messages) == 1
    sender, rcpts, data = srv.messages[0]
    assert sender == "gpus@lab.example" and rcpts == ["bob@example.org"]
    msg = message_from_bytes(data)
    assert msg["Subject"].startswith("gpusd: 1 GPU(s) free") and msg["To"] == "bob@example.org"


@pytest.mark.timeout(60)
def test_an_smtp_server_that_never_answers_is_bounded(tmp_path: Path) -> None:
    """The library's bound, with short timeouts (the CLI's are 30 s per step, 3 tries)."""
    from gpusd.errors import GpusdError
    from gpusd.notify.deliver import Gpu, Mail, Notice

    srv = Smtp(silent=True)
    try:
        mail = Mail("bob@example.org", smtp=f"127.0.0.1:{srv.port}", timeout=0.3, attempts=2, backoff=0.01)
        with pytest.raises(GpusdError, match="not delivered") as err:
            mail.deliver(Notice("h", None, (Gpu(0, "GPU-1"),)))
    finally:
        srv.close()
    assert "\n" not in str(err.value)
    assert srv.connections == 2
