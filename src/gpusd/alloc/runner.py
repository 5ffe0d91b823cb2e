"""``gpusd run``: run a command on leased GPUs, for as long as it lives.

The lease's lock descriptors are handed to the command (``pass_fds``), so the GPUs stay leased while
any process of the job holds them — even if ``gpusd run`` itself is killed with SIGKILL — and are
freed by the kernel when the last one exits, however it exits.  Signals sent to ``gpusd run``
(TERM, HUP, INT, QUIT, USR1, USR2) are forwarded to the command; at an interactive terminal, Ctrl-C
already reaches the command through the terminal, so it is not sent twice.  The exit status is the
command's, or 128+N when a signal N ended it (as shells report it).
"""

# Imports inside functions: start-up (quick commands import this module).
from __future__ import annotations

import os
import signal
import sys

from ..errors import exec_failure
from .api import Selection

# typing is not imported at run time: start-up time
TYPE_CHECKING = False
if TYPE_CHECKING:  # pragma: no cover
    import subprocess
    from typing import Any, Callable, Sequence

FORWARDED = (signal.SIGTERM, signal.SIGHUP, signal.SIGINT, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)


def _interactive() -> bool:
    try:
        return os.isatty(0) and os.tcgetpgrp(0) == os.getpgrp()
    except OSError:
        return False


def run_with(selection: Selection, cmd: Sequence[str], bind_cpus: bool = False) -> int:
    """Run ``cmd`` on ``selection``'s devices (``bind_cpus``: on their local CPUs, :mod:`gpusd.alloc.cpus`)."""
    # here: a job's supervisor reads FORWARDED while it waits for GPUs, and needs no subprocess
    import subprocess

    from ..inventory.vendors import job_environ
    from .cpus import binding, preexec

    env = job_environ(os.environ, selection.visible, use_uuid=selection.use_uuid)
    # never an outer job's token
    env.pop("GPUSD_LEASE_EPOCH", None)
    env.update({k: v for k, v in selection.env().items() if k in ("GPUSD_LEASE", "GPUSD_LEASE_EPOCH")})
    fds = list(selection.lease.fds) if selection.lease else []
    cpus = None
    if bind_cpus:
        cpus, said = binding(selection.gpus)
        print(f"gpusd: {said}", file=sys.stderr, flush=True)
    try:
        proc = subprocess.Popen(list(cmd), env=env, pass_fds=fds, preexec_fn=preexec(cpus, False))
    except (FileNotFoundError, PermissionError) as exc:
        status, why = exec_failure(exc, cmd[0])
        print(f"gpusd: {why}", file=sys.stderr)
        selection.release()
        return status
    try:
        return wait_forwarding(proc, proc.send_signal, _interactive())
    finally:
        selection.release()


def wait_forwarding(proc: subprocess.Popen[Any], send: Callable[[int], object], interactive: bool) -> int:
    """Wait for ``proc``, passing the signals a runner gets on to it through ``send`` (``FORWARDED``;
    not SIGINT/SIGQUIT at a terminal, which sent them to the whole foreground group, the command
    included); its exit status, or 128 + the signal that ended it."""
    def forward(signum: int, _frame: object) -> None:
        if signum in (signal.SIGINT, signal.SIGQUIT) and interactive:
            return
        try:
            send(signum)
        except (ProcessLookupError, OSError):
            pass

    previous = {sig: signal.signal(sig, forward) for sig in FORWARDED}
    try:
        rc = proc.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return rc if rc >= 0 else 128 - rc
