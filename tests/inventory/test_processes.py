"""Who runs a GPU process (gpusd.inventory.processes): looked up once per pid while it stays on a GPU."""

import random

from gpusd.inventory.processes import ProcessResolver
from gpusd.model import GpuInfo, ProcessInfo


def _resolver(looked: list[int]) -> ProcessResolver:
    r = ProcessResolver()
    r._lookup = lambda pid: looked.append(pid) or (f"user{pid}", f"cmd{pid}")  # type: ignore[method-assign]
    return r


def test_a_snapshots_owners_are_looked_up_once_and_forgotten_when_gone():
    looked: list[int] = []
    r = _resolver(looked)
    gpus = [GpuInfo(index=0, uuid="a", processes=[ProcessInfo(1), ProcessInfo(2)]),
            GpuInfo(index=1, uuid="b", processes=[ProcessInfo(1, type="graphics"), ProcessInfo(3, user="x")])]
    r.fill_gpus(gpus)
    assert [(p.user, p.command) for g in gpus for p in g.processes] == [
        ("user1", "cmd1"), ("user2", "cmd2"), ("user1", "cmd1"), ("x", None)]  # one already known is kept
    assert looked == [1, 2]
    r.fill_gpus([GpuInfo(index=0, uuid="a", processes=[ProcessInfo(2)])])
    assert looked == [1, 2] and set(r._cache) == {2}  # pid 1 left the GPUs: looked up again if it comes back


def test_filling_a_snapshots_gpus_is_filling_their_processes_keeping_only_those_seen():
    rng = random.Random(3)
    a_looked: list[int] = []
    b_looked: list[int] = []
    a, b = _resolver(a_looked), _resolver(b_looked)
    def gpus(seed: float) -> list[GpuInfo]:
        r = random.Random(seed)
        return [GpuInfo(index=i, uuid=str(i), processes=[
            ProcessInfo(r.randint(1, 12), user=r.choice([None, None, "x"]), command=r.choice([None, None, "y"]))
            for _ in range(r.randint(0, 3))]) for i in range(r.randint(0, 4))]

    for _ in range(200):
        seed = rng.random()
        mine, theirs = gpus(seed), gpus(seed)
        a.fill_gpus(mine)
        b.fill([p for g in theirs for p in g.processes], keep_only_seen=True)
        assert mine == theirs and a._cache == b._cache and a_looked == b_looked
