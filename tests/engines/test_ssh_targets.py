"""One check for every ssh target gpusd uses (issue 17, attack 1): ``gpusd run --fleet``, ``launch``,
``hostfile`` and ``ray up`` take a host name or an IP address, never an option, ``user@`` (from the
network), a URL, a port, spaces or control characters (``gpusd.engines.placement.check_ssh_target``)."""

from __future__ import annotations

import json
import os
import stat
import sys
from pathlib import Path

import pytest

from gpusd.engines.placement import HostSlot, PlacementError, check_ssh_target, valid_host

HOSTILE = [
    "attacker@198.18.0.2", "ssh://victim@198.18.0.2:2222", "-oProxyCommand=touch /tmp/pwned", "-p2222",
    "node-1:2222", "node 1", "node-1\n", "node-1\r", "\nnode-1", "node\t1", "node-1;reboot", "$(id)", "`id`",
    "node-1/x", "[198.18.0.2]", "", "..", "a..b", "nöde", "node-1\x00", "x" * 300, "%6e",
]
GOOD = ["node-1", "gpu-node-3.example.com", "198.18.0.2", "10.0.0.1", "fe80::1", "_gateway", "n1.local"]


@pytest.mark.parametrize("target", HOSTILE)
def test_hostile_ssh_targets_are_refused(target: str) -> None:
    assert not valid_host(target)
    with pytest.raises(PlacementError):
        check_ssh_target(target)
    with pytest.raises(PlacementError):  # with or without a login, the host part must be a host
        check_ssh_target(f"me@{target}", user=True)


@pytest.mark.parametrize("target", GOOD)
def test_host_names_and_addresses_are_ssh_targets(target: str) -> None:
    assert valid_host(target) and check_ssh_target(target) == target


def test_a_login_only_where_the_user_wrote_the_placement() -> None:
    """``me@node-2`` in a placement file the user wrote (docs/engines.md); never in a name from the network."""
    assert check_ssh_target("me@node-2", user=True) == "me@node-2"
    with pytest.raises(PlacementError):
        check_ssh_target("me@node-2")
    for login in ("-oProxyCommand=x", "a b", "", "ro ot"):
        with pytest.raises(PlacementError):
            check_ssh_target(f"{login}@node-2", user=True)
    assert HostSlot("node-2", "10.0.0.2", "me@node-2", (0,)).ssh_host == "node-2"
    with pytest.raises(PlacementError):  # a host name (what a daemon signs) is never user@
        HostSlot("me@node-2", "10.0.0.2", "node-2", (0,))
    with pytest.raises(PlacementError):
        HostSlot("node-2\n", "10.0.0.2", "node-2", (0,))  # a trailing newline is no name either


def _fake_ssh(tmp_path: Path) -> Path:
    """A logging ``ssh`` on PATH: each call's argv as one JSON line."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    log = tmp_path / "ssh.log"
    script = bindir / "ssh"
    script.write_text(f"#!{sys.executable}\nimport json, sys\n"
                      f"open({str(log)!r}, 'a').write(json.dumps(sys.argv[1:]) + '\\n')\n")
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return log


@pytest.mark.parametrize("name", ["attacker@198.18.0.2", "ssh://victim@198.18.0.2:2222", "-oProxyCommand=sh",
                                  "aaa evil"])
def test_run_fleet_never_sshs_to_a_name_that_is_not_a_host(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                           name: str) -> None:
    from gpusd.cli.pool import _run_over_ssh
    from gpusd.pool.client import HostLease

    log = _fake_ssh(tmp_path)
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:{os.environ['PATH']}")
    monkeypatch.delenv("GPUSD_SSH_CONFIG", raising=False)
    part = HostLease("abc123", name, "0123456789abcdef", "https://198.18.0.2:4781/api/v1", None,
                     [{"index": 0, "uuid": "GPU-1"}], {"CUDA_VISIBLE_DEVICES": "0"}, 30, 0, ["198.18.0.2"])
    with pytest.raises(PlacementError, match="host name"):
        _run_over_ssh(part, ["python", "train.py", "--wandb-key=SECRET"], [])
    assert not log.exists()  # no ssh at all
    # a host name goes as the one target after "--"
    good = HostLease("abc123", "node-1", "0123456789abcdef", "https://198.18.0.2:4781/api/v1", None,
                     [{"index": 0, "uuid": "GPU-1"}], {}, 30, 0, ["198.18.0.2"])
    assert _run_over_ssh(good, ["true"], []) == 0
    (argv,) = [json.loads(ln) for ln in log.read_text().splitlines()]
    assert argv[argv.index("--") + 1] == "node-1"
