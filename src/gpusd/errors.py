"""Exceptions gpusd raises, and the CLI exit codes they map to (see docs/cli.md)."""

from __future__ import annotations

# CLI exit codes, documented in docs/cli.md.
EXIT_OK = 0
EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_NO_BACKEND = 3  # no NVML library, no driver, or no simulation given
EXIT_NO_GPU = 4  # no GPU satisfies the constraints (and --wait was not given)
EXIT_TIMEOUT = 5  # --wait --timeout ran out
EXIT_NO_DAEMON = 6  # no daemon running / none found


class GpusdError(Exception):
    """Base class of gpusd's errors; its message is one line meant for users."""

    exit_code = EXIT_ERROR


class BackendUnavailable(GpusdError):
    """The GPU inventory cannot be read: no NVML library, no driver, or NVML failed to start."""

    exit_code = EXIT_NO_BACKEND


class NoGpuAvailable(GpusdError):
    """No GPU satisfies the constraints right now."""

    exit_code = EXIT_NO_GPU


class WaitTimeout(NoGpuAvailable):
    """Waiting for qualifying GPUs ran past its timeout."""

    exit_code = EXIT_TIMEOUT


class LockBusy(GpusdError):
    """A lock of the lock directory stayed held past the documented bound (by a stuck or hostile
    process); the message names the holder where the kernel tells it."""


class ConfigError(GpusdError):
    """A bad flag, value or file given by the user."""

    exit_code = EXIT_USAGE
