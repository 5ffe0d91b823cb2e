"""The fair-use policy file (issue 20, docs/allocation.md "The policy file", gpusd.alloc.policy): caps per
user and per group on one host, for local runs (real accounts, forked children running ``gpusd run``
under their uids) and the file's safety checks."""

from __future__ import annotations

import contextlib
import io
import json
import os
from pathlib import Path

import pytest

from other_user import AsUser
from user_keys import Accounts, accounts, needs_accounts  # noqa: F401


def policy_file(d: Path, body: dict[str, object], mode: int = 0o644) -> Path:
    p = d / "policy.json"
    p.write_text(json.dumps(body))
    p.chmod(mode)
    return p


def run_cli(args: list[str]) -> str:
    from gpusd.cli import main

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main(args)
    return f"{code} {err.getvalue().strip()}"


@needs_accounts
def test_max_gpus_per_user_refuses_alices_second_run_naming_the_cap_while_bob_gets_a_gpu(
        shared_tmp: Path, accounts: Accounts, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    alice, bob = accounts.add("alice"), accounts.add("bob")
    shared_tmp.chmod(0o1777)
    locks = shared_tmp / "locks"
    monkeypatch.setenv("GPUSD_LOCK_DIR", str(locks))
    monkeypatch.setenv("GPUSD_SIMULATE", "3xA100-80GB")
    monkeypatch.setenv("GPUSD_LEASE_SOCKET", str(shared_tmp / "no-daemon.sock"))
    monkeypatch.setenv("GPUSD_STATE_DIR", str(shared_tmp / "state"))
    monkeypatch.setenv("GPUSD_POLICY", str(policy_file(shared_tmp, {"max_gpus_per_user": 1})))

    locks.mkdir()
    locks.chmod(0o1777)  # as an administrator makes it
    first = AsUser(alice.uid, _hold, stay=True)  # alice's first job holds one GPU (the API gpusd run uses)
    try:
        assert first.result == "ok leased", first.result
        second = AsUser(alice.uid, lambda: run_cli(["run", "-n", "1", "--", "true"]))
        second.stop()
        assert second.result.startswith("ok ") and not second.result.startswith("ok 0"), second.result
        assert "max_gpus_per_user 1" in second.result and alice.name in second.result, second.result
        # and with --wait: refused at once too (a capped waiter would hold up everyone behind it)
        waiting = AsUser(alice.uid, lambda: run_cli(["run", "--wait", "--timeout", "20", "-n", "1", "--", "true"]))
        waiting.stop()
        assert "max_gpus_per_user 1" in waiting.result, waiting.result
        # bob still gets a GPU
        theirs = AsUser(bob.uid, lambda: run_cli(["run", "-n", "1", "--", "true"]))
        theirs.stop()
        assert theirs.result == "ok 0", theirs.result
    finally:
        first.stop()
        _kill_holders(locks)


_held: list[object] = []


def _hold() -> str:
    from gpusd.alloc.api import LeaseRequest, allocate
    from gpusd.alloc.select import Constraints

    _held.append(allocate(LeaseRequest(Constraints(count=1))))
    return "leased"


def _kill_holders(locks: Path) -> None:
    import signal

    from gpusd.alloc.leases import LeaseStore

    for le in LeaseStore(locks).leases():
        with contextlib.suppress(ProcessLookupError):
            os.kill(le.pid, signal.SIGKILL)


def test_the_policy_counts_a_group_together_and_is_believed_only_from_root(tmp_path: Path) -> None:
    import grp
    import pwd

    from gpusd.alloc import policy

    me = pwd.getpwuid(os.geteuid()).pw_name
    group = grp.getgrgid(pwd.getpwuid(os.geteuid()).pw_gid).gr_name
    p = policy.parse(json.dumps({"max_gpus_per_group": {group: 2}}).encode(), "test")
    assert p.refusal(me, 1, {me: 1}) is None
    why = p.refusal(me, 2, {me: 1})
    assert why is not None and f"max_gpus_per_group {group}: 2" in why
    for bad in ({"max_gpus_per_user": -1}, {"max_gpus_per_user": "2"}, {"maxgpus": 1}, {"fair_share_days": 0},
                {"priorities": {"max": "divine"}}, [1]):
        with pytest.raises(ValueError):
            policy.parse(json.dumps(bad).encode())
    good = policy_file(tmp_path, {"max_gpus_per_user": 1, "priorities": {"max": "normal"}})
    assert policy.load(str(good)).max_gpus_per_user == 1
    assert policy.load(str(good)).priorities.max_default == 1  # absorbed: the priority policy's own field
    good.chmod(0o666)  # writable by others: nobody's policy
    assert policy.load(str(good)).max_gpus_per_user is None
    good.chmod(0o644)
    link = tmp_path / "link.json"
    link.symlink_to(good)
    assert policy.load(str(link)).max_gpus_per_user is None


def test_one_cache_for_every_policy_file() -> None:
    """The fair-use and priority policies are read through one reader and one cache (alloc.policy);
    no other module keeps a cache of policy files."""
    import re

    from tests_paths import REPO

    alloc = REPO / "src" / "gpusd" / "alloc"
    for path in alloc.glob("*.py"):
        if path.name != "policy.py":
            assert not re.search(r"^_cache\b", path.read_text(), re.M), path.name
