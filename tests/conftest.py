"""Shared fixtures.

Every test gets its own lock and state directories and lease socket (never the machine's real ones), no inherited
CUDA_VISIBLE_DEVICES and no simulation unless it asks.  The fake NVML library (tests/fakenvml) is
built once per session with the system C compiler.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Iterator, Sequence

import pytest

from fakeamdsmi.fixtures import fake_amdsmi, fake_amdsmi_root  # noqa: F401
from fakenvml import FakeGPU, FakeNvml, make_gpus  # noqa: F401  (re-exported for tests)
from fakenvml.fixtures import fake_nvml, fake_nvml_inprocess, fake_nvml_libdir  # noqa: F401
from fakeruntime import fake_runtimes  # noqa: F401
from fakeze.fixtures import fake_ze, fake_ze_lib  # noqa: F401

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def _isolated_env(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    base = tmp_path_factory.mktemp("gpusd")
    monkeypatch.setenv("GPUSD_LOCK_DIR", str(base / "locks"))
    monkeypatch.setenv("GPUSD_STATE_DIR", str(base / "state"))
    monkeypatch.setenv("GPUSD_LEASE_SOCKET", str(base / "run" / "lease.sock"))
    for var in ("GPUSD_SIMULATE", "CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", "GPUSD_NVML_LIBRARY",
                # the other vendors' visibility variables and libraries
                "ROCR_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "GPU_DEVICE_ORDINAL", "ZE_AFFINITY_MASK",
                "ONEAPI_DEVICE_SELECTOR", "ZE_FLAT_DEVICE_HIERARCHY", "GPUSD_AMDSMI_LIBRARY", "GPUSD_ZE_LIBRARY",
                "GPUSD_BACKENDS",
                # a lease or job this process may be running under (CI's own shell, or a grant applied
                # in-process by an earlier test): a fleet job would take it for its own
                "GPUSD_LEASE", "GPUSD_LEASE_EPOCH", "GPUSD_JOB_ID", "GPUSD_JOB_FILE", "GPUSD_NOTIFY_SIGNAL",
                "GPUSD_RESTART_COUNT", "GPUSD_RESTART_STATUS"):
        monkeypatch.delenv(var, raising=False)
    before = dict(os.environ)
    yield base
    # what the library wrote into os.environ itself (Selection.apply) goes with the test
    for var in set(os.environ) - set(before):
        del os.environ[var]
    from gpusd.alloc import backend

    backend.close_all()


def gpusd_cli(args: Sequence[str], env: dict[str, str] | None = None, timeout: float = 60,
              **kw: object) -> subprocess.CompletedProcess[str]:
    """Run the gpusd CLI in a subprocess, as a user would."""
    return subprocess.run([sys.executable, "-m", "gpusd", *args], env=env, capture_output=True, text=True,
                          timeout=timeout, **kw)  # type: ignore[call-overload]


@pytest.fixture
def shared_tmp() -> Iterator[Path]:
    """A directory like /tmp that every uid can use (pytest's tmp_path is private to root), for the
    tests that play a second, hostile local user (tests/other_user.py)."""
    import shutil
    import tempfile

    d = Path(tempfile.mkdtemp(prefix="gpusd-shared-", dir="/tmp"))
    os.chmod(d, 0o1777)  # like /tmp
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def cli_env(fake_nvml: FakeNvml) -> Iterator[dict[str, str]]:
    """Environment for a gpusd subprocess on the fake NVML (state written by the test), with a temporary
    directory of the test's own (short: sockets made in it must fit a path), removed afterwards with
    whatever a `gpusd run` the test killed left there (its job's directory)."""
    import shutil
    import tempfile

    tmp = tempfile.mkdtemp(prefix="gpusd-t-", dir="/tmp")
    yield fake_nvml.env(dict(os.environ, TMPDIR=tmp))
    shutil.rmtree(tmp, ignore_errors=True)
