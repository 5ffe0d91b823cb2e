"""The CLI's exit codes (docs/cli.md), keyed off the errors' wire codes (``GpusdError.code``,
docs/errors.md).  Library exceptions carry no exit code: this table is the only place that knows them."""

from __future__ import annotations

from ..errors import DaemonStartFailed, GpusdError

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_NO_BACKEND = 3  # no NVML library, no driver, or no simulation given
EXIT_NO_GPU = 4  # no GPU satisfies the constraints (and --wait was not given)
EXIT_TIMEOUT = 5  # --wait --timeout ran out
EXIT_NO_DAEMON = 6  # no daemon running / none found, or its answer cannot be read
EXIT_ALREADY_RUNNING = 7  # gpusd start: a daemon already runs on this state directory with other options
EXIT_TIME_LIMIT = 124  # gpusd run --time: the job's time ran out and it was stopped (as timeout(1) exits)

# An error's code -> the exit status; a code not listed takes its base class's (IdError, code "bad_id",
# is a ConfigError: 2), and anything else 1.
EXIT_CODES: dict[str, int] = {
    "usage": EXIT_USAGE,
    "no_backend": EXIT_NO_BACKEND,
    "no_gpu": EXIT_NO_GPU,
    "timeout": EXIT_TIMEOUT,
    "no_daemon": EXIT_NO_DAEMON,
    "source": EXIT_NO_DAEMON,  # a daemon's answer cannot be read (SourceError was a NoDaemon in 0.2)
    "already_running": EXIT_ALREADY_RUNNING,
}
_DOCUMENTED = frozenset(EXIT_CODES.values())


def exit_code_for(exc: BaseException) -> int:
    """The exit code the CLI returns for ``exc`` (1 for anything not listed)."""
    if isinstance(exc, DaemonStartFailed):  # keep the daemon's own documented code (e.g. 3: no NVML)
        return exc.status if exc.status in _DOCUMENTED else EXIT_ERROR
    if not isinstance(exc, GpusdError):
        return EXIT_ERROR
    for cls in type(exc).__mro__:  # the most specific class with a listed code of its own
        code = cls.__dict__.get("code")
        if isinstance(code, str) and code in EXIT_CODES:
            return EXIT_CODES[code]
    return EXIT_ERROR
