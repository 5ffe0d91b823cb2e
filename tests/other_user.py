"""A second, unprivileged user for the tests that play a hostile local user (tests/alloc/test_local_trust.py,
tests/jobs/test_jobs_trust.py): a forked child that drops to a uid no passwd entry needs.  Root only."""

from __future__ import annotations

import os
import signal
import time
from typing import Callable

import pytest

MALLORY = 40001  # the attacker; no passwd entry needed: the kernel only knows numbers
ALICE = 40002  # a second ordinary user

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to play a second, unprivileged user")


class AsUser:
    """A forked child running ``fn`` as ``uid``; it reports one line (``fn``'s result or error) and
    then, with ``stay``, keeps running (holding whatever it opened) until stopped."""

    def __init__(self, uid: int, fn: Callable[[], object], stay: bool = False) -> None:
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: never return into pytest
            try:
                os.close(r)
                os.setgroups([])
                os.setgid(uid)
                os.setuid(uid)
                try:
                    result = f"ok {fn()}"
                except Exception as exc:
                    result = f"error {type(exc).__name__}: {exc}"
                os.write(w, (result.replace("\n", " ") + "\n").encode())
                if stay:
                    time.sleep(120)
            finally:
                os._exit(0)
        os.close(w)
        self.pid = pid
        with os.fdopen(r) as f:
            self.result = f.readline().strip()

    def stop(self) -> None:
        try:
            os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        os.waitpid(self.pid, 0)


def as_user(uid: int, fn: Callable[[], object]) -> str:
    child = AsUser(uid, fn)
    child.stop()
    return child.result
