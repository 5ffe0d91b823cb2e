"""One pool: reserve the least-loaded GPUs of any verified host of the fleet (docs/pool.md).

>>> from gpusd.pool import reserve
>>> with reserve(count=2, min_free="20GiB", token_file="~/.gpusd-token") as r:   # doctest: +SKIP
...     print(r.host, r.env)      # where, and CUDA_VISIBLE_DEVICES for that host

* :mod:`.client` — :func:`reserve` ranks every verified host's GPUs with the ranking of local selection
  (:func:`gpusd.alloc.select.choose`), asks the best host's daemon for a lease (``POST /api/v1/leases``),
  and moves on to the next host when that daemon answers 409 (the GPUs just went).  The returned
  :class:`Reservation` renews its lease(s) in a background thread until :meth:`Reservation.release` or
  the end of a ``with`` block;
* :mod:`.renewer` — the background renewer of ``gpusd reserve`` (``python -m gpusd.pool.renewer``);
* :mod:`.calendar` — bookings as an iCalendar file (``gpusd reservations --ics``).

``reserve`` and ``Reservation`` are public (also as ``gpusd.reserve``, docs/api.md); the rest is internal.
"""

from .client import HostLease, Reservation, rank_hosts, reserve

__all__ = ["HostLease", "Reservation", "rank_hosts", "reserve"]
