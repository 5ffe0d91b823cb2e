"""The data model every part of gpusd passes around: one host and its GPUs.

A :class:`HostSnapshot` is what the inventory backends produce, what selection ranks, what the daemon
serves over HTTP and what discovery clients receive.  Units are base units throughout: bytes, watts,
degrees Celsius, percent (0-100) for utilisation, seconds since the epoch for times.  A field the GPU
does not support is ``None`` — never 0 and never an exception.

The classes are records (:func:`gpusd.record.record`: what ``@dataclass`` gives, without importing
:mod:`dataclasses` at start-up).  ``to_dict``/``from_dict`` convert losslessly to and from
JSON-compatible dicts; both are derived from the record fields and their types (:func:`encode`,
:func:`decode`), so a new field cannot be left off the wire.  ``from_dict`` is the entry point for
data from the network: it validates types and bounds and raises :class:`gpusd.errors.WireError` (a
:class:`ValueError`) with a message naming the bad field, so a malformed record can be logged and skipped.
"""

# Imports inside functions: start-up (quick commands import this module).
from __future__ import annotations

import math

from .errors import WireError
from .record import MISSING, field, record

# typing is not imported at run time: start-up time
TYPE_CHECKING = False
if TYPE_CHECKING:  # pragma: no cover
    from typing import Any, Callable, Iterable, TypeVar

    T = TypeVar("T")

SCHEMA_VERSION = 1

# Decode-time bounds (docs/wire-format.md): data from the network is hostile until proven otherwise.
# characters in a name, id, version or other short string
MAX_NAME = 256
# characters in a command line or an error message
MAX_TEXT = 4096
# entries in a list (unless a field says fewer)
MAX_ITEMS = 4096
# integers are 64-bit on every producer (NVML, the kernel)
MAX_INT = 2**63

# A GPU is free when it is healthy, runs no process, holds no lease, and its utilisation is known
# and below this many percent.  An unknown utilisation is not free: gpusd cannot tell.
FREE_UTIL = 5.0


def free_memory(total: int | None, used: int | None, reported: int | None = None,
                reserved: int = 0) -> int | None:
    """gpusd's one rule for free memory (a GPU's, a MIG slice's): what the driver reported, else total
    less used, less what leases reserved and have not allocated yet (``reserved``,
    :func:`reserved_memory`), never below 0; None: unknown.  ``select``, ``list``, ``top`` and
    /metrics all show this number (``GpuInfo.memory_available``)."""
    base = reported if reported is not None else None if total is None or used is None else total - used
    return None if base is None else max(0, base - reserved)


def gpu_is_free(healthy: bool, processes: Any, leases: Any, util: float | None) -> bool:
    """gpusd's one rule for "free" (``GpuInfo.is_free``, and a GPU's ``free`` on the wire): healthy, no
    process, no lease, and a known utilisation below :data:`FREE_UTIL` percent."""
    return bool(healthy and not processes and not leases and util is not None and math.isfinite(util)
                and util < FREE_UTIL)


def reserved_memory(leases: Iterable[LeaseInfo], processes: Iterable[ProcessInfo],
                    family: Callable[[int], set[int]] | None = None) -> int:
    """Memory the ``leases`` asked for that their processes (``family(pid)``: a lease holder's
    process and its children; by default the holder alone) have not allocated yet."""
    procs = list(processes)
    total = 0
    for lease in leases:
        if not lease.memory:
            continue
        used = 0
        if procs:
            pids = family(lease.pid) if family is not None else {lease.pid}
            used = sum(p.used_memory or 0 for p in procs if p.pid in pids)
        total += max(0, lease.memory - used)
    return total


def finite(value: float | None) -> float | None:
    """``value``, or None where it is NaN or infinite: a reading gpusd cannot trust is unsupported."""
    if value is None or not math.isfinite(value):
        return None
    return value


# -- the codec: to_dict/from_dict derived from the record fields and their types ----------------------


class _Spec:
    """How one field is encoded and decoded (a plain class: a dataclass costs 0.7 ms at import)."""

    __slots__ = ("name", "kind", "optional", "is_list", "required", "limit", "nested", "omit_none", "private",
                 "none_default")

    def __init__(self, name: str, kind: type, optional: bool, is_list: bool, required: bool, limit: int,
                 nested: bool, omit_none: bool = False, private: bool = False, none_default: bool = False) -> None:
        self.name = name
        # int, float, str, bool, or a model class (for list entries)
        self.kind = kind
        # None is a valid value
        self.optional = optional
        self.is_list = is_list
        # no default: must be present
        self.required = required
        # characters (str) or entries (list)
        self.limit = limit
        # kind is a model class
        self.nested = nested
        # left off the wire while None (the telemetry fields: most snapshots lack them)
        self.omit_none = omit_none
        # withheld from readers who may not see it (PRIVATE): :func:`redact`
        self.private = private
        self.none_default = none_default  # its default is None


_PLANS: dict[type, tuple[_Spec, ...]] = {}
_SCALARS = (int, float, str, bool)


def _plan(cls: type) -> tuple[_Spec, ...]:
    """How to encode and decode each field of ``cls`` (computed once per class)."""
    plan = _PLANS.get(cls)
    if plan is not None:
        return plan
    specs = []
    own = getattr(cls, "__record_fields__", None)
    if own is not None:
        defined, missing = tuple(own.values()), MISSING
    else:
        # a dataclass of another module using this codec (wire.fleet's records): dataclasses is imported there
        import dataclasses

        defined, missing = dataclasses.fields(cls), dataclasses.MISSING
    for f in defined:
        tp, optional, is_list = _field_type(cls, f.name, f.type)
        default_limit = MAX_ITEMS if is_list else MAX_NAME
        required = f.default is missing and f.default_factory is missing
        specs.append(_Spec(f.name, tp, optional, is_list, required, int(f.metadata.get("max", default_limit)),
                           tp not in _SCALARS, bool(f.metadata.get("omit_none", False)),
                           bool(f.metadata.get("private", False)), f.default is None))
    plan = _PLANS[cls] = tuple(specs)
    return plan


def _field_type(cls: type, name: str, annotation: object) -> tuple[type, bool, bool]:
    """A field's annotation as (kind, optional, is_list).  The model's annotations are strings (``from
    __future__ import annotations``) of four forms only: ``X``, ``X | None``, ``list[X]`` and ``list[X] |
    None``, X a scalar or a model class; they are read here, without :mod:`typing`'s evaluation."""
    text = str(annotation).replace(" ", "")
    parts = text.split("|")
    optional = "None" in parts
    rest = [p for p in parts if p != "None"]
    if len(rest) != 1:
        raise TypeError(f"{cls.__name__}.{name}: unsupported type {annotation}")
    text = rest[0]
    is_list = text.startswith("list[") and text.endswith("]")
    if is_list:
        text = text[5:-1]
    kind = _KINDS.get(text) or _MODEL_NAMES.get(text)
    # a class of another module's record (wire.fleet's FleetHost), named in its module
    if kind is None:
        import sys

        kind = vars(sys.modules[cls.__module__]).get(text)
    if not isinstance(kind, type) or not (kind in _SCALARS or _has_fields(kind)):
        raise TypeError(f"{cls.__name__}.{name}: unsupported type {annotation}")
    return kind, optional, is_list


_KINDS: dict[str, type] = {"int": int, "float": float, "str": str, "bool": bool}
# the model classes by name, filled below
_MODEL_NAMES: dict[str, type] = {}


def _has_fields(obj: Any) -> bool:
    """Whether ``obj`` is a record or a dataclass (class or instance): something this codec reads."""
    return hasattr(obj, "__record_fields__") or hasattr(obj, "__dataclass_fields__")


def _kind_name(kind: type) -> str:
    return "number" if kind is float else kind.__name__


def _scalar(spec: _Spec, value: Any, where: str) -> Any:
    kind = spec.kind
    # bool is an int subclass: never accept it where a number is meant, and vice versa.
    ok = isinstance(value, (int, float) if kind is float else kind) and (
        kind is bool or not isinstance(value, bool))
    if not ok:
        raise WireError(f"field {where!r} must be {_kind_name(kind)}, got {type(value).__name__}")
    if kind is str and len(value) > spec.limit:
        raise WireError(f"field {where!r} is longer than {spec.limit} characters")
    if kind is int and not -MAX_INT <= value < MAX_INT:
        raise WireError(f"field {where!r} is out of range")
    if kind is float:
        if not math.isfinite(value):
            raise WireError(f"field {where!r} must be a finite number")
        return float(value)
    return value


def decode(cls: type[T], d: Any) -> T:
    """``cls`` from a JSON-compatible dict, validated against the field types and bounds.  Unknown
    keys are ignored (forward compatibility); a missing or null field takes its default."""
    fast = _DECODERS.get(cls)
    if fast is not None:
        try:
            return fast(d)  # type: ignore[no-any-return]
        except (_Slow, ValueError):
            # not the plain case (or invalid): the general code below decides, with its message
            pass
    elif _count(_DECODE_USES, cls):
        _DECODERS[cls] = _compile_decoder(cls)
    if not isinstance(d, dict):
        raise WireError(f"a {cls.__name__} must be an object")
    kwargs: dict[str, Any] = {}
    for spec in _plan(cls):
        value = d.get(spec.name)
        if value is None:
            if spec.required and not spec.optional:
                raise WireError(f"field {spec.name!r} is required")
            if spec.optional and spec.name in d:
                kwargs[spec.name] = None
            continue
        if not spec.is_list:
            kwargs[spec.name] = (spec.kind.from_dict(value) if spec.nested  # type: ignore[attr-defined]
                                 else _scalar(spec, value, spec.name))
            continue
        if not isinstance(value, list):
            raise WireError(f"field {spec.name!r} must be a list")
        if len(value) > spec.limit:
            raise WireError(f"field {spec.name!r} has {len(value)} entries, more than {spec.limit}")
        if spec.nested:
            out = []
            for i, item in enumerate(value):
                if not isinstance(item, dict):
                    raise WireError(f"entries of {spec.name!r} must be objects")
                try:
                    out.append(spec.kind.from_dict(item))  # type: ignore[attr-defined]
                except ValueError as exc:
                    raise WireError(f"{spec.name}[{i}]: {exc}") from None
            kwargs[spec.name] = out
        else:
            kwargs[spec.name] = [_scalar(spec, v, f"{spec.name}[{i}]") for i, v in enumerate(value)]
    return cls(**kwargs)


def encode(obj: Any) -> dict[str, Any]:
    """A model object as a JSON-compatible dict: every field, nested objects as dicts, and never a
    NaN or an infinity (an optional non-finite number is sent as null)."""
    cls = type(obj)
    fast = _ENCODERS.get(cls)
    if fast is not None:
        try:
            return fast(obj)  # type: ignore[no-any-return]
        except _Slow:
            # a non-finite number: the general code below decides
            pass
    elif _count(_ENCODE_USES, cls):
        _ENCODERS[cls] = _compile_encoder(cls)
    out: dict[str, Any] = {}
    for spec in _plan(type(obj)):
        value = getattr(obj, spec.name)
        if value is None:
            if spec.omit_none:
                # a reader takes the default, None
                continue
        elif spec.nested:
            value = [v.to_dict() for v in value] if spec.is_list else value.to_dict()
        elif spec.is_list:
            value = list(value)
            if spec.kind is float and not all(math.isfinite(v) for v in value):
                raise WireError(f"field {spec.name!r} holds a number that is not finite")
        elif spec.kind is float and not math.isfinite(value):
            if not spec.optional:
                raise WireError(f"field {spec.name!r} is not a finite number")
            value = None
        out[spec.name] = value
    return out


# -- the codec, compiled: a class's encoder and decoder as straight-line code, once it is used often -----
# The general code above reads each field's spec at every call (~0.3 ms to decode a snapshot of 8 GPUs,
# ~0.25 ms to encode one): a daemon following 1,000 hosts, its fleet view and a list of their 8,000 GPUs
# spend most of their CPU there.  After COMPILE_AFTER uses of a class, its encoder and decoder are
# generated from the same plan (as the record's __init__ is, gpusd.record) and take the plain case: every
# value of its exact type and within bounds.  Anything else (a bound crossed, an int where a float is
# meant, a non-finite number, a wrong type) is handed to the general code, which decides as it always
# did, with the same message; so the two accept the same input and give the same result.  One-shot
# commands that encode a few GPUs never pay for the compilation.

COMPILE_AFTER = 32
_DECODERS: dict[type, Any] = {}
_ENCODERS: dict[type, Any] = {}
_DECODE_USES: dict[type, int] = {}
_ENCODE_USES: dict[type, int] = {}


class _Slow(Exception):
    """Raised by a compiled codec for anything but the plain case: the general code takes over."""


def _count(uses: dict[type, int], cls: type) -> bool:
    """Count one use of ``cls``'s codec; True when it is time to compile it."""
    n = uses[cls] = uses.get(cls, 0) + 1
    return n >= COMPILE_AFTER


def _plain_check(spec: _Spec, v: str) -> str:
    """A condition true when ``v`` is a value of ``spec`` the general code keeps as it is."""
    kind = spec.kind
    if kind is str:
        return f"type({v}) is str and len({v}) <= {spec.limit}"
    if kind is bool:
        return f"type({v}) is bool"
    if kind is int:
        return f"type({v}) is int and {-MAX_INT} <= {v} < {MAX_INT}"
    # finite: inf - inf and nan - nan are nan
    return f"type({v}) is float and {v} - {v} == 0.0"


def _compile_decoder(cls: type) -> Any:
    names: dict[str, Any] = {"_cls": cls, "_Slow": _Slow}
    lines = ["def _decode(d):", "    if type(d) is not dict:", "        raise _Slow", "    g = d.get", "    k = {}"]
    for i, spec in enumerate(_plan(cls)):
        key = repr(spec.name)
        lines += [f"    v = g({key})", "    if v is None:"]
        if spec.required and not spec.optional:
            lines.append("        raise _Slow")
        elif spec.optional:
            lines += [f"        if {key} in d:", f"            k[{key}] = None"]
        else:
            lines.append("        pass")
        if spec.nested:
            # a class whose from_dict is this codec's alone: its compiled decoder, called directly
            plain = spec.kind in _PLAIN_DECODE
            names[f"_k{i}"] = _compiled_decoder(spec.kind) if plain else spec.kind.from_dict  # type: ignore[attr-defined]
            if spec.is_list:
                lines += [f"    elif type(v) is list and len(v) <= {spec.limit}:",
                          f"        k[{key}] = [_k{i}(x) if type(x) is dict else _slow() for x in v]"]
            else:
                lines += ["    else:", f"        k[{key}] = _k{i}(v)"]
        elif spec.is_list:
            lines += [f"    elif type(v) is list and len(v) <= {spec.limit} and all({_plain_check(spec, 'x')} "
                      "for x in v):", f"        k[{key}] = list(v)"]
        else:
            lines += [f"    elif {_plain_check(spec, 'v')}:", f"        k[{key}] = v"]
        if spec.is_list or not spec.nested:
            lines += ["    else:", "        raise _Slow"]
    lines.append("    return _cls(**k)")
    names["_slow"] = _raise_slow
    exec("\n".join(lines), names)  # noqa: S102 - generated from the class's own field plan
    return names["_decode"]


def _raise_slow() -> Any:
    raise _Slow


def _compiled_decoder(cls: type) -> Any:
    fast = _DECODERS.get(cls)
    if fast is None:
        fast = _DECODERS[cls] = _compile_decoder(cls)
    return fast


def _compiled_encoder(cls: type) -> Any:
    fast = _ENCODERS.get(cls)
    if fast is None:
        fast = _ENCODERS[cls] = _compile_encoder(cls)
    return fast


def _compile_encoder(cls: type) -> Any:
    names: dict[str, Any] = {"_Slow": _Slow, "_fin": math.isfinite, "_slow": _raise_slow}
    lines = ["def _encode(o):", "    out = {}"]
    for i, spec in enumerate(_plan(cls)):
        key = repr(spec.name)
        lines.append(f"    v = o.{spec.name}")
        if spec.nested and spec.kind in _PLAIN_ENCODE:
            # a class whose to_dict is this codec's alone: its compiled encoder, called directly (on
            # exactly that class: a subclass may say more)
            names[f"_e{i}"], names[f"_k{i}"] = _compiled_encoder(spec.kind), spec.kind
            value = (f"[_e{i}(x) if type(x) is _k{i} else _slow() for x in v]" if spec.is_list
                     else f"_e{i}(v) if type(v) is _k{i} else _slow()")
        elif spec.nested:
            value = "[x.to_dict() for x in v]" if spec.is_list else "v.to_dict()"
        elif spec.is_list:
            value = "list(v)"
            if spec.kind is float:
                lines += ["    if v is not None and not all(_fin(x) for x in v):", "        raise _Slow"]
        else:
            value = "v"
            if spec.kind is float:
                lines += ["    if v is not None and v - v != 0.0:", "        raise _Slow"]
        if spec.omit_none:
            lines += ["    if v is not None:", f"        out[{key}] = {value}"]
        elif value == "v":
            lines.append(f"    out[{key}] = v")
        else:
            lines.append(f"    out[{key}] = None if v is None else {value}")
    lines.append("    return out")
    exec("\n".join(lines), names)  # noqa: S102 - generated from the class's own field plan
    return names["_encode"]


# -- the codec's pair without the object: a wire dict checked and put in the form encode writes ---------
# ``gpusd list --json`` from a daemon's fleet view turns 8,000 GPUs of JSON into 8,000 GPUs of JSON: building
# a model object of each only to encode it again costs more than reading the answer.  :func:`canonical`
# gives what encode(decode(...)) gives, from the same field plan: the plain case (every value of its exact
# type, within bounds, every field but the telemetry present) in generated straight-line code, anything
# else by the general code above (so the two accept the same input, raise the same errors, give the same
# dict).

_CANONICAL: dict[type, Any] = {}


def canonical(cls: type, d: Any) -> dict[str, Any]:
    """``encode(decode(cls, d))`` without the object: ``d`` (data from the network) checked by the
    model's rules (:class:`WireError` where :func:`decode` raises) and written as :func:`encode` writes
    it (field order, defaults, nested objects as dicts; a new dict).  The codec's pair only: a class's
    ``to_dict`` may add derived keys (:func:`canonical_gpu` adds GpuInfo's ``free``)."""
    fast = _CANONICAL.get(cls)
    if fast is None:
        fast = _CANONICAL[cls] = _compile_canonical(cls)
    try:
        return fast(d)  # type: ignore[no-any-return]
    except _Slow:
        return encode(decode(cls, d))


def _compile_canonical(cls: type) -> Any:
    names: dict[str, Any] = {"_Slow": _Slow}
    lines = ["def _canonical(d):", "    if type(d) is not dict:", "        raise _Slow", "    g = d.get",
             "    out = {}"]
    for i, spec in enumerate(_plan(cls)):
        key = repr(spec.name)
        lines += [f"    v = g({key})", "    if v is None:"]
        if spec.none_default and spec.omit_none:
            # absent or null: None, which encode leaves off
            lines.append("        pass")
        elif spec.none_default and spec.optional:
            lines.append(f"        out[{key}] = None")
        else:
            # a default of its own, or a required field: the general code
            lines.append("        raise _Slow")
        if spec.nested and spec.kind in _PLAIN_DECODE and spec.kind in _PLAIN_ENCODE:
            names[f"_c{i}"] = _compiled_canonical(spec.kind)
            if spec.is_list:
                lines += [f"    elif type(v) is list and len(v) <= {spec.limit}:",
                          f"        out[{key}] = [_c{i}(x) for x in v]"]
            else:
                lines += ["    else:", f"        out[{key}] = _c{i}(v)"]
        elif spec.nested and spec.is_list:
            # a class whose from_dict or to_dict says more: none of it here
            lines += ["    elif type(v) is list and not v:", f"        out[{key}] = []"]
        elif spec.nested:
            pass
        elif spec.is_list:
            lines += [f"    elif type(v) is list and len(v) <= {spec.limit} and all({_plain_check(spec, 'x')} "
                      "for x in v):", f"        out[{key}] = list(v)"]
        else:
            lines += [f"    elif {_plain_check(spec, 'v')}:", f"        out[{key}] = v"]
        if spec.is_list or not (spec.nested and spec.kind in _PLAIN_DECODE and spec.kind in _PLAIN_ENCODE):
            lines += ["    else:", "        raise _Slow"]
    lines.append("    return out")
    exec("\n".join(lines), names)  # noqa: S102 - generated from the class's own field plan
    return names["_canonical"]


def _compiled_canonical(cls: type) -> Any:
    fast = _CANONICAL.get(cls)
    if fast is None:
        fast = _CANONICAL[cls] = _compile_canonical(cls)
    return fast


def canonical_gpu(d: Any) -> dict[str, Any]:
    """``GpuInfo.from_dict(d).to_dict()`` without the object: :func:`canonical` and the derived ``free``."""
    out = canonical(GpuInfo, d)
    out["free"] = gpu_is_free(out["healthy"], out["processes"], out["leases"], out["utilization_gpu"])
    return out


def canonical_snapshot(d: Any) -> tuple[dict[str, Any], bool, list[dict[str, Any]]]:
    """A host snapshot from the network checked as :meth:`HostSnapshot.from_dict` checks it
    (:class:`WireError` where it raises), without its objects: its fields as :func:`canonical` gives
    them but ``gpus`` (empty), whether it is simulated, and each GPU as :func:`canonical_gpu` gives it."""
    simulated = _snapshot_envelope(d)
    gpus = d.get("gpus")
    head = canonical(HostSnapshot, {**d, "gpus": []})
    if gpus is None:
        gpus = []
    limit = next(s.limit for s in _plan(HostSnapshot) if s.name == "gpus")
    if type(gpus) is not list:
        raise WireError("field 'gpus' must be a list")
    if len(gpus) > limit:
        raise WireError(f"field 'gpus' has {len(gpus)} entries, more than {limit}")
    rows = [canonical_gpu(g) for g in gpus]
    return head, head["backend"] == SIMULATED_BACKEND or (simulated and "backend" not in d), rows


def gpu_memory_available(gpu: dict[str, Any]) -> int | None:
    """``GpuInfo.memory_available`` of a GPU as :func:`canonical_gpu` gives it (the one rule)."""
    leases = gpu["leases"]
    reserved = reserved_memory([LeaseInfo.from_dict(x) for x in leases],
                               [ProcessInfo.from_dict(x) for x in gpu["processes"]]) if leases else 0
    return free_memory(gpu["memory_total"], gpu["memory_used"], gpu["memory_free"], reserved)


# -- private fields: marked in the field metadata (PRIVATE), withheld by one function ------------------


_PRIVATE_KEYS: tuple[frozenset[str], frozenset[str]] | None = None


def private_keys() -> tuple[frozenset[str], frozenset[str]]:
    """(the names of the private fields, the names of the list fields whose entries have private fields),
    derived from the model's field metadata: today ``{user, command}`` and ``{processes, leases}``."""
    global _PRIVATE_KEYS
    if _PRIVATE_KEYS is None:
        keys = {s.name for cls in MODEL_CLASSES for s in _plan(cls) if s.private}
        lists = {s.name for cls in MODEL_CLASSES for s in _plan(cls)
                 if s.is_list and s.nested and any(x.private for x in _plan(s.kind))}
        _PRIVATE_KEYS = frozenset(keys), frozenset(lists)
    return _PRIVATE_KEYS


def redact(value: Any) -> Any:
    """``value`` without its private fields (process owners and command lines, docs/security.md), the
    one redaction of gpusd (daemon answers, event data, fleet views, a client's view of an unverified host).

    * a JSON-like payload (dict, list): a copy in which every entry of a private list (``processes``,
      ``leases``) has its private keys (``user``, ``command``) set to None; other values are shared;
    * a model object (or any record or dataclass using this module's codec, such as a fleet view's host): its
      private fields, and those of the objects it holds, set to None in place; returned."""
    if isinstance(value, dict):
        keys, lists = private_keys()
        out = {}
        for k, v in value.items():
            if k in lists and isinstance(v, list):
                out[k] = [{f: (None if f in keys else x) for f, x in e.items()} if isinstance(e, dict) else e
                          for e in v]
            else:
                out[k] = redact(v)
        return out
    if isinstance(value, list):
        return [redact(v) for v in value]
    if _has_fields(value) and not isinstance(value, type):
        for spec in _plan(type(value)):
            if spec.private:
                setattr(value, spec.name, None)
            elif spec.nested:
                held = getattr(value, spec.name)
                for item in (held or ()) if spec.is_list else (held,):
                    if item is not None:
                        redact(item)
    return value


_PRIVATE_SPECS: dict[type, tuple[_Spec, ...]] = {}


def _private_specs(cls: type) -> tuple[_Spec, ...]:
    """The fields of ``cls`` that are private or hold objects with private fields."""
    specs = _PRIVATE_SPECS.get(cls)
    if specs is None:
        specs = _PRIVATE_SPECS[cls] = tuple(s for s in _plan(cls) if s.private or (s.nested and _private_specs(s.kind)))
    return specs


def redact_encoded(cls: type, d: dict[str, Any]) -> dict[str, Any]:
    """``d``, a ``cls`` as :func:`encode` (or :func:`canonical`) writes it, as encode writes the
    :func:`redact`-ed object: each private field None, or left off where encode leaves its None off.
    In place; returned."""
    for spec in _private_specs(cls):
        if spec.name not in d:
            continue
        if spec.private:
            if spec.omit_none:
                del d[spec.name]
            else:
                d[spec.name] = None
            continue
        held = d[spec.name]
        for item in (held or ()) if spec.is_list else (held,):
            if item is not None:
                redact_encoded(spec.kind, item)
    return d


TEXT: dict[str, Any] = {"max": MAX_TEXT}
# an optional reading sent only where present
OPT: dict[str, Any] = {"omit_none": True}
# A private field (process owners, command lines: docs/security.md): served only to readers the daemon
# trusts, dropped from hosts that did not prove they hold the fleet secret.  :func:`redact` reads this mark.
PRIVATE: dict[str, Any] = {"private": True}


@record(slots=True)
class ProcessInfo:
    """A process running on a GPU (or on one of its MIG instances)."""

    pid: int
    used_memory: int | None = None
    # "compute" or "graphics"
    type: str = "compute"
    # None where the host cannot tell (containers)
    user: str | None = field(default=None, metadata=PRIVATE)
    command: str | None = field(default=None, metadata={**TEXT, **PRIVATE})
    gpu_instance_id: int | None = None
    compute_instance_id: int | None = None
    # on a GPU no gpusd lease covers: not a lease holder's (or its descendants') and not a lease
    # holder's user's (docs/allocation.md "Unleased processes"); False where leases were not read
    unleased: bool = False
    # the container it runs in, from its cgroup (gpusd.inventory.cgroups; added in 0.4, sent only where
    # known): the container's id (a Slurm job's number), its runtime, a Kubernetes pod's UID, and who
    # started it where gpusd knows (the gpusd job that ran the container: its user)
    container: str | None = field(default=None, metadata={**OPT, "max": 128})
    container_runtime: str | None = field(default=None, metadata={**OPT, "max": 32})
    pod: str | None = field(default=None, metadata={**OPT, "max": 64})
    container_owner: str | None = field(default=None, metadata={**OPT, **PRIVATE, "max": 64})

    def to_dict(self) -> dict[str, Any]:
        return encode(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ProcessInfo:
        return decode(cls, d)


@record(slots=True)
class MigInstance:
    """A MIG slice of a GPU.  NVML reports no utilisation per slice."""

    index: int
    uuid: str
    profile: str | None = None  # e.g. "1g.10gb"
    memory_total: int | None = None
    memory_used: int | None = None
    gpu_instance_id: int | None = None
    compute_instance_id: int | None = None

    @property
    def memory_available(self) -> int | None:
        """Free memory by the one rule (:func:`free_memory`); a slice reports no free reading."""
        return free_memory(self.memory_total, self.memory_used)

    memory_free = memory_available  # its older name

    def free_after(self, reserved: int) -> int | None:
        """Free memory by the one rule, less ``reserved`` (the allocator counts leases itself)."""
        return free_memory(self.memory_total, self.memory_used, None, reserved)

    def to_dict(self) -> dict[str, Any]:
        return encode(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> MigInstance:
        return decode(cls, d)


@record(slots=True)
class LeaseInfo:
    """A lease held on a GPU by a job on this host (see :mod:`gpusd.alloc.leases`)."""

    lease_id: str
    pid: int
    user: str | None = field(default=None, metadata=PRIVATE)
    # seconds since the epoch
    started: float | None = None
    # bytes the job asked for; None: not stated
    memory: int | None = None
    shared: bool = False
    command: str | None = field(default=None, metadata={**TEXT, **PRIVATE})
    # UUID of the leased GPU or MIG slice
    device: str | None = None
    # A lease the daemon holds for a remote holder (docs/pool.md): where the request came from (the
    # client's address), and when the lease ends unless its holder renews it (seconds since the epoch).
    # ``user`` is then the holder's name and ``command`` its note (both private, as for local leases).
    remote_from: str | None = None
    expires: float | None = None
    # the gpusd job holding it (docs/jobs.md), when known
    job: str | None = None
    # Not a lease: a process (``pid``, ``user`` naming its uid) holds the device's lock without one,
    # which blocks the GPU for gpusd's leases in that lock directory (docs/allocation.md).
    unleased: bool = False
    # the Slurm job holding it (added in 0.3): its id, recorded by `gpusd slurm prolog` (docs/slurm.md)
    slurm_job: str | None = None
    # Added in 0.4 (docs/allocation.md, "Leases the authority did not grant"): where a daemon is the lease
    # authority, a lease taken in the shared lock directory instead (GPUSD_LEASE_SOCKET=off, or a
    # hand-made flock) is "not through the authority"; its user still counts against the policy's caps,
    # and the leases of a user holding more than a cap are flagged ``over_cap``.
    outside_authority: bool = False
    over_cap: bool = False
    # Held, but its record cannot be read (damaged, empty, not a gpusd record: added in 0.4): the kernel
    # says the device's lock is held by a lease's holder (``pid``), so the GPU counts as taken; what the
    # lease was for is unknown (docs/allocation.md, "A damaged record").
    unreadable: bool = False
    # the fencing token of this GPU's grant (added in 0.4): greater than every earlier grant's of the
    # GPU on this host, across daemon restarts (gpusd.alloc.epoch, docs/allocation.md "Epochs")
    epoch: int | None = None
    # a remote lease's holder says when it stops renewing (added in 0.4; seconds since the epoch, shown
    # only): how long a reservation lasts (its --for), where ``expires`` is only the TTL's next deadline
    ends: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return encode(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> LeaseInfo:
        return decode(cls, d)


@record(slots=True)
class BookingInfo:
    """GPUs of the host booked ahead (``gpusd reserve --at``, docs/pool.md "Time"; added in 0.4, schema 1
    still: older readers ignore the key): from ``start`` to ``end`` (seconds since the epoch), the GPUs'
    ``indices``, the booker (``user``, private) and whether the daemon holds them for the booker now."""

    booking_id: str
    start: float
    end: float
    indices: list[int] = field(default_factory=list, metadata={"max": 256})
    user: str | None = field(default=None, metadata=PRIVATE)
    held: bool = False

    def to_dict(self) -> dict[str, Any]:
        return encode(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> BookingInfo:
        return decode(cls, d)


@record(slots=True)
class GpuLink:
    """How a GPU reaches another GPU of the same host (docs/inventory.md, "Topology").

    ``level`` is NVML's common-ancestor level of the PCIe path (0 INTERNAL, 10 SINGLE switch,
    20 MULTIPLE switches, 30 HOSTBRIDGE, 40 NODE, 50 SYSTEM: :mod:`gpusd.topology`); ``nvlink`` the
    number of active NVLinks between the two (through an NVSwitch: the GPU's links to the switches),
    0 for none."""

    # the other GPU's index in the same snapshot
    peer: int
    # None: NVML cannot tell
    level: int | None = None
    nvlink: int = 0

    def to_dict(self) -> dict[str, Any]:
        return encode(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> GpuLink:
        return decode(cls, d)


@record(slots=True)
class GpuTopology:
    """Where one GPU sits in its host (docs/wire-format.md, "Topology v2"): a size that does not grow
    with the host's other GPUs, so a host's topology grows with its GPUs and the links that exist, not
    with their pairs.  Two GPUs of one snapshot are compared by :func:`gpusd.topology.link_between`.

    ``pcie[k]`` names the group of GPUs whose PCIe paths meet this one's at or below NVML level
    ``PCIE_LEVELS[k]`` (INTERNAL, SINGLE, MULTIPLE, HOSTBRIDGE, NODE) by its lowest GPU index (this GPU's
    own index where it is alone); two GPUs of the host that share no group meet at SYSTEM; empty: NVML
    cannot tell.  ``nvlink``: the GPUs this one has NVLinks to directly (``peer``, ``nvlink``: the
    links); ``fabric``: the lowest index of the GPUs that reach each other through NVSwitches, this one
    with ``fabric_links`` links (None: none)."""

    # the topology's form (version 1: GpuInfo.links, a link per pair)
    version: int = 2
    pcie: list[int] = field(default_factory=list, metadata={"max": 5})
    nvlink: list[GpuLink] = field(default_factory=list, metadata={"max": 64})
    fabric: int | None = None
    fabric_links: int = 0

    def to_dict(self) -> dict[str, Any]:
        return encode(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> GpuTopology:
        return decode(cls, d)


@record(slots=True)
class GpuInfo:
    """One physical GPU as seen at one moment."""

    # NVML index, which is nvidia-smi's (PCI bus) order
    index: int
    uuid: str
    name: str | None = None
    pci_bus_id: str | None = None
    memory_total: int | None = None
    memory_used: int | None = None
    memory_free: int | None = None
    # percent, averaged over utilization_window seconds
    utilization_gpu: float | None = None
    # percent (memory controller busy)
    utilization_memory: float | None = None
    # seconds the average covers; None: a single reading
    utilization_window: float | None = None
    temperature: int | None = None  # degrees C
    power_draw: float | None = None  # watts
    power_limit: float | None = None  # watts
    fan_speed: int | None = None  # percent
    # "default", "exclusive_process", "prohibited"
    compute_mode: str | None = None
    # None: the GPU has no MIG support
    mig_mode: bool | None = None
    mig_instances: list[MigInstance] = field(default_factory=list, metadata={"max": 64})
    processes: list[ProcessInfo] = field(default_factory=list)
    leases: list[LeaseInfo] = field(default_factory=list)
    healthy: bool = True
    # why the GPU is unhealthy, or which query failed
    error: str | None = field(default=None, metadata=TEXT)
    # Topology (added in 0.3, schema 1 still: older readers ignore these keys): the GPU's NUMA node, the
    # CPUs close to it (a Linux CPU list, "0-23,48-71"), and its link to every other GPU of the host.
    numa_node: int | None = None
    local_cpus: str | None = None
    links: list[GpuLink] = field(default_factory=list, metadata={"max": 256})
    # The topology in a form that grows with the GPU's links, not the host's GPUs (added in 0.4, schema 1
    # still): what gpusd's backends send instead of ``links``, which stays for the readers of older daemons.
    topology: GpuTopology | None = field(default=None, metadata=OPT)
    # Added in 0.3 (additive, docs/wire-format.md): who made the GPU, and its number in its vendor's own
    # runtime (CUDA, ROCm, Level Zero), which is what that vendor's visibility variable counts.
    # ``index`` stays unique on the host; on a one-vendor host both are the same.
    # "nvidia", "amd" or "intel" (VENDORS)
    vendor: str = "nvidia"
    # None: the same as ``index``
    vendor_index: int | None = None
    # AMD: "SPX", "DPX", "QPX", "CPX"; None: not partitionable
    compute_partition: str | None = None
    memory_partition: str | None = None  # AMD: "NPS1", "NPS4"
    # Intel: stacks (tiles) of the card; None: not reported
    subdevices: int | None = None

    # Telemetry behind the DCGM exporter's default counters (docs/monitoring.md); None where unsupported
    # or not read, and then left off the wire (OPT).
    clock_sm: int | None = field(default=None, metadata=OPT)  # MHz
    clock_memory: int | None = field(default=None, metadata=OPT)  # MHz
    memory_temperature: int | None = field(default=None, metadata=OPT)  # degrees C (HBM)
    # bytes the driver reserves
    memory_reserved: int | None = field(default=None, metadata=OPT)
    # mJ since the driver loaded (a counter)
    energy: int | None = field(default=None, metadata=OPT)
    pcie_replays: int | None = field(default=None, metadata=OPT)  # PCIe replay counter
    utilization_encoder: int | None = field(default=None, metadata=OPT)  # percent
    utilization_decoder: int | None = field(default=None, metadata=OPT)  # percent
    # NVLink raw bytes, TX+RX, every link
    nvlink_bytes: int | None = field(default=None, metadata=OPT)
    remapped_rows_correctable: int | None = field(default=None, metadata=OPT)
    remapped_rows_uncorrectable: int | None = field(default=None, metadata=OPT)
    row_remap_pending: bool | None = field(default=None, metadata=OPT)
    row_remap_failure: bool | None = field(default=None, metadata=OPT)
    # the last XID seen since the start; 0: none
    xid_last: int | None = field(default=None, metadata=OPT)
    # XIDs seen since the start; None: no events
    xid_errors: int | None = field(default=None, metadata=OPT)
    # NVML's GPM (Hopper and newer), between the last two samples: percent, bytes per second
    gpm_graphics_util: float | None = field(default=None, metadata=OPT)
    gpm_tensor_util: float | None = field(default=None, metadata=OPT)  # any tensor pipe
    gpm_dram_util: float | None = field(default=None, metadata=OPT)  # DRAM bandwidth
    pcie_tx_rate: float | None = field(default=None, metadata=OPT)
    pcie_rx_rate: float | None = field(default=None, metadata=OPT)
    # Unified memory (no memory of its own: DGX Spark GB10, Jetson Thor): the memory fields are the host's
    # (MemTotal, MemAvailable), shared with the CPU and with every other such GPU of the host.
    memory_shared: bool | None = field(default=None, metadata=OPT)
    # Each temperature sensor under its own name where the GPU has it (AMD: an MI300X has no edge sensor;
    # ``temperature`` is then the hotspot), and the board's part number (AMD: amdsmi's
    # ``board_info.model_number``, ``102-G30211-00``, what AMD's exporter labels ``card_model``)
    edge_temperature: int | None = field(default=None, metadata=OPT)  # degrees C
    junction_temperature: int | None = field(default=None, metadata=OPT)  # degrees C (hotspot)
    board_model: str | None = field(default=None, metadata={**OPT, "max": 64})
    # ECC errors since the driver loaded, every block together (AMD: amdsmi_get_gpu_total_ecc_count;
    # deferred: found but not yet corrected or signalled)
    ecc_correctable: int | None = field(default=None, metadata=OPT)
    ecc_uncorrectable: int | None = field(default=None, metadata=OPT)
    ecc_deferred: int | None = field(default=None, metadata=OPT)
    # The PCIe link (AMD: amdsmi_get_pcie_info): its speed now and at most (GT/s), the bandwidth in use
    # (Mb/s, amdsmi's unit and AMD's exporter's), and counters since the driver loaded beside
    # ``pcie_replays``: L0-to-recovery transitions, replay rollovers, NAKs sent and received
    pcie_speed: float | None = field(default=None, metadata=OPT)
    pcie_max_speed: float | None = field(default=None, metadata=OPT)
    pcie_bandwidth: int | None = field(default=None, metadata=OPT)
    pcie_recoveries: int | None = field(default=None, metadata=OPT)
    pcie_replay_rollovers: int | None = field(default=None, metadata=OPT)
    pcie_nak_sent: int | None = field(default=None, metadata=OPT)
    pcie_nak_received: int | None = field(default=None, metadata=OPT)
    # The GFX engine's busy percent now, one per compute die (XCC) of the GPU (AMD MI300-class:
    # amdsmi_get_gpu_metrics_info's xcp_stats.gfx_busy_inst); None where not reported
    gfx_busy_xcc: list[float] | None = field(default=None, metadata={**OPT, "max": 64})

    @property
    def device_index(self) -> int:
        """The GPU's number for its vendor's runtime (what ``CUDA_VISIBLE_DEVICES``,
        ``ZE_AFFINITY_MASK`` or ``HIP_VISIBLE_DEVICES`` count)."""
        return self.index if self.vendor_index is None else self.vendor_index

    @property
    def memory_available(self) -> int | None:
        """Free memory by the one rule (:func:`free_memory`): ``memory_free`` (the driver's raw reading)
        where the backend read it, else total less used; less what the GPU's leases reserved and have
        not allocated; None when unknown."""
        return self.free_after(reserved_memory(self.leases, self.processes))

    def free_after(self, reserved: int) -> int | None:
        """Free memory by the one rule, less ``reserved`` (the allocator counts leases itself: a
        lease's processes with their children, and every GPU sharing the host's memory)."""
        return free_memory(self.memory_total, self.memory_used, self.memory_free, reserved)

    @property
    def memory_used_ratio(self) -> float | None:
        if not self.memory_total or self.memory_used is None:
            return None
        return self.memory_used / self.memory_total

    @property
    def is_free(self) -> bool:
        """gpusd's one rule for "free" (the TXT count, ``list``, ``top`` and the dashboard): healthy,
        no process, no lease, and a known utilisation below :data:`FREE_UTIL` percent."""
        return gpu_is_free(self.healthy, self.processes, self.leases, self.utilization_gpu)

    def to_dict(self) -> dict[str, Any]:
        d = encode(self)
        # derived: sent so that clients (the dashboard) need not re-implement it
        d["free"] = self.is_free
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> GpuInfo:
        return decode(cls, d)


@record(slots=True)
class HostSnapshot:
    """One host and all its GPUs at one moment."""

    hostname: str
    # stable across restarts of the same machine (or state directory)
    node_id: str
    timestamp: float
    gpus: list[GpuInfo] = field(default_factory=list, metadata={"max": 256})
    driver_version: str | None = None
    cuda_version: str | None = None  # e.g. "12.4"
    nvml_version: str | None = None
    # "nvml", "amdsmi", "levelzero", "simulated", or several joined by "+"
    backend: str = "nvml"
    # ``simulated`` is derived from ``backend`` (a property, below), still sent on the wire after it
    schema: int = SCHEMA_VERSION
    # The machine (added in 0.3, schema 1 still: older readers ignore these keys), as ``slurmd -C``
    # reports it: online logical CPUs, sockets, cores per socket, threads per core, bytes of RAM
    # (gpusd.topology.machine; docs/slurm.md). None: not read (an older daemon).
    cpus: int | None = None
    sockets: int | None = None
    cores_per_socket: int | None = None
    threads_per_core: int | None = None
    memory: int | None = None
    # the host's bookings not yet over, soonest first (added in 0.4: docs/pool.md, "Time")
    bookings: list[BookingInfo] = field(default_factory=list, metadata={"max": 64})

    @property
    def simulated(self) -> bool:
        """The GPUs are simulated (``gpusd start --simulate``): the backend says so, and every output
        with it.  Sent on the wire as ``simulated`` beside ``backend``, as before 0.3."""
        return self.backend == SIMULATED_BACKEND

    def gpu(self, key: int | str) -> GpuInfo:
        """The GPU with this index or UUID."""
        for g in self.gpus:
            if g.index == key or g.uuid == key:
                return g
        raise KeyError(key)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        # "simulated" right after "backend", where it always was
        for key, value in encode(self).items():
            out[key] = value
            if key == "backend":
                out["simulated"] = self.simulated
        return out

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> HostSnapshot:
        simulated = _snapshot_envelope(d)
        snap = decode(cls, d)
        if simulated and "backend" not in d:
            # a sender that said only "simulated"
            snap.backend = SIMULATED_BACKEND
        return snap

    def to_json(self) -> str:
        import json

        return json.dumps(self.to_dict(), separators=(",", ":"), allow_nan=False)

    @classmethod
    def from_json(cls, text: str | bytes) -> HostSnapshot:
        import json

        try:
            data = json.loads(text)
        except (ValueError, UnicodeDecodeError) as exc:
            raise WireError(f"not JSON: {exc}") from None
        return cls.from_dict(data)


def check_schema(d: Any, what: str, kind: str, version: int) -> dict[str, Any]:
    """``d``, a wire document (``what``: "a host snapshot") of ``kind``'s schema ``version``: an object
    whose ``schema`` is that version, or absent (senders older than the field send the same fields);
    :class:`WireError` otherwise."""
    if not isinstance(d, dict):
        raise WireError(f"{what} must be an object")
    schema = d.get("schema", version)
    if schema != version or isinstance(schema, bool):
        raise WireError(f"unsupported {kind} schema {str(schema)[:20]} (this gpusd reads {version})")
    return d


def _snapshot_envelope(d: Any) -> bool:
    """A snapshot's checks beyond its fields' (:class:`WireError`): an object, of this schema, with a
    boolean ``simulated`` if any; whether it says ``simulated``."""
    d = check_schema(d, "a host snapshot", "snapshot", SCHEMA_VERSION)
    simulated = d.get("simulated")
    if simulated is not None and not isinstance(simulated, bool):
        raise WireError(f"field 'simulated' must be bool, got {type(simulated).__name__}")
    return bool(simulated)


# HostSnapshot.backend of simulated GPUs (gpusd.inventory.simulated)
SIMULATED_BACKEND = "simulated"


def _accept_simulated_keyword(cls: type) -> None:
    """``HostSnapshot(..., simulated=True)`` as 0.2 wrote it still works (until 0.4), with a warning:
    ``simulated`` is now derived from ``backend``, which it sets."""
    init = cls.__init__  # type: ignore[misc]  # the generated one (gpusd.record), made now

    def __init__(self: Any, *args: Any, simulated: bool | None = None, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        if simulated is not None:
            import warnings

            warnings.warn("HostSnapshot(simulated=...) is derived from backend: pass backend='simulated'",
                          DeprecationWarning, stacklevel=2)
            if simulated:
                self.backend = SIMULATED_BACKEND

    __init__.__wrapped__ = init  # type: ignore[attr-defined]  # inspect.signature shows the fields
    setattr(cls, "__init__", __init__)  # noqa: B010


_accept_simulated_keyword(HostSnapshot)


# The GPU vendors gpusd reads (GpuInfo.vendor; ``--vendor``); what each one means is
# gpusd.inventory.vendors' to say.  A GPU that names no vendor (a peer before 0.3) is NVIDIA's.
VENDORS = ("nvidia", "amd", "intel")
DEFAULT_VENDOR = VENDORS[0]

# What a sample changes while nothing changes hands: a GPU's readings (and a process's, a MIG slice's
# memory, a lease's renewed expiry).  Everything else -- a lease, a process coming or going, health, a
# booking, a GPU's free state -- is its shape.  A paced event-stream reader (docs/wire-format.md, "Event
# stream") gets a change of readings alone at most every few seconds, a change of shape at once.
READINGS = frozenset({
    "memory_used", "memory_free", "utilization_gpu", "utilization_memory", "utilization_window", "temperature",
    "power_draw", "fan_speed", "clock_sm", "clock_memory", "memory_temperature", "memory_reserved", "energy",
    "pcie_replays", "utilization_encoder", "utilization_decoder", "nvlink_bytes", "gpm_graphics_util",
    "gpm_tensor_util", "gpm_dram_util", "pcie_tx_rate", "pcie_rx_rate", "edge_temperature",
    "junction_temperature", "gfx_busy_xcc", "pcie_speed", "pcie_bandwidth",
})
_PART_READINGS = {"processes": frozenset({"used_memory"}), "mig_instances": frozenset({"memory_used"}),
                  "leases": frozenset({"expires"})}


def shape_of(snapshot: dict[str, Any]) -> list[Any]:
    """The shape of ``snapshot`` (a :class:`HostSnapshot` as its ``to_dict`` writes it): its GPUs
    without their :data:`READINGS` (each keeps its ``free``, :func:`gpu_is_free` written out), and the
    host's other fields but its timestamp.  Two samples of one host with the same shape differ in
    readings alone."""
    gpus = []
    for gpu in snapshot.get("gpus") or ():
        if not isinstance(gpu, dict):
            gpus.append(gpu)
            continue
        kept: dict[str, Any] = {}
        for name, value in gpu.items():
            if name in READINGS:
                continue
            drop = _PART_READINGS.get(name)
            if drop is not None and isinstance(value, list):
                value = [{k: v for k, v in item.items() if k not in drop} if isinstance(item, dict) else item
                         for item in value]
            kept[name] = value
        gpus.append(kept)
    return [gpus, {k: v for k, v in snapshot.items() if k not in ("gpus", "timestamp")}]


MODEL_CLASSES = (HostSnapshot, GpuInfo, GpuLink, GpuTopology, MigInstance, ProcessInfo, LeaseInfo, BookingInfo)
# the classes whose from_dict (to_dict) is decode (encode) and nothing more: a compiled codec of a class
# holding them calls theirs directly (tests/test_model_codec.py checks the lists against the methods)
_PLAIN_DECODE = frozenset({GpuInfo, GpuLink, GpuTopology, MigInstance, ProcessInfo, LeaseInfo, BookingInfo})
_PLAIN_ENCODE = frozenset({GpuLink, GpuTopology, MigInstance, ProcessInfo, LeaseInfo, BookingInfo})
_MODEL_NAMES.update((cls.__name__, cls) for cls in MODEL_CLASSES)

__all__ = [
    "SCHEMA_VERSION",
    "HostSnapshot",
    "GpuInfo",
    "GpuLink",
    "GpuTopology",
    "MigInstance",
    "ProcessInfo",
    "LeaseInfo",
    "FREE_UTIL",
    "VENDORS",
    "MAX_NAME",
    "MAX_TEXT",
    "finite",
    "canonical",
    "check_schema",
    "canonical_gpu",
    "canonical_snapshot",
    "free_memory",
    "gpu_is_free",
    "gpu_memory_available",
    "READINGS",
    "shape_of",
    "redact",
    "redact_encoded",
    "shown_name",
]


# -- how a GPU's name is shown -----------------------------------------------------------------------
# the vendor, then at most one brand
_NAME_PREFIXES = ("NVIDIA ", "AMD ", "Intel(R) ")
_BRAND_PREFIXES = ("GeForce ", "Tesla ", "Instinct ", "Radeon ", "Data Center GPU ")


def display_name(name: str | None) -> str:
    """A GPU's name as every gpusd table shows it (``devices``, ``list``, ``scan``, ``watch``, ``top``,
    the dashboard): NVML's name without the vendor and brand prefixes.  ``NVIDIA A100-SXM4-80GB`` ->
    ``A100-SXM4-80GB``, ``NVIDIA GeForce RTX 4090`` -> ``RTX 4090``, ``Tesla T4`` -> ``T4``; ``-`` when
    unknown.  ``--json`` output keeps NVML's full name."""
    if not name:
        return "-"
    for prefix in _NAME_PREFIXES:
        name = name.removeprefix(prefix)
    for prefix in _BRAND_PREFIXES:
        if name.startswith(prefix):
            name = name[len(prefix):]
            break
    return name or "-"


def shown_name(name: str | None, vendor: str = "nvidia") -> str:
    """A GPU's NAME cell in every table (``devices``, ``list``, ``top``): :func:`display_name`, with the
    vendor for a GPU that is not NVIDIA's (``MI300X [amd]``; the vendor made printable, at most 8
    characters).  The dashboard's ``shortName`` (web/app.js) follows the same rule."""
    shown = display_name(name)
    if vendor == DEFAULT_VENDOR:
        return shown
    from .sanitize import for_terminal

    return f"{shown} [{for_terminal(vendor, 8)}]"


def name_matches(name: str | None, pattern: str) -> bool:
    """``--model``/``--filter``: does ``pattern`` match this GPU?  Case-insensitive; a glob (``*?[``)
    must match the whole shown name or the whole full name, other text is a substring of either."""
    p = pattern.lower()
    candidates = (display_name(name).lower(), (name or "").lower())
    if any(c in p for c in "*?["):
        from fnmatch import fnmatchcase

        return any(fnmatchcase(c, p) for c in candidates)
    return any(p in c for c in candidates)
