"""A simulated GPU lost and brought back while the backend runs (docs/simulation.md, "Losing a GPU
while gpusd runs"): the scenario file's ``lost`` is read again when the file changes."""

from __future__ import annotations

import json
import os
from pathlib import Path

from gpusd.inventory.simulated import SimulatedBackend


def _write(path: Path, lost: list[bool], models: list[str] | None = None) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"hostname": "sim-l", "gpus": [
        {"model": m, "util": 10, "lost": x} for m, x in zip(models or ["A100-80GB"] * len(lost), lost)]}))
    os.replace(tmp, path)  # a new inode: the change is seen whatever the clock's resolution


def test_a_gpu_lost_in_the_scenario_while_running_is_lost_then_back(tmp_path: Path) -> None:
    path = tmp_path / "s.json"
    _write(path, [False, False])
    sim = SimulatedBackend(str(path))
    assert all(g.healthy for g in sim.snapshot().gpus)
    _write(path, [True, False])
    gone = sim.snapshot().gpus
    assert [g.healthy for g in gone] == [False, True] and "lost" in (gone[0].error or "")
    _write(path, [False, False])
    assert all(g.healthy for g in sim.snapshot().gpus)


def test_a_broken_or_different_scenario_changes_nothing(tmp_path: Path) -> None:
    path = tmp_path / "s.json"
    _write(path, [False, True])
    sim = SimulatedBackend(str(path))
    path.write_text("{not json")
    assert [g.healthy for g in sim.snapshot().gpus] == [True, False]
    _write(path, [True, True, True])  # other GPUs: not this host's scenario any more
    assert [g.healthy for g in sim.snapshot().gpus] == [True, False]
    _write(path, [False, False], models=["H100-80GB", "H100-80GB"])
    assert [g.healthy for g in sim.snapshot().gpus] == [True, False]
