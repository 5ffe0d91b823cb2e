"""Where a one-shot reading of the fleet comes from: this host's daemon's fleet view where it answers
in time, else a one-shot browse of the LAN, the two raced where the daemon is slow.  ``gpusd list`` and
the synchronous client's ``list_devices`` (:class:`gpusd.discovery.sync.Client`) both take it from here.

:func:`ask_local_daemon` asks this host's own daemon (found through :mod:`gpusd.localdaemon`) for its
view, in a thread, where its view is what was asked for (:func:`ask_for`: from a client's options).
The daemon's view costs one signed HTTP GET (no asyncio, no browser imported: ~30 ms); a browse costs
the mDNS settling and its imports.  :func:`choose` waits for the view a short while (``QUICK``), or to
its own bound where the daemon took the request and is building its answer (1,000 hosts: 0.1-0.5 s),
and only then browses; :func:`race` browses while a slow view may still come.
"""

# Imports inside functions: start-up (gpusd list imports this module).
from __future__ import annotations

import os
import time

from ..identity import state_dir
from ..localdaemon import api_bases, may_run, status
from ..wire.mdns import resolve_interfaces
from .fleetview import FLEET_TIMEOUT, LocalFleetView

# typing is not imported at run time: start-up time
TYPE_CHECKING = False
if TYPE_CHECKING:  # pragma: no cover
    from collections.abc import Callable, Coroutine, Sequence
    from typing import Any

    from ..wire.signing import FleetKey
    from .fleetview import Reading
    from .options import DiscoveryOptions
    from .source import Listing
    from .types import Filters


def local_daemon_urls(session: str, interfaces: list[str] | None = None) -> tuple[list[str], str] | None:
    """The running local daemon's API bases to try (loopback first) and its node id, when it runs in
    ``session`` (and, with ``interfaces``, on the addresses asked for, resolved: it browses on exactly
    those); None otherwise.  Read anew at each call: the daemon may have stopped or started since."""

    st = status(state_dir())
    info = st.info
    if not st.running or info.get("session") != session:
        return None
    if interfaces is not None:
        running = info.get("interfaces")
        if not isinstance(running, list) or sorted(map(str, running)) != sorted(interfaces):
            # it browses elsewhere (or everywhere): its view is not what was asked for
            return None
    node_id, bases = info.get("node_id"), api_bases(info)
    if not isinstance(node_id, str) or not bases:
        return None
    return bases, node_id


def beyond_link(peers: Sequence[str] | None = None, peers_file: str | None = None,
                dns_sd_domain: str | None = None) -> bool:
    """Whether hosts beyond the link are asked for: static peers, a peers file or a wide-area DNS-SD
    domain, given or in their variables (``$GPUSD_PEERS``, ...).  A daemon's fleet view has its own, so
    the client looks for them itself."""

    return bool(peers or peers_file or dns_sd_domain) or any(
        os.environ.get(v) for v in ("GPUSD_PEERS", "GPUSD_PEERS_FILE", "GPUSD_DNS_SD_DOMAIN"))


def ask_local_daemon(filters: Filters, *, key: FleetKey | None = None, interfaces: list[str] | None = None,
                     beyond: bool = False, timeout: float | None = None) -> Reading | None:
    """This host's own daemon's fleet view, asked in a thread (take it with :func:`choose` or
    :func:`race`), where its view is what was asked for: ``filters.session`` set (a daemon's view is of
    its own session), no hosts beyond the link asked for (``beyond``: peers, wide-area DNS-SD; the
    daemon's view has its own), a daemon of that session running here on the ``interfaces`` asked for
    (resolved; None: any).  With the fleet secret (``key``) the daemon must prove it holds it too.  None
    where no daemon can be asked: browse alone."""

    session = filters.session
    if session is None or beyond or not may_run():
        return None

    # where the daemon runs is read in the request's thread: the caller goes on meanwhile
    view = LocalFleetView(lambda: local_daemon_urls(session, interfaces), filters, key=key,
                          timeout=FLEET_TIMEOUT if timeout is None else timeout)
    return view.start()


def ask_for(options: DiscoveryOptions) -> Reading | None:
    """:func:`ask_local_daemon` for a discovery client's options (their filters, fleet key, interfaces
    and hosts beyond the link, the environment's defaults included); a bad interface raises
    :class:`~gpusd.errors.ConfigError` as listening would."""

    filters = options.filters()
    if filters.session is None or not may_run():
        # before the interfaces are resolved: nothing to ask
        return None

    return ask_local_daemon(filters, key=options.key, interfaces=resolve_interfaces(options.interfaces),
                            beyond=beyond_link(options.peers, options.peers_file, options.dns_sd_domain))


def choose(local: Reading | None, browse: Callable[[Reading | None], Listing]) -> Listing:
    """The daemon's view (``local``, asked already) where it answers in time; otherwise
    ``browse(local)``, handed the view still on its way where the daemon took the request."""
    if local is not None and local.arrived():
        found = local.result()
        if found is not None:
            return found
        # no usable answer: browse alone
        local = None
    return browse(local)


async def race(local: Reading | None, browse: Coroutine[Any, Any, Listing]) -> Listing:
    """``browse``, or the daemon's view where it comes first, or within its own bound after the
    browse settled (the view is the whole fleet, hosts beyond the link too)."""
    import asyncio

    task = asyncio.ensure_future(browse)
    # the local daemon is slow: browse meanwhile
    while local is not None and not task.done():
        if local.done():
            answer = local.result()
            if answer is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                return answer
            break
        await asyncio.wait({task}, timeout=0.02)
    if local is not None and not local.done():
        end = time.monotonic() + FLEET_TIMEOUT
        while not local.done() and time.monotonic() < end:
            await asyncio.sleep(0.02)
        answer = local.result() if local.done() else None
        if answer is not None:
            return answer
    return await task
