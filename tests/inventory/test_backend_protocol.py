"""Every inventory backend implements the one protocol (gpusd.inventory.backend.Backend, issue 19
point 7): the simulated one, NVML on the fake libnvidia-ml (tests/fakenvml), amdsmi on the fake
libamd_smi (tests/fakeamdsmi), Level Zero on the fake loader (tests/fakeze), and NVML and amdsmi side
by side (the combined backend).  The vendor backends run in a child process, as ``gpusd`` would: each
library is loaded once per process."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import tests_paths
from fakeamdsmi import AmdGpu
from fakenvml import make_gpus
from fakeze import ZeGpu

# Run in the child: open the backend $GPUSD_BACKENDS names, check it against the protocol, report.
CHECK = r"""
import json, sys
from gpusd.errors import BackendUnavailable
from gpusd.inventory import open_backend
from gpusd.inventory.backend import Backend

b = open_backend(sys.argv[1] or None)
out = {"is_backend": isinstance(b, Backend), "backend": b.backend, "vendors": list(b.vendors),
       "hostname": isinstance(b.hostname, str) and bool(b.hostname), "node_id": isinstance(b.node_id, str)}
with b as same:
    out["enter_is_self"] = same is b
    full = b.snapshot()
    fast = b.snapshot(util_since={g.uuid: 0.0 for g in full.gpus}, detail=False)
    out["snapshot_backend"] = full.backend
    out["gpu_vendors"] = sorted({g.vendor for g in full.gpus})
    out["same_gpus"] = [g.uuid for g in full.gpus] == [g.uuid for g in fast.gpus]
    out["indices"] = [g.index for g in full.gpus]
try:
    b.snapshot()
    out["after_close"] = "answered"
except BackendUnavailable as exc:
    out["after_close"] = "unavailable"
print(json.dumps(out))
"""


def _check(env: dict[str, str], simulate: str = "") -> dict[str, object]:
    env = {**env, "PYTHONPATH": os.pathsep.join(p for p in (str(tests_paths.SRC), env.get("PYTHONPATH")) if p)}
    env.pop("GPUSD_SIMULATE", None)
    r = subprocess.run([sys.executable, "-c", CHECK, simulate], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def _nvml(request: pytest.FixtureRequest) -> dict[str, str]:
    fake = request.getfixturevalue("fake_nvml")
    fake.write(make_gpus(2))
    return {**fake.env(dict(os.environ)), "GPUSD_BACKENDS": "nvidia"}


def _amd(request: pytest.FixtureRequest) -> dict[str, str]:
    fake = request.getfixturevalue("fake_amdsmi")
    fake.write([AmdGpu(), AmdGpu(serial="00000000000000b1", bdf="0000:1c:00.0")])
    return fake.env(dict(os.environ))  # type: ignore[no-any-return]


def _intel(request: pytest.FixtureRequest) -> dict[str, str]:
    fake = request.getfixturevalue("fake_ze")
    fake.write([ZeGpu()])
    return fake.env(dict(os.environ))  # type: ignore[no-any-return]


def _combined(request: pytest.FixtureRequest) -> dict[str, str]:
    env = _amd(request)
    env = request.getfixturevalue("fake_nvml").env(env)
    request.getfixturevalue("fake_nvml").write(make_gpus(1))
    return {**env, "GPUSD_BACKENDS": "nvidia,amd"}


@pytest.mark.parametrize("name, make, backend, vendors, closes", [
    ("nvml", _nvml, "nvml", ["nvidia"], True),
    ("amdsmi", _amd, "amdsmi", ["amd"], True),
    ("levelzero", _intel, "levelzero", ["intel"], True),
    ("combined", _combined, "nvml+amdsmi", ["nvidia", "amd"], True),
])
def test_every_vendor_backend_implements_the_protocol(request: pytest.FixtureRequest, name, make, backend, vendors,
                                                      closes) -> None:
    got = _check(make(request))
    assert got["is_backend"] is True, got
    assert (got["backend"], got["snapshot_backend"], got["vendors"]) == (backend, backend, vendors), got
    assert got["gpu_vendors"] == sorted(vendors)  # every GPU says its vendor, one the backend names
    assert got["hostname"] and got["node_id"] and got["enter_is_self"] and got["same_gpus"], got
    assert got["indices"] == list(range(len(got["indices"])))  # unique on the host, whatever the vendors
    assert got["after_close"] == ("unavailable" if closes else "answered"), got


@pytest.mark.parametrize("spec, vendors", [("2xA100-80GB", ["nvidia"]), ("1xMI300X,1xMAX1550", ["amd", "intel"])])
def test_the_simulated_backend_implements_the_protocol(spec: str, vendors: list[str]) -> None:
    from gpusd.inventory import open_backend
    from gpusd.inventory.backend import Backend

    with open_backend(spec) as b:
        assert isinstance(b, Backend)
        assert list(b.vendors) == vendors
        snap = b.snapshot(util_since={}, detail=False)
        assert sorted({g.vendor for g in snap.gpus}) == sorted(vendors) and snap.backend == b.backend == "simulated"


def test_the_daemons_shared_backend_implements_the_protocol() -> None:
    from gpusd.daemon.backend import SharedBackend
    from gpusd.errors import BackendUnavailable
    from gpusd.inventory import open_backend
    from gpusd.inventory.backend import Backend

    shared = SharedBackend(lambda: open_backend("1xMI300X"))
    assert isinstance(shared, Backend)
    with pytest.raises(BackendUnavailable):
        shared.snapshot()  # not opened yet: a one-line error, never an AttributeError
    shared.open()
    assert shared.vendors == ("amd",) and shared.snapshot(detail=False).gpus[0].vendor == "amd"
    shared.reopen()
    assert shared.opens == 2
    shared.close()
    with pytest.raises(BackendUnavailable):
        shared.snapshot()


def test_the_daemons_gpus_read_over_the_lease_socket_implement_the_protocol() -> None:
    """alloc.authority.DaemonInventory: the backend of a process without a driver library, reading
    the local daemon's GPUs over its lease socket."""
    from authority_helpers import ServerThread
    from gpusd.alloc.authority import DaemonInventory
    from gpusd.inventory.backend import Backend

    server = ServerThread("1xMI300X,1xA100-80GB")
    try:
        with DaemonInventory() as b:
            assert isinstance(b, Backend) and b.backend == "daemon"
            assert b.vendors == ("amd", "nvidia")  # in the order of the daemon's GPUs
            assert [g.vendor for g in b.snapshot(detail=False).gpus] == ["amd", "nvidia"]
    finally:
        server.stop()
