"""Record classes without :mod:`dataclasses` at import time: the one definition of a record's fields.

``dataclasses`` costs a command ~10 ms before its first line runs (it imports ``inspect``, ``ast``,
``dis`` and ``tokenize``, ~5 ms, then builds each class's methods, 0.2-0.8 ms a class).  The
records on the quick commands' path (the model, the selection constraints, the leases...) are made by
:func:`record` instead, from the same class body a dataclass would have::

    @record(slots=True)
    class ProcessInfo:
        pid: int
        used_memory: int | None = None
        user: str | None = field(default=None, metadata=PRIVATE)

The class gets what ``@dataclass`` would give it, with the same meaning: an ``__init__`` taking the
fields in order (generated once per class, so constructing one costs what a dataclass's does), a
``__repr__``, an ``__eq__`` comparing the fields of two records of the same class, ``__hash__`` as
dataclasses set it (None for a mutable record that compares by value, by the fields for a frozen one),
``__match_args__``, and with ``frozen``/``slots`` the same behaviour as dataclasses' options.

:func:`fields` and :func:`replace` are the functions gpusd's own code uses; :func:`maker` gives a
function that makes a record of a class without the class call's own cost (where many are made: a
snapshot).  The records also answer :func:`dataclasses.fields`, :func:`dataclasses.replace`,
:func:`dataclasses.asdict` and :func:`dataclasses.is_dataclass` as the dataclasses they were (the
public model types have been dataclasses since 0.1): the first such call imports ``dataclasses`` and
builds its field objects, once per class.  ``tests/core/test_record.py`` checks every record of gpusd
against a dataclass made from the same fields (signature, defaults, repr, equality, hashing, freezing,
copying, pickling).

Annotations are read as strings (every gpusd module has ``from __future__ import annotations``); an
annotation naming ``ClassVar`` is not a field, as for dataclasses.
"""

from __future__ import annotations

import operator

# typing is not imported at run time: start-up time
TYPE_CHECKING = False
if TYPE_CHECKING:  # pragma: no cover
    from typing import Any, Callable, TypeVar

    from typing_extensions import dataclass_transform

    T = TypeVar("T")
else:
    # what a type checker reads; nothing at run time
    def dataclass_transform(**_kw: Any) -> Any:
        return lambda f: f

__all__ = ["MISSING", "Field", "FrozenRecordError", "field", "fields", "is_record", "maker", "record", "replace"]


class _Missing:
    __slots__ = ()

    def __repr__(self) -> str:
        return "MISSING"


# a field without a default (or without a default factory)
MISSING: Any = _Missing()


class _Factory:
    __slots__ = ()

    def __repr__(self) -> str:
        # what inspect.signature shows for such a parameter, as for a dataclass
        return "<factory>"


_FACTORY: Any = _Factory()
_EMPTY: dict[str, Any] = {}


class Field:
    """One field of a record: ``name``, ``type`` (its annotation, a string), ``default``,
    ``default_factory`` (:data:`MISSING` where none) and ``metadata`` (read by the model's codec and
    by the selection constraints), the attributes of a :class:`dataclasses.Field` of the same name."""

    __slots__ = ("default", "default_factory", "metadata", "name", "type")

    def __init__(self, default: Any = MISSING, default_factory: Any = MISSING,
                 metadata: dict[str, Any] | None = None) -> None:
        if default is not MISSING and default_factory is not MISSING:
            raise ValueError("cannot specify both default and default_factory")
        self.name = ""
        self.type: Any = None
        self.default = default
        self.default_factory = default_factory
        self.metadata = _EMPTY if metadata is None else metadata

    def __repr__(self) -> str:
        return (f"Field(name={self.name!r}, type={self.type!r}, default={self.default!r}, "
                f"default_factory={self.default_factory!r}, metadata={self.metadata!r})")


def field(*, default: Any = MISSING, default_factory: Callable[[], Any] | Any = MISSING,
          metadata: dict[str, Any] | None = None) -> Any:
    """A field's default, default factory or metadata, as :func:`dataclasses.field` gives them."""
    return Field(default, default_factory, metadata)


class FrozenRecordError(AttributeError):
    """A field of a frozen record was assigned (as :class:`dataclasses.FrozenInstanceError`)."""


def fields(class_or_instance: Any) -> tuple[Field, ...]:
    """The fields of a record class or instance, in order (TypeError for anything else)."""
    own = getattr(class_or_instance, "__record_fields__", None)
    if own is None:
        raise TypeError(f"{class_or_instance!r} is not a record")
    return tuple(own.values())


def is_record(obj: Any) -> bool:
    """Whether ``obj`` is a record class or instance (made by :func:`record`)."""
    return hasattr(obj, "__record_fields__")


def replace(obj: T, /, **changes: Any) -> T:
    """A copy of the record ``obj`` with ``changes`` (as :func:`dataclasses.replace`)."""
    own = getattr(obj, "__record_fields__", None)
    if own is None or isinstance(obj, type):
        raise TypeError("replace() should be called on record instances")
    for name in own:
        if name not in changes:
            changes[name] = getattr(obj, name)
    return obj.__class__(**changes)


def maker(cls: type[T]) -> Callable[..., T]:
    """A function that makes a record of ``cls`` from its fields (positionally or by keyword, with the
    same defaults), as the ``__init__`` that :func:`record` generated for it does, without calling the
    class: CPython (3.11) passes a class call through ``type.__call__``, ``object.__new__`` and
    ``__init__``'s lookup, a seventh of a record's cost here (``GpuInfo``, 51 fields: ~0.56 us made so,
    ~0.64 us by its class; ``ProcessInfo`` ~0.17 and ~0.21 us).  For code that makes many records, such
    as a snapshot.  Made once per class, on first use.  A class's own ``__init__`` (one the
    class body defines or puts in place of the generated one) is not called; ``__post_init__`` is."""
    made: Any = cls.__dict__.get("__record_maker__") if isinstance(cls, type) else None
    if made is None:
        own = getattr(cls, "__record_fields__", None)
        if own is None or not isinstance(cls, type):
            raise TypeError(f"{cls!r} is not a record class")
        made = _init(cls, own, cls.__record_options__["frozen"], maker=True)  # type: ignore[attr-defined]
        type.__setattr__(cls, "__record_maker__", staticmethod(made))
        return made  # type: ignore[no-any-return]
    return made.__func__  # type: ignore[no-any-return]


@dataclass_transform(field_specifiers=(field, Field))
def record(cls: Any = None, /, *, slots: bool = False, frozen: bool = False, eq: bool = True) -> Any:
    """Make ``cls`` a record (``@record`` or ``@record(slots=True, frozen=True, eq=False)``), as
    ``@dataclass`` with the same options would."""

    def wrap(c: type) -> type:
        return _make(c, slots=slots, frozen=frozen, eq=eq)

    return wrap if cls is None else wrap(cls)


def _own_annotations(cls: type) -> dict[str, Any]:
    ann = cls.__dict__.get("__annotations__")
    # Python 3.14: evaluated on first use
    if ann is None and "__annotate__" in cls.__dict__:
        ann = cls.__annotations__
    return dict(ann or {})


def _is_classvar(annotation: Any) -> bool:
    text = annotation if isinstance(annotation, str) else getattr(annotation, "__name__", "")
    return text.replace("typing.", "").startswith("ClassVar")


def _make(cls: type, *, slots: bool, frozen: bool, eq: bool) -> type:
    inherited: dict[str, Field] = {}
    for base in reversed(cls.__mro__[1:]):
        inherited.update(getattr(base, "__record_fields__", None) or {})
    own: dict[str, Field] = {}
    for name, annotation in _own_annotations(cls).items():
        if _is_classvar(annotation):
            continue
        if not name.isidentifier() or name == "self" or name.startswith("__record_"):
            raise TypeError(f"{cls.__name__}: {name!r} cannot be a record's field")
        value = cls.__dict__.get(name, MISSING)
        f = value if isinstance(value, Field) else Field(default=value)
        f.name, f.type = name, annotation
        # list, dict, set: shared by all
        if f.default is not MISSING and f.default.__class__.__hash__ is None:
            raise ValueError(f"mutable default {type(f.default)} for field {name} is not allowed: use default_factory")
        own[name] = f
    all_fields = {**inherited, **own}
    seen_default = False
    for f in all_fields.values():
        if f.default is MISSING and f.default_factory is MISSING:
            if seen_default:
                raise TypeError(f"non-default argument {f.name!r} follows default argument")
        else:
            seen_default = True

    body = cls.__dict__
    methods: dict[str, Any] = {}
    lazy = None
    if "__init__" not in body:
        methods["__init__"] = lazy = _LazyInit(all_fields, frozen)
    if "__repr__" not in body:
        methods["__repr__"] = _repr(tuple(all_fields))
    if eq and "__eq__" not in body:
        methods["__eq__"] = _eq(tuple(all_fields))
    class_hash = body.get("__hash__", MISSING)
    explicit_hash = not (class_hash is MISSING or (class_hash is None and "__eq__" in body))
    if eq and not explicit_hash:
        methods["__hash__"] = _hash(tuple(all_fields)) if frozen else None
    if frozen:
        methods["__setattr__"], methods["__delattr__"] = _frozen(cls, tuple(all_fields))
    if "__match_args__" not in body:
        methods["__match_args__"] = tuple(all_fields)
    methods["__record_fields__"] = all_fields
    methods["__record_options__"] = {"slots": slots, "frozen": frozen, "eq": eq}
    methods["__dataclass_fields__"] = _DataclassFields()

    if slots:
        if "__slots__" in body:
            raise TypeError(f"{cls.__name__} already specifies __slots__")
        ns = {k: v for k, v in body.items() if k not in own and k not in ("__dict__", "__weakref__")}
        ns.update(methods)
        ns["__slots__"] = tuple(own)
        # object's would meet the frozen __setattr__ on the way back
        if frozen and "__getstate__" not in body:
            ns["__getstate__"], ns["__setstate__"] = _state(tuple(all_fields))
        qualname = getattr(cls, "__qualname__", None)
        new = type(cls)(cls.__name__, cls.__bases__, ns)
        if qualname is not None:
            new.__qualname__ = qualname
        # the frozen __setattr__ names the class it guards
        if frozen:
            new.__setattr__, new.__delattr__ = _frozen(new, tuple(all_fields))  # type: ignore[method-assign]
        if lazy is not None:
            lazy.owner = new
        return new
    # a default stays a class attribute (as with dataclasses); a Field object does not
    for name in own:
        f = all_fields[name]
        if isinstance(body.get(name), Field):
            if f.default is MISSING:
                delattr(cls, name)
            else:
                setattr(cls, name, f.default)
    for name, value in methods.items():
        setattr(cls, name, value)
    if lazy is not None:
        lazy.owner = cls
    return cls


class _LazyInit:
    """A record's ``__init__`` until it is first looked up (the first record made, ``inspect.signature``):
    then generated (:func:`_init`) and put in its place.  Most records a command's modules define are
    never made by that command: their ``__init__`` is then never compiled (~0.1-0.3 ms each at import)."""

    __slots__ = ("fields", "frozen", "owner")

    def __init__(self, all_fields: dict[str, Field], frozen: bool) -> None:
        self.fields, self.frozen = all_fields, frozen
        self.owner: Any = None

    def __get__(self, obj: Any, objtype: Any = None) -> Any:
        owner = self.owner
        fn = _init(owner, self.fields, self.frozen)
        if owner.__dict__.get("__init__") is self:
            type.__setattr__(owner, "__init__", fn)
        return fn if obj is None else fn.__get__(obj, objtype)


def _init(cls: type, all_fields: dict[str, Field], frozen: bool, maker: bool = False) -> Any:
    """``__init__``, generated: one assignment per field, defaults bound at definition (a dataclass's
    own way: the generic alternative costs each construction several times more).  ``maker``: the
    function :func:`maker` returns instead, the same assignments to a new instance of ``cls``."""
    # the generated function's own names start with __record_, which no field's may (checked in _make)
    scope: dict[str, Any] = {"__record_factory": _FACTORY, "__record_set": object.__setattr__,
                             "__record_new": object.__new__, "__record_cls": cls}
    params, lines = [] if maker else ["self"], ["    self = __record_new(__record_cls)"] if maker else []
    for i, f in enumerate(all_fields.values()):
        name = f.name
        if f.default_factory is not MISSING:
            scope[f"__record_f{i}"] = f.default_factory
            params.append(f"{name}=__record_factory")
            value = f"__record_f{i}() if {name} is __record_factory else {name}"
        elif f.default is not MISSING:
            scope[f"__record_d{i}"] = f.default
            params.append(f"{name}=__record_d{i}")
            value = name
        else:
            params.append(name)
            value = name
        lines.append(f"    __record_set(self, {name!r}, {value})" if frozen else f"    self.{name} = {value}")
    if "__post_init__" in {k for c in cls.__mro__ for k in vars(c)}:
        lines.append("    self.__post_init__()")
    name = "make" if maker else "__init__"
    if maker:
        lines.append("    return self")
    src = f"def {name}({', '.join(params)}):\n" + ("\n".join(lines) or "    pass") + "\n"
    exec(src, scope)  # noqa: S102  (made of the class's own field names: identifiers, checked in _make)
    fn = scope[name]
    fn.__qualname__ = f"{cls.__qualname__}.{name}"
    fn.__module__ = cls.__module__
    return fn


def _repr(names: tuple[str, ...]) -> Any:
    def __repr__(self: Any) -> str:
        return f"{type(self).__qualname__}({', '.join(f'{n}={getattr(self, n)!r}' for n in names)})"

    return __repr__


def _values(names: tuple[str, ...]) -> Callable[[Any], tuple[Any, ...]]:
    if not names:
        return lambda _obj: ()
    get = operator.attrgetter(*names)
    return get if len(names) > 1 else lambda obj: (get(obj),)


def _eq(names: tuple[str, ...]) -> Any:
    values = _values(names)

    def __eq__(self: Any, other: Any) -> Any:
        if other.__class__ is self.__class__:
            return values(self) == values(other)
        return NotImplemented

    return __eq__


def _hash(names: tuple[str, ...]) -> Any:
    values = _values(names)

    def __hash__(self: Any) -> int:
        return hash(values(self))

    return __hash__


def _frozen(cls: Any, names: tuple[str, ...]) -> tuple[Any, Any]:
    guarded = frozenset(names)

    def __setattr__(self: Any, name: str, value: Any) -> None:
        if type(self) is cls or name in guarded:
            raise FrozenRecordError(f"cannot assign to field {name!r}")
        super(cls, self).__setattr__(name, value)

    def __delattr__(self: Any, name: str) -> None:
        if type(self) is cls or name in guarded:
            raise FrozenRecordError(f"cannot delete field {name!r}")
        super(cls, self).__delattr__(name)

    return __setattr__, __delattr__


def _state(names: tuple[str, ...]) -> tuple[Any, Any]:
    def __getstate__(self: Any) -> list[Any]:
        return [getattr(self, n) for n in names]

    def __setstate__(self: Any, state: list[Any]) -> None:
        for n, v in zip(names, state):
            object.__setattr__(self, n, v)

    return __getstate__, __setstate__


class _DataclassFields:
    """``__dataclass_fields__`` of a record, built on first use: what :func:`dataclasses.fields`,
    ``replace``, ``asdict`` and ``is_dataclass`` read.  Only a caller of those imports ``dataclasses``
    (and it has already).  Each field becomes the :class:`dataclasses.Field` that ``@dataclass`` would
    have made of it (``dataclasses._FIELD`` marks a regular field; the tests check the result against
    real dataclasses)."""

    def __get__(self, obj: Any, owner: type) -> dict[str, Any]:
        import dataclasses

        out: dict[str, Any] = {}
        for f in owner.__record_fields__.values():  # type: ignore[attr-defined]
            d: Any = dataclasses.field(default=dataclasses.MISSING if f.default is MISSING else f.default,
                                  default_factory=(dataclasses.MISSING if f.default_factory is MISSING
                                                   else f.default_factory),
                                  metadata=f.metadata or None)
            d.name, d.type = f.name, f.type
            d._field_type = dataclasses._FIELD  # type: ignore[attr-defined]  # a regular field, as @dataclass marks it
            out[f.name] = d
        type.__setattr__(owner, "__dataclass_fields__", out)  # once per class
        return out
