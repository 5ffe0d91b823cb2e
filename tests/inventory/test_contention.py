"""The contention model of the simulator (gpusd.inventory.contention): sharing slows jobs by the
others' utilisation, memory that does not fit kills the job that allocates last, and 2-GPU jobs
communicate at the speed of their worst link."""

from __future__ import annotations

import pytest

from gpusd.inventory.contention import NVLINK_BW, PCIE_BW, RETRIES, Box, Gpu, Job, State, lower_bound, rate, run

GiB = 2**30


def _box(n: int = 2, nvlink: bool = True) -> Box:
    return Box([Gpu(i, 80 * GiB) for i in range(n)], lambda idx: 0 if nvlink or len(idx) < 2 else 2, 0 if nvlink else 2)


def _on(gpus):
    return lambda state, job: list(gpus)


def test_two_full_jobs_on_one_gpu_each_run_at_half_speed():
    assert rate(100.0) == pytest.approx(0.5) and rate(0.0) == 1.0 and rate(30.0) == pytest.approx(1 / 1.3)
    jobs = [Job("a", 0.0, 1, 100.0, 100.0, GiB), Job("b", 0.0, 1, 100.0, 100.0, GiB)]
    r = run(_box(), jobs, _on([0]), ramp=0.0)
    assert [j.end for j in r.jobs] == [pytest.approx(200.0)] * 2
    r = run(_box(), jobs, lambda s, j: [0] if j.name == "a" else [1], ramp=0.0)
    assert r.makespan == pytest.approx(100.0) and r.mean_jct == pytest.approx(100.0)


def test_background_load_slows_a_job_in_proportion():
    box = _box()
    box.gpus[0].background_util = 50.0
    r = run(box, [Job("a", 0.0, 1, 100.0, 90.0, GiB)], _on([0]), ramp=0.0)
    assert r.makespan == pytest.approx(150.0)


def test_memory_that_does_not_fit_kills_the_job_that_allocates_last():
    jobs = [Job("a", 0.0, 1, 100.0, 50.0, 50 * GiB), Job("b", 5.0, 1, 100.0, 50.0, 50 * GiB)]
    seen = []

    def policy(state: State, job: Job):
        seen.append((job.name, state.memory_used(0)))
        return [0] if job.ooms == 0 else [1]  # after its OOM, its user runs it elsewhere
    r = run(_box(), jobs, policy, ramp=20.0)
    b = next(j for j in r.jobs if j.name == "b")
    assert r.oom == 1 and b.ooms == 1 and b.placed == [1] and r.completed == 2
    assert seen[1] == ("b", 0)  # before a's ramp, NVML showed nothing in use on GPU 0
    never = run(_box(), [Job("c", 0.0, 1, 100.0, 50.0, 90 * GiB)], _on([0]), ramp=20.0)  # more than the GPU
    assert never.given_up == 1 and never.oom == RETRIES + 1 and never.completed == 0  # given up, not forever


def test_a_two_gpu_job_communicates_at_its_links_speed():
    job = Job("d", 0.0, 2, 100.0, 90.0, GiB, comm_bytes=10 * NVLINK_BW)
    assert job.standalone(0) == pytest.approx(110.0)
    assert job.standalone(2) == pytest.approx(100 + 10 * NVLINK_BW / PCIE_BW)
    assert run(_box(nvlink=True), [job], _on([0, 1]), ramp=0.0).makespan == pytest.approx(110.0)
    assert run(_box(nvlink=False), [job], _on([0, 1]), ramp=0.0).makespan == pytest.approx(204.0)


def test_a_job_runs_at_its_slowest_gpus_rate():
    box = _box()
    box.gpus[1].background_util = 100.0
    r = run(box, [Job("d", 0.0, 2, 100.0, 90.0, GiB)], _on([0, 1]), ramp=0.0)
    assert r.makespan == pytest.approx(200.0)


def test_the_lower_bound_is_below_any_schedule():
    jobs = [Job(f"j{i}", 10.0 * i, 1, 100.0, 100.0, GiB) for i in range(6)]
    ms, jct = lower_bound(_box(), jobs)
    r = run(_box(), jobs, lambda s, j: [min(range(2), key=lambda i: len(s.jobs_on(i)))], ramp=0.0)
    assert ms <= r.makespan and jct <= r.mean_jct
    assert ms == pytest.approx(max(50 + 100, 0 + 600 / 2)) and jct == pytest.approx(100.0)


def test_a_policy_that_never_places_ends_the_run():
    r = run(_box(), [Job("a", 0.0, 1, 10.0, 50.0, GiB)], lambda s, j: None)
    assert r.completed == 0
