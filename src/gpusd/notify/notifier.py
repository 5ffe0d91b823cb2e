"""The notifier's loop: look, deliver at each not-free -> free transition, wait for the next change.

>>> from gpusd.notify import notify, Webhook
>>> notify(2, Webhook("https://hooks.example/gpus"), min_free="20GiB", timeout=3600)  # doctest: +SKIP

:func:`run` is the loop over any :class:`~gpusd.notify.watch.Watch` and
:class:`~gpusd.notify.deliver.Target`; :func:`notify` makes the watch from the constraint keywords of
:func:`gpusd.select` (``fleet=True``: those of :func:`gpusd.reserve`).  No lease is taken, ever."""

# Imports inside functions: optional or heavy packages.
from __future__ import annotations

import logging
import time
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Callable

from ..alloc.select import Constraints
from ..errors import ConfigError, GpusdError, WaitTimeout
from .watch import FleetWatch, LocalWatch, pace_for

if TYPE_CHECKING:  # pragma: no cover
    from ..discovery.sync import Client
    from .deliver import Target
    from .watch import Watch

log = logging.getLogger("gpusd.notify")


def run(watch: Watch, target: Target, *, repeat: bool = False, timeout: float | None = None,
        on_error: Callable[[GpusdError], object] | None = None) -> int:
    """Deliver a notice to ``target`` when ``watch`` first finds its GPUs free (at once, when they
    are free already) and return 1; with ``repeat``, again at each new transition from not free to
    free, until ``timeout`` (then the number delivered).  ``timeout`` (seconds, monotonic) bounds the
    whole watch: :class:`WaitTimeout` when it runs out before the first notice.  A delivery that
    fails raises (one line); with ``repeat`` it goes to ``on_error`` (default: logged) and the watch
    goes on."""
    if timeout is not None and not timeout > 0:  # also refuses nan
        raise ConfigError(f"the timeout must be a duration greater than 0, not {timeout!r}")
    deadline = None if timeout is None else time.monotonic() + timeout
    delivered = 0
    sequence = 0
    was_free = False
    said = False
    while True:
        notice = watch.look()
        if notice is not None and not was_free:
            sequence += 1
            notice = replace(notice, sequence=sequence, time=time.time())
            try:
                target.deliver(notice)
                delivered += 1
            except GpusdError as exc:
                if not repeat:
                    raise
                (on_error or _log)(exc)
            if not repeat:
                return delivered
        if notice is None and (was_free or sequence == 0 and not said):
            # one line each time the watch starts waiting (-v): the tests' and the user's sign that it watches
            log.info("%s %s: watching until they are free", "the GPUs were taken again" if was_free else "not free now",
                     getattr(watch, "scope", ""))
            said = True
        was_free = notice is not None
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left <= 0:
            break
        watch.wait(1.0 if left is None else min(1.0, left))
    if delivered == 0 and sequence == 0:
        raise WaitTimeout(f"gave up after {timeout:g}s: the GPUs asked for never qualified")
    return delivered


def _log(exc: GpusdError) -> None:
    log.warning("%s", exc)


def local_watch(c: Constraints, simulate: str | None = None) -> Watch:
    return LocalWatch(c, simulate=simulate)


def fleet_watch(c: Constraints, client: Client, host: str | None = None, model: str | None = None) -> Watch:
    return FleetWatch(client, c, host=host, model=model)


def notify(count: int, target: Target, *, fleet: bool = False, repeat: bool = False, timeout: float | None = None,
           host: str | None = None, model: str | None = None, client: Client | None = None,
           token_file: str | None = None, simulate: str | None = None, constraints: Constraints | None = None,
           **keywords: Any) -> int:
    """Wait until ``count`` GPUs qualify (the constraint keywords of :func:`gpusd.select`; ``fleet``:
    on any verified host, as :func:`gpusd.reserve` chooses, ``host``/``model`` its globs, ``client``
    or ``token_file`` its discovery), then deliver to ``target`` (:class:`Exec`, :class:`Webhook`,
    :class:`Mail`); see :func:`run` for ``repeat`` and ``timeout``.  Returns the notices delivered."""

    c = constraints or Constraints.from_keywords(count=count, **keywords)
    if c.count != count:
        c = replace(c, count=count)
    if not fleet:
        if host is not None or model is not None or client is not None:
            raise ConfigError("--host, --model and a discovery client are for --fleet")
        watch = local_watch(c, simulate)
        own = None
    else:
        own = None
        if client is None:
            from ..discovery.sync import Client as SyncClient
            from ..wire.signing import FleetKey, load_secret

            secret = load_secret(token_file)
            if not secret:
                raise ConfigError("notify --fleet needs the fleet secret (--token-file or $GPUSD_TOKEN_FILE)")
            client = own = SyncClient(key=FleetKey(secret), pace=pace_for(c))
        watch = fleet_watch(c, client, host, model)
    try:
        return run(watch, target, repeat=repeat, timeout=timeout)
    finally:
        watch.close()
        if own is not None:
            own.stop_listening()
