"""Every exception gpusd raises on purpose: one hierarchy, all exported from :mod:`gpusd`.

::

    class (code)                         what it means
    GpusdError (error)                   base; its message is one line meant for users
    ├── ConfigError (usage) ValueError   a bad flag, value, rule, scenario or file given by the user
    │   ├── IdError (bad_id)             not a job, lease or Slurm job id (gpusd.ids)
    │   └── SecretError (secret)         the fleet secret cannot be read or is too weak
    ├── BackendUnavailable (no_backend)  no NVML library, no driver, or NVML failed to start
    ├── NoGpuAvailable (no_gpu)          no GPU satisfies the constraints right now
    │   └── WaitTimeout (timeout)        waiting for qualifying GPUs ran past its timeout
    ├── WireError (wire) ValueError      data from the network fails validation
    │   ├── TxtError (txt)               a malformed DNS-SD TXT record
    │   └── SSEError (sse)               a malformed event stream
    ├── NoDaemon (no_daemon)             no daemon runs (or none answers)
    ├── SourceError (source)             a daemon's answer cannot be read (unreachable, bad answer)
    ├── LockBusy (lock_busy)             a lock of the lock directory stayed held past its bound
    ├── AlreadyRunning (already_running) gpusd start: a daemon with other options runs on this state directory
    ├── DiskFull (disk_full)             a file could not be written: its file system is full (ENOSPC, EDQUOT)
    └── DaemonStartFailed (start_failed) a background daemon exited while starting (``status``: its exit code)

Each class carries the three numbers that stand for it (docs/errors.md), and nothing else chooses them:

- ``code``: stable, on the lease socket, a job's control socket and the HTTP API (:func:`to_wire`,
  :func:`from_wire`);
- ``exit_status``: what the CLI exits with (``gpusd.cli.exits`` reads it; a subclass inherits its base's);
- ``http_status`` (and ``http_reason``): the daemon's HTTP answer for it (:func:`http_answer`); the pool
  client's decoding reads the same attributes (``REFUSED_STATUSES``).

Two subclasses keep their base's code on every wire (older peers read them as before): ``OverCap`` (a
``no_gpu`` past the fair-use cap, HTTP 429) and ``PlacementError`` (a bad placement file, ``error``).
:func:`exec_failure` is the one rule for a command that cannot be started (exit 127 or 126).  Those that
are also :class:`ValueError` stay catchable as before.
"""

# Imports inside functions: start-up (quick commands import this module).
from __future__ import annotations

# typing is not imported at run time: start-up time
TYPE_CHECKING = False
if TYPE_CHECKING:  # pragma: no cover
    from typing import Any


# The CLI's exit statuses (docs/cli.md "Exit codes"); gpusd.cli.exits re-exports them.
EXIT_OK = 0
EXIT_ERROR = 1
EXIT_USAGE = 2
# no NVML library, no driver, or no simulation given
EXIT_NO_BACKEND = 3
# no GPU satisfies the constraints (and --wait was not given)
EXIT_NO_GPU = 4
# --wait --timeout ran out
EXIT_TIMEOUT = 5
# no daemon running / none found, or its answer cannot be read
EXIT_NO_DAEMON = 6
# gpusd start: a daemon already runs on this state directory with other options
EXIT_ALREADY_RUNNING = 7
# gpusd run --time: the job's time ran out and it was stopped (as timeout(1) exits)
EXIT_TIME_LIMIT = 124
# the shell's statuses for a command that cannot be started
EXIT_CANNOT_EXECUTE = 126
EXIT_NOT_FOUND = 127


class GpusdError(Exception):
    """Base class of gpusd's errors; its message is one line meant for users."""

    # stable: on the wire (to_wire)
    code = "error"
    exit_status = EXIT_ERROR
    # the daemon could not do it; a subclass says better where it can
    http_status = 503
    # the HTTP body's "reason" (older clients read it)
    http_reason: str | None = None

    @classmethod
    def from_message(cls, message: str, d: dict[str, Any]) -> GpusdError:
        """The error a peer reported (``d``: its wire form), rebuilt here (:func:`from_wire`)."""
        return cls(message)


class ConfigError(GpusdError, ValueError):
    """A bad flag, value or file given by the user."""

    code = "usage"
    exit_status = EXIT_USAGE
    http_status = 400


class IdError(ConfigError):
    """Not a job, lease or Slurm job id (:mod:`gpusd.ids`); the message says what one is."""

    code = "bad_id"


class SecretError(ConfigError):
    """The fleet secret (``--token-file``, ``$GPUSD_TOKEN``, ``token=``) cannot be read, or is too short
    or not text (still a :class:`ValueError`, as before it joined the tree)."""

    code = "secret"


SIMULATE_EXAMPLE = "--simulate 4xA100-80GB"


class BackendUnavailable(GpusdError):
    """The GPU inventory cannot be read: no NVML library, no driver, or NVML failed to start.

    ``reason`` is what failed; with ``hint``, the message also says how to try gpusd without a GPU
    (the CLI rewrites that hint to name the very command that was run)."""

    code = "no_backend"
    exit_status = EXIT_NO_BACKEND

    def __init__(self, reason: str, hint: bool = False) -> None:
        self.reason = reason
        self.hint = hint
        super().__init__(f"{reason}; to try gpusd without a GPU, simulate some ({SIMULATE_EXAMPLE}, "
                         "or simulate='4xA100-80GB' in Python)" if hint else reason)


class NoGpuAvailable(GpusdError):
    """No GPU satisfies the constraints right now."""

    code = "no_gpu"
    exit_status = EXIT_NO_GPU
    http_status = 409
    http_reason = "no_gpu"


class WaitTimeout(NoGpuAvailable):
    """Waiting for qualifying GPUs ran past its timeout."""

    code = "timeout"
    exit_status = EXIT_TIMEOUT


class WireError(GpusdError, ValueError):
    """Data from the network (a snapshot, a fleet answer, a TXT record, an event stream) fails
    validation; the message names the bad field."""

    code = "wire"


class TxtError(WireError):
    """A TXT record that is malformed, oversized, of another version, or inconsistent."""

    code = "txt"


class SSEError(WireError):
    """The stream is not valid SSE, or an event is too large."""

    code = "sse"


class NoDaemon(GpusdError):
    """No daemon runs (for this state directory), or none was found."""

    code = "no_daemon"
    exit_status = EXIT_NO_DAEMON


class SourceError(GpusdError):
    """The hosts cannot be read from a daemon (unreachable, bad answer).  Not a :class:`NoDaemon`
    (a daemon may well run: its answer is what failed); the CLI still exits 6 for it."""

    code = "source"
    exit_status = EXIT_NO_DAEMON


class LockBusy(GpusdError):
    """A lock of the lock directory stayed held past the documented bound (by a stuck or hostile
    process); the message names the holder where the kernel tells it."""

    code = "lock_busy"


class AlreadyRunning(GpusdError):
    """``gpusd start`` asked for other options than the daemon already running on its state directory."""

    code = "already_running"
    exit_status = EXIT_ALREADY_RUNNING


class DiskFull(GpusdError):
    """A file gpusd needs could not be written because the file system holding it is full (``ENOSPC``)
    or over quota (``EDQUOT``); the message names the directory and the errno (:meth:`of`).  Nothing
    half-written is left behind.  HTTP 507 on the API."""

    code = "disk_full"
    # Insufficient Storage: the reason, not "no GPU"
    http_status = 507
    http_reason = "disk_full"

    @classmethod
    def of(cls, directory: object, exc: OSError | None = None, what: str = "a file") -> DiskFull:
        import errno as _errno

        name = _errno.errorcode.get(exc.errno, "ENOSPC") if exc is not None and exc.errno else "ENOSPC"
        why = "over the disk quota" if name == "EDQUOT" else "no space left on the device"
        return cls(f"cannot write {what} in {directory}: {why} ({name}); free some space there (or point "
                   "GPUSD_LOCK_DIR / GPUSD_STATE_DIR elsewhere) and try again")

    @staticmethod
    def caused(exc: BaseException) -> bool:
        """Whether ``exc`` is a full file system's error (``ENOSPC`` or ``EDQUOT``)."""
        import errno as _errno

        return isinstance(exc, OSError) and exc.errno in (_errno.ENOSPC, _errno.EDQUOT)


class DaemonStartFailed(GpusdError):
    """A daemon started in the background exited before it was ready."""

    code = "start_failed"

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        # the daemon process's exit status
        self.status = status

    @classmethod
    def from_message(cls, message: str, d: dict[str, Any]) -> GpusdError:
        status = d.get("status")
        return cls(message, status if type(status) is int and 0 <= status < 256 else 1)


class OverCap(NoGpuAvailable):
    """A request past the fair-use policy's cap for its user (the message names the cap); never
    waited out.  Its code stays ``no_gpu`` (older peers read it as one)."""

    http_status = 429
    http_reason = "policy"


class PlacementError(GpusdError, ValueError):
    """A placement that cannot be used: unsafe or malformed host names, GPU lists or job id."""


def exec_failure(exc: OSError, program: str) -> tuple[int, str]:
    """The exit status and one-line message for a command that could not be started: 127 when it
    is not found, 126 when it cannot be executed (the shell's convention)."""
    if isinstance(exc, FileNotFoundError):
        return EXIT_NOT_FOUND, f"command not found: {program}"
    if isinstance(exc, PermissionError):
        return EXIT_CANNOT_EXECUTE, f"permission denied: {program}"
    return EXIT_NOT_FOUND, f"cannot run {program}: {exc.strerror or exc}"


# -- errors on the wire ---------------------------------------------------------------------------------
# The answers of 0.2 daemons and supervisors name a kind in "error" (lease socket, control socket) and
# no "code"; those words are the codes of these classes, and every answer still carries its nearest one.
LEGACY_KINDS = ("usage", "no_gpu", "timeout", "error")
# characters of a peer's message kept (sanitised for a terminal)
MAX_MESSAGE = 2000


def to_wire(exc: BaseException, http: bool = False) -> dict[str, Any]:
    """The wire form of ``exc``: ``{"ok": false, "code": ..., "error": KIND, "message": ...}`` on the
    lease socket and a job's control socket (``error``: the nearest 0.2 kind, for older clients), or
    ``{"error": MESSAGE, "code": ...}`` as an HTTP API error body (``http``; its ``error`` has always
    been the message).  Anything not a :class:`GpusdError` is code ``error``."""
    cls = type(exc) if isinstance(exc, GpusdError) else GpusdError
    message = str(exc)
    if http:
        out: dict[str, Any] = {"error": message, "code": cls.code}
    else:
        kind = next(c.__dict__["code"] for c in cls.__mro__ if c.__dict__.get("code") in LEGACY_KINDS)
        out = {"ok": False, "code": cls.code, "error": kind, "message": message}
    if isinstance(exc, DaemonStartFailed):
        out["status"] = exc.status
    return out


def http_answer(exc: BaseException, reason: str | None = None) -> tuple[int, dict[str, Any]]:
    """The daemon's HTTP answer for ``exc``: its class's status and the body :func:`to_wire` makes,
    with ``reason`` (else the class's ``http_reason``) where there is one.  Anything not a
    :class:`GpusdError` answers as one (503)."""
    cls = type(exc) if isinstance(exc, GpusdError) else GpusdError
    body = to_wire(exc, http=True)
    why = reason or cls.http_reason
    if why is not None:
        body["reason"] = why
    return cls.http_status, body


def from_wire(d: object, prefix: str = "") -> GpusdError:
    """The :class:`GpusdError` a peer's refusal (:func:`to_wire`'s form, or a 0.2 peer's without
    ``code``) stands for, its message sanitised and prefixed with ``prefix`` (e.g. ``"job 3f..: "``).
    An unknown code falls back on the 0.2 ``error`` kind, then on :class:`GpusdError`."""
    from .sanitize import for_terminal

    if not isinstance(d, dict):
        return GpusdError(prefix + "the peer's answer is not a JSON object")
    code, message = d.get("code"), d.get("message")
    # the sockets' form: "error" is the kind
    if isinstance(message, str):
        kind = d.get("error")
    else:
        # an HTTP error body: "error" is the message, a 0.2 daemon's "reason" the kind where it gave one
        message, kind = d.get("error"), d.get("reason")
    cls = (_BY_CODE.get(code) if isinstance(code, str) else None) or (
        _BY_CODE.get(kind) if isinstance(kind, str) and kind in LEGACY_KINDS else None) or GpusdError
    text = for_terminal(str(message), MAX_MESSAGE) if message else "the peer refused the request"
    return cls.from_message(prefix + text, d)


__all__ = [
    "GpusdError",
    "ConfigError",
    "BackendUnavailable",
    "NoGpuAvailable",
    "WaitTimeout",
    "IdError",
    "SecretError",
    "WireError",
    "TxtError",
    "SSEError",
    "NoDaemon",
    "SourceError",
    "LockBusy",
    "AlreadyRunning",
    "DiskFull",
    "DaemonStartFailed",
]

_BY_CODE: dict[str, type[GpusdError]] = {
    c.code: c for c in (GpusdError, ConfigError, IdError, SecretError, BackendUnavailable, NoGpuAvailable,
                        WaitTimeout, WireError, TxtError, SSEError, NoDaemon, SourceError, LockBusy,
                        AlreadyRunning, DiskFull, DaemonStartFailed)}

# The HTTP statuses of a daemon that refused a lease for now (no GPU, a cap, a full disk, another
# failure): the pool client then tries the next host, and tells the user each one's reason when none
# granted.
REFUSED_STATUSES = frozenset({NoGpuAvailable.http_status, OverCap.http_status, DiskFull.http_status,
                              GpusdError.http_status})
