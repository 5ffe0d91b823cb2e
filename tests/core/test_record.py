"""gpusd's records (:mod:`gpusd.record`) against :mod:`dataclasses`, their reference: every record class of
gpusd behaves as the dataclass made from the same fields with the same options would (signature and
defaults, repr, equality, hashing, freezing, slots, copying, pickling, ``dataclasses.fields``/``replace``/
``asdict``), and the quick commands' modules import no ``dataclasses`` to make them."""

from __future__ import annotations

import copy
import dataclasses
import importlib
import inspect
import os
import pickle
import re
import subprocess
import sys
from pathlib import Path
from typing import Any, ClassVar

import pytest

from gpusd.record import MISSING, Field, FrozenRecordError, field, fields, is_record, maker, record, replace

SRC = Path(__file__).resolve().parents[2] / "src"


def _record_classes() -> list[type]:
    """Every class of gpusd's source made by ``@record`` (found in the source, then imported)."""
    out: list[type] = []
    for path in sorted((SRC / "gpusd").rglob("*.py")):
        text = path.read_text()
        if "@record" not in text or path.name == "record.py":
            continue
        module = ".".join(path.relative_to(SRC).with_suffix("").parts)
        try:
            mod = importlib.import_module(module)
        except ImportError:  # an optional vendor's module (its package absent here)
            continue
        for name in re.findall(r"@record(?:\([^)]*\))?\nclass (\w+)", text):
            out.append(getattr(mod, name))
    return out


RECORDS = _record_classes()


def _twin(cls: type) -> type:
    """The dataclass ``@dataclass`` would have made of ``cls``'s fields, with its options."""
    opts = cls.__record_options__  # type: ignore[attr-defined]
    specs = []
    for f in fields(cls):
        kw: dict[str, Any] = {"metadata": f.metadata or None}
        if f.default is not MISSING:
            kw["default"] = f.default
        if f.default_factory is not MISSING:
            kw["default_factory"] = f.default_factory
        specs.append((f.name, f.type, dataclasses.field(**kw)))
    return dataclasses.make_dataclass(cls.__name__, specs, frozen=opts["frozen"], eq=opts["eq"], slots=opts["slots"])


def _values(cls: type, salt: int) -> dict[str, Any]:
    """A value for every field (every required one at least), different for each ``salt``."""
    out: dict[str, Any] = {}
    for i, f in enumerate(fields(cls)):
        if f.default is MISSING and f.default_factory is MISSING or i % 2 == salt % 2:
            out[f.name] = f"{f.name}-{salt}" if i % 3 else (i + 1) * (salt + 7)
    return out


def _params(fn: Any) -> list[tuple[str, Any, str]]:
    return [(p.name, p.kind, repr(p.default)) for p in inspect.signature(fn).parameters.values()]


def test_the_records_were_found() -> None:
    names = {c.__name__ for c in RECORDS}
    assert {"HostSnapshot", "GpuInfo", "ProcessInfo", "Constraints", "Candidate", "Pick", "Lease", "Holder",
            "LeaseRequest", "Visible", "HostIdentity", "VendorDevice"} <= names


@pytest.mark.parametrize("cls", RECORDS, ids=lambda c: f"{c.__module__}.{c.__qualname__}")
def test_a_record_behaves_as_its_dataclass(cls: type) -> None:
    twin = _twin(cls)
    assert _params(cls) == _params(twin)
    assert cls.__match_args__ == twin.__match_args__  # type: ignore[attr-defined]
    a, b = _values(cls, 1), _values(cls, 2)
    rec, same, other = cls(**a), cls(**a), cls(**b)
    ref = twin(**a)
    assert repr(rec) == repr(ref)
    for f in fields(cls):  # defaults and factories as the dataclass gives them (a fresh list each time)
        assert getattr(rec, f.name) == getattr(ref, f.name)
        if f.default_factory is not MISSING and f.name not in a:
            assert getattr(rec, f.name) is not getattr(same, f.name)
    opts = cls.__record_options__  # type: ignore[attr-defined]
    if opts["eq"]:
        assert rec == same and rec != other and not (rec != same)
    else:
        assert rec != same and rec == rec
    assert (rec == ref) is False  # another class, as two dataclasses of different classes
    try:
        hash(ref)
    except TypeError:
        with pytest.raises(TypeError):
            hash(rec)
    else:
        hash(rec)
        if opts["frozen"]:
            assert hash(rec) == hash(same)
    assert hasattr(rec, "__dict__") == hasattr(ref, "__dict__")  # slots
    name = fields(cls)[0].name
    if opts["frozen"]:
        with pytest.raises(AttributeError):
            setattr(rec, name, 1)
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(ref, name, 1)
        with pytest.raises(FrozenRecordError):
            delattr(rec, name)
    # dataclasses' own functions, as on the dataclasses the model types were before 0.3
    assert dataclasses.is_dataclass(cls) and dataclasses.is_dataclass(rec)
    assert [(f.name, f.type, f.metadata) for f in dataclasses.fields(rec)] == \
        [(f.name, f.type, f.metadata) for f in dataclasses.fields(ref)]
    assert dataclasses.asdict(rec) == dataclasses.asdict(ref)
    changed = dataclasses.replace(rec, **{name: b.get(name, 5)})
    assert type(changed) is cls and getattr(changed, name) == b.get(name, 5)
    assert replace(rec, **{name: b.get(name, 5)}) == changed or not opts["eq"]


@pytest.mark.parametrize("cls", [c for c in RECORDS if c.__record_options__["eq"]],  # type: ignore[attr-defined]
                         ids=lambda c: f"{c.__module__}.{c.__qualname__}")
def test_a_record_copies_and_pickles(cls: type) -> None:
    rec = cls(**_values(cls, 3))
    assert copy.copy(rec) == rec and copy.deepcopy(rec) == rec
    assert pickle.loads(pickle.dumps(rec)) == rec


def test_the_model_records_round_trip_through_pickle_with_nested_records() -> None:
    from model_samples import _snapshot

    snap = _snapshot()
    assert pickle.loads(pickle.dumps(snap)) == snap and copy.deepcopy(snap) == snap


@pytest.mark.parametrize("cls", RECORDS, ids=lambda c: f"{c.__module__}.{c.__qualname__}")
def test_a_records_maker_makes_what_its_class_makes(cls: type) -> None:
    make = maker(cls)
    assert maker(cls) is make and _params(make) == _params(cls)  # made once; the class's signature
    a = _values(cls, 1)
    rec, made = cls(**a), make(**a)
    assert type(made) is cls
    for f in fields(cls):
        assert getattr(made, f.name) == getattr(rec, f.name)
        if f.default_factory is not MISSING and f.name not in a:
            assert getattr(made, f.name) is not getattr(make(**a), f.name)  # a fresh list each time
    required = [a[f.name] for f in fields(cls) if f.default is MISSING and f.default_factory is MISSING]
    if cls.__record_options__["eq"]:  # type: ignore[attr-defined]
        assert made == rec and make(*required) == cls(*required)
    with pytest.raises(TypeError):
        make(*required, __not_a_field=1)
    if required:
        with pytest.raises(TypeError):
            make()
    if cls.__record_options__["frozen"]:  # type: ignore[attr-defined]
        with pytest.raises(FrozenRecordError):
            setattr(made, fields(cls)[0].name, 1)


def test_a_maker_runs_post_init_and_refuses_what_is_not_a_record() -> None:
    @record
    class R:
        a: int
        b: list[int] = field(default_factory=list)

        def __post_init__(self) -> None:
            self.b.append(self.a)

    @record(slots=True)
    class Sub(R):
        c: int = 3

    assert maker(R)(4).b == [4] and maker(Sub)(1) == Sub(1) and type(maker(Sub)(1)) is Sub
    with pytest.raises(TypeError):
        maker(object)
    with pytest.raises(TypeError):
        maker(R(1))  # type: ignore[arg-type]

    @record(slots=True, frozen=True)
    class Slots:
        a: int

    with pytest.raises(TypeError):
        maker(Slots(1))  # type: ignore[arg-type]


# -- the rules dataclasses enforce, enforced ----------------------------------------------------------------
def test_a_mutable_default_is_refused() -> None:
    with pytest.raises(ValueError, match="default_factory"):
        @record
        class Bad:
            items: list[int] = []  # noqa: RUF012


def test_a_field_without_default_after_one_with_is_refused() -> None:
    with pytest.raises(TypeError, match="non-default argument 'b'"):
        @record
        class Bad:
            a: int = 1
            b: int


def test_both_default_and_factory_are_refused() -> None:
    with pytest.raises(ValueError):
        field(default=1, default_factory=list)


def test_classvars_are_not_fields_and_post_init_runs() -> None:
    @record
    class R:
        kind: ClassVar[str] = "r"
        a: int
        b: list[int] = field(default_factory=list)

        def __post_init__(self) -> None:
            self.b.append(self.a)

    assert [f.name for f in fields(R)] == ["a", "b"] and R.kind == "r"
    assert R(3).b == [3]


def test_a_record_subclass_adds_fields_after_its_bases() -> None:
    @record
    class Base:
        a: int
        b: int = 2

    @record
    class Sub(Base):
        c: int = 3

    class Plain(Sub):  # not a record: takes Sub's __init__
        pass

    assert [f.name for f in fields(Sub)] == ["a", "b", "c"]
    assert Sub(1) == Sub(1, 2, 3) and repr(Sub(1)) == "test_a_record_subclass_adds_fields_after_its_bases.<locals>." \
        "Sub(a=1, b=2, c=3)"
    assert Plain(5).c == 3 and Base(1).b == 2
    assert is_record(Sub(1)) and is_record(Sub) and not is_record(object())


def test_the_init_is_made_on_first_use_and_inspect_sees_it_before() -> None:
    @record(slots=True, frozen=True)
    class Lazy:
        a: int
        b: str = "x"

    assert not inspect.isfunction(Lazy.__dict__["__init__"])  # not generated yet
    assert str(inspect.signature(Lazy)) == "(a, b='x')"
    assert inspect.isfunction(Lazy.__dict__["__init__"])
    assert Lazy(1) == Lazy(1, "x") and hash(Lazy(1)) == hash(Lazy(1, "x"))
    with pytest.raises(FrozenRecordError):
        Lazy(1).a = 2  # type: ignore[misc]


def test_fields_and_replace_refuse_what_is_not_a_record() -> None:
    with pytest.raises(TypeError):
        fields(object())

    @record
    class R:
        a: int

    with pytest.raises(TypeError):
        replace(R, a=1)
    assert isinstance(fields(R)[0], Field) and fields(R(1)) == fields(R)


# -- what the quick commands import -----------------------------------------------------------------------
def test_the_model_and_the_allocation_path_do_not_import_dataclasses() -> None:
    code = ("import sys, gpusd.model, gpusd.alloc.api, gpusd.alloc.placement, gpusd.inventory.nvml; "
            "print(sorted(m for m in ('dataclasses', 'inspect', 'typing', 'pynvml') if m in sys.modules))")
    env = dict(os.environ, PYTHONPATH=str(SRC))
    out = subprocess.run([sys.executable, "-S", "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
