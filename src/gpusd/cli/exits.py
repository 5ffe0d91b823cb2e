"""The CLI's exit codes (docs/cli.md) and which library exception maps to which.  Library exceptions
carry no exit code: this table is the only place that knows them."""

from __future__ import annotations

from ..errors import (
    AlreadyRunning,
    BackendUnavailable,
    ConfigError,
    DaemonStartFailed,
    GpusdError,
    NoDaemon,
    NoGpuAvailable,
    WaitTimeout,
)

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_NO_BACKEND = 3  # no NVML library, no driver, or no simulation given
EXIT_NO_GPU = 4  # no GPU satisfies the constraints (and --wait was not given)
EXIT_TIMEOUT = 5  # --wait --timeout ran out
EXIT_NO_DAEMON = 6  # no daemon running / none found
EXIT_ALREADY_RUNNING = 7  # gpusd start: a daemon already runs on this state directory with other options

# Most specific first: the first class the exception is an instance of gives the code.
EXIT_CODES: tuple[tuple[type[GpusdError], int], ...] = (
    (ConfigError, EXIT_USAGE),
    (BackendUnavailable, EXIT_NO_BACKEND),
    (WaitTimeout, EXIT_TIMEOUT),
    (NoGpuAvailable, EXIT_NO_GPU),
    (NoDaemon, EXIT_NO_DAEMON),
    (AlreadyRunning, EXIT_ALREADY_RUNNING),
)
_DOCUMENTED = frozenset((EXIT_USAGE, EXIT_NO_BACKEND, EXIT_NO_GPU, EXIT_TIMEOUT, EXIT_NO_DAEMON, EXIT_ALREADY_RUNNING))


def exit_code_for(exc: BaseException) -> int:
    """The exit code the CLI returns for ``exc`` (1 for anything not listed)."""
    if isinstance(exc, DaemonStartFailed):  # keep the daemon's own documented code (e.g. 3: no NVML)
        return exc.status if exc.status in _DOCUMENTED else EXIT_ERROR
    for cls, code in EXIT_CODES:
        if isinstance(exc, cls):
            return code
    return EXIT_ERROR
