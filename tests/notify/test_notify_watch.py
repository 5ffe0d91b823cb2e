"""The local watch in-process: a lease that ends while the watch is looking still wakes its next wait
(the end is not lost to the look's own clean-up), and a watch takes no lease."""

from __future__ import annotations

from typing import Any

from gpusd.alloc.select import Constraints
from gpusd.notify.watch import LocalWatch


def test_a_lease_ending_during_a_look_wakes_the_next_wait() -> None:
    w = LocalWatch(Constraints(count=1), simulate="1xA100-80GB")
    try:
        uuid = w.backend.snapshot(detail=False).gpus[0].uuid
        lease = w.store.acquire([uuid])
        assert lease is not None
        real = w.store.leases

        def leases_then_the_end(*a: Any, **kw: Any) -> Any:
            out = real(*a, **kw)
            lease.release()  # the holder ends after the look read its lease
            return out

        w.store.leases = leases_then_the_end  # type: ignore[method-assign]
        assert w.look() is None  # it read the lease: not free at that moment
        w.store.leases = real  # type: ignore[method-assign]
        woken: list[bool] = []
        wait = w._watch.wait

        def spy(timeout: float, followed: bool = False) -> bool:
            woken.append(wait(timeout, followed))
            return woken[-1]

        w._watch.wait = spy  # type: ignore[method-assign]
        w._last = 0.0
        w.wait(5.0)
        assert woken == [True]  # woken by the end, not by the once-a-second look
        notice = w.look()
        assert notice is not None and [g.uuid for g in notice.gpus] == [uuid]
        assert w.store.leases() == []  # looking took no lease
    finally:
        w.close()
