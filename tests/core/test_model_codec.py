"""The model's compiled codec (a class's encoder and decoder generated once it is used often) accepts
exactly what the general codec accepts and gives the same result, or raises the same error."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpusd import model
from gpusd.inventory.simulated import SimulatedBackend
from gpusd.model import MODEL_CLASSES, GpuInfo, HostSnapshot, decode, encode
from model_samples import _sample, _snapshot


@pytest.fixture(autouse=True)
def _fresh_codec() -> Iterator[None]:
    """Each test starts from no compiled codec and ends leaving none it made."""
    saved = dict(model._DECODERS), dict(model._ENCODERS), model.COMPILE_AFTER
    model._DECODERS.clear()
    model._ENCODERS.clear()
    yield
    model._DECODERS.clear()
    model._ENCODERS.clear()
    model._DECODERS.update(saved[0])
    model._ENCODERS.update(saved[1])
    model.COMPILE_AFTER = saved[2]


def _general(fn: Any, *args: Any) -> Any:
    """``fn(*args)`` through the general codec alone (nothing compiled, nothing compiled meanwhile)."""
    decoders, encoders, after = dict(model._DECODERS), dict(model._ENCODERS), model.COMPILE_AFTER
    model._DECODERS.clear()
    model._ENCODERS.clear()
    model.COMPILE_AFTER = 10**9
    try:
        return _outcome(fn, *args)
    finally:
        model._DECODERS.update(decoders)
        model._ENCODERS.update(encoders)
        model.COMPILE_AFTER = after


def _compiled(fn: Any, *args: Any) -> Any:
    """``fn(*args)`` with every model class's codec compiled."""
    for cls in MODEL_CLASSES:
        model._compiled_decoder(cls)
        model._compiled_encoder(cls)
    return _outcome(fn, *args)


def _outcome(fn: Any, *args: Any) -> Any:
    try:
        result = fn(*args)
    except Exception as exc:  # noqa: BLE001 - the error is the outcome compared
        return ("error", type(exc).__name__, str(exc))
    return ("ok", result.to_dict() if hasattr(result, "to_dict") else result)


def _snapshots() -> list[HostSnapshot]:
    sim = SimulatedBackend("8xH100", host="h", node="n").snapshot()
    odd = _snapshot()
    odd.gpus[0].power_draw = float("nan")  # an optional reading that is not finite: sent as null
    odd.gpus[1].power_limit = 300  # an int where a float is meant
    return [sim, _snapshot(), odd, *(_sample(cls) for cls in (HostSnapshot,))]  # type: ignore[list-item]


@pytest.mark.parametrize("i", range(4))
def test_compiled_and_general_codecs_agree_on_snapshots(i: int) -> None:
    snap = _snapshots()[i]
    encoded = _general(encode, snap)
    assert _compiled(encode, snap) == encoded
    assert _compiled(HostSnapshot.to_dict, snap) == _general(HostSnapshot.to_dict, snap)
    d = snap.to_dict()
    assert _compiled(HostSnapshot.from_dict, d) == _general(HostSnapshot.from_dict, d)


def test_every_class_of_the_model_round_trips_compiled() -> None:
    for cls in MODEL_CLASSES:
        obj = _sample(cls)
        d = _general(encode, obj)[1]
        assert _compiled(encode, obj) == ("ok", d)
        assert _compiled(decode, cls, d) == _general(decode, cls, d)


def test_the_plain_lists_name_classes_whose_methods_are_the_codec_alone() -> None:
    """A compiled codec calls a nested class's compiled codec directly only where its from_dict/to_dict
    adds nothing (GpuInfo.to_dict adds "free", HostSnapshot's add "simulated" and the schema check)."""
    for cls in MODEL_CLASSES:
        from_dict = cls.from_dict.__func__.__code__  # type: ignore[attr-defined]
        to_dict = cls.to_dict.__code__
        assert (cls in model._PLAIN_DECODE) == (from_dict.co_names == ("decode",)), cls
        assert (cls in model._PLAIN_ENCODE) == (to_dict.co_names == ("encode",)), cls


def test_a_class_is_compiled_only_after_it_is_used_often() -> None:
    snap = SimulatedBackend("2xA100", host="h", node="n").snapshot()
    model._DECODE_USES.clear()
    model._ENCODE_USES.clear()
    d = snap.to_dict()
    HostSnapshot.from_dict(d)
    assert GpuInfo not in model._ENCODERS and GpuInfo not in model._DECODERS  # a one-shot command: none
    for _ in range(model.COMPILE_AFTER):
        HostSnapshot.from_dict(snap.to_dict())
    assert GpuInfo in model._ENCODERS and GpuInfo in model._DECODERS


_JSON = st.recursive(st.none() | st.booleans() | st.integers(min_value=-(2**70), max_value=2**70)
                     | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=300),
                     lambda inner: st.lists(inner, max_size=3)
                     | st.dictionaries(st.text(max_size=8), inner, max_size=3),
                     max_leaves=6)
_GPU = SimulatedBackend("4xH100", host="h", node="n").snapshot().gpus[1].to_dict()
_FIELDS = sorted(_GPU)


@settings(max_examples=300, deadline=None)
@given(changes=st.dictionaries(st.sampled_from([*_FIELDS, "links", "processes", "leases"]),
                               _JSON | st.just(math.inf) | st.just(2**63) | st.just(-(2**63)) | st.just("x" * 5000),
                               max_size=4),
       dropped=st.lists(st.sampled_from(_FIELDS), max_size=3))
def test_any_gpu_record_gets_the_same_answer_from_both(changes: dict[str, Any], dropped: list[str]) -> None:
    d = {k: v for k, v in _GPU.items() if k not in dropped}
    d.update(changes)
    assert _compiled(GpuInfo.from_dict, d) == _general(GpuInfo.from_dict, d)
    snap = {**_snapshot().to_dict(), "gpus": [d, _GPU]}
    assert _compiled(HostSnapshot.from_dict, snap) == _general(HostSnapshot.from_dict, snap)


# -- canonical: the codec's pair without the object (gpusd list --json from a fleet view) ----------------
def _pair(cls: type, d: Any) -> Any:
    return encode(decode(cls, d))


@pytest.mark.parametrize("cls", MODEL_CLASSES, ids=lambda c: c.__name__)
def test_canonical_writes_what_the_codec_pair_writes(cls: type) -> None:
    for salt in (1, 2):
        d = encode(_sample(cls, salt))
        assert _outcome(model.canonical, cls, d) == _general(_pair, cls, d)


def test_canonical_gpus_and_snapshots_are_what_to_dict_writes() -> None:
    for snap in _snapshots():
        d = snap.to_dict()
        head, simulated, gpus = model.canonical_snapshot(d)
        again = HostSnapshot.from_dict(d)
        assert gpus == [g.to_dict() for g in again.gpus]
        assert simulated is again.simulated
        assert head == {k: v for k, v in again.to_dict().items() if k != "simulated"} | {"gpus": []}


@settings(max_examples=300, deadline=None)
@given(changes=st.dictionaries(st.sampled_from([*_FIELDS, "links", "processes", "leases", "topology"]),
                               _JSON | st.just(math.inf) | st.just(2**63) | st.just(-(2**63)) | st.just("x" * 5000),
                               max_size=4),
       dropped=st.lists(st.sampled_from(_FIELDS), max_size=3))
def test_any_gpu_record_gets_from_canonical_what_the_objects_give(changes: dict[str, Any], dropped: list[str]) -> None:
    d = {k: v for k, v in _GPU.items() if k not in dropped}
    d.update(changes)
    assert _outcome(model.canonical, GpuInfo, d) == _general(_pair, GpuInfo, d)
    via_objects = _outcome(lambda x: GpuInfo.from_dict(x).to_dict(), d)
    canonical = _outcome(model.canonical_gpu, d)
    assert canonical == via_objects or canonical[0] == via_objects[0] == "error"
    snap = {**_snapshot().to_dict(), "gpus": [d, _GPU]}
    objects = _outcome(lambda x: [g.to_dict() for g in HostSnapshot.from_dict(x).gpus], snap)
    rows = _outcome(lambda x: model.canonical_snapshot(x)[2], snap)
    assert rows == objects or rows[0] == objects[0] == "error"
