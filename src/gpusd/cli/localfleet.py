"""``gpusd list`` asks this host's own daemon for its fleet view, where one runs: which daemon that is.

The reading itself (the request, its proof, the answer's checks and filters) is
:class:`gpusd.discovery.fleetview.LocalFleetView`; here is only what the CLI knows: where this user's
daemon runs (``gpusd.json`` in the state directory and the pid file's lock, see
:mod:`gpusd.daemon.process`), read in the request's thread.
"""

# Imports inside functions: start-up (a command's own module).
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from ..discovery.fleetview import Reading
    from ..discovery.types import Filters
    from ..wire.signing import FleetKey


def daemon_api_urls(session: str, interfaces: list[str] | None = None) -> tuple[list[str], str] | None:
    """The running local daemon's API bases to try (loopback first) and its node id, when it runs
    in ``session`` (and, with ``interfaces``, the addresses the user asked for, resolved: it browses on
    exactly those); None otherwise."""
    from ..daemon.process import status
    from ..discovery.fleetview import api_urls
    from ..identity import state_dir

    st = status(state_dir())
    if not st.running:
        return None
    return api_urls(st.info, session, interfaces)


def start_fleet_request(filters: Filters, *, key: FleetKey | None = None, timeout: float | None = None,
                        interfaces: list[str] | None = None) -> Reading:
    """The local daemon's fleet view, read in a daemon thread (the caller browses meanwhile)."""
    from ..discovery.fleetview import FLEET_TIMEOUT, LocalFleetView

    session = filters.session
    view = LocalFleetView(lambda: daemon_api_urls(session, interfaces) if session is not None else None, filters,
                          key=key, timeout=FLEET_TIMEOUT if timeout is None else timeout)
    return view.start()
