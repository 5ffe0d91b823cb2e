"""A daemon process on the fake NVML (127.0.0.1 only): it keeps serving when a GPU is lost and when
a GPU disappears; clients see each change as events."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from daemon_helpers import unique_session
from fakenvml import FakeNvml, make_gpus
from gpusd.discovery.sync import Client
from netns import read_lines
from waiting import wait_until_sync

GiB = 2**30


@pytest.fixture
def daemon(fake_nvml: FakeNvml, tmp_path: Path):  # type: ignore[no-untyped-def]
    fake_nvml.write(make_gpus(3, memory_used=GiB))
    session = unique_session("nvml")
    env = fake_nvml.env()
    env.update(GPUSD_STATE_DIR=str(tmp_path / "state"), GPUSD_INTERFACES="127.0.0.1", GPUSD_MDNS_FAST="1",
               GPUSD_HOSTNAME="nvml-host")
    r, w = os.pipe()
    with open(tmp_path / "log", "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "gpusd", "start", "--foreground", "--port", "0",
                                 "--session", session, "--interval", "0.2", "--ready-fd", str(w)],
                                env=env, pass_fds=(w,), stdout=subprocess.DEVNULL, stderr=log)
    os.close(w)
    try:
        assert read_lines(r, 1, 60), (tmp_path / "log").read_text()
        yield fake_nvml, session, proc
    finally:
        os.close(r)
        proc.terminate()
        proc.wait(15)


def wait(pred, timeout: float = 10.0) -> None:  # type: ignore[no-untyped-def]
    wait_until_sync(pred, timeout)


def test_daemon_survives_lost_and_vanished_gpus(daemon) -> None:  # type: ignore[no-untyped-def]
    fake, session, proc = daemon
    client = Client(session=session, interfaces=["127.0.0.1"], daemon_thread=True)
    events: list[tuple[str, int | None, bool | None]] = []
    client.register_event_handler("*", lambda e: events.append(
        (e.event, e.device.index if e.device else None, e.device.gpu.healthy if e.device else None)))
    client.start_listening()
    try:
        wait(lambda: len(client.list_devices()) == 3)
        # GPU 1 falls off the bus: every query answers NVML_ERROR_GPU_IS_LOST
        gpus = make_gpus(3, memory_used=GiB)
        gpus[1].errors = {"*": 15}
        fake.write(gpus)
        wait(lambda: ("device_updated", 1, False) in events)
        # the driver reports one GPU less
        fake.write(make_gpus(2, memory_used=GiB))
        wait(lambda: ("device_removed", 2, True) in events)
        # it comes back, healthy (NVML failing as a whole is covered in test_daemon.py)
        fake.write(make_gpus(3, memory_used=2 * GiB))
        wait(lambda: ("device_added", 2, True) in events)
        wait(lambda: all(d.memory_used == 2 * GiB and d.gpu.healthy for d in client.list_devices()))
        assert proc.poll() is None
        assert not any(e[0] == "host_removed" for e in events)
    finally:
        client.stop_listening()
