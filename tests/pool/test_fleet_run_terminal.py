"""`gpusd run --fleet` as a user sees it (issue 18, item 14): at a terminal neither gpusd's protocol
line nor ssh's "Connection ... closed." reaches the screen, and when ssh cannot resolve the name a
host announced the message says which host and what to put in ssh's config.  ssh is a stand-in on
PATH that behaves as OpenSSH does (with -tt the remote pty merges the command's stderr into stdout)."""

from __future__ import annotations

import os
import pty
import select
import subprocess
import sys
import time
from pathlib import Path

from tests_paths import SRC

FAKE_SSH = r"""#!/bin/sh
case " $* " in
  *" -tt "*) printf 'gpusd-remote-pid 4242 job\r\nhello from the job\r\n'
             printf 'Connection to node-1 closed.\r\n' >&2; exit 0;;
  *" kill "*) exit 0;;
  *) echo "ssh: Could not resolve hostname node-1: Name or service not known" >&2; exit 255;;
esac
"""

DRIVER = """
import sys
from gpusd.cli.pool import _run_over_ssh
from gpusd.pool.client import HostLease
part = HostLease("ab12", "node-1", "n" * 16, "http://198.18.0.7:4780/api/v1", None, [], {}, 30.0, 0.0)
sys.exit(_run_over_ssh(part, ["python3", "train.py"], [], ["gpusd", "fleet-job", "--"]))
"""


def _env(tmp_path: Path) -> dict[str, str]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    ssh = bin_dir / "ssh"
    ssh.write_text(FAKE_SSH)
    ssh.chmod(0o755)
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", PYTHONPATH=str(SRC))
    env.pop("GPUSD_SSH_CONFIG", None)
    return env


def test_at_a_terminal_no_protocol_line_and_no_ssh_goodbye(tmp_path: Path) -> None:
    env = _env(tmp_path)
    pid, fd = pty.fork()
    if pid == 0:  # pragma: no cover - the child, at a terminal
        os.execve(sys.executable, [sys.executable, "-c", DRIVER], env)
    out = bytearray()
    end = time.time() + 30
    while time.time() < end:
        r, _, _ = select.select([fd], [], [], 0.1)
        if r:
            try:
                data = os.read(fd, 65536)
            except OSError:
                break
            if not data:
                break
            out.extend(data)
    _, status = os.waitpid(pid, 0)
    os.close(fd)
    text = out.decode("utf-8", "replace")
    assert os.waitstatus_to_exitcode(status) == 0, text
    assert "hello from the job" in text
    assert "gpusd-remote-pid" not in text and "Connection to" not in text, text


def test_an_unresolvable_name_says_which_host_and_what_to_configure(tmp_path: Path) -> None:
    r = subprocess.run([sys.executable, "-c", DRIVER], env=_env(tmp_path), stdin=subprocess.DEVNULL,
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 255
    assert "Could not resolve hostname node-1" in r.stderr  # ssh's own words stay
    assert "ssh cannot resolve node-1" in r.stderr and "Host node-1" in r.stderr and "HostName" in r.stderr
    assert "198.18.0.7" in r.stderr and "~/.ssh/config" in r.stderr


HOSTILE_PID_SSH = r"""#!/bin/sh
case " $* " in
  *" kill "*) echo "$*" >> "$SSH_LOG"; exit 0;;
  *) printf 'gpusd-remote-pid %s job\n' "$REMOTE_PID" >&2; exec sleep 30;;
esac
"""


def test_a_protocol_line_naming_no_single_process_is_never_signalled(tmp_path: Path) -> None:
    """The remote side (an sshd banner, the user's shell rc) prints ``gpusd-remote-pid -1``: a
    signal to the run must not become ``kill -s TERM -1`` (every process of that user there) — the
    connection is ended instead."""
    import signal

    env = _env(tmp_path)
    (tmp_path / "bin" / "ssh").write_text(HOSTILE_PID_SSH)
    log = tmp_path / "ssh.log"
    for hostile in ("-1", "0", "1", "99999999999"):
        log.unlink(missing_ok=True)
        run_env = dict(env, SSH_LOG=str(log), REMOTE_PID=hostile)
        proc = subprocess.Popen([sys.executable, "-c", DRIVER], env=run_env, stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        time.sleep(1.5)  # the protocol line is read
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=30)
        assert not log.exists() or "kill" not in log.read_text(), (hostile, log.read_text())
