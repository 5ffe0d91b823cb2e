"""Issue 13: the --wait queue orders by priority class, first come first served within a class, ages
waiting jobs, puts preempted jobs at the head of their class, and believes none of it blindly
(docs/jobs.md, "Fairness"; gpusd.alloc.queue, gpusd.alloc.priority)."""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from conftest import REPO
from fakenvml import make_gpus
from gpusd.alloc import lockdir, queue
from gpusd.alloc.api import LeaseRequest, allocate
from gpusd.alloc.leases import LeaseStore
from gpusd.alloc.policy import load_priority_policy
from gpusd.alloc.priority import HIGH, LOW, NORMAL, URGENT, PriorityPolicy, parse_policy
from gpusd.alloc.select import Constraints
from gpusd.errors import NoGpuAvailable
from other_user import MALLORY, AsUser, needs_root
from waiting import wait_until_sync


def _order(store: LeaseStore) -> list[str]:
    return [w.ticket for w in queue.waiters(store)]


def _enqueue(store: LeaseStore, priority: int, **kw: object) -> queue.Ticket:
    with store.mutex():
        return queue.enqueue(store, 1, priority=priority, **kw)  # type: ignore[arg-type]


def test_higher_classes_go_first_and_each_class_is_first_come_first_served():
    store = LeaseStore()
    store.ensure()
    t = [_enqueue(store, p) for p in (NORMAL, LOW, HIGH, NORMAL, URGENT, HIGH)]
    try:
        expected = [t[4], t[2], t[5], t[0], t[3], t[1]]
        assert _order(store) == [x.path.name for x in expected]
        assert [w.priority for w in queue.waiters(store)] == [URGENT, HIGH, HIGH, NORMAL, NORMAL, LOW]
        assert queue.ahead_of(store, t[0]) == t[5].path and queue.ahead_of(store, t[4]) is None
        # A newcomer that does not wait is refused while anyone of its class or above is queued ...
        assert len(queue.ahead_of_newcomer(store, NORMAL)) == 5
        assert len(queue.ahead_of_newcomer(store, URGENT)) == 1
        for x in (t[4], t[2], t[5], t[0], t[3]):
            x.close()
        # ... and not by those below it.
        assert queue.ahead_of_newcomer(store, NORMAL) == []
    finally:
        for x in t:
            x.close()


def test_waiting_ages_a_job_up_to_high_but_never_to_urgent():
    policy = PriorityPolicy(aging_s=600)
    assert policy.aged(LOW, 599) == LOW and policy.aged(LOW, 600) == NORMAL and policy.aged(LOW, 1200) == HIGH
    assert policy.aged(LOW, 10**6) == HIGH and policy.aged(HIGH, 10**6) == HIGH
    assert policy.aged(NORMAL, float("nan")) == NORMAL


def test_a_low_job_that_waited_long_enough_goes_before_newer_high_ones(tmp_path, monkeypatch):
    """Starvation: with an aging period of 0.6 s, a low job is passed by newcomers for at most 1.2 s."""
    policy = tmp_path / "priorities.json"
    policy.write_text(json.dumps({"aging_minutes": 0.01}))
    monkeypatch.setenv("GPUSD_PRIORITY_POLICY", str(policy))
    store = LeaseStore()
    store.ensure()
    low = _enqueue(store, LOW)
    early_high = _enqueue(store, HIGH)
    try:
        assert _order(store) == [early_high.path.name, low.path.name]  # passed while young
        wait_until_sync(lambda: all(w.level == HIGH for w in queue.waiters(store)), timeout=30)
        late_high = _enqueue(store, HIGH)
        # Aged to high, it is a high job that has waited longest.
        assert _order(store) == [low.path.name, early_high.path.name, late_high.path.name]
        late_high.close()
    finally:
        low.close()
        early_high.close()


def test_a_preempted_job_is_requeued_at_the_head_of_its_class(tmp_path):
    """The claim is believed because the process that holds the ticket's lock makes it; its place is
    the time that process started (its ``gpusd run``), which the kernel keeps."""
    store = LeaseStore()
    store.ensure()
    script = tmp_path / "resume.py"
    script.write_text(
        "import sys, time\n"
        "from gpusd.alloc import queue\n"
        "from gpusd.alloc.leases import LeaseStore\n"
        "store = LeaseStore()\n"
        "sys.stdin.readline()\n"  # started now, queues when told (after the others)
        "with store.mutex():\n"
        "    t = queue.enqueue(store, 1, priority=0, resume=True)\n"
        "print(t.path.name, flush=True)\n"
        "sys.stdin.readline()\n")
    env = dict(os.environ, PYTHONPATH=str(REPO / "src"))
    p = subprocess.Popen([sys.executable, str(script)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                         env=env)
    others: list[queue.Ticket] = []
    try:
        wait_until_sync(lambda: lockdir.process_start(p.pid) is not None, timeout=10)
        import time

        time.sleep(1.1)  # /proc's boot time has whole seconds: be clearly later than the process's start
        others = [_enqueue(store, LOW), _enqueue(store, LOW), _enqueue(store, NORMAL)]
        assert p.stdin is not None and p.stdout is not None
        p.stdin.write("go\n")
        p.stdin.flush()
        resumed = p.stdout.readline().strip()
        order = queue.waiters(store)
        assert [w.ticket for w in order] == [others[2].path.name, resumed, others[0].path.name, others[1].path.name]
        assert order[1].resumed and not order[2].resumed
    finally:
        p.kill()
        p.wait()
        for x in others:
            x.close()


def test_a_resume_claim_by_a_process_that_does_not_hold_the_ticket_is_not_believed(tmp_path):
    """Naming an old process (one's login shell, say) to take an early place does not work: the named
    process must hold the ticket's lock."""
    store = LeaseStore()
    store.ensure()
    first = _enqueue(store, LOW)
    forged = _enqueue(store, LOW, resume=True, pid=1)  # pid 1 started long ago; it holds nothing of ours
    try:
        order = queue.waiters(store)
        assert [w.ticket for w in order] == [first.path.name, forged.path.name]
        assert not order[1].resumed
    finally:
        first.close()
        forged.close()


@pytest.fixture
def shared_locks(shared_tmp):
    locks = shared_tmp / "locks"
    locks.mkdir()
    os.chmod(locks, 0o1777)
    return locks


def _forge_ticket(locks: Path, name: str, body: dict[str, object]) -> object:
    fd = os.open(str(locks / f".{name}.tmp"), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX)
    os.write(fd, json.dumps(body).encode())
    os.rename(str(locks / f".{name}.tmp"), str(locks / name))
    return fd


@needs_root
def test_a_local_user_cannot_jump_the_queue_by_forging_numbers_times_or_urgency(shared_locks, monkeypatch):
    """Mallory writes her own ticket: the smallest sequence number, a waiting time of 1970, urgent.
    The queue believes the kernel instead: her ticket started waiting when it appeared, she may claim
    at most high (the default policy), and with a policy that allows her normal, normal."""
    monkeypatch.setenv("GPUSD_LOCK_DIR", str(shared_locks))
    store = LeaseStore()
    root_normal = _enqueue(store, NORMAL)
    root_urgent = _enqueue(store, URGENT)

    def forge() -> str:
        _forge_ticket(shared_locks, "queue-000000000001-1-abcd.ticket",
                      {"pid": os.getpid(), "user": "root", "count": 1, "since": 0, "since_boot": 0,
                       "priority": URGENT})
        return "forged"

    mallory = AsUser(MALLORY, forge, stay=True)
    try:
        assert mallory.result == "ok forged"
        order = queue.waiters(store)
        assert [w.ticket for w in order] == [root_urgent.path.name, "queue-000000000001-1-abcd.ticket",
                                             root_normal.path.name]
        assert order[1].priority == HIGH and order[1].uid == MALLORY and order[1].user != "root"

        policy = shared_locks.parent / "priorities.json"
        policy.write_text(json.dumps({"max": "normal"}))
        monkeypatch.setenv("GPUSD_PRIORITY_POLICY", str(policy))
        order = queue.waiters(store)
        assert [w.ticket for w in order] == [root_urgent.path.name, root_normal.path.name,
                                             "queue-000000000001-1-abcd.ticket"]
        assert order[2].priority == NORMAL
    finally:
        mallory.stop()
        root_normal.close()
        root_urgent.close()


@needs_root
def test_a_priority_policy_another_user_can_write_is_ignored(shared_locks, monkeypatch, caplog):
    policy = shared_locks / "priorities.json"
    policy.write_text(json.dumps({"max": "urgent"}))
    os.chown(policy, MALLORY, MALLORY)
    assert load_priority_policy(str(policy)).max_for(MALLORY) == HIGH  # hers: ignored, the defaults apply
    os.chown(policy, 0, 0)
    os.chmod(policy, 0o666)
    assert load_priority_policy(str(policy)).max_for(MALLORY) == HIGH  # root's but world-writable: ignored
    assert "ignoring the priority policy" in caplog.text
    os.chmod(policy, 0o644)
    assert load_priority_policy(str(policy)).max_for(MALLORY) == URGENT  # root's, only root may write it
    link = shared_locks / "link.json"
    link.symlink_to(policy)
    assert load_priority_policy(str(link)).max_for(MALLORY) == HIGH  # never through a symlink
    os.chmod(policy, 0o666)  # made writable by others after a good read: no longer believed, cache or not
    assert load_priority_policy(str(policy)).max_for(MALLORY) == HIGH


def test_policy_files_are_checked_field_by_field():
    p = parse_policy(b'{"max": "normal", "users": {"alice": "urgent"}, "groups": {"root": "low"}, '
                     b'"aging_minutes": 5}')
    assert (p.max_default, p.users, p.groups, p.aging_s) == (NORMAL, {"alice": URGENT}, {"root": LOW}, 300.0)
    assert p.max_for(0) == URGENT  # root may always claim anything
    for bad, why in [(b"[]", "not a JSON object"), (b"{", "not JSON"), (b'{"max": "top"}', "max"),
                     (b'{"users": {"bob": 3}}', "bob"), (b'{"aging_minutes": -1}', "aging_minutes"),
                     (b'{"aging_minutes": NaN}', "aging_minutes"), (b'{"colour": 1}', "unknown field")]:
        with pytest.raises(ValueError, match=why):
            parse_policy(bad)


def test_a_high_priority_newcomer_gets_the_freed_gpu_before_the_normal_jobs_queued_earlier(fake_nvml_inprocess):
    fake_nvml_inprocess.write(make_gpus(1))
    store = LeaseStore()
    c = Constraints(count=1)
    held = allocate(LeaseRequest(c), store=store)
    got: list[str] = []
    lock = threading.Lock()

    def waiter(name: str, priority: int) -> None:
        sel = allocate(LeaseRequest(c, wait=True, timeout=60, priority=priority), store=store)
        with lock:
            got.append(name)
        sel.release()

    threads = []
    try:
        for i in range(2):
            threads.append(threading.Thread(target=waiter, args=(f"normal{i}", NORMAL)))
            threads[-1].start()
            wait_until_sync(lambda n=i + 1: len(queue.waiters(store)) == n, timeout=20)
        with pytest.raises(NoGpuAvailable, match="waiting for GPUs ahead of this one"):
            allocate(LeaseRequest(c, priority=NORMAL), store=store)  # no --wait: refused, two are ahead
        threads.append(threading.Thread(target=waiter, args=("high", HIGH)))
        threads[-1].start()
        wait_until_sync(lambda: len(queue.waiters(store)) == 3, timeout=20)
        assert queue.waiters(store)[0].priority == HIGH
    finally:
        held.release()
        for t in threads:
            t.join(90)
    assert got == ["high", "normal0", "normal1"]


@needs_root
def test_run_as_another_user_refuses_urgent_without_the_administrators_word(fake_nvml, shared_locks, monkeypatch,
                                                                           capsys):
    """The CLI is run in the forked child (this interpreter lives in root's home, which others cannot
    execute): Mallory asks for urgent and is told she may use at most high, before anything is queued."""
    fake_nvml.write(make_gpus(1))
    monkeypatch.setenv("GPUSD_LOCK_DIR", str(shared_locks))
    for k, v in fake_nvml.env({}).items():
        monkeypatch.setenv(k, v)

    def run() -> str:
        import contextlib
        import io

        from gpusd.cli import main

        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            try:
                rc = main(["run", "--priority", "urgent", "--", "true"])
            except SystemExit as exc:
                rc = exc.code  # type: ignore[assignment]
        return f"{rc} {err.getvalue().strip()}"

    result = AsUser(MALLORY, run)
    result.stop()
    assert result.result.startswith("ok 2 ") and "allows you at most high" in result.result, result.result
    assert queue.waiters(LeaseStore()) == []


@needs_root
def test_one_users_flood_of_tickets_is_bounded(shared_locks, monkeypatch):
    """Every waiter scans every ticket: one user's thousand tickets would slow everyone's queue. Past
    MAX_TICKETS_PER_USER, a user's tickets are not counted (they queue behind everyone)."""
    monkeypatch.setenv("GPUSD_LOCK_DIR", str(shared_locks))
    monkeypatch.setattr(queue, "MAX_TICKETS_PER_USER", 5)
    store = LeaseStore()
    mine = _enqueue(store, NORMAL)

    kept: list[queue.Ticket] = []  # held while the child stays

    def flood() -> str:
        s = LeaseStore()
        kept.extend(_enqueue(s, HIGH) for _ in range(8))
        return str(len(kept))

    mallory = AsUser(MALLORY, flood, stay=True)
    try:
        assert mallory.result == "ok 8"
        order = queue.waiters(store)
        assert [w.uid for w in order].count(MALLORY) == 5 and order[-1].ticket == mine.path.name
    finally:
        mallory.stop()
        mine.close()


@pytest.mark.skipif(os.geteuid() != 0, reason="a priority policy is believed only when root owns it")
def test_the_clients_environment_cannot_lift_the_administrators_priority_bounds(tmp_path, monkeypatch):
    """Root's policy caps everyone at normal: GPUSD_PRIORITY_POLICY pointing at a laxer file (or at
    none) does not give a user `high`; a stricter one still lowers the bound."""
    from gpusd.alloc import priority

    root = tmp_path / "priorities.json"
    root.write_text(json.dumps({"max": "normal"}))
    root.chmod(0o644)
    monkeypatch.setattr(priority, "PRIORITY_PATH", str(root))
    nobody = 65534
    assert load_priority_policy().max_for(nobody) == NORMAL
    lax = tmp_path / "lax.json"
    lax.write_text(json.dumps({"max": "urgent"}))
    lax.chmod(0o644)
    for chosen in (str(lax), str(tmp_path / "nonexistent.json")):
        monkeypatch.setenv("GPUSD_PRIORITY_POLICY", chosen)
        assert load_priority_policy().believed(HIGH, nobody) == NORMAL, chosen
    strict = tmp_path / "strict.json"
    strict.write_text(json.dumps({"max": "low"}))
    strict.chmod(0o644)
    monkeypatch.setenv("GPUSD_PRIORITY_POLICY", str(strict))
    assert load_priority_policy().max_for(nobody) == LOW
