"""What the notify tests share: a gpusd process whose stderr is read on a thread, and a holder of GPUs
that ends when told (its command writes ENDING just before it exits, so that whatever fires after
the lease ended can tell it is after)."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path
from typing import Any, Sequence

from waiting import wait_until_sync


class Lines:
    """A process started with ``stderr=PIPE`` (text): its stderr lines, collected on a thread."""

    def __init__(self, proc: subprocess.Popen[Any]) -> None:
        self.proc = proc
        self.lines: list[str] = []
        self._t = threading.Thread(target=self._read, daemon=True)
        self._t.start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.lines.append(line)

    def wait_for(self, text: str, timeout: float = 30, count: int = 1) -> None:
        wait_until_sync(lambda: sum(text in ln for ln in self.lines) >= count or self.proc.poll() is not None,
                        timeout, what=f"{text!r} on stderr")
        assert sum(text in ln for ln in self.lines) >= count, "".join(self.lines)

    def finish(self, timeout: float = 30) -> int:
        rc = self.proc.wait(timeout)
        self._t.join(5)
        return rc

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def notifier(args: Sequence[str], env: dict[str, str], popen: Any = None) -> Lines:
    """``gpusd -v notify ARGS`` (``popen``: how to start it, e.g. in a namespace)."""
    argv = [sys.executable, "-m", "gpusd", "-v", "notify", *args]
    start = popen or (lambda argv, env, **kw: subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, **kw))
    return Lines(start(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))


def when_said(exec_out: Path) -> str:
    """An --exec command line that appends ``after`` or ``before`` (whether the holder had begun to
    end: ``ENDING`` beside the output) and the variables it got to ``exec_out``."""
    ending = exec_out.parent / "ENDING"
    return (f'if [ -e {ending} ]; then w=after; else w=before; fi; '
            'echo "$w $GPUSD_NOTIFY_COUNT $GPUSD_NOTIFY_GPUS $GPUSD_NOTIFY_UUIDS $GPUSD_NOTIFY_SEQUENCE" '
            f'>> {exec_out}')


class Holder:
    """``gpusd run -n N -- ...`` holding GPUs until :meth:`end` (its command waits for GO, writes ENDING and exits)."""

    def __init__(self, work: Path, n: int, env: dict[str, str], popen: Any = None, prefix: Sequence[str] = ()) -> None:
        self.work = work
        go, held = work / "GO", work / f"HELD-{id(self)}"
        for f in (go, work / "ENDING"):
            f.unlink(missing_ok=True)
        script = (f"touch {held}; i=0; while [ ! -e {go} ] && [ $i -lt 1200 ]; do sleep 0.05; i=$((i+1)); done; "
                  f"touch {work / 'ENDING'}")
        argv = [sys.executable, "-m", "gpusd", "run", "-n", str(n), *prefix, "--", "sh", "-c", script]
        start = popen or (lambda argv, env, **kw: subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, **kw))
        self.proc = start(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        wait_until_sync(lambda: held.exists() or self.proc.poll() is not None, 60, what="the holder's lease")
        assert held.exists(), self.proc.communicate(timeout=10)

    def end(self) -> None:
        (self.work / "GO").touch()
        assert self.proc.wait(30) == 0, self.proc.communicate(timeout=10)
