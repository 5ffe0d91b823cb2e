"""Review (issue 13 security): attacks on the priority queue. Each test fails while the hole is open."""
from __future__ import annotations

import os
import subprocess
import sys
import time

from conftest import REPO
from gpusd.alloc import queue
from gpusd.alloc.leases import LeaseStore
from gpusd.alloc.priority import NORMAL


def _enqueue(store, priority, **kw):
    with store.mutex():
        return queue.enqueue(store, 1, priority=priority, **kw)


def test_a_fresh_process_claiming_resume_does_not_pass_earlier_waiters_of_its_class(tmp_path):
    """Any user can write resume=true in a ticket that a process of theirs holds; if that process
    started *after* the others queued, it must not go ahead of them (docs: 'at best the place they
    would have had by queueing when that process started')."""
    store = LeaseStore()
    store.ensure()
    others = [_enqueue(store, NORMAL), _enqueue(store, NORMAL)]
    time.sleep(1.1)  # /proc's btime has whole seconds
    script = tmp_path / "jump.py"
    script.write_text(
        "import sys\n"
        "from gpusd.alloc import queue\n"
        "from gpusd.alloc.leases import LeaseStore\n"
        "store = LeaseStore()\n"
        "with store.mutex():\n"
        "    t = queue.enqueue(store, 1, priority=1, resume=True)\n"  # a lie: never preempted
        "print(t.path.name, flush=True)\n"
        "sys.stdin.readline()\n")
    p = subprocess.Popen([sys.executable, str(script)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                         env=dict(os.environ, PYTHONPATH=str(REPO / "src")))
    try:
        assert p.stdout is not None
        mine = p.stdout.readline().strip()
        order = [w.ticket for w in queue.waiters(store)]
        assert order == [others[0].path.name, others[1].path.name, mine], order
    finally:
        p.kill()
        p.wait()
        for x in others:
            x.close()


def test_a_hard_link_or_a_fifo_in_the_queue_is_not_a_waiter(tmp_path):
    """A ticket is a regular file with one link (as every other lock-directory file): a hard link to
    another user's file (root's, say: believed to name anyone, at any priority) or a FIFO is not one."""
    import fcntl

    store = LeaseStore()
    store.ensure()
    d = store.dir
    other = d / "elsewhere.json"
    other.write_text('{"priority": 3, "user": "alice"}')
    os.link(other, d / "queue-000000000001-1.ticket")
    os.mkfifo(d / "queue-000000000002-1.ticket")
    fds = [os.open(d / "queue-000000000001-1.ticket", os.O_RDONLY),
           os.open(d / "queue-000000000002-1.ticket", os.O_RDONLY | os.O_NONBLOCK)]
    try:
        for fd in fds:
            fcntl.flock(fd, fcntl.LOCK_EX)
        assert queue.waiters(store) == []
    finally:
        for fd in fds:
            os.close(fd)
