"""A bounded CPU load for the benchmarks that report figures "at load 3": ``busy_load(3)`` starts three
busy-loop processes (each stops by itself after ``limit`` seconds, whatever happens to this one) and
stops them, by pid, when the block ends.  The load average follows with a lag of about a minute; the
figure to report beside a result is how many loops ran, and ``os.getloadavg()`` as read then."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator

LOOP = "import sys, time\nend = time.monotonic() + float(sys.argv[1])\nwhile time.monotonic() < end:\n    pass\n"


@contextlib.contextmanager
def busy_load(n: int, limit: float = 900.0) -> Iterator[list[int]]:
    """``n`` busy loops (each ends by itself after ``limit`` s) while the block runs; their pids."""
    procs = [subprocess.Popen([sys.executable, "-c", LOOP, str(limit)], stdin=subprocess.DEVNULL)
             for _ in range(max(0, n))]
    try:
        yield [p.pid for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, signal.SIGKILL)
            p.wait()
