"""One rule each, in the model: private fields marked in the field metadata and one
redaction derived from them, one free-memory rule, ``simulated`` derived from ``backend`` (both still on
the wire), one shown GPU name; and the sanitiser's one per-character rule."""

from __future__ import annotations

import json
from dataclasses import fields

import gpusd.model as model
from gpusd.model import GpuInfo, HostSnapshot, LeaseInfo, MigInstance, ProcessInfo, redact
from gpusd.sanitize import printable


def _snap() -> HostSnapshot:
    gpu = GpuInfo(index=0, uuid="GPU-0", name="NVIDIA A100-SXM4-80GB",
                  processes=[ProcessInfo(pid=7, user="alice", command="python train.py --secret")],
                  leases=[LeaseInfo(lease_id="l1", pid=8, user="bob", command="eval.py", job="j1")])
    return HostSnapshot(hostname="h", node_id="n", timestamp=1.0, gpus=[gpu])


def test_the_private_fields_are_the_marked_ones() -> None:
    marked = {(cls.__name__, f.name) for cls in model.MODEL_CLASSES for f in fields(cls) if f.metadata.get("private")}
    assert marked == {("ProcessInfo", "user"), ("ProcessInfo", "command"), ("LeaseInfo", "user"),
                      ("LeaseInfo", "command"), ("ProcessInfo", "container_owner"), ("BookingInfo", "user")}
    assert model.private_keys() == (frozenset({"user", "command", "container_owner"}),
                                    frozenset({"processes", "leases", "bookings"}))


def test_one_redaction_for_objects_and_for_json() -> None:
    """The JSON form and the objects are redacted alike: owners and commands gone, the rest kept."""
    as_json = redact(_snap().to_dict())
    snap = redact(_snap())
    assert as_json == snap.to_dict()
    g = snap.gpus[0]
    assert (g.processes[0].pid, g.processes[0].user, g.processes[0].command) == (7, None, None)
    assert (g.leases[0].lease_id, g.leases[0].job, g.leases[0].user, g.leases[0].command) == ("l1", "j1", None, None)
    text = json.dumps(as_json)
    assert "alice" not in text and "bob" not in text and "secret" not in text


def test_json_redaction_copies_and_reaches_nested_payloads() -> None:
    payload = {"hosts": [{"snapshot": _snap().to_dict()}], "note": {"user": "kept: not in a private list"}}
    out = redact(payload)
    assert payload["hosts"][0]["snapshot"]["gpus"][0]["processes"][0]["user"] == "alice"  # not changed
    assert out["hosts"][0]["snapshot"]["gpus"][0]["processes"][0]["user"] is None
    assert out["note"] == {"user": "kept: not in a private list"}


def test_one_free_memory_rule() -> None:
    assert model.free_memory(100, 30) == 70
    assert model.free_memory(100, 130) == 0  # a reading above the total is not negative memory
    assert model.free_memory(100, 30, reported=60) == 60  # what the driver says wins (reserved memory)
    assert model.free_memory(None, 30) is None and model.free_memory(100, None) is None
    g = GpuInfo(index=0, uuid="u", memory_total=100, memory_used=30)
    assert g.memory_available == 70
    g.memory_free = 50
    assert g.memory_available == 50
    assert MigInstance(index=0, uuid="m", memory_total=10, memory_used=4).memory_free == 6


def test_simulated_is_derived_from_the_backend_and_still_on_the_wire() -> None:
    snap = HostSnapshot(hostname="h", node_id="n", timestamp=1.0, backend="simulated")
    assert snap.simulated and not HostSnapshot(hostname="h", node_id="n", timestamp=1.0).simulated
    d = snap.to_dict()
    keys = list(d)
    assert d["simulated"] is True and keys.index("simulated") == keys.index("backend") + 1
    assert HostSnapshot.from_dict(d) == snap
    old = {"hostname": "h", "node_id": "n", "timestamp": 1.0, "simulated": True}  # a sender without backend
    assert HostSnapshot.from_dict(old).simulated
    assert not HostSnapshot.from_dict({**old, "simulated": False}).simulated


def test_one_shown_name() -> None:
    assert model.shown_name("NVIDIA GeForce RTX 4090") == "RTX 4090"
    assert model.shown_name("AMD Instinct MI300X", "amd") == "MI300X [amd]"
    assert model.shown_name("Intel(R) Data Center GPU Max 1550", "intel") == "Max 1550 [intel]"
    assert model.shown_name(None, "\x1b[31mevil-and-long") == "- [evil-an…]"  # the vendor made printable, cut


def test_printable_replaces_or_drops_what_python_does_not_print() -> None:
    assert printable("render\x07-1") == "render?-1"
    assert printable("\u202eevil") == "?evil"
    assert printable("a\x00b", replace="") == "ab"
    assert printable("x" * 10, 4) == "xxxx"
    assert printable("plain") == "plain"


def test_the_old_simulated_keyword_still_builds_a_simulated_snapshot() -> None:
    import pytest

    with pytest.warns(DeprecationWarning, match="backend"):
        snap = HostSnapshot(hostname="h", node_id="n", timestamp=1.0, simulated=True)  # type: ignore[call-arg]
    assert snap.simulated and snap.backend == "simulated"


def test_free_memory_is_after_reservations_and_select_agrees_with_the_model() -> None:
    """One number for a GPU's free memory: what the driver reported (else total less used) less what
    leases reserved and have not allocated; the allocator's candidate shows the same number as list,
    top and /metrics (GpuInfo.memory_available)."""
    from gpusd.alloc.select import Constraints, candidates

    lease = LeaseInfo(lease_id="l1", pid=424242, user="bob", memory=20, device="GPU-0", shared=True)
    g = GpuInfo(index=0, uuid="GPU-0", memory_total=100, memory_used=30, memory_free=60, utilization_gpu=0.0,
                leases=[lease])
    assert model.free_memory(100, 30, reported=60, reserved=20) == 40
    assert model.reserved_memory([lease], []) == 20
    assert model.reserved_memory([lease], [ProcessInfo(pid=424242, used_memory=15)]) == 5
    assert g.memory_available == 40
    snap = HostSnapshot(hostname="h", node_id="n", timestamp=1.0, gpus=[g])
    ok, _ = candidates(snap, Constraints(count=1, shared=True), env={})
    assert [c.free for c in ok] == [g.memory_available]


def test_no_module_outside_the_model_computes_free_memory() -> None:
    """Free memory has one owner (model.free_memory); the backends read it from the hardware, and
    the DCGM and AMD exporter names on /metrics mirror the driver's raw reading as those exporters do."""
    import re

    from tests_paths import REPO

    src = REPO / "src" / "gpusd"
    allowed = {"model.py", "daemon/metrics.py"}
    for path in src.rglob("*.py"):
        rel = path.relative_to(src).as_posix()
        if rel in allowed or rel.startswith("inventory/"):
            continue
        text = path.read_text()
        assert not re.search(r"total\w* - \w*\.?(memory_)?used", text), f"{rel} computes free memory"
        assert not re.search(r"\.memory_free\b", text), f"{rel} reads the raw memory_free, not the rule"
    metrics = (src / "daemon" / "metrics.py").read_text()
    assert re.search(r'"gpusd_gpu_memory_free_bytes": \(.*memory_available', metrics)
