"""An IPv6 scope id is no way into a shell (review of issue 17/18): Python's ``ipaddress`` accepts
``fe80::1%<anything but / and %>`` -- ``;``, spaces, ``$( )``, backquotes -- so a host name or an
address that passed as "an IP address" could carry a command into launch's remote script (``ip -o
addr show to ADDR``, run by the user's shell on the host), a hostfile line or an ssh argument.  A
daemon signs its addresses (``Gpusd-Addrs``) and its name (``Gpusd-Host``): one fleet member must not
run commands as the user who launches a job through it."""

from __future__ import annotations

import os
import stat
import subprocess
from pathlib import Path

import pytest

from gpusd.engines.generate import HostCommand
from gpusd.engines.launch import LaunchOptions, _iface_lines
from gpusd.engines.placement import HostSlot, Placement, PlacementError, check_ssh_target, valid_host
from gpusd.wire.signing import decode_addresses

SCOPED = ["fe80::1%;touch${IFS}pwned", "fe80::1%$(touch pwned)", "fe80::1%`touch pwned`", "fe80::1%a b",
          "fe80::1%x|sh", "::1%&touch pwned", "fe80::1%\n", "fe80::1%eth0;id", "fe80::1%'"]


@pytest.mark.parametrize("text", SCOPED)
def test_a_scope_id_with_shell_characters_is_no_host(text: str) -> None:
    assert not valid_host(text)
    with pytest.raises(PlacementError):
        check_ssh_target(text)
    with pytest.raises(PlacementError):
        HostSlot("node-1", text, "node-1", (0,))
    with pytest.raises(PlacementError):
        Placement.from_dict({"job_id": "j", "hosts": [{"hostname": text, "gpus": [0]}]})


@pytest.mark.parametrize("text", SCOPED)
def test_a_signed_address_list_drops_such_scopes(text: str) -> None:
    assert decode_addresses(f"{text},198.18.0.2") == ("198.18.0.2",)


def test_plain_scope_ids_still_work() -> None:
    for text in ("fe80::1%eth0", "fe80::1%2", "fe80::1%br-lan.10", "fe80::1%veth_x"):
        assert valid_host(text) and decode_addresses(text) == (text,)


def test_the_interface_lookup_passes_the_address_as_one_word(tmp_path: Path) -> None:
    """Even an address that got past the checks reaches ``ip`` as one argument: nothing runs."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    log = tmp_path / "ip.log"
    ip = bindir / "ip"
    ip.write_text(f'#!/bin/sh\nfor a in "$@"; do printf "%s\\n" "$a"; done > {log}\necho "2: eth7    inet x"\n')
    ip.chmod(ip.stat().st_mode | stat.S_IXUSR)
    slot = HostSlot("node-1", "fe80::1%eth0", "node-1", (0,))
    object.__setattr__(slot, "address", "fe80::1%;touch${IFS}pwned")  # as if a check had let it through
    script = _iface_lines(HostCommand(slot, 0, ["true"], iface_env=("GLOO_SOCKET_IFNAME",)))
    script += 'echo "if=$GLOO_SOCKET_IFNAME"\n'
    env = {k: v for k, v in os.environ.items() if k != "GLOO_SOCKET_IFNAME"}
    r = subprocess.run(["sh", "-c", script], cwd=tmp_path, env={**env, "PATH": f"{bindir}:{env['PATH']}"},
                       capture_output=True, text=True, timeout=30)
    assert not (tmp_path / "pwned").exists(), "the address ran as a command"
    assert log.read_text().splitlines() == ["-o", "addr", "show", "to", "fe80::1%;touch${IFS}pwned"]
    assert "if=eth7" in r.stdout
    assert LaunchOptions().watchdog  # (the options the script is built with are the defaults)
