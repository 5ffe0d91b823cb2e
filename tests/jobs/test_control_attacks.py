"""Review: a job's control socket is another user's (root's supervisor preempts anyone's
jobs; any user may connect to anyone's job): a peer that sends a byte now and then must not keep
the other side waiting past its bound."""
from __future__ import annotations

import os
import threading
import time

from gpusd.alloc.leases import LeaseStore
from gpusd.errors import GpusdError
from gpusd.jobs import control


def test_a_control_socket_that_drips_bytes_cannot_hold_a_request_past_its_timeout():
    store = LeaseStore()
    store.ensure()
    job = "abcdefabcdef"
    srv = control.bind(store, job)
    stop = threading.Event()

    def drip() -> None:
        c, _ = srv.accept()
        while not stop.is_set():
            time.sleep(0.2)
            try:
                c.send(b" ")  # never a newline
            except OSError:
                return

    threading.Thread(target=drip, daemon=True).start()
    outcome: list[object] = []

    def ask() -> None:
        try:
            outcome.append(control.request(job, os.geteuid(), {"op": "status"}, timeout=1.0, store=store))
        except GpusdError as exc:
            outcome.append(exc)

    t = threading.Thread(target=ask, daemon=True)
    t.start()
    t.join(60)  # a hang detector (the bound asked for is 1 s), not a speed assertion
    stop.set()
    srv.close()
    assert outcome and isinstance(outcome[0], GpusdError), "the request is still waiting on the dripping peer"
