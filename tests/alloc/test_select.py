"""Constraints and ranking, on hand-made snapshots (pure functions)."""

import pytest

from gpusd.alloc.env import cuda_env
from gpusd.alloc.select import Constraints, candidates, choose
from gpusd.errors import ConfigError, NoGpuAvailable
from gpusd.model import GpuInfo, HostSnapshot, LeaseInfo, MigInstance, ProcessInfo

GiB = 2**30


def gpu(i, util=0.0, used=0, total=80 * GiB, **kw):
    return GpuInfo(index=i, uuid=f"GPU-{i:04d}", name="A100", memory_total=total, memory_used=used,
                   memory_free=total - used, utilization_gpu=util, **kw)


def snap(*gpus):
    return HostSnapshot(hostname="h", node_id="n", timestamp=0.0, gpus=list(gpus))


def pick(s, env=None, leases=None, **kw):
    return [c.label for c in choose(s, Constraints.build(**kw), leases=leases, env=env or {})]


def test_least_loaded_first_by_default():
    s = snap(gpu(0, util=90), gpu(1, util=10, used=60 * GiB), gpu(2, util=20, used=GiB), gpu(3, util=5))
    assert pick(s, count=2) == ["3", "2"]


def test_by_util_and_by_memory():
    s = snap(gpu(0, util=50, used=GiB), gpu(1, util=10, used=70 * GiB), gpu(2, util=30, used=10 * GiB))
    assert pick(s, count=3, by="util") == ["1", "2", "0"]
    assert pick(s, count=3, by="memory") == ["0", "2", "1"]


def test_constraints_filter_and_explain():
    s = snap(gpu(0, util=95), gpu(1, used=75 * GiB), gpu(2, processes=[ProcessInfo(1), ProcessInfo(2)]), gpu(3))
    assert pick(s, count=1, max_util=50, min_free="8GiB", max_processes=1) == ["3"]
    with pytest.raises(NoGpuAvailable) as err:
        pick(s, count=2, max_util=50, min_free="8GiB", max_processes=1)
    msg = str(err.value)
    assert "need 2, 1 qualify" in msg and "GPU 0: utilisation 95%" in msg and "GPU 1: 5.0GiB free" in msg
    assert "GPU 2: 2 processes" in msg


def test_min_free_as_ratio():
    s = snap(gpu(0, used=50 * GiB), gpu(1, used=30 * GiB))
    assert pick(s, count=1, min_free="0.5") == ["1"]
    assert pick(s, count=1, min_free="50%") == ["1"]


def test_include_exclude_by_index_or_uuid():
    s = snap(gpu(0), gpu(1), gpu(2), gpu(3))
    assert pick(s, count=2, include="1,3") == ["1", "3"]
    with pytest.raises(NoGpuAvailable):
        pick(s, count=3, exclude=["0", "GPU-0002"])
    assert pick(s, count=2, exclude=["0", "GPU-0002"]) == ["1", "3"]


def test_unhealthy_and_mig_mode_gpus_are_not_given_whole():
    s = snap(gpu(0, healthy=False, error="GPU is lost"), gpu(1, mig_mode=True), gpu(2, compute_mode="prohibited"),
             gpu(3))
    assert pick(s, count=1) == ["3"]
    ok, rejected = candidates(s, Constraints.build(count=1), env={})
    assert any("unhealthy" in r for r in rejected) and any("MIG mode" in r for r in rejected)


def test_mig_slices_are_selected_and_emitted_as_uuids():
    g = gpu(0, mig_mode=True, mig_instances=[
        MigInstance(0, "MIG-aaaa", "3g.40gb", 40 * GiB, 30 * GiB), MigInstance(1, "MIG-bbbb", "3g.40gb", 40 * GiB, 0)])
    s = snap(g, gpu(1))
    chosen = choose(s, Constraints.build(count=1, mig=True), env={})
    assert [c.uuid for c in chosen] == ["MIG-bbbb"]
    env = cuda_env([c.gpu.index for c in chosen], uuids=[c.uuid for c in chosen])
    assert env == {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": "MIG-bbbb"}


def test_inherited_cuda_visible_devices_limits_the_choice():
    s = snap(gpu(0), gpu(1), gpu(2, util=50), gpu(3, util=60))
    assert pick(s, count=1, env={"CUDA_VISIBLE_DEVICES": "2,3"}) == ["2"]
    assert pick(s, count=1, env={"CUDA_VISIBLE_DEVICES": "GPU-0003"}) == ["3"]
    with pytest.raises(NoGpuAvailable, match="outside the inherited CUDA_VISIBLE_DEVICES"):
        pick(s, count=1, env={"CUDA_VISIBLE_DEVICES": ""})
    # CUDA stops at the first invalid entry
    assert pick(s, count=1, env={"CUDA_VISIBLE_DEVICES": "3,foo,0"}) == ["3"]
    with pytest.raises(NoGpuAvailable):
        pick(s, count=2, env={"CUDA_VISIBLE_DEVICES": "3,foo,0"})
    assert pick(s, count=1, env={"CUDA_VISIBLE_DEVICES": "2"}, within_visible=False) == ["0"]


def test_inherited_amd_and_intel_device_lists_limit_the_choice_as_cuda_visible_devices_does():
    """Under Slurm (or a parent) that set ROCR_VISIBLE_DEVICES, HIP_VISIBLE_DEVICES or ZE_AFFINITY_MASK,
    the job got GPUs outside its allocation: only CUDA_VISIBLE_DEVICES was honoured."""
    from dataclasses import replace

    amd = [replace(gpu(i, util=10 * i, vendor="amd"), uuid=f"GPU-{0xA0 + i:016X}") for i in range(3)]
    intel = [gpu(3 + i, util=10 * i, vendor="intel", vendor_index=i) for i in range(2)]
    s = snap(*amd, *intel)
    assert pick(s, count=1, vendor="amd", env={"ROCR_VISIBLE_DEVICES": "2"}) == ["2"]
    # by UUID, in the lower case ROCr writes
    assert pick(s, count=1, vendor="amd", env={"ROCR_VISIBLE_DEVICES": f"{amd[1].uuid.lower()}"}) == ["1"]
    # set but empty: ROCr shows no GPU
    with pytest.raises(NoGpuAvailable, match="outside the inherited ROCR_VISIBLE_DEVICES"):
        pick(s, count=1, vendor="amd", env={"ROCR_VISIBLE_DEVICES": ""})
    # HIP numbers what ROCr leaves: 1 of (1, 2) is GPU 2
    assert pick(s, count=1, vendor="amd", env={"ROCR_VISIBLE_DEVICES": "1,2", "HIP_VISIBLE_DEVICES": "1"}) == ["2"]
    assert pick(s, count=1, vendor="amd", env={"HIP_VISIBLE_DEVICES": "1"}) == ["1"]
    with pytest.raises(NoGpuAvailable, match="outside the inherited HIP_VISIBLE_DEVICES"):
        pick(s, count=2, vendor="amd", env={"HIP_VISIBLE_DEVICES": "1"})
    assert pick(s, count=1, vendor="intel", env={"ZE_AFFINITY_MASK": "1"}) == ["4"]
    assert pick(s, count=1, vendor="intel", env={"ZE_AFFINITY_MASK": "1.0"}) == ["4"]
    with pytest.raises(NoGpuAvailable, match="outside the inherited ZE_AFFINITY_MASK"):
        pick(s, count=2, vendor="intel", env={"ZE_AFFINITY_MASK": "1"})
    # an empty mask is no mask to Level Zero; the limit is per vendor (AMD's leaves Intel's GPUs alone)
    assert pick(s, count=2, vendor="intel", env={"ZE_AFFINITY_MASK": ""}) == ["3", "4"]
    assert pick(s, count=1, env={"ROCR_VISIBLE_DEVICES": "2", "ZE_AFFINITY_MASK": "1"}) == ["4"]
    assert pick(s, count=1, vendor="amd", env={"ROCR_VISIBLE_DEVICES": "2"}, within_visible=False) == ["0"]


def test_the_authority_request_carries_the_inherited_amd_and_intel_lists(monkeypatch):
    """The daemon cannot see the client's environment: the request carries the lists, validated."""
    from gpusd.alloc.authority import request
    from gpusd.daemon.leasereq import constraints

    monkeypatch.setenv("ROCR_VISIBLE_DEVICES", "1,2")
    monkeypatch.setenv("ZE_AFFINITY_MASK", "0")
    monkeypatch.delenv("HIP_VISIBLE_DEVICES", raising=False)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    req = request(Constraints.build(count=1))
    assert req["visible_vars"] == {"ROCR_VISIBLE_DEVICES": "1,2", "ZE_AFFINITY_MASK": "0"}
    assert constraints(req)["visible"] == {"ROCR_VISIBLE_DEVICES": "1,2", "ZE_AFFINITY_MASK": "0"}
    with pytest.raises(ConfigError, match="visible_vars"):
        constraints({**req, "visible_vars": {"LD_PRELOAD": "x"}})


def lease(dev, pid=1, shared=False, memory=None):
    return LeaseInfo(lease_id=f"l{pid}", pid=pid, user="bob", shared=shared, memory=memory, device=dev)


def test_leased_gpus_are_skipped_exclusive_and_shared():
    s = snap(gpu(0), gpu(1, util=50), gpu(2, util=60))
    assert pick(s, count=1, leases=[lease("GPU-0000")]) == ["1"]
    with pytest.raises(NoGpuAvailable, match="leased by bob:1"):
        pick(s, count=3, leases=[lease("GPU-0000")])
    # a shared job may join a GPU shared by others, never an exclusive one
    assert pick(s, count=1, shared=True, leases=[lease("GPU-0002", shared=True), lease("GPU-0000")]) == ["2"]
    assert pick(s, count=1, leases=[lease("GPU-0002", shared=True), lease("GPU-0000")]) == ["1"]


def test_shared_jobs_pack_by_requested_memory():
    s = snap(gpu(0), gpu(1), gpu(2))
    leases = [lease("GPU-0001", pid=10, shared=True, memory=30 * GiB)]
    # fits beside the 30 GiB job: packed onto GPU 1
    assert pick(s, count=1, shared=True, memory="40GiB", leases=leases) == ["1"]
    # does not fit (80 - 30 < 60): a fresh GPU
    assert pick(s, count=1, shared=True, memory="60GiB", leases=leases) == ["0"]


def test_requested_memory_counts_until_the_job_allocates_it():
    s = snap(gpu(0, used=40 * GiB))
    leases = [lease("GPU-0000", pid=4242, shared=True, memory=30 * GiB)]
    with pytest.raises(NoGpuAvailable, match="10.0GiB free"):
        pick(s, count=1, shared=True, min_free="20GiB", leases=leases)
    # once the job's process holds its 30 GiB, the reservation is not counted twice
    s2 = snap(gpu(0, used=70 * GiB, processes=[ProcessInfo(pid=4242, used_memory=30 * GiB)]))
    c = choose(s2, Constraints.build(count=1, shared=True, min_free="8GiB"), leases=leases, env={})
    assert c[0].free == 10 * GiB


@pytest.mark.parametrize("kw, msg", [
    ({"count": 0}, "count"), ({"by": "random"}, "--by"), ({"min_free": "lots"}, "not a size"),
    ({"max_util": 150}, "max-util"), ({"memory": "0.5"}, "ratio"),
])
def test_bad_constraints_are_config_errors(kw, msg):
    with pytest.raises(ConfigError, match=msg):
        Constraints.build(**kw)


# -- the constraints are defined once (Constraints' fields); flags and select() keywords derive from them --

def test_build_takes_exactly_the_fields() -> None:
    import dataclasses
    import inspect

    params = list(inspect.signature(Constraints.build).parameters)
    assert params == [f.name for f in dataclasses.fields(Constraints)]


def test_select_keywords_are_the_constraints_plus_how_to_take_them() -> None:
    import inspect

    import gpusd
    from gpusd.alloc.select import constraint_keywords

    sig = inspect.signature(gpusd.select).parameters
    keywords = constraint_keywords()
    assert {k: sig[k].default for k in keywords if k in sig} == keywords  # every constraint, same default
    not_constraints = set(sig) - set(keywords)
    assert not_constraints == {"lease", "wait", "timeout", "use_uuid", "simulate"}


def test_the_documented_select_keywords_still_work() -> None:
    from gpusd.alloc.select import Constraints as C

    c = C.from_keywords(count=2, min_free="8GiB", max_util=50.0, max_processes=1, include="0,2", exclude=[3],
                        mig=False, by="util", share=True, within_visible=False)
    assert (c.count, c.min_free, c.memory, c.max_util, c.max_processes) == (2, 8 * 2**30, 8 * 2**30, 50.0, 1)
    assert (c.include, c.exclude, c.by, c.shared, c.within_visible) == (["0", "2"], ["3"], "util", True, False)
    with pytest.raises(TypeError, match="unknown constraint 'max_temp'"):
        C.from_keywords(max_temp=80)


def test_cli_flags_are_derived_from_the_fields() -> None:
    import dataclasses

    from gpusd.cli import build_parser
    from gpusd.cli.options import to_constraints as constraints_from_args

    parser = build_parser("select")
    sub = next(a for a in parser._actions if a.dest == "command").choices["select"]  # type: ignore[union-attr]
    flags = {opt for a in sub._actions for opt in a.option_strings}
    for f in dataclasses.fields(Constraints):
        assert set(f.metadata["flags"]) <= flags, f.name
    args = parser.parse_args(["select", "-n", "2", "--min-free", "8GiB", "--max-util", "50", "--max-processes", "1",
                              "--include", "0,2", "--exclude", "3", "--by", "util", "--share"])
    assert constraints_from_args(args) == Constraints.from_keywords(
        count=2, min_free="8GiB", max_util=50.0, max_processes=1, include="0,2", exclude="3", by="util", share=True)
    assert constraints_from_args(parser.parse_args(["select"])) == Constraints.build()  # defaults agree too
