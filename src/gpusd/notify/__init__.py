"""Tell me when GPUs are free: ``gpusd notify`` (docs/notify.md).

>>> from gpusd.notify import notify, Exec
>>> notify(2, Exec("notify-send 'GPUs free on $GPUSD_NOTIFY_HOST'"), min_free="20GiB")  # doctest: +SKIP

A notifier is a client process: it watches (this machine's lease view, or the fleet's event
streams), delivers once when ``count`` GPUs qualify (or at each new transition), and never takes a
lease — the GPUs may be gone by the time anyone acts; ``gpusd run --wait`` is what holds them.

* :mod:`.watch` — what is watched: :class:`~.watch.LocalWatch` (this machine, ``gpusd select``'s rule,
  woken by inotify when a lease ends) and :class:`~.watch.FleetWatch` (any verified host, ``gpusd
  reserve``'s ranking, woken by the hosts' events);
* :mod:`.deliver` — where a notice goes: :class:`~.deliver.Exec` (a shell command with
  ``GPUSD_NOTIFY_*`` variables), :class:`~.deliver.Webhook` (a JSON POST, ``gpusd-notify/1``, signed
  with HMAC-SHA256, retried with bounded back-off), :class:`~.deliver.Mail` (sendmail or SMTP);
* :mod:`.notifier` — the loop (:func:`~.notifier.run`) and :func:`~.notifier.notify`, the library's call.
"""

from .deliver import Exec, Mail, Notice, Webhook
from .notifier import notify, run

__all__ = ["Exec", "Mail", "Notice", "Webhook", "notify", "run"]
