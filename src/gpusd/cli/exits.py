"""The CLI's exit codes (docs/cli.md): each error class carries its own (``GpusdError.exit_status``,
:mod:`gpusd.errors`, where the ``EXIT_*`` numbers are defined); this module only reads it."""

from __future__ import annotations

from .. import errors
from ..errors import DaemonStartFailed, GpusdError

# typing is not imported at run time: start-up time
TYPE_CHECKING = False
if TYPE_CHECKING:  # pragma: no cover
    from typing import Any

# The statuses a daemon that failed to start may pass on as they are (its own documented ones).
_DOCUMENTED = frozenset(c.exit_status for c in (GpusdError, errors.ConfigError, errors.BackendUnavailable,
                                                errors.NoGpuAvailable, errors.WaitTimeout, errors.NoDaemon,
                                                errors.AlreadyRunning))


def exit_code_for(exc: BaseException) -> int:
    """The exit code the CLI returns for ``exc`` (1 for anything not a :class:`GpusdError`)."""
    # keep the daemon's own documented code (e.g. 3: no NVML)
    if isinstance(exc, DaemonStartFailed):
        return exc.status if exc.status in _DOCUMENTED else errors.EXIT_ERROR
    if not isinstance(exc, GpusdError):
        return errors.EXIT_ERROR
    return type(exc).exit_status


def __getattr__(name: str) -> Any:
    """``gpusd.cli.exits.EXIT_*``: the numbers of :mod:`gpusd.errors`, by their older address."""
    if name.startswith("EXIT_") and hasattr(errors, name):
        return getattr(errors, name)
    raise AttributeError(f"module 'gpusd.cli.exits' has no attribute {name!r}")
