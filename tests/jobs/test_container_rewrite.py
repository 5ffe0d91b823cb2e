"""The container rewrite per runtime and vendor (gpusd.jobs.containers; docs/allocation.md, "Containers"):
render nodes from a sysfs fixture tree, CDI names from spec files, docker's CDI switch."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gpusd.errors import ConfigError
from gpusd.jobs.containers import Leased, cdi_specs, parse

AMD = [Leased("amd", 1, "GPU-00112233aabbccdd", "0000:c3:00.0"),
       Leased("amd", 3, "GPU-44556677aabbccdd", "0000:e3:00.0")]
INTEL = [Leased("intel", 2, None, "0000:4d:00.0")]


@pytest.fixture
def sysfs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "sys"
    for bdf, node in (("0000:c3:00.0", "renderD129"), ("0000:e3:00.0", "renderD131"), ("0000:4d:00.0", "renderD128")):
        d = root / "bus/pci/devices" / bdf / "drm"
        d.mkdir(parents=True)
        (d / node).mkdir()
        (d / f"card{node[-1]}").mkdir()
    monkeypatch.setenv("GPUSD_SYSFS", str(root))
    monkeypatch.setenv("GPUSD_CDI_DIRS", str(tmp_path / "cdi"))
    monkeypatch.setenv("GPUSD_DOCKER_CONFIG", str(tmp_path / "daemon.json"))
    return root


def _opts(argv: list[str], flag: str) -> list[str]:
    return [argv[i + 1] for i, a in enumerate(argv) if a == flag]


def test_amd_gets_kfd_its_render_nodes_the_video_group_and_rocr_by_uuid(sysfs):
    run = parse(["docker", "run", "--rm", "rocm/pytorch", "python3", "x.py"])
    assert run is not None
    argv, env = run.command(AMD)
    assert _opts(argv, "--device") == ["/dev/kfd", "/dev/dri/renderD129", "/dev/dri/renderD131"]
    assert _opts(argv, "--group-add") == ["video"]
    assert "ROCR_VISIBLE_DEVICES=GPU-00112233aabbccdd,GPU-44556677aabbccdd" in _opts(argv, "-e")
    assert "--gpus" not in argv and env == {}


def test_amd_without_uuids_is_numbered_as_the_container_counts(sysfs):
    run = parse(["podman", "run", "img"])
    assert run is not None
    argv, _ = run.command([Leased("amd", 5, None, "0000:e3:00.0"), Leased("amd", 7, "", "0000:c3:00.0")])
    assert "ROCR_VISIBLE_DEVICES=0,1" in _opts(argv, "-e")


def test_intel_gets_its_render_node_and_an_in_container_mask(sysfs):
    run = parse(["nerdctl", "run", "img"])
    assert run is not None
    argv, _ = run.command(INTEL)
    assert _opts(argv, "--device") == ["/dev/dri/renderD128"]
    assert "ZE_AFFINITY_MASK=0" in _opts(argv, "-e")


def test_a_gpu_without_a_render_node_is_refused_rather_than_passed_wrong(sysfs):
    run = parse(["docker", "run", "img"])
    assert run is not None
    with pytest.raises(ConfigError, match="no render node"):
        run.command([Leased("amd", 0, "GPU-00112233aabbccdd", "0000:99:00.0")])


def _spec(tmp: Path, name: str, spec: dict) -> None:  # type: ignore[type-arg]
    (tmp / "cdi").mkdir(exist_ok=True)
    (tmp / "cdi" / name).write_text(json.dumps(spec))


def test_amd_cdi_names_are_matched_by_render_node_where_the_toolkit_wrote_a_spec(sysfs, tmp_path):
    _spec(tmp_path, "amd.json", {"cdiVersion": "0.6.0", "kind": "amd.com/gpu", "devices": [
        {"name": str(i), "containerEdits": {"deviceNodes": [{"path": "/dev/kfd"}, {"path": f"/dev/dri/renderD{n}"}]}}
        for i, n in enumerate((128, 129, 130, 131))] + [{"name": "all", "containerEdits": {}}]})
    run = parse(["podman", "run", "img"])
    assert run is not None
    argv, _ = run.command(AMD)
    assert _opts(argv, "--device") == ["amd.com/gpu=1", "amd.com/gpu=3"]


def test_docker_uses_cdi_only_where_its_daemon_enables_it(sysfs, tmp_path):
    u = "GPU-aaaaaaaa-0000-0000-0000-000000000001"
    _spec(tmp_path, "nvidia.json", {"kind": "nvidia.com/gpu", "devices": [{"name": "0"}, {"name": u}]})
    run = parse(["docker", "run", "img"])
    assert run is not None
    argv, _ = run.command([Leased("nvidia", 0, u)])
    assert _opts(argv, "--gpus") == [f'"device={u}"']
    (tmp_path / "daemon.json").write_text(json.dumps({"features": {"cdi": True}}))
    argv, _ = run.command([Leased("nvidia", 0, u)])
    assert _opts(argv, "--device") == [f"nvidia.com/gpu={u}"] and "--gpus" not in argv


def test_damaged_or_hostile_cdi_specs_cost_only_themselves(sysfs, tmp_path):
    d = tmp_path / "cdi"
    d.mkdir()
    (d / "a.json").write_text("{not json")
    (d / "b.json").write_text(json.dumps({"kind": 5, "devices": "x"}))
    (d / "c.json").symlink_to("/etc/passwd")
    (d / "d.json").write_text(json.dumps({"kind": "nvidia.com/gpu", "devices": [{"name": "GPU-x"}, 7, {"name": 3}]}))
    assert cdi_specs() == {"nvidia.com/gpu": {"GPU-x": ()}}


@pytest.mark.parametrize("cmd", [["docker", "ps"], ["python3", "train.py"],
                                 ["docker", "exec", "c", "nvidia-smi"]])
def test_commands_that_are_not_a_container_run_are_left_alone(cmd):
    assert parse(cmd) is None


def test_options_after_the_image_are_the_containers_own(sysfs):
    run = parse(["docker", "run", "-e", "A=1", "-v", "/x:/y", "img", "train", "-d", "--gpus", "all"])
    assert run is not None and not run.detached
