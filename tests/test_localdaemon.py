"""gpusd.localdaemon: whether this host's daemon runs (its pid file's lock) and where it serves (its gpusd.json,
another process's file: each value checked)."""

from __future__ import annotations

import json
from pathlib import Path

from gpusd.daemon.process import PidFile, write_info
from gpusd.localdaemon import INFO_FILE, api_bases, may_run, status


def test_a_daemon_runs_only_while_its_pid_file_is_locked(tmp_path: Path) -> None:
    info = {"port": 4780, "addresses": ["127.0.0.1"], "session": "s"}
    assert not may_run(tmp_path) and not status(tmp_path).running
    write_info(tmp_path, info)  # left behind by a daemon that crashed: nobody holds the pid file
    assert may_run(tmp_path)
    st = status(tmp_path)
    assert (st.running, st.pid, st.info) == (False, None, {})
    pid = PidFile(tmp_path)
    pid.acquire()
    try:
        st = status(tmp_path)
        assert st.running and st.pid is not None and st.info == info
        (tmp_path / INFO_FILE).write_text("[1, 2]")  # damaged: as good as none
        assert status(tmp_path).info == {}
        (tmp_path / INFO_FILE).write_text(json.dumps({"port": 1, "pad": "x" * (8 << 20)}))  # beyond the bound
        assert status(tmp_path).info == {}
    finally:
        pid.release()
    assert not status(tmp_path).running


def test_where_a_daemon_serves_is_read_with_each_value_checked() -> None:
    # bound to every address: loopback first, then its addresses (IPv4 only, each once)
    assert api_bases({"port": 4780, "addresses": ["198.18.0.7", "127.0.0.1", "fe80::1"], "interfaces": []}) == [
        "http://127.0.0.1:4780/api/v1", "http://198.18.0.7:4780/api/v1"]
    # bound to the interfaces asked for: only their addresses
    assert api_bases({"port": 4780, "addresses": ["198.18.0.7"], "interfaces": ["198.18.0.7"]}) == [
        "http://198.18.0.7:4780/api/v1"]
    assert api_bases({"port": 4780, "addresses": ["198.18.0.7/x", "evil host", 7, None],
                      "interfaces": ["eth0"]}) == []
    for port in ("4780", True, 0, 70000, None, 47.8):
        assert api_bases({"port": port, "addresses": ["127.0.0.1"]}) == [], port
    many = [f"198.18.0.{i}" for i in range(1, 10)]
    assert len(api_bases({"port": 4780, "addresses": many, "interfaces": many})) == 4
