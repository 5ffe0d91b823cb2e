"""Caps the client cannot choose (issue 39, row 4): the root-owned policy applies whatever the client's
environment says (``GPUSD_POLICY`` can only make it stricter), and where a daemon is the lease
authority, leases taken in the shared lock directory are shown as "not through the authority", count
against their user's cap, and a user over the cap is flagged (docs/allocation.md)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from authority_helpers import ServerThread
from conftest import gpusd_cli
from fakenvml import make_gpus

GPUSD = [sys.executable, "-m", "gpusd"]


def policy_file(path: Path, body: dict[str, object]) -> Path:
    path.write_text(json.dumps(body))
    path.chmod(0o644)  # root's (the tests run as root), readable by all, writable by none else
    return path


@pytest.fixture
def root_policy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The administrator's /etc/gpusd/policy.json, here (only this process reads it from here)."""
    if os.geteuid() != 0:
        pytest.skip("a policy file is believed only when root owns it: run as root")
    from gpusd.alloc import policy

    path = policy_file(tmp_path / "policy.json", {"max_gpus_per_user": 1, "fair_share_days": 7})
    monkeypatch.setattr(policy, "FAIR_USE_PATH", str(path))
    return path


def test_gpusd_policy_can_only_make_the_root_policy_stricter(
        root_policy: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from gpusd.alloc.policy import load

    for name in ("/nonexistent", str(tmp_path / "missing.json")):  # the attack: a file that is not there
        monkeypatch.setenv("GPUSD_POLICY", name)
        assert load().max_gpus_per_user == 1
    laxer = policy_file(tmp_path / "lax.json", {"max_gpus_per_user": 8, "idle_warn_minutes": 600,
                                                "priorities": {"max": "urgent"}})
    monkeypatch.setenv("GPUSD_POLICY", str(laxer))
    p = load()
    assert p.max_gpus_per_user == 1 and p.fair_share_days == 7 and p.priorities is None
    assert p.idle_warn_minutes == 600  # a limit root's file does not set: added (it only adds)
    strict = policy_file(tmp_path / "strict.json", {"max_gpus_per_user": 0, "max_gpus_per_group": {"interns": 2},
                                                    "fair_share_days": 1})
    monkeypatch.setenv("GPUSD_POLICY", str(strict))
    p = load()
    assert (p.max_gpus_per_user, p.max_gpus_per_group, p.fair_share_days) == (0, {"interns": 2}, 7)


def test_a_client_that_bypasses_the_daemon_is_capped_by_the_root_policy_all_the_same(
        root_policy: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``GPUSD_LEASE_SOCKET=off GPUSD_POLICY=/nonexistent gpusd run -n 2`` under a cap of 1: the client's
    environment picked the policy file, so nothing was capped."""
    from gpusd.alloc.api import LeaseRequest, allocate
    from gpusd.alloc.policy import OverCap
    from gpusd.alloc.select import Constraints

    monkeypatch.setenv("GPUSD_LEASE_SOCKET", "off")
    monkeypatch.setenv("GPUSD_POLICY", "/nonexistent")
    with pytest.raises(OverCap, match="max_gpus_per_user 1"):
        allocate(LeaseRequest(Constraints(count=2), simulate="3xA100-80GB"))


def test_leases_outside_the_authority_are_shown_counted_and_flagged_over_the_cap(
        fake_nvml_inprocess, cli_env, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake_nvml_inprocess.write(make_gpus(3))
    cap = policy_file(tmp_path / "cap.json", {"max_gpus_per_user": 1})
    server = ServerThread()  # the daemon, lease authority (its policy: this process's)
    bypass = subprocess.Popen([*GPUSD, "run", "-n", "2", "--", "sleep", "60"], start_new_session=True,
                              env=dict(cli_env, GPUSD_LEASE_SOCKET="off", GPUSD_POLICY="/nonexistent"))
    viewer = dict(cli_env, GPUSD_POLICY=str(cap))  # a stricter policy: allowed
    try:
        def mine() -> list[dict[str, object]]:
            r = gpusd_cli(["leases", "--json"], env=viewer)
            return [le for le in json.loads(r.stdout)["leases"] if not le.get("unleased")]

        deadline = time.monotonic() + 20
        while len(mine()) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        held = mine()
        assert len(held) == 2 and all(le["outside_authority"] and le["over_cap"] for le in held), held
        table = gpusd_cli(["leases"], env=viewer).stdout
        assert "2 NOT through the lease authority" in table and "over the cap: " in table, table
        assert "[not through the authority]" in table and "OVER CAP" in table
        devices = json.loads(gpusd_cli(["devices", "--json"], env=viewer).stdout)
        shown = [le for g in devices["gpus"] for le in g["leases"]]
        assert len(shown) == 2 and all(le["outside_authority"] and le["over_cap"] for le in shown), shown
        table = gpusd_cli(["devices"], env=viewer).stdout
        assert table.count("(not-through-authority)(OVER-CAP)") == 2, table
        from gpusd.model import HostSnapshot
        from gpusd.views.top import _leases

        snap = HostSnapshot.from_dict(devices)
        assert all("not through the authority OVER CAP" in _leases(g) for g in snap.gpus if g.leases)
        # they count against the user's cap at the authority: no third GPU through the daemon
        monkeypatch.setenv("GPUSD_POLICY", str(cap))
        r = gpusd_cli(["run", "-n", "1", "--", "true"], env=viewer)
        assert r.returncode != 0 and "max_gpus_per_user 1" in r.stderr, r.stderr
    finally:
        try:
            os.killpg(bypass.pid, 9)
        except ProcessLookupError:
            pass
        bypass.wait()
        server.stop()


def test_a_closed_shared_directory_sends_every_lease_through_the_daemon(
        fake_nvml_inprocess, shared_tmp: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What docs/allocation.md tells an administrator: the lock directory root's, mode 0755. A user
    can then lease only through the daemon; a client that turns the daemon off gets no lease."""
    from other_user import MALLORY, AsUser

    if os.geteuid() != 0:
        pytest.skip("needs root to play a second, unprivileged user")
    fake_nvml_inprocess.write(make_gpus(2))
    locks = shared_tmp / "locks"
    locks.mkdir()
    locks.chmod(0o755)  # install -d -o root -g root -m 0755
    monkeypatch.setenv("GPUSD_LOCK_DIR", str(locks))
    monkeypatch.setenv("GPUSD_LEASE_SOCKET", str(shared_tmp / "run" / "lease.sock"))
    server = ServerThread()

    def lease(socket: str | None) -> str:
        from gpusd.alloc.api import LeaseRequest, allocate
        from gpusd.alloc.select import Constraints

        if socket is not None:
            os.environ["GPUSD_LEASE_SOCKET"] = socket
        sel = allocate(LeaseRequest(Constraints(count=1)))
        return f"leased {len(sel.devices)}"

    try:
        bypass = AsUser(MALLORY, lambda: lease("off"))
        bypass.stop()
        assert bypass.result.startswith("error") and "not writable for you" in bypass.result, bypass.result
        through = AsUser(MALLORY, lambda: lease(None))
        through.stop()
        assert through.result == "ok leased 1", through.result
    finally:
        server.stop()


def test_the_report_shows_gpu_hours_held_outside_the_authority(tmp_path: Path) -> None:
    """The usage history charges a lease the authority did not grant to its user, and the report says so."""
    from gpusd.model import GpuInfo, HostSnapshot, LeaseInfo
    from gpusd.usage import query
    from gpusd.usage.db import Retention, connect
    from gpusd.usage.recorder import Accountant
    from gpusd.usage.report import build
    from gpusd.views.report import render

    conn = connect(tmp_path / "h.sqlite")
    acc = Accountant(conn, 10.0)
    t0 = time.time() - 3600
    for i in range(7):
        leases = [LeaseInfo(lease_id="ab12cd34", pid=1, user="bob", device="GPU-h-0", outside_authority=True),
                  LeaseInfo(lease_id="ef56ab78", pid=2, user="alice", device="GPU-h-1")]
        gpus = [GpuInfo(index=i, uuid=f"GPU-h-{i}", name="A100", memory_total=1, memory_used=0, memory_free=1,
                        utilization_gpu=0.0, leases=[le for le in leases if le.device == f"GPU-h-{i}"])
                for i in range(2)]
        acc.add(HostSnapshot(hostname="h", node_id="0", timestamp=t0 + 10 * i, gpus=gpus))
    answer = query.usage(conn, t0 - 60, t0 + 600, t0 + 600, Retention(), True, host="h", node_id="0")
    report = build([answer], by="user")
    rows = {r["user"]: r for r in report["rows"]}
    assert rows["bob"]["gpu_hours_outside_authority"] > 0 and rows["alice"]["gpu_hours_outside_authority"] == 0
    text = render(report, "table")
    assert "Held NOT through the lease authority" in text and "bob" in text.split("Held NOT")[1]


def test_over_cap_flags_every_lease_of_a_user_or_group_past_a_cap() -> None:
    from gpusd.alloc.policy import Policy, flag_over_cap, over_caps
    from gpusd.model import LeaseInfo

    leases = [LeaseInfo(lease_id=f"l{i}", pid=1, user="root", device=f"GPU-{i}") for i in range(3)]
    leases.append(LeaseInfo(lease_id="m", pid=2, user="nobody-such-user", device="GPU-9"))
    assert over_caps(leases, Policy(max_gpus_per_user=3)) == {}
    flagged = flag_over_cap(leases, Policy(max_gpus_per_user=2))
    assert [le.over_cap for le in flagged] == [True, True, True, False]
    assert not any(le.over_cap for le in leases)  # copies: the records as read stay as they were
    why = over_caps(leases, Policy(max_gpus_per_group={"root": 2}))
    assert list(why) == ["root"] and "max_gpus_per_group root: 2" in why["root"]
