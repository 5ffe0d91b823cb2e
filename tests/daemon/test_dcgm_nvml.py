"""Every DCGM default counter NVML can give, read from the fake NVML through the real nvidia-ml-py and
the NVML backend, rendered by the daemon's metrics code and parsed with prometheus_client's own text
parser: each series' type, value and labels against the fake GPUs' state."""

from __future__ import annotations

import time
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from fakenvml import FakeMig, make_gpus
from gpusd.daemon.metrics import make_registry, render
from gpusd.inventory.nvml import NvmlBackend

MiB = 2**20
GiB = 2**30

# dcgm-exporter's etc/default-counters.csv (d5e5f51): the series NVML can feed, and their types.
DCGM_TYPES = {
    "DCGM_FI_DEV_SM_CLOCK": "gauge", "DCGM_FI_DEV_MEM_CLOCK": "gauge", "DCGM_FI_DEV_MEMORY_TEMP": "gauge",
    "DCGM_FI_DEV_GPU_TEMP": "gauge", "DCGM_FI_DEV_POWER_USAGE": "gauge",
    "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION": "counter", "DCGM_FI_DEV_PCIE_REPLAY_COUNTER": "counter",
    "DCGM_FI_DEV_GPU_UTIL": "gauge", "DCGM_FI_DEV_MEM_COPY_UTIL": "gauge", "DCGM_FI_DEV_ENC_UTIL": "gauge",
    "DCGM_FI_DEV_DEC_UTIL": "gauge", "DCGM_FI_DEV_XID_ERRORS": "gauge", "DCGM_FI_DEV_FB_FREE": "gauge",
    "DCGM_FI_DEV_FB_USED": "gauge", "DCGM_FI_DEV_FB_RESERVED": "gauge",
    "DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL": "counter", "DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS": "counter",
    "DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS": "counter", "DCGM_FI_DEV_ROW_REMAP_FAILURE": "gauge",
}


@pytest.fixture
def backend(fake_nvml_inprocess: Any) -> Any:
    created: list[NvmlBackend] = []

    def make() -> NvmlBackend:
        b = NvmlBackend(telemetry=True)
        created.append(b)
        return b

    yield make
    for b in created:
        b.close()


def _gpus() -> list[Any]:
    gpus = make_gpus(2, memory_used=20 * GiB, memory_reserved=512 * MiB, util_gpu=45, util_memory=30,
                     util_encoder=7, util_decoder=9, temperature=61, power_usage=250_500, clock_sm=1395,
                     clock_mem=1593, energy=5_000_000, pcie_replay=3, remapped_rows=(2, 1, 0, 0),
                     memory_temperature=71, nvlink_raw={0: (100, 200), 1: (10, 20)})
    gpus[1].remapped_rows = (0, 4, 1, 1)
    gpus[1].mig_mode = 1
    gpus[1].migs = [FakeMig("3g.40gb", "MIG-11111111-2222-3333-4444-555555555555", 40 * GiB, 3 * GiB,
                            gpu_instance_id=2)]
    return gpus


def _families(text: str) -> dict[str, Any]:
    return {f.name: f for f in text_string_to_metric_families(text)}


def _one(fam: Any, uuid: str, **labels: str) -> Any:
    [s] = [s for s in fam.samples if s.labels["UUID"] == uuid and "GPU_I_ID" not in s.labels
           and all(s.labels.get(k) == v for k, v in labels.items())]
    return s


def test_every_dcgm_default_counter_nvml_can_give(fake_nvml_inprocess: Any, backend: Any) -> None:
    gpus = _gpus()
    fake_nvml_inprocess.write(gpus, driver_version="550.54.15")
    b = backend()
    snap = b.snapshot()
    text = render(make_registry(lambda: [snap], process_metrics=False, dcgm=True)).decode()
    fams = _families(text)
    assert {n: fams[n].type for n in DCGM_TYPES} == DCGM_TYPES
    # a counter keeps DCGM's name (no _total) in the text, as dcgm-exporter writes it
    assert "\nDCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION{" in text and "ENERGY_CONSUMPTION_total" not in text
    u0, u1 = gpus[0].uuid, gpus[1].uuid
    value = {n: _one(fams[n], u0).value for n in DCGM_TYPES}
    assert value == {
        "DCGM_FI_DEV_SM_CLOCK": 1395, "DCGM_FI_DEV_MEM_CLOCK": 1593, "DCGM_FI_DEV_MEMORY_TEMP": 71,
        "DCGM_FI_DEV_GPU_TEMP": 61, "DCGM_FI_DEV_POWER_USAGE": 250.5,
        "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION": value["DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION"],
        "DCGM_FI_DEV_PCIE_REPLAY_COUNTER": 3, "DCGM_FI_DEV_GPU_UTIL": 45, "DCGM_FI_DEV_MEM_COPY_UTIL": 30,
        "DCGM_FI_DEV_ENC_UTIL": 7, "DCGM_FI_DEV_DEC_UTIL": 9, "DCGM_FI_DEV_XID_ERRORS": 0,
        "DCGM_FI_DEV_FB_FREE": 60 * 1024 - 512, "DCGM_FI_DEV_FB_USED": 20 * 1024, "DCGM_FI_DEV_FB_RESERVED": 512,
        "DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL": (100 + 200 + 10 + 20) * 1024,
        "DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS": 1, "DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS": 2,
        "DCGM_FI_DEV_ROW_REMAP_FAILURE": 0}
    # energy: the fake's 5e6 mJ at load, grown at 250.5 W since
    assert 5_000_000 <= value["DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION"] < 5_000_000 + 250_500 * 60
    # integers where DCGM's fields are integers: only the power draw is a double
    assert [n for n, v in value.items() if type(v) is not int] == ["DCGM_FI_DEV_POWER_USAGE"]
    assert _one(fams["DCGM_FI_DEV_ROW_REMAP_FAILURE"], u1).value == 1
    assert _one(fams["DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS"], u1).value == 4
    # dcgm-exporter's labels
    assert _one(fams["DCGM_FI_DEV_GPU_TEMP"], u1).labels == {
        "gpu": "1", "UUID": u1, "pci_bus_id": gpus[1].pci_bus_id, "device": "nvidia1",
        "modelName": "NVIDIA A100-SXM4-80GB", "hostname": snap.hostname, "DCGM_FI_DRIVER_VERSION": "550.54.15"}
    # a MIG instance: its framebuffer with GPU_I_PROFILE and GPU_I_ID, the parent's gpu/UUID
    [mig] = [s for s in fams["DCGM_FI_DEV_FB_USED"].samples if "GPU_I_ID" in s.labels]
    assert mig.value == 3 * 1024
    assert {k: mig.labels[k] for k in ("gpu", "UUID", "GPU_I_PROFILE", "GPU_I_ID")} == {
        "gpu": "1", "UUID": u1, "GPU_I_PROFILE": "3g.40gb", "GPU_I_ID": "2"}
    [mig_free] = [s for s in fams["DCGM_FI_DEV_FB_FREE"].samples if "GPU_I_ID" in s.labels]
    assert mig_free.value == 37 * 1024


def test_energy_grows_and_xid_events_arrive(fake_nvml_inprocess: Any, backend: Any) -> None:
    gpus = _gpus()
    fake_nvml_inprocess.write(gpus)
    b = backend()
    latest: list[Any] = [None]
    registry = make_registry(lambda: [latest[0]], process_metrics=False, dcgm=True)

    def read() -> dict[str, Any]:
        # one sample per scrape, as the daemon's latest_snapshot(): gpusd's and DCGM's series are rendered
        # by two collectors, and a new sample each could put an XID in one and not yet in the other
        latest[0] = b.snapshot()
        return _families(render(registry).decode())

    first = read()
    u0, u1 = gpus[0].uuid, gpus[1].uuid
    e0 = _one(first["DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION"], u0).value
    assert _one(first["DCGM_FI_DEV_XID_ERRORS"], u1).value == 0
    time.sleep(0.2)
    gpus[1].xids = [79, 48]  # two XIDs happen on GPU 1 (the fake: new `xid` lines)
    for g in gpus:  # the fake's counter restarts from the file's value at a rewrite: write it further on
        g.energy += 10**6
    fake_nvml_inprocess.write(gpus)
    deadline = time.monotonic() + 10
    while True:
        fams = read()
        if _one(fams["DCGM_FI_DEV_XID_ERRORS"], u1).value == 48 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert _one(fams["DCGM_FI_DEV_XID_ERRORS"], u1).value == 48  # the last one
    assert _one(fams["DCGM_FI_DEV_XID_ERRORS"], u0).value == 0
    xids = {s.labels["uuid"]: s.value for s in fams["gpusd_gpu_xid_errors"].samples}
    assert xids == {u0: 0, u1: 2}
    # the energy counter grows (the fake: at the power draw, from the rewritten file's value)
    e1 = _one(fams["DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION"], u0).value
    time.sleep(0.1)
    e2 = _one(read()["DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION"], u0).value
    assert e0 <= e1 < e2


def test_a_gpu_that_falls_off_keeps_a_health_series(fake_nvml_inprocess: Any, backend: Any) -> None:
    gpus = _gpus()
    fake_nvml_inprocess.write(gpus)
    b = backend()
    registry = make_registry(lambda: [b.snapshot()], process_metrics=False, dcgm=True)

    def healthy() -> dict[str, float]:
        fams = _families(render(registry).decode())
        return {s.labels["uuid"]: s.value for s in fams["gpusd_gpu_healthy"].samples}

    assert healthy() == {gpus[0].uuid: 1, gpus[1].uuid: 1}
    fake_nvml_inprocess.write(gpus[:1])  # GPU 1 is gone from the bus
    assert healthy() == {gpus[0].uuid: 1, gpus[1].uuid: 0}
    gpus[0].errors = {"*": 15}  # GPU 0 is lost (NVML_ERROR_GPU_IS_LOST)
    fake_nvml_inprocess.write(gpus[:1])
    text = render(registry).decode()
    assert healthy() == {gpus[0].uuid: 0, gpus[1].uuid: 0}
    assert "DCGM_FI_DEV_GPU_TEMP{" not in text  # a lost GPU reports no readings, not zeros


def test_a_driver_without_the_readings_leaves_their_series_out(fake_nvml_inprocess: Any, backend: Any) -> None:
    gpus = make_gpus(1, clock_sm=None, clock_mem=None, util_encoder=None, util_decoder=None, xid_events=False)
    fake_nvml_inprocess.write(gpus)
    text = render(make_registry(lambda: [backend().snapshot()], process_metrics=False, dcgm=True)).decode()
    fams = _families(text)
    for name in ("DCGM_FI_DEV_SM_CLOCK", "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION", "DCGM_FI_DEV_XID_ERRORS",
                 "DCGM_FI_DEV_MEMORY_TEMP", "DCGM_FI_DEV_PCIE_REPLAY_COUNTER", "DCGM_FI_DEV_ENC_UTIL",
                 "DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL", "DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS"):
        assert name not in fams, name
    assert fams["DCGM_FI_DEV_GPU_TEMP"].samples[0].value == 35


def test_one_shot_commands_do_not_read_telemetry(fake_nvml_inprocess: Any) -> None:
    """``gpusd devices`` and selection open the backend without telemetry: no XID thread to wait for
    at exit, no extra NVML calls (BENCHMARKS.md); the daemon turns it on for /metrics."""
    import threading

    fake_nvml_inprocess.write(_gpus())
    b = NvmlBackend()
    try:
        g = b.snapshot().gpus[0]
        assert g.clock_sm is None and g.energy is None and g.xid_errors is None
        assert not any(t.name == "gpusd-nvml-xid" for t in threading.enumerate() if t.is_alive())
    finally:
        b.close()


def test_profiling_series_from_gpm_on_hopper(fake_nvml_inprocess: Any, backend: Any) -> None:
    """DCGM's profiling counters need DCGM, but NVML's GPM (Hopper and newer) measures the same: served
    under DCGM's names from the second sample on; an Ampere GPU (no GPM) has none."""
    gpus = _gpus()
    gpus[0].name = "NVIDIA H100 80GB HBM3"
    gpus[0].gpm = {1: 60, 5: 35, 10: 20, 20: 100, 21: 50}  # graphics, any tensor, DRAM %; PCIe TX/RX MiB/s
    fake_nvml_inprocess.write(gpus)
    b = backend()
    def read() -> dict[str, Any]:
        snap = b.snapshot()
        return _families(render(make_registry(lambda: [snap], process_metrics=False, dcgm=True)).decode())

    assert "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE" not in read()  # one sample: nothing to measure between yet
    fams = read()
    u0 = gpus[0].uuid
    assert {n: _one(fams[n], u0).value for n in (
        "DCGM_FI_PROF_GR_ENGINE_ACTIVE", "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE", "DCGM_FI_PROF_DRAM_ACTIVE",
        "DCGM_FI_PROF_PCIE_TX_BYTES", "DCGM_FI_PROF_PCIE_RX_BYTES")} == {
        "DCGM_FI_PROF_GR_ENGINE_ACTIVE": 0.6, "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE": 0.35,
        "DCGM_FI_PROF_DRAM_ACTIVE": 0.2, "DCGM_FI_PROF_PCIE_TX_BYTES": 100 * MiB,
        "DCGM_FI_PROF_PCIE_RX_BYTES": 50 * MiB}
    assert [s.labels["UUID"] for s in fams["DCGM_FI_PROF_PIPE_TENSOR_ACTIVE"].samples] == [u0]  # not the A100
    tensor = {s.labels["uuid"]: s.value for s in fams["gpusd_gpu_tensor_active_ratio"].samples}
    assert tensor == {u0: 0.35}
    for _ in range(300):  # the samples are freed as they are used: the fake has 256
        b.snapshot()


def test_no_control_byte_of_a_gpu_name_reaches_the_metrics(fake_nvml_inprocess: Any, backend: Any) -> None:
    """A driver naming its GPU with ESC/BEL sequences: the labels of /metrics carried the raw bytes
    (quoted right, but ``curl .../metrics`` in a terminal ran them).  Every label value goes through
    the one rule for labels (gpusd.sanitize.for_label); what is left still parses, and reads."""
    gpus = make_gpus(2)
    hostile = "\x1b]0;owned\x07\x1b[2J\x1b[31mNVIDIA\x1b[0m A100\x07\x1bc\x07\x07"
    for g in gpus:
        g.name = hostile
    fake_nvml_inprocess.write(gpus, driver_version="550.\x1b[5m54")
    b = backend()
    snap = b.snapshot()
    raw = render(make_registry(lambda: [snap], process_metrics=False, dcgm=True))
    text = raw.decode()
    assert not [c for c in text if (ord(c) < 0x20 and c != "\n") or 0x7f <= ord(c) <= 0x9f or c == "\u202e"]
    fams = _families(text)
    labels = _one(fams["DCGM_FI_DEV_GPU_TEMP"], gpus[0].uuid).labels
    assert labels["modelName"] == "NVIDIA A100" and labels["DCGM_FI_DRIVER_VERSION"] == "550.54"
