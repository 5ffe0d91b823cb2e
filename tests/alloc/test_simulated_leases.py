"""Issue 18, item 7: a GPU shown as leased in a simulation scenario (carol's reservation in
tests/scenarios/two_users.json, docs/simulation.md) is never handed out before a free one: the
snapshot's own leases count as much as the lock directory's."""

from __future__ import annotations

from pathlib import Path

from conftest import gpusd_cli

SCENARIO = Path(__file__).resolve().parents[1] / "scenarios" / "two_users.json"


def test_select_in_the_two_users_scenario_skips_carols_leased_gpu():
    # GPU 2 and GPU 3 are alike (idle, no memory used) but carol leases GPU 2; GPU 0 has alice's
    # 20 GiB; the loads of GPU 0 and 1 follow the wall clock
    for n in (1, 2, 3):
        r = gpusd_cli(["select", "-n", str(n), "--simulate", str(SCENARIO)])
        assert r.returncode == 0, r.stderr
        assert "2" not in r.stdout.strip().split(","), (n, r.stdout)
    r = gpusd_cli(["select", "-n", "4", "--simulate", str(SCENARIO)])
    assert r.returncode == 4 and "GPU 2: leased by carol:303" in r.stderr, r.stderr


def test_run_in_the_scenario_never_gets_the_leased_gpu():
    r = gpusd_cli(["run", "-n", "3", "--simulate", str(SCENARIO), "--", "sh", "-c", "echo $CUDA_VISIBLE_DEVICES"])
    assert r.returncode == 0 and set(r.stdout.strip().split(",")) == {"0", "1", "3"}, r.stderr


def test_a_lease_given_and_shown_is_counted_once():
    """The same lease in the lock directory's list and attached to the snapshot: one lease, not two."""
    from gpusd.alloc.select import Constraints, candidates
    from gpusd.inventory.simulated import SimulatedBackend
    from gpusd.model import LeaseInfo

    snap = SimulatedBackend("2xA100-80GB").snapshot()
    lease = LeaseInfo(lease_id="abc", pid=1, memory=2**30, shared=True, device=snap.gpus[0].uuid)
    snap.gpus[0].leases = [lease]
    ok, _ = candidates(snap, Constraints.build(count=1, shared=True), [lease])
    assert [len(c.leases) for c in ok if c.gpu.index == 0] == [1]


def test_a_simulated_daemons_gpus_are_never_handed_out_without_a_word(fake_nvml, cli_env):
    """A daemon started with --simulate as the lease authority: select and run (which did not ask for
    simulated GPUs) still get its GPUs, and say on stderr that they are simulated."""
    from authority_helpers import ServerThread

    server = ServerThread(simulate="2xA100-80GB")
    try:
        for argv in (["select", "-n", "1"], ["run", "-n", "1", "--", "true"]):
            r = gpusd_cli(argv, env=cli_env)
            assert r.returncode == 0, r.stderr
            assert "SIMULATED GPUs" in r.stderr, (argv, r.stderr)
    finally:
        server.stop()
