"""aiohttp for gpusd's own processes, imported without loading the system's CA store.

``import aiohttp`` builds two default SSL contexts at import time (``aiohttp.connector``, since
aio-libs/aiohttp#9029), each loading every certificate of the system's CA bundle: 40-70 ms of CPU on
every cold ``gpusd list``, ``watch`` and ``top`` on the machines measured (BENCHMARKS.md), and about
2 MiB of a daemon's memory.  gpusd never verifies a certificate against that store: a daemon's TLS
certificate is pinned by the fingerprint it announces (``aiohttp.Fingerprint``, which aiohttp checks on
its unverified context), and everything else is plain HTTP on the LAN (docs/security.md).

So where the process is gpusd's own (the command line and the daemon it starts: :func:`own_process`
is called by :func:`gpusd.cli.main`), :func:`load` imports aiohttp with
``ssl.SSLContext.set_default_verify_paths`` made a no-op for the duration of the import (for the
importing thread only: a context another thread makes meanwhile loads the store as always), and puts
the original back.  aiohttp's two default contexts then trust no certificate authority at all: a request
that relied on them would fail verification (closed), never succeed unverified.  In anyone else's
process (``import gpusd`` in a program that uses aiohttp for its own HTTPS), aiohttp is imported as
it is.  Where aiohttp was imported already, nothing changes.
"""

# Imports inside functions: start-up (quick commands import this module).
from __future__ import annotations

import _thread
import sys

# typing is not imported at run time: start-up time
TYPE_CHECKING = False
if TYPE_CHECKING:  # pragma: no cover
    from types import ModuleType

_own = False
# _thread: built in, nothing to import on the quick commands' path
_lock = _thread.allocate_lock()


def own_process() -> None:
    """Say that this process is gpusd's own (the command line, the daemon): :func:`load` may skip the CA
    store.  Never called on the library's paths."""
    global _own
    _own = True


def load() -> ModuleType:
    """``aiohttp``, imported (the first time) as the module docstring says."""
    # one patch at a time: the prefetch thread and the main thread may both ask
    with _lock:
        # (the import statement waits for one under way)
        if not _own or "aiohttp" in sys.modules:
            import aiohttp

            return aiohttp
        import ssl

        real = ssl.SSLContext.set_default_verify_paths
        me = _thread.get_ident()

        # for the importing thread only: another thread's
        def no_ca_store(self: ssl.SSLContext) -> None:
            # context made meanwhile loads the store as always
            if _thread.get_ident() != me:
                real(self)

        ssl.SSLContext.set_default_verify_paths = no_ca_store  # type: ignore[method-assign]
        try:
            import aiohttp
        finally:
            ssl.SSLContext.set_default_verify_paths = real  # type: ignore[method-assign]
        return aiohttp


__all__ = ["load", "own_process"]
