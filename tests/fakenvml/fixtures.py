"""pytest fixtures for the fake NVML library.

Make them available with, in a conftest.py::

    from fakenvml.fixtures import fake_nvml, fake_nvml_inprocess, fake_nvml_libdir  # noqa: F401

(or ``tests.fakenvml.fixtures`` when ``tests`` is a package).

* ``fake_nvml_libdir`` (session): directory holding the built libnvidia-ml.so.1;
  skips the test when there is no C compiler.
* ``fake_nvml`` (function): a :class:`FakeNvml` with its state file in
  ``tmp_path``, initially a valid state with zero GPUs.  Use ``.write(gpus)``
  and ``.env()`` for subprocesses.
* ``fake_nvml_inprocess`` (function): like ``fake_nvml`` but also preloads the
  library into this process and points ``$GPUSD_FAKE_NVML_STATE`` at the state
  file (restored afterwards), so ``pynvml.nvmlInit()`` here uses the fake.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import pytest

from . import STATE_ENV, FakeNvml, FakeNvmlBuildError, build_fake_nvml


@pytest.fixture(scope="session")
def fake_nvml_libdir() -> Path:
    try:
        return build_fake_nvml()
    except FakeNvmlBuildError as exc:
        if "no C compiler" in str(exc):
            pytest.skip(str(exc))
        raise


@pytest.fixture
def fake_nvml(fake_nvml_libdir: Path, tmp_path: Path) -> FakeNvml:
    fake = FakeNvml(fake_nvml_libdir, tmp_path / "fake-nvml-state.txt")
    fake.write([])
    return fake


@pytest.fixture
def fake_nvml_inprocess(
    fake_nvml: FakeNvml, monkeypatch: pytest.MonkeyPatch
) -> Iterator[FakeNvml]:
    fake_nvml.preload()
    monkeypatch.setenv(STATE_ENV, str(fake_nvml.state_path))
    yield fake_nvml
