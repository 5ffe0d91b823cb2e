import json

import pytest

from gpusd.model import HostSnapshot
from model_samples import _sample, _snapshot


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

from gpusd.model import MAX_NAME, MAX_TEXT, MODEL_CLASSES  # noqa: E402


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


def test_telemetry_fields_travel_only_where_read() -> None:
    """The DCGM-backing readings are left off the JSON while None: a snapshot without them is
    as large as before; with them they round-trip, and a hostile value is refused like any field."""
    from gpusd.errors import WireError
    from gpusd.model import GpuInfo

    plain = GpuInfo(index=0, uuid="GPU-0").to_dict()
    assert "energy" not in plain and "xid_last" not in plain and "clock_sm" not in plain
    assert GpuInfo.from_dict(plain).energy is None
    g = GpuInfo(index=0, uuid="GPU-0", energy=123, xid_last=79, row_remap_failure=True, gpm_tensor_util=35.0)
    assert GpuInfo.from_dict(json.loads(json.dumps(g.to_dict()))) == g
    with pytest.raises(WireError, match="energy"):
        GpuInfo.from_dict({**g.to_dict(), "energy": "lots"})
