"""Fake container runtimes on PATH (docker, podman, nerdctl, apptainer, singularity): see fake_runtime.py.

The machine has a real docker CLI in /usr/local/bin: the fake's directory goes first on PATH, and no test
calls the real one."""

from __future__ import annotations

import json
import os
import signal
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import pytest

SCRIPT = Path(__file__).with_name("fake_runtime.py")
NAMES = ("docker", "podman", "nerdctl", "apptainer", "singularity")


@dataclass
class FakeRuntimes:
    bin: Path
    state: Path
    log: Path

    def env(self, base: dict[str, str]) -> dict[str, str]:
        return dict(base, PATH=f"{self.bin}:{base.get('PATH', os.environ.get('PATH', ''))}",
                    FAKE_RUNTIME_STATE=str(self.state), FAKE_RUNTIME_LOG=str(self.log))

    def calls(self, runtime: str | None = None) -> list[dict[str, Any]]:
        if not self.log.exists():
            return []
        out = [json.loads(line) for line in self.log.read_text().splitlines() if line.strip()]
        return [c for c in out if runtime is None or c["runtime"] == runtime]

    def containers(self) -> list[str]:
        return sorted(p.name[:-5] for p in self.state.glob("*.shim")) if self.state.exists() else []

    def exit_status(self, cid: str) -> int | None:
        try:
            return int((self.state / f"{cid}.rc").read_text())
        except (OSError, ValueError):
            return None

    def kill_all(self) -> None:
        """End every container a test left (by the pids the fake recorded)."""
        for what in ("pid", "shim"):
            for p in self.state.glob(f"*.{what}") if self.state.exists() else []:
                try:
                    os.kill(int(p.read_text()), signal.SIGKILL)
                except (OSError, ValueError):
                    pass


@pytest.fixture
def fake_runtimes(tmp_path: Path) -> Iterator[FakeRuntimes]:
    b = tmp_path / "fakebin"
    b.mkdir()
    for name in NAMES:
        (b / name).write_text(f"#!{sys.executable}\n" + SCRIPT.read_text())
        (b / name).chmod(0o755)
    fr = FakeRuntimes(b, tmp_path / "fakestate", tmp_path / "fakeruntime.log")
    fr.state.mkdir()
    try:
        yield fr
    finally:
        fr.kill_all()
