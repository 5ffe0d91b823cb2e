"""pytest fixtures for the fake Level Zero loader (see ``__init__.py``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from fakeamdsmi import FakeAmdSmiUnavailable

from . import FakeZe, build


@pytest.fixture(scope="session")
def fake_ze_lib() -> Path:
    try:
        return build()
    except FakeAmdSmiUnavailable as exc:
        pytest.skip(str(exc))


@pytest.fixture
def fake_ze(fake_ze_lib: Path, tmp_path: Path) -> FakeZe:
    fake = FakeZe(fake_ze_lib, tmp_path / "fake-ze-state.txt")
    fake.write([])
    return fake
