"""pytest fixtures for the fake libamd_smi.so (see ``__init__.py``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from . import FakeAmdSmi, FakeAmdSmiUnavailable, build


@pytest.fixture(scope="session")
def fake_amdsmi_root() -> Path:
    try:
        return build()
    except FakeAmdSmiUnavailable as exc:
        pytest.skip(str(exc))


@pytest.fixture
def fake_amdsmi(fake_amdsmi_root: Path, tmp_path: Path) -> FakeAmdSmi:
    fake = FakeAmdSmi(fake_amdsmi_root, tmp_path / "fake-amdsmi-state.txt")
    fake.write([])
    return fake
