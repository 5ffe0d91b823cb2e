"""A pick reads the process lists of the GPUs it is about to choose only, and still never chooses a
GPU its processes rule out (counted by the fake NVML: no timing).

A process list costs a driver about a millisecond (tests/fakenvml/README.md, "Cost and counting"):
a one-GPU pick that read every GPU's two lists spent most of its time there."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from fakenvml import COUNTS_ENV, FakeNvml, FakeProcess, call_counts, make_gpus

GiB = 2**30
EXCLUSIVE_PROCESS = 3  # NVML_COMPUTEMODE_EXCLUSIVE_PROCESS


def _lists(counts: Path) -> dict[str, int]:
    """The process-list calls this process made so far, by name."""
    return {k: v for k, v in call_counts(counts, os.getpid()).items() if "RunningProcesses" in k}


def _picks(fake: FakeNvml, gpus: list, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
           **constraints: object) -> tuple[list[list[int]], int]:
    """(The GPUs of three picks after a first one, the process-list calls those three made.)"""
    import gpusd

    fake.write(gpus)
    counts = tmp_path / "counts"
    counts.mkdir()
    monkeypatch.setenv(COUNTS_ENV, str(counts))
    gpusd.select(**constraints).release()  # type: ignore[arg-type]  # the static facts read
    before = sum(_lists(counts).values())
    chosen = []
    for _ in range(3):
        sel = gpusd.select(**constraints)  # type: ignore[arg-type]
        chosen.append([int(i) for i in sel.indices])
        sel.release()
    return chosen, sum(_lists(counts).values()) - before


def test_a_one_gpu_pick_reads_the_process_lists_of_the_gpu_it_chooses_only(
        fake_nvml_inprocess: FakeNvml, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    gpus = make_gpus(8, memory_used=GiB)
    chosen, lists = _picks(fake_nvml_inprocess, gpus, tmp_path, monkeypatch)
    assert chosen == [[0]] * 3
    assert lists == 3 * 2  # its compute and its graphics list; none of the seven others'


def test_a_busy_leading_candidate_is_passed_over_after_reading_its_list(
        fake_nvml_inprocess: FakeNvml, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """GPU 0 leads on memory and utilisation, but a process of someone else runs on it: the pick reads
    its lists, then GPU 1's, and chooses GPU 1 (as a pick that read every list would)."""
    gpus = make_gpus(8, memory_used=2 * GiB)
    gpus[0].memory_used = GiB
    gpus[0].processes = [FakeProcess(4242, 10 * 2**20), FakeProcess(4243, 10 * 2**20)]
    chosen, lists = _picks(fake_nvml_inprocess, gpus, tmp_path, monkeypatch)
    assert chosen == [[1]] * 3
    assert lists == 3 * 2 * 2  # GPU 0's two lists and GPU 1's, no other GPU's


def test_a_gpu_whose_processes_rule_it_out_is_never_chosen(
        fake_nvml_inprocess: FakeNvml, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """In exclusive compute mode a GPU with a process is taken: the least-loaded GPUs on memory and
    utilisation all have one, and the pick goes to the one that has none, however loaded."""
    gpus = make_gpus(4, memory_used=GiB, util_gpu=0)
    for g in gpus:
        g.compute_mode = EXCLUSIVE_PROCESS
    for g in gpus[:3]:
        g.processes = [FakeProcess(4242, 10 * 2**20)]
    gpus[3].memory_used, gpus[3].util_gpu = 60 * GiB, 90
    chosen, lists = _picks(fake_nvml_inprocess, gpus, tmp_path, monkeypatch)
    assert chosen == [[3]] * 3
    assert lists == 3 * 4 * 2  # every GPU's lists: each one ahead of GPU 3 turned out busy


def test_max_processes_refuses_a_busy_gpu_and_two_gpus_skip_it(
        fake_nvml_inprocess: FakeNvml, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    gpus = make_gpus(6, memory_used=2 * GiB)
    gpus[1].memory_used = GiB
    gpus[1].graphics_processes = [FakeProcess(4242, 10 * 2**20)]  # a graphics process counts as much
    chosen, lists = _picks(fake_nvml_inprocess, gpus, tmp_path, monkeypatch, count=2, max_processes=0)
    assert chosen == [[0, 2]] * 3
    assert lists == 3 * 3 * 2  # GPUs 1 and 0 first, then 2 in GPU 1's place


def test_no_gpu_free_of_processes_says_why_each_was_refused(
        fake_nvml_inprocess: FakeNvml, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import gpusd

    gpus = make_gpus(3, memory_used=GiB)
    for g in gpus:
        g.processes = [FakeProcess(4242, 10 * 2**20)]
    fake_nvml_inprocess.write(gpus)
    with pytest.raises(gpusd.NoGpuAvailable) as exc:
        gpusd.select(max_processes=0)
    for i in range(3):
        assert f"GPU {i}: 1 processes > 0" in str(exc.value)


@pytest.mark.parametrize("seed", range(6))
def test_reading_the_lists_later_chooses_as_reading_them_all(
        fake_nvml_inprocess: FakeNvml, monkeypatch: pytest.MonkeyPatch, seed: int) -> None:
    """Hosts of mixed load (processes, an exclusive GPU, NVLink pairs): each request gets the GPUs a
    pick that reads every GPU's lists first would give it."""
    import random

    import gpusd
    from fakenvml import nvlink_pairs
    from gpusd.inventory.nvml import NvmlBackend

    rng = random.Random(seed)
    gpus = make_gpus(8, memory_used=GiB)
    for i, g in enumerate(gpus):
        g.numa_node, g.host_bridge, g.pcie_switch = i // 4, i // 4, i // 2
        g.memory_used = rng.choice([1, 2, 4, 9, 30]) * GiB
        g.util_gpu = rng.choice([0, 0, 3, 8, 40])
        g.processes = [FakeProcess(5000 + k, GiB) for k in range(rng.choice([0, 0, 0, 1, 3]))]
        if rng.random() < 0.2:
            g.compute_mode = EXCLUSIVE_PROCESS
    nvlink_pairs(gpus, [(0, 1), (2, 3), (4, 5), (6, 7)])
    fake_nvml_inprocess.write(gpus)
    requests: list[dict[str, object]] = [{}, {"count": 2}, {"count": 3}, {"count": 2, "topology": "any"},
                                         {"max_processes": 0}, {"count": 2, "by": "util"}]

    def chosen(later: bool) -> list[object]:
        monkeypatch.setattr(NvmlBackend, "_defers_processes", later)
        out: list[object] = []
        for r in requests:
            try:
                out.append(gpusd.select(lease=False, **r).indices)  # type: ignore[arg-type]
            except gpusd.NoGpuAvailable as exc:
                out.append(str(exc))
        return out

    chosen(False)  # the static facts and the utilisation windows read
    assert chosen(True) == chosen(False)
