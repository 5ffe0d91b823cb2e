import json

import pytest

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


def test_json_round_trip_is_lossless():
    snap = _snapshot()
    text = snap.to_json()
    again = HostSnapshot.from_json(text)
    assert again == snap
    assert again.to_json() == text


def test_unsupported_fields_are_none_not_zero():
    d = json.loads(_snapshot().to_json())
    lost = d["gpus"][1]
    assert lost["memory_total"] is None and lost["temperature"] is None and lost["healthy"] is False
    assert d["gpus"][0]["fan_speed"] is None


@pytest.mark.parametrize("mutate, message", [
    (lambda d: d["gpus"][0].__setitem__("memory_total", "80GB"), "memory_total"),
    (lambda d: d["gpus"][0].__setitem__("index", True), "index"),
    (lambda d: d.__setitem__("node_id", None), "node_id"),
    (lambda d: d.__setitem__("gpus", {"0": {}}), "gpus"),
    (lambda d: d["gpus"][0]["processes"].append("pid 4"), "processes"),
    (lambda d: d.__setitem__("schema", 99), "schema"),
])
def test_from_dict_rejects_bad_input_with_a_named_field(mutate, message):
    d = json.loads(_snapshot().to_json())
    mutate(d)
    with pytest.raises(ValueError, match=message):
        HostSnapshot.from_dict(d)


def test_from_json_rejects_non_json():
    with pytest.raises(ValueError, match="not JSON"):
        HostSnapshot.from_json(b"\xff\xfe garbage")


def test_unknown_fields_are_ignored_for_forward_compatibility():
    d = json.loads(_snapshot().to_json())
    d["future_field"] = 1
    d["gpus"][0]["nvlink"] = [1, 2]
    assert HostSnapshot.from_dict(d).gpus[0].uuid == "GPU-a"


# -- every field of every class travels, and hostile input is refused -------------------------------------

import dataclasses  # noqa: E402
import typing  # noqa: E402

from gpusd.model import MAX_NAME, MAX_TEXT, MODEL_CLASSES  # noqa: E402


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
            kw[f.name] = [_sample(item, salt + 1)]
            continue
        tp = args[0] if args else tp
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


@pytest.mark.parametrize("cls", MODEL_CLASSES, ids=lambda c: c.__name__)
def test_every_field_round_trips(cls):
    obj = _sample(cls)
    d = json.loads(json.dumps(obj.to_dict(), allow_nan=False))
    assert {f.name for f in dataclasses.fields(cls)} <= set(d)
    for f in dataclasses.fields(cls):  # nothing left at its default: the sample covers every field
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        assert getattr(obj, f.name) != default or f.name == "schema", f.name
    assert cls.from_dict(d) == obj


def _good() -> dict:
    return json.loads(_snapshot().to_json())


@pytest.mark.parametrize("mutate, message", [
    (lambda d: d["gpus"][0].__setitem__("utilization_gpu", float("nan")), "utilization_gpu"),
    (lambda d: d["gpus"][0].__setitem__("power_draw", float("inf")), "power_draw"),
    (lambda d: d.__setitem__("timestamp", float("-inf")), "timestamp"),
    (lambda d: d.__setitem__("hostname", "h" * (MAX_NAME + 1)), "hostname"),
    (lambda d: d["gpus"][0].__setitem__("name", "[/bold]" * 20000), "name"),
    (lambda d: d["gpus"][0]["processes"][0].__setitem__("command", "x" * (MAX_TEXT + 1)), "command"),
    (lambda d: d["gpus"][0].__setitem__("error", "e" * 100_000), "error"),
    (lambda d: d["gpus"][0].__setitem__("memory_total", 10**30), "memory_total"),
    (lambda d: d["gpus"][0].__setitem__("temperature", 41.5), "temperature"),
    (lambda d: d["gpus"][0].__setitem__("healthy", "yes"), "healthy"),
    (lambda d: d["gpus"][0].__setitem__("utilization_gpu", "12"), "utilization_gpu"),
    (lambda d: d["gpus"][0].__setitem__("processes", [{"pid": 1}] * 5000), "processes"),
    (lambda d: d.__setitem__("gpus", [d["gpus"][1]] * 257), "gpus"),
    (lambda d: d["gpus"][0]["mig_instances"][0].__setitem__("uuid", ["MIG-x"]), "uuid"),
    (lambda d: d.__setitem__("schema", True), "schema"),
])
def test_hostile_input_is_refused_with_the_field_named(mutate, message):
    d = _good()
    mutate(d)
    with pytest.raises(ValueError, match=message):
        HostSnapshot.from_dict(d)


def test_hostile_json_text_is_refused():
    text = _snapshot().to_json().replace('"utilization_gpu":12.5', '"utilization_gpu":NaN')
    assert "NaN" in text
    with pytest.raises(ValueError, match="utilization_gpu"):
        HostSnapshot.from_json(text)


def test_strings_at_the_bound_are_accepted():
    d = _good()
    d["hostname"] = "h" * MAX_NAME
    d["gpus"][0]["processes"][0]["command"] = "c" * MAX_TEXT
    snap = HostSnapshot.from_dict(d)
    assert len(snap.hostname) == MAX_NAME


def test_a_non_finite_reading_never_reaches_the_wire():
    snap = _snapshot()
    snap.gpus[0].utilization_gpu = float("nan")
    snap.gpus[0].power_draw = float("inf")
    d = snap.to_dict()
    assert d["gpus"][0]["utilization_gpu"] is None and d["gpus"][0]["power_draw"] is None
    text = snap.to_json()  # allow_nan=False: would raise if one slipped through
    assert "NaN" not in text and "Infinity" not in text
    snap.timestamp = float("nan")  # a required number cannot become null: refused, never sent
    with pytest.raises(ValueError, match="timestamp"):
        snap.to_json()


def test_a_field_of_a_type_the_codec_cannot_carry_is_refused_at_once():
    from gpusd.model import encode

    @dataclasses.dataclass
    class Odd:
        when: dict  # type: ignore[type-arg]

    with pytest.raises(TypeError, match="when"):
        encode(Odd({}))
