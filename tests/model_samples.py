"""Model instances the tests share: a realistic snapshot, and a sample of any model class with a
non-default value in every field (tests/core/test_model.py, tests/wire/test_wire_fleet.py)."""

from __future__ import annotations

import dataclasses
import typing

from gpusd.model import GpuInfo, HostSnapshot, LeaseInfo, MigInstance, ProcessInfo


def _snapshot() -> HostSnapshot:
    return HostSnapshot(
        hostname="node-1", node_id="0123456789abcdef", timestamp=1700000000.25,
        driver_version="550.54.15", cuda_version="12.4", nvml_version="12.550.54.15",
        gpus=[
            GpuInfo(index=0, uuid="GPU-a", name="NVIDIA A100-SXM4-80GB", pci_bus_id="00000000:07:00.0",
                    memory_total=80 * 2**30, memory_used=2**30, memory_free=79 * 2**30,
                    utilization_gpu=12.5, utilization_memory=3.0, utilization_window=5.0, temperature=41,
                    power_draw=61.5, power_limit=400.0, fan_speed=None, compute_mode="default", mig_mode=True,
                    mig_instances=[MigInstance(index=0, uuid="MIG-x", profile="3g.40gb", memory_total=40 * 2**30,
                                               memory_used=0, gpu_instance_id=1, compute_instance_id=0)],
                    processes=[ProcessInfo(pid=42, used_memory=2**30, user="alice", command="python train.py",
                                           gpu_instance_id=1, compute_instance_id=0)],
                    leases=[LeaseInfo(lease_id="abc", pid=42, user="alice", started=1.5, memory=2**34,
                                      shared=True, command="python", device="MIG-x")]),
            GpuInfo(index=1, uuid="GPU-b", healthy=False, error="GPU is lost"),
        ],
    )


def _sample(cls: type, salt: int = 1) -> object:
    """An instance of ``cls`` with a non-default value in every field (so a field the codec forgets
    comes back as its default and the comparison fails)."""
    hints = typing.get_type_hints(cls)
    kw: dict[str, object] = {}
    for i, f in enumerate(dataclasses.fields(cls)):
        tp = hints[f.name]
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if typing.get_origin(tp) is list:
            (item,) = typing.get_args(tp)
            kw[f.name] = [item(i + 1), item(salt + 2)] if item in (int, float, str) else [_sample(item, salt + 1)]
            continue
        tp = args[0] if args else tp
        if typing.get_origin(tp) is list:  # an optional list of scalars (list[float] | None)
            (item,) = typing.get_args(tp)
            assert item in (int, float, str), f"{cls.__name__}.{f.name}: no sample for {tp}"
            kw[f.name] = [item(i + 1), item(salt + 2)]
            continue
        if f.name == "schema":
            kw[f.name] = 1
        elif tp is bool:
            kw[f.name] = not (f.default if isinstance(f.default, bool) else False)
        elif tp is int:
            kw[f.name] = 1000 * salt + i + 1
        elif tp is float:
            kw[f.name] = 0.5 + salt + i
        elif tp is str:
            kw[f.name] = f"{f.name}-{salt}"
        elif dataclasses.is_dataclass(tp):
            kw[f.name] = _sample(tp, salt + 1)
        else:
            raise AssertionError(f"{cls.__name__}.{f.name}: no sample for {tp}; teach this test and the codec")
    return cls(**kw)
