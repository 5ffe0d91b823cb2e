"""Every exception gpusd raises on purpose: one hierarchy, all exported from :mod:`gpusd`.

::

    GpusdError                     base; its message is one line meant for users
    ├── ConfigError (ValueError)   a bad flag, value, rule, scenario or file given by the user
    ├── BackendUnavailable         no NVML library, no driver, or NVML failed to start
    ├── NoGpuAvailable             no GPU satisfies the constraints right now
    │   └── WaitTimeout            waiting for qualifying GPUs ran past its timeout
    ├── WireError (ValueError)     data from the network fails validation
    │   ├── TxtError               a malformed DNS-SD TXT record
    │   └── SSEError               a malformed event stream
    ├── NoDaemon                   no daemon runs (or none answers)
    │   └── SourceError            a daemon's answer cannot be read (unreachable, bad answer)
    ├── LockBusy                   a lock of the lock directory stayed held past its bound
    ├── AlreadyRunning             gpusd start: a daemon with other options runs on this state directory
    └── DaemonStartFailed          a background daemon exited while starting (``status``: its exit code)

Library exceptions carry no CLI exit code: the CLI maps them (``gpusd.cli.exit_code_for``,
documented in docs/cli.md).  Those that are also :class:`ValueError` stay catchable as before.
"""

from __future__ import annotations

TYPE_CHECKING = False  # typing is not imported at run time: start-up time (issue 24)
if TYPE_CHECKING:  # pragma: no cover
    from typing import Any


class GpusdError(Exception):
    """Base class of gpusd's errors; its message is one line meant for users."""


class ConfigError(GpusdError, ValueError):
    """A bad flag, value or file given by the user."""


SIMULATE_EXAMPLE = "--simulate 4xA100-80GB"


class BackendUnavailable(GpusdError):
    """The GPU inventory cannot be read: no NVML library, no driver, or NVML failed to start.

    ``reason`` is what failed; with ``hint``, the message also says how to try gpusd without a GPU
    (the CLI rewrites that hint to name the very command that was run)."""

    def __init__(self, reason: str, hint: bool = False) -> None:
        self.reason = reason
        self.hint = hint
        super().__init__(f"{reason}; to try gpusd without a GPU, simulate some ({SIMULATE_EXAMPLE}, "
                         "or simulate='4xA100-80GB' in Python)" if hint else reason)

class NoGpuAvailable(GpusdError):
    """No GPU satisfies the constraints right now."""


class WaitTimeout(NoGpuAvailable):
    """Waiting for qualifying GPUs ran past its timeout."""


class WireError(GpusdError, ValueError):
    """Data from the network (a snapshot, a fleet answer, a TXT record, an event stream) fails
    validation; the message names the bad field."""


class TxtError(WireError):
    """A TXT record that is malformed, oversized, of another version, or inconsistent."""


class SSEError(WireError):
    """The stream is not valid SSE, or an event is too large."""


class NoDaemon(GpusdError):
    """No daemon runs (for this state directory), or none was found."""


class SourceError(NoDaemon):
    """The hosts cannot be read from a daemon (unreachable, bad answer)."""


class LockBusy(GpusdError):
    """A lock of the lock directory stayed held past the documented bound (by a stuck or hostile
    process); the message names the holder where the kernel tells it."""


class AlreadyRunning(GpusdError):
    """``gpusd start`` asked for other options than the daemon already running on its state directory."""


class DaemonStartFailed(GpusdError):
    """A daemon started in the background exited before it was ready."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status  # the daemon process's exit status


__all__ = [
    "GpusdError",
    "ConfigError",
    "BackendUnavailable",
    "NoGpuAvailable",
    "WaitTimeout",
    "WireError",
    "TxtError",
    "SSEError",
    "NoDaemon",
    "SourceError",
    "LockBusy",
    "AlreadyRunning",
    "DaemonStartFailed",
]

_MOVED = ("EXIT_OK", "EXIT_ERROR", "EXIT_USAGE", "EXIT_NO_BACKEND", "EXIT_NO_GPU", "EXIT_TIMEOUT", "EXIT_NO_DAEMON")


def __getattr__(name: str) -> Any:
    """The CLI exit codes moved to :mod:`gpusd.cli.exits`; the old names still resolve."""
    if name in _MOVED:
        from .cli import exits

        return getattr(exits, name)
    raise AttributeError(f"module 'gpusd.errors' has no attribute {name!r}")
