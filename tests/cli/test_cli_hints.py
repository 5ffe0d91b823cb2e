"""Without a GPU, the hint names the command the user ran (`gpisd start --simulate ...`), under the
name it was run as."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO


@pytest.fixture
def gpisd(tmp_path: Path) -> Path:
    """An installed-style `gpisd` entry point (as pip writes it) running this checkout."""
    path = tmp_path / "bin" / "gpisd"
    path.parent.mkdir()
    path.write_text(f"#!{sys.executable}\nfrom gpusd.cli import entry\nentry()\n")
    path.chmod(0o755)
    return path


@pytest.fixture
def no_gpu_env(tmp_path: Path) -> dict[str, str]:
    env = dict(os.environ, GPUSD_NVML_LIBRARY="/nonexistent/libnvidia-ml.so.1", GPUSD_STATE_DIR=str(tmp_path / "st"),
               GPUSD_INTERFACES="127.0.0.1", PYTHONPATH=str(REPO / "src"))
    env.pop("GPUSD_SIMULATE", None)
    return env


@pytest.mark.parametrize("argv, hint", [
    (["start", "--port", "0"], "gpisd start --simulate 4xA100-80GB"),  # the daemon runs in the background
    (["start", "--foreground", "--port", "0"], "gpisd start --simulate 4xA100-80GB"),
    (["devices"], "gpisd devices --simulate 4xA100-80GB"),
    (["select", "-n", "1"], "gpisd select --simulate 4xA100-80GB"),
    (["top", "--local", "--once"], "gpisd top --local --simulate 4xA100-80GB"),
    (["run", "--", "true"], "gpisd run --simulate 4xA100-80GB -- CMD ..."),
])
def test_no_gpu_hint_names_the_command_run(gpisd: Path, no_gpu_env: dict[str, str], argv: list[str],
                                            hint: str) -> None:
    r = subprocess.run([str(gpisd), *argv], env=no_gpu_env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 3, (r.stdout, r.stderr)
    assert hint in r.stderr, r.stderr
    assert "devices --simulate" not in r.stderr or argv[0] == "devices"
    assert "Traceback" not in r.stderr


def test_hint_under_the_usual_name(no_gpu_env: dict[str, str]) -> None:
    r = subprocess.run([sys.executable, "-m", "gpusd", "start", "--port", "0"], env=no_gpu_env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 3 and "gpusd start --simulate 4xA100-80GB" in r.stderr, r.stderr


def test_library_error_keeps_a_hint_without_a_command() -> None:
    from gpusd.errors import BackendUnavailable

    err = BackendUnavailable("the NVIDIA driver is not loaded", hint=True)
    assert str(err).startswith("the NVIDIA driver is not loaded; ") and "--simulate" in str(err)
    assert str(BackendUnavailable("NVML is gone")) == "NVML is gone"
