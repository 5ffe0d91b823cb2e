"""The background renewer of ``gpusd reserve`` (docs/pool.md) stops by itself once its leases can no
longer be renewed: a daemon that went away expires them after their TTL, so renewing on would be a
process left running forever (as the namespace tests once left them behind)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

from gpusd.pool.client import HostLease


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])  # nothing listens there once the socket is closed


def test_a_renewer_whose_daemon_is_gone_stops_after_the_ttl() -> None:
    lease = HostLease(lease_id="abc123", hostname="gone", node_id="0123456789abcdef",
                      url=f"http://127.0.0.1:{_closed_port()}/api/v1", pin=None, devices=[], env={},
                      ttl=2.0, expires=time.time() + 2.0)
    job = {"secret": "a-fleet-secret-of-32-characters!", "until": time.time() + 3600,
           "leases": [lease.to_dict()]}
    env = dict(os.environ)
    proc = subprocess.Popen([sys.executable, "-m", "gpusd.pool.renewer"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env, text=True)
    try:
        out, _ = proc.communicate(json.dumps(job), timeout=60)  # generous: it gives up after ttl + ttl/3
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0 and out == "renewing\n"


def test_a_reservation_is_remembered_where_it_was_made_and_only_our_own_record_is_read(tmp_path, monkeypatch):
    """gpusd release ID reads the renewer's record (issue 18, item 4): a symbolic link or a record naming
    another lease is not acted on."""
    from gpusd.pool import renewer

    monkeypatch.setenv("GPUSD_STATE_DIR", str(tmp_path / "state"))
    part = HostLease(lease_id="abcdef123456", hostname="node-b", node_id="0123456789abcdef",
                     url="https://198.18.2.2:4781/api/v1", pin="ab" * 32, devices=[], env={}, ttl=3.0,
                     expires=time.time() + 3).to_dict()
    renewer.remember([part], 4242, time.time() + 60)
    d = tmp_path / "state" / renewer.RECORD_DIR
    assert oct(d.stat().st_mode & 0o777) == "0o700" and oct((d / "abcdef123456.json").stat().st_mode & 0o777) == "0o600"
    rec = renewer.recall("abcdef123456")
    assert rec is not None and rec["lease"]["url"] == part["url"] and rec["renewer_pid"] == 4242
    assert renewer.recall("../../etc/passwd") is None and renewer.recall("ABC") is None
    (d / "feedfacecafe.json").write_text(json.dumps({"lease": {**part}}))  # names another lease
    assert renewer.recall("feedfacecafe") is None
    (d / "0badc0de0bad.json").symlink_to(d / "abcdef123456.json")
    assert renewer.recall("0badc0de0bad") is None
    renewer.forget("abcdef123456")
    assert renewer.recall("abcdef123456") is None


def test_a_record_directory_another_user_controls_is_neither_written_nor_read(tmp_path, monkeypatch):
    """$GPUSD_STATE_DIR in a shared place: another user made ``reservations`` first (theirs, or open to
    all, or a link to their own directory). gpusd neither tells them where its reservations are nor
    believes what they may rearrange there."""
    import os

    from gpusd.pool import renewer

    state = tmp_path / "state"
    state.mkdir()
    monkeypatch.setenv("GPUSD_STATE_DIR", str(state))
    part = HostLease(lease_id="abcdef123456", hostname="node-b", node_id="0123456789abcdef",
                     url="https://198.18.2.2:4781/api/v1", pin="ab" * 32, devices=[], env={}, ttl=3.0,
                     expires=time.time() + 3).to_dict()
    d = state / renewer.RECORD_DIR
    d.mkdir(mode=0o777)
    os.chmod(d, 0o777)  # open to everyone
    renewer.remember([part], 4242, time.time() + 60)
    assert list(d.iterdir()) == []
    os.chmod(d, 0o700)
    renewer.remember([part], 4242, time.time() + 60)
    assert renewer.recall("abcdef123456") is not None
    os.chmod(d, 0o777)
    assert renewer.recall("abcdef123456") is None  # a directory anyone may rearrange: not believed
    os.chmod(d, 0o700)
    if os.geteuid() == 0:
        os.chown(d, 65534, 65534)  # another user's directory
        assert renewer.recall("abcdef123456") is None
        os.chown(d, 0, 0)
    elsewhere = tmp_path / "theirs"
    d.rename(elsewhere)
    d.symlink_to(elsewhere)  # a link to a directory of theirs
    assert renewer.recall("abcdef123456") is None
    renewer.remember([dict(part, lease_id="feedfacecafe")], 4242, time.time() + 60)
    assert not (elsewhere / "feedfacecafe.json").exists()
