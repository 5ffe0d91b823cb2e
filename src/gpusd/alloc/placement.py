"""Choosing a set of GPUs for a multi-GPU request: load first, then how the GPUs connect.

:func:`gpusd.alloc.select.candidates` ranks each GPU by load; this module chooses which ``count`` of
them go together (docs/allocation.md, "Topology").  With ``--topology auto`` (the default) the
best-connected set wins unless its GPUs are clearly more loaded than the least-loaded set:

* a set is *within the tolerance* when its busiest GPU's utilisation is at most :data:`TOL_UTIL`
  points above the least-loaded set's busiest, and its fullest GPU's memory in use (reservations
  counted) at most :data:`TOL_MEMORY` of a GPU's memory above the least-loaded set's fullest;
* among the sets within the tolerance, the one whose worst link is best wins (NVLink, then one PCIe
  switch, several switches, the host bridge, the NUMA node, across sockets:
  :func:`gpusd.topology.rank`), then the better mean link, then the lower summed load score, then
  the lower indices.  The least-loaded set is always within the tolerance, so a host that reports
  no topology gets exactly the load order.

``--topology any`` is the pure load order (the least-loaded set); ``--topology nvlink`` takes the
least-loaded set whose GPUs are all NVLink-connected, and refuses when there is none.  One GPU, MIG
slices and ``--share`` requests are placed by load alone (``nvlink`` is then refused for MIG).

Every choice comes with a :class:`Pick` that says why (``gpusd select --explain``, and ``explain``
in ``gpusd select --json``).
"""

from __future__ import annotations

import itertools
import math

from ..errors import NoGpuAvailable
from ..model import GpuLink, HostSnapshot
from ..record import field, record
from ..topology import WORST_RANK, has_topology, label, link_between, rank

# typing is not imported at run time: start-up time
TYPE_CHECKING = False

if TYPE_CHECKING:  # pragma: no cover
    from typing import Any, Protocol, Sequence

    from .candidate import Candidate

    class Constraints(Protocol):
        """What a set's choice reads of :class:`gpusd.alloc.select.Constraints` (that module ranks the
        candidates and calls :func:`pick`: it is above this one)."""

        @property
        def count(self) -> int: ...
        @property
        def mig(self) -> bool: ...
        @property
        def shared(self) -> bool: ...
        @property
        def topology(self) -> str: ...

TOPOLOGIES = ("auto", "any", "nvlink")
TOL_UTIL = 10.0  # utilisation points
TOL_MEMORY = 0.10  # of a GPU's memory
# sets compared exhaustively; beyond, each GPU seeds one set grown greedily
MAX_SETS = 20000


@record
class _Set:
    members: list[Candidate]
    # the worst link's rank (0: NVLink)
    worst: int
    mean: float  # the mean link rank
    max_util: float
    # fraction of the GPU in use
    max_memory: float
    # summed ranking scores
    load: float

    @property
    def labels(self) -> list[str]:
        return [m.label for m in self.members]


@record
class Pick:
    """The chosen devices and why (``to_dict`` for JSON, ``lines`` for people)."""

    chosen: list[Candidate]
    topology: str  # auto, any or nvlink
    reason: str
    # labels of the least-loaded set
    least_loaded: list[str] = field(default_factory=list)
    # (a, b, NV4/PIX/...) of the chosen set
    links: list[tuple[str, str, str]] = field(default_factory=list)
    considered: int = 0
    # other sets, best first (a few)
    alternatives: list[dict[str, Any]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {"topology": self.topology, "chosen": [c.label for c in self.chosen],
                "least_loaded": self.least_loaded, "reason": self.reason,
                "links": [{"a": a, "b": b, "link": lk} for a, b, lk in self.links],
                "sets_considered": self.considered, "alternatives": self.alternatives,
                "tolerance": {"utilization_points": TOL_UTIL, "memory_fraction": TOL_MEMORY}}

    @classmethod
    def from_dict(cls, d: Any, chosen: list[Candidate]) -> Pick | None:
        """The pick the daemon explained (``explain`` of its ``choose`` answer) for ``chosen``; None when
        it is not one (an older daemon sends none).  Only typed, bounded fields are kept."""
        if not isinstance(d, dict) or not isinstance(d.get("reason"), str) or not isinstance(d.get("topology"), str):
            return None

        def words(v: Any, n: int = 64) -> list[str]:
            return [str(x)[:64] for x in v[:n] if isinstance(x, (str, int))] if isinstance(v, list) else []

        def items(key: str, n: int) -> list[Any]:
            v = d.get(key)
            return v[:n] if isinstance(v, list) else []

        links = [(str(x.get("a"))[:64], str(x.get("b"))[:64], str(x.get("link"))[:8])
                 for x in items("links", 2016) if isinstance(x, dict)]
        alternatives = []
        for alt in items("alternatives", 8):
            if (isinstance(alt, dict) and type(alt.get("max_util")) in (int, float)
                    and type(alt.get("max_memory")) in (int, float)):
                alternatives.append({"gpus": words(alt.get("gpus")), "worst_link": str(alt.get("worst_link"))[:16],
                                     "max_util": float(alt["max_util"]), "max_memory": float(alt["max_memory"]),
                                     "within_tolerance": alt.get("within_tolerance") if isinstance(
                                         alt.get("within_tolerance"), bool) else None})
        considered = d.get("sets_considered")
        return cls(chosen, d["topology"][:16], d["reason"][:400], words(d.get("least_loaded")), links,
                   considered if type(considered) is int else 0, alternatives)

    def lines(self) -> list[str]:
        out = [f"chose GPU(s) {', '.join(c.label for c in self.chosen)} (--topology {self.topology}): {self.reason}"]
        if self.links:
            out.append("links: " + ", ".join(f"{a}-{b} {lk}" for a, b, lk in self.links))
        if self.least_loaded and self.least_loaded != [c.label for c in self.chosen]:
            out.append(f"least-loaded set: {', '.join(self.least_loaded)}")
        for alt in self.alternatives:
            out.append(f"  also: {', '.join(alt['gpus'])}  worst link {alt['worst_link']}, busiest "
                       f"{alt['max_util']:.0f}%, fullest {alt['max_memory'] * 100:.0f}% memory"
                       + ("  (beyond the tolerance)" if alt["within_tolerance"] is False else ""))
        for c in self.chosen:
            util = f"{c.util:.0f}%" if c.util is not None else "?"
            out.append(f"  GPU {c.label}: utilisation {util}, memory in use {_memory(c) * 100:.0f}%")
        return out


def _util(c: Candidate) -> float:
    return c.util if c.util is not None and math.isfinite(c.util) else 0.0


def _memory(c: Candidate) -> float:
    return 1.0 - c.free / c.total if c.free is not None and c.total else 0.0


class _Ranks:
    """The link rank of every pair of ranked GPUs, looked up once (a set's description and the greedy
    growth then cost no link search: a 128-GPU host stays fast)."""

    def __init__(self, ranked: Sequence[Candidate]) -> None:
        self._r: dict[tuple[int, int], int] = {}
        gpus = {id(x.gpu): x.gpu for x in ranked}
        # each GPU's links by peer index, the first one it lists as link_between takes it: one pass
        # over the links (a snapshot from an older daemon may list 256 GPUs with 256 links each)
        by_peer: dict[int, dict[int, GpuLink]] = {}
        for g in gpus.values():
            mine = by_peer.setdefault(id(g), {})
            for link in g.links:
                mine.setdefault(link.peer, link)
        for a, b in itertools.combinations(gpus.values(), 2):
            if a.topology is not None and b.topology is not None:
                r = rank(link_between(a, b))
            else:
                r = rank(by_peer[id(a)].get(b.index) or by_peer[id(b)].get(a.index))
            self._r[(id(a), id(b))] = self._r[(id(b), id(a))] = r

    def __call__(self, a: Candidate, b: Candidate) -> int:
        return self._r.get((id(a.gpu), id(b.gpu)), WORST_RANK)


def _describe(members: Sequence[Candidate], c: Constraints, ranks: _Ranks) -> _Set:
    pair_ranks = [ranks(a, b) for a, b in itertools.combinations(members, 2)]
    return _Set(list(members), max(pair_ranks, default=0),
                sum(pair_ranks) / len(pair_ranks) if pair_ranks else 0.0,
                max(_util(m) for m in members), max(_memory(m) for m in members),
                # the ranking's key, set by alloc.select.candidates
                sum(m.score[0] for m in members))


def _sets(ranked: Sequence[Candidate], count: int, c: Constraints, ranks: _Ranks) -> list[_Set]:
    if math.comb(len(ranked), count) <= MAX_SETS:
        return [_describe(s, c, ranks) for s in itertools.combinations(ranked, count)]
    # the least-loaded set: always a candidate (the tolerance's base)
    out = [_describe(ranked[:count], c, ranks)]
    # greedy: add the GPU that connects best to the set so far, ties by load order
    for seed in ranked:
        members = [seed]
        # each other GPU's worst link to the set so far, kept up to date as the set grows
        worst = {i: ranks(x, seed) for i, x in enumerate(ranked) if x is not seed}
        while len(members) < count:
            i = min(worst, key=lambda j: (worst[j], j))
            added = ranked[i]
            del worst[i]
            members.append(added)
            for j in worst:
                worst[j] = max(worst[j], ranks(ranked[j], added))
        out.append(_describe(sorted(members, key=ranked.index), c, ranks))
    return out


def _key(s: _Set) -> tuple[Any, ...]:
    return (s.worst, s.mean, s.load, [m.gpu.index for m in s.members])


def _links(members: Sequence[Candidate]) -> list[tuple[str, str, str]]:
    return [(a.label, b.label, label(link_between(a.gpu, b.gpu))) for a, b in itertools.combinations(members, 2)]


def _worst_label(s: _Set) -> str:
    names = {0: "NVLink", 1: "same board", 2: "PIX", 3: "PXB", 4: "PHB", 5: "NODE", 6: "SYS"}
    return names.get(s.worst, "SYS")


def pick(snap: HostSnapshot, ranked: list[Candidate], c: Constraints) -> Pick:
    """The ``c.count`` devices for ``c`` out of ``ranked`` (qualifying, best first, at least
    ``c.count`` of them); NoGpuAvailable for ``--topology nvlink`` when no set is all NVLink."""
    policy = c.topology
    least = ranked[: c.count]
    least_labels = [x.label for x in least]
    if c.count == 1 or c.mig or c.shared or policy == "any":
        if policy == "nvlink" and c.mig:
            raise NoGpuAvailable("--topology nvlink is for whole GPUs, not MIG slices")
        why = ("one GPU: the least loaded" if c.count == 1 else
               "MIG slices: by load" if c.mig else
               "the least-loaded GPUs, whatever connects them" if policy == "any" else
               "--share: packed by memory, by load")
        if policy == "nvlink" and c.count > 1 and c.shared:
            nv = [s for s in _sets(ranked, c.count, c, _Ranks(ranked)) if s.worst == 0]
            if not nv:
                raise NoGpuAvailable(f"--topology nvlink: no {c.count} qualifying GPUs are all connected by NVLink")
            best = min(nv, key=lambda s: (s.load, [m.gpu.index for m in s.members]))
            return Pick(best.members, policy, "--share with --topology nvlink: the least-loaded NVLink set",
                        least_labels, _links(best.members))
        return Pick(least, policy, why, least_labels, _links(least) if c.count > 1 else [])
    if not has_topology(snap):
        if policy == "nvlink":
            raise NoGpuAvailable("--topology nvlink: this host reports no topology (no NVLink seen)")
        return Pick(least, policy, "the host reports no topology: the least-loaded GPUs", least_labels)
    ranks = _Ranks(ranked)
    sets = _sets(ranked, c.count, c, ranks)
    base = _describe(least, c, ranks)
    if policy == "nvlink":
        nv = [s for s in sets if s.worst == 0]
        if not nv:
            raise NoGpuAvailable(f"--topology nvlink: no {c.count} qualifying GPUs are all connected by NVLink "
                                 f"({len(ranked)} qualify)")
        best = min(nv, key=lambda s: (s.load, s.mean, [m.gpu.index for m in s.members]))
        return Pick(best.members, policy, "the least-loaded set whose GPUs are all connected by NVLink",
                    least_labels, _links(best.members), len(sets), _alternatives(sets, best, None))

    def within(s: _Set) -> bool:
        return (s.max_util <= base.max_util + TOL_UTIL + 1e-9
                and s.max_memory <= base.max_memory + TOL_MEMORY + 1e-9)

    ok = [s for s in sets if within(s)]
    best = min(ok, key=_key)
    if [m.gpu.index for m in best.members] == [m.gpu.index for m in least]:
        reason = ("the least-loaded set is also the best connected within the tolerance "
                  f"(worst link {_worst_label(best)})")
    elif best.worst < base.worst or best.mean < base.mean:
        reason = (f"better connected (worst link {_worst_label(best)}, against {_worst_label(base)} for the "
                  f"least-loaded set) and within the tolerance ({TOL_UTIL:g} utilisation points, "
                  f"{TOL_MEMORY * 100:g}% memory)")
    else:
        reason = "as well connected as the least-loaded set, and less loaded in sum"
    return Pick(sorted(best.members, key=ranked.index), policy, reason, least_labels,
                _links(sorted(best.members, key=ranked.index)), len(sets), _alternatives(sets, best, base))


def _alternatives(sets: list[_Set], best: _Set, base: _Set | None, n: int = 3) -> list[dict[str, Any]]:
    """A few other sets, best first; ``within_tolerance`` None where no tolerance applies (nvlink)."""
    others = sorted((s for s in sets if s.labels != best.labels), key=_key)[:n]
    return [{"gpus": s.labels, "worst_link": _worst_label(s), "max_util": s.max_util, "max_memory": s.max_memory,
             "within_tolerance": None if base is None else (s.max_util <= base.max_util + TOL_UTIL + 1e-9
                                                            and s.max_memory <= base.max_memory + TOL_MEMORY + 1e-9)}
            for s in others]
