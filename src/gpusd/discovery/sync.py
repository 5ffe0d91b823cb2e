"""``Client``: the discovery client for synchronous code.

A thin wrapper around :class:`~gpusd.discovery.client.AsyncClient` whose event loop runs in a
background thread (as python-zeroconf's own ``Zeroconf`` does).  Event handlers are called, in
order, from one dispatcher thread, so a slow handler never delays liveness checks.

The seed example works as written::

    import gpisd
    client = gpisd.Client()
    client.register_event_handler('device_added', print)
    client.start_listening()      # returns at once; the listener keeps the program running

While listening, the client keeps the program alive: a script that ends with ``start_listening()``
keeps reporting events until interrupted (Ctrl-C, which stops the client cleanly) or until
``stop_listening()``.  ``Client(daemon_thread=True)`` does not hold the program open.
"""

# Imports inside functions: optional or heavy packages.
from __future__ import annotations

import asyncio
import atexit
import copy
import logging
import queue
import threading
import time
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Iterator, Sequence, TypeVar

from ..wire.txt import DEFAULT_SESSION
from .fleetsource import ask_for, choose, race
from .options import MAX_HOSTS, DiscoveryOptions, options_of
from .source import Listing
from .types import EVENTS, Device, DiscoveryEvent, RemoteHost, event_names

if TYPE_CHECKING:  # pragma: no cover
    from ..wire.signing import FleetKey
    from .fleetview import Reading
    from .source import Listing

log = logging.getLogger(__name__)
T = TypeVar("T")
Handler = Callable[[DiscoveryEvent], Any]
_STOP = object()


def _hold_at_exit(client: "Client") -> None:
    """At interpreter exit, wait while ``client`` listens (as a non-daemon thread would), and turn
    Ctrl-C into a clean stop instead of a traceback from the threading module."""

    def hold() -> None:
        try:
            while client.listening:
                time.sleep(0.2)
        except KeyboardInterrupt:
            pass
        finally:
            client.stop_listening()

    # runs before non-daemon threads are joined
    register = getattr(threading, "_register_atexit", None)
    try:
        if register is not None:
            register(hold)
        else:  # pragma: no cover - Pythons without it

            atexit.register(hold)
    except RuntimeError:
        # already shutting down
        pass


class Client:
    """Discover gpusd hosts and their GPUs (synchronous API; the same arguments as ``AsyncClient``, or
    its ``options=`` value, but ``zeroconf`` and ``sources``, which belong to an event loop; and
    ``daemon_thread``: do not hold the program open while listening)."""

    def __init__(self, session: str | None = DEFAULT_SESSION, *, interfaces: Sequence[str] | None = None,
                 hostname: str | None = None, model: str | None = None, min_free_memory: int | str | None = None,
                 all_sessions: bool = False, liveness_timeout: float = 10.0, include_hwsd: bool = True,
                 daemon_thread: bool = False, token: str | None = None, max_hosts: int = MAX_HOSTS,
                 key: "FleetKey | None" = None, allow_loopback: bool | None = None,
                 peers: Sequence[str] | None = None, peers_file: str | None = None,
                 dns_sd_domain: str | None = None, dns_server: str | None = None,
                 options: DiscoveryOptions | None = None, pace: float | None = None) -> None:
        # Checked here, so that bad arguments fail in the caller's thread; the asyncio client it drives
        # (and the one a restart makes) takes the same value.
        # (the keyword arguments above are the options' fields: tests/discovery/test_sources.py checks it)
        self.options = options_of(options, locals())
        self._daemon_thread = daemon_thread
        from .client import AsyncClient

        # it binds to a loop only when listening starts
        self._async = AsyncClient(options=self.options)
        self._handlers: dict[str, list[Handler]] = {e: [] for e in EVENTS}
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._dispatcher: threading.Thread | None = None
        self._queue: queue.Queue[Any] = queue.Queue()
        self._subscribers: list[queue.Queue[Any]] = []

    # -- handlers -----------------------------------------------------------------------------
    def register_event_handler(self, event: str, fn: Handler) -> None:
        """Call ``fn(event)`` from the dispatcher thread; events as for ``AsyncClient`` (or ``*``)."""
        names = event_names(event)
        with self._lock:
            for name in names:
                self._handlers[name].append(fn)

    def unregister_event_handler(self, event: str, fn: Handler) -> None:
        names = event_names(event)
        with self._lock:
            for name in names:
                if fn in self._handlers.get(name, []):
                    self._handlers[name].remove(fn)

    def _forward(self, event: DiscoveryEvent) -> None:  # on the loop thread
        self._queue.put(event)
        with self._lock:
            subs = list(self._subscribers)
        for q in subs:
            q.put(event)

    # the dispatcher thread
    def _dispatch(self) -> None:
        while True:
            event = self._queue.get()
            if event is _STOP:
                return
            with self._lock:
                handlers = list(self._handlers.get(event.event, ()))
            for fn in handlers:
                try:
                    fn(event)
                except Exception:
                    log.exception("event handler %r failed on %s", fn, event.event)

    # -- the loop thread ----------------------------------------------------------------------
    @property
    def listening(self) -> bool:
        return self._thread is not None and self._async.listening

    def start_listening(self) -> None:
        """Start discovery in the background and return at once."""
        if self._thread is not None:
            return
        loop = asyncio.new_event_loop()
        ready = threading.Event()

        def run() -> None:
            asyncio.set_event_loop(loop)
            loop.call_soon(ready.set)
            try:
                loop.run_forever()
            finally:
                try:
                    # what a slow stop left (a stream still closing on a loaded machine): cancelled
                    # and awaited here, as asyncio.run does, never destroyed while pending
                    left = asyncio.all_tasks(loop)
                    for task in left:
                        task.cancel()
                    if left:
                        loop.run_until_complete(asyncio.wait(left, timeout=5))
                    loop.run_until_complete(loop.shutdown_asyncgens())
                finally:
                    loop.close()

        self._loop = loop
        self._thread = threading.Thread(target=run, name="gpusd-discovery", daemon=True)
        self._thread.start()
        if not self._daemon_thread:
            _hold_at_exit(self)
        ready.wait()
        self._dispatcher = threading.Thread(target=self._dispatch, name="gpusd-events", daemon=True)
        self._dispatcher.start()
        self._async.register_event_handler("*", self._forward)
        try:
            self._call(self._async.start_listening(), timeout=30)
        except BaseException:
            self.stop_listening()
            raise

    def stop_listening(self) -> None:
        """Stop discovery and the background threads."""
        loop, thread = self._loop, self._thread
        if loop is None or thread is None:
            return
        try:
            if loop.is_running():
                self._call(self._async.stop_listening(), timeout=15)
        except Exception:
            log.debug("stopping the discovery client failed", exc_info=True)
        finally:
            self._async.unregister_event_handler("*", self._forward)
            if loop.is_running():
                loop.call_soon_threadsafe(loop.stop)
            if thread is not threading.current_thread():
                thread.join(10)
            self._queue.put(_STOP)
            with self._lock:
                subs = list(self._subscribers)
            for q in subs:
                q.put(_STOP)
            self._loop = self._thread = None
            from .client import AsyncClient

            # a stopped client can be restarted
            self._async = AsyncClient(options=self.options)

    def _call(self, coro: Awaitable[T], timeout: float | None = None) -> T:
        assert self._loop is not None
        fut: Any = asyncio.run_coroutine_threadsafe(coro, self._loop)  # type: ignore[arg-type]
        return fut.result(timeout)  # type: ignore[no-any-return]

    def _in_loop(self, fn: Callable[[], T]) -> T:
        async def call() -> T:
            return fn()

        return self._call(call(), timeout=10)

    def __enter__(self) -> Client:
        self.start_listening()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop_listening()

    # -- views --------------------------------------------------------------------------------
    def scan(self, timeout: float = 2.0) -> list[RemoteHost]:
        """Browse for ``timeout`` seconds and return the announcements seen (starts listening)."""
        self.start_listening()
        return self._call(self._async.scan(timeout), timeout=timeout + 30)

    def wait_settled(self, timeout: float = 3.0) -> bool:
        """Wait until every announced host has been reached (or given up on); see AsyncClient."""
        self.start_listening()
        return self._call(self._async.wait_settled(timeout), timeout=timeout + 30)

    def list_devices(self, timeout: float = 3.0) -> list[Device]:
        """Every GPU on the LAN (filtered).  While listening: the GPUs followed.  Otherwise, as ``gpusd
        list`` (:mod:`.fleetsource`): this host's own daemon's fleet view where a daemon of the session
        runs here and answers in time (one local request, no browse, hosts it follows beyond the link
        included; the client does not start listening), else the client starts listening and waits until
        discovery settles (at most ``timeout`` s) first."""
        if self.listening:
            return self._in_loop(self._async.list_devices)

        return choose(ask_for(self.options), lambda slow: self._browse(slow, timeout)).devices

    def _browse(self, slow: Reading | None, timeout: float) -> Listing:
        """Listen until settled (at most ``timeout`` s) and list; or the daemon's view (``slow``, asked
        already) where it comes first, or within its bound (:func:`.fleetsource.race`)."""

        async def settled() -> Listing:
            await self._async.wait_settled(timeout)
            return Listing(self._async.list_devices(), self._async.hosts, len(self._async.unmatched_hosts))

        self.start_listening()
        return self._call(race(slow, settled()), timeout=timeout + 30)

    @property
    def hosts(self) -> list[RemoteHost]:
        """The hosts currently reported."""
        if not self.listening:
            return []
        return self._in_loop(lambda: [copy.copy(h) for h in self._async.hosts])

    def events(self, timeout: float | None = None) -> Iterator[DiscoveryEvent]:
        """Iterate over events from now on; stops after ``timeout`` s without an event (None: never)
        or when the client stops."""
        q: queue.Queue[Any] = queue.Queue()
        with self._lock:
            self._subscribers.append(q)
        try:
            while True:
                try:
                    ev = q.get(timeout=timeout)
                except queue.Empty:
                    return
                if ev is _STOP:
                    return
                yield ev
        finally:
            with self._lock:
                if q in self._subscribers:
                    self._subscribers.remove(q)
