"""Threshold rules ("temperature>85", "utilization>90 for 60s", "memory>95%", "lost") and the engine
that turns a stream of :class:`~gpusd.model.HostSnapshot` into ``exceeded``/``cleared`` events.

Rule syntax (one rule per string; spaces optional)::

    [NAME:] METRIC OP VALUE[UNIT] [for DURATION]
    [NAME:] lost [for DURATION]

* METRIC: ``temperature`` (°C), ``utilization`` (percent), ``memory`` (percent of total, or bytes with a
  unit: ``memory>70GiB``), ``power`` (watts, or percent of the power limit: ``power>90%``), ``fan``
  (percent), ``processes`` (count).  ``temp``, ``util``, ``utilisation``, ``mem`` are accepted too.
* OP: ``>``, ``>=``, ``<``, ``<=`` (or ``above``/``below``).
* DURATION: ``60s``, ``5m``, ``1h``, ``500ms`` or plain seconds: the condition must hold that long,
  sample after sample, before the rule fires.
* ``lost``: the GPU is unhealthy (NVML "GPU is lost" and other errors) or has vanished from the host.

Semantics: a rule fires (``exceeded``) once when its condition has held for DURATION, and clears
(``cleared``) at the first sample where it no longer holds — no hysteresis band.  A reading the GPU
does not give (``None``) leaves an exceeded rule as it is and restarts a pending one.  A GPU that
vanishes clears its other rules and trips ``lost``.

Config file (JSON)::

    {"thresholds": ["temperature>85", {"name": "busy", "rule": "utilization>90 for 60s"}, "lost"]}

(a bare list is accepted too).
"""

from __future__ import annotations

import json
import math
import operator
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import ConfigError
from .model import GpuInfo, HostSnapshot
from .units import DURATION_UNITS, format_bytes, parse_bytes

EXCEEDED = "exceeded"
CLEARED = "cleared"

_OPS: dict[str, Callable[[float, float], bool]] = {
    ">": operator.gt, ">=": operator.ge, "<": operator.lt, "<=": operator.le,
}
_WORD_OPS = {"above": ">", "over": ">", "below": "<", "under": "<"}

# accepted spelling -> canonical metric
_METRICS = {
    "temperature": "temperature", "temp": "temperature",
    "utilization": "utilization", "utilisation": "utilization", "util": "utilization", "gpu": "utilization",
    "memory": "memory", "mem": "memory",
    "power": "power",
    "fan": "fan",
    "processes": "processes", "procs": "processes",
    "lost": "lost", "unhealthy": "lost",
}
METRIC_NAMES = ("temperature", "utilization", "memory", "power", "fan", "processes", "lost")

_RULE = re.compile(
    r"""^\s*
    (?:(?P<name>[A-Za-z_][\w.\-]*)\s*:\s*)?          # optional name:
    (?P<metric>[A-Za-z_]+)\s*
    (?:(?P<op>>=|<=|>|<|above\b|below\b|over\b|under\b)\s*
       (?P<num>[+-]?(?:\d+(?:\.\d*)?|\.\d+))\s*
       (?!for\b)(?P<unit>°?[A-Za-z%]*)\s*)?
    (?:for\s+(?P<dur>\d+(?:\.\d*)?|\.\d+)\s*(?P<dunit>[A-Za-z]*))?
    \s*$""",
    re.VERBOSE | re.IGNORECASE,
)
_NAME = re.compile(r"[A-Za-z_][\w.\-]*")
_SYNTAX_HELP = ('expected METRIC OP VALUE [for DURATION] or "lost", e.g. "temperature>85", '
                '"utilization>90 for 60s", "memory>95%", "power>300W", "lost"')


@dataclass(frozen=True)
class Rule:
    """One parsed threshold rule.  ``limit`` is in the unit the value is read in (see :meth:`value`)."""

    name: str
    metric: str  # one of METRIC_NAMES
    op: str | None = None  # None only for "lost"
    limit: float | None = None
    # "C", "%", "B", "W", "" (count)
    unit: str = ""
    duration: float = 0.0  # seconds
    # canonical form, e.g. "utilization>90% for 60s"
    text: str = ""

    def value(self, gpu: GpuInfo) -> float | None:
        """The reading this rule compares, in the rule's unit; None where the GPU does not report it."""
        m = self.metric
        if m == "temperature":
            return None if gpu.temperature is None else float(gpu.temperature)
        if m == "utilization":
            return gpu.utilization_gpu
        if m == "memory":
            if self.unit == "B":
                return None if gpu.memory_used is None else float(gpu.memory_used)
            ratio = gpu.memory_used_ratio
            return None if ratio is None else 100.0 * ratio
        if m == "power":
            if self.unit == "%":
                if gpu.power_draw is None or not gpu.power_limit:
                    return None
                return 100.0 * gpu.power_draw / gpu.power_limit
            return gpu.power_draw
        if m == "fan":
            return None if gpu.fan_speed is None else float(gpu.fan_speed)
        if m == "processes":
            return float(len(gpu.processes))
        if m == "lost":
            return 0.0 if gpu.healthy else 1.0
        raise AssertionError(m)  # pragma: no cover

    def holds(self, value: float) -> bool:
        if self.metric == "lost":
            return value >= 1.0
        assert self.op is not None and self.limit is not None
        return _OPS[self.op](value, self.limit)

    @property
    def spec(self) -> str:
        """The rule as one string that parses back to it, name included (``busy: utilization>90%``)."""
        return self.text if self.name == self.text else f"{self.name}: {self.text}"

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "rule": self.text, "metric": self.metric, "op": self.op,
                "limit": self.limit, "unit": self.unit, "duration": self.duration}


def _fmt_num(x: float) -> str:
    return f"{x:g}"


def format_value(value: float | None, unit: str) -> str:
    """A reading for humans: ``87 C``, ``93.5%``, ``71.2GiB``, ``310 W``."""
    if value is None:
        return "-"
    if unit == "B":
        return format_bytes(int(value))
    if unit == "%":
        return f"{value:.3g}%" if value < 100 else f"{value:.0f}%"
    if unit in ("C", "W"):
        return f"{value:.0f} {unit}"
    return _fmt_num(value)


def _duration(num: str, unit: str, rule: str) -> float:
    factor = DURATION_UNITS.get(unit.lower())
    if factor is None:
        raise ConfigError(f"bad threshold rule {rule!r}: unknown duration unit {unit!r} (use s, m, h or ms)")
    return float(num) * factor


def parse_rule(text: str, name: str | None = None) -> Rule:
    """Parse one rule; raises :class:`~gpusd.errors.ConfigError` with a one-line message."""
    if not isinstance(text, str) or not text.strip():
        raise ConfigError(f"bad threshold rule {text!r}: empty; {_SYNTAX_HELP}")
    m = _RULE.match(text)
    if not m:
        raise ConfigError(f"bad threshold rule {text!r}: {_SYNTAX_HELP}")
    metric = _METRICS.get(m["metric"].lower())
    if metric is None:
        raise ConfigError(f"bad threshold rule {text!r}: unknown metric {m['metric']!r} "
                          f"(known: {', '.join(METRIC_NAMES)})")
    duration = _duration(m["dur"], m["dunit"] or "", text) if m["dur"] else 0.0
    rname = name or m["name"]
    if metric == "lost":
        if m["op"]:
            raise ConfigError(f"bad threshold rule {text!r}: \"lost\" takes no comparison (write \"lost\" "
                              f"or \"lost for 30s\")")
        canon = "lost" + (f" for {_fmt_num(duration)}s" if duration else "")
        return Rule(name=rname or canon, metric="lost", duration=duration, text=canon)
    if not m["op"]:
        raise ConfigError(f"bad threshold rule {text!r}: {metric} needs a comparison, e.g. {_example(metric)}")
    op = _WORD_OPS.get(m["op"].lower(), m["op"])
    limit = float(m["num"])
    if not math.isfinite(limit):  # pragma: no cover - the regex admits only plain numbers
        raise ConfigError(f"bad threshold rule {text!r}: the value must be a finite number")
    unit, limit = _unit(metric, m["unit"] or "", limit, m["num"], text)
    canon = f"{metric}{op}{_fmt_num(limit) if unit != 'B' else format_value(limit, 'B')}"
    canon += {"C": "C", "%": "%", "W": "W"}.get(unit, "")
    if duration:
        canon += f" for {_fmt_num(duration)}s"
    return Rule(name=rname or canon, metric=metric, op=op, limit=limit, unit=unit, duration=duration, text=canon)


def _example(metric: str) -> str:
    return {"temperature": '"temperature>85"', "utilization": '"utilization>90 for 60s"',
            "memory": '"memory>95%" or "memory>70GiB"', "power": '"power>300W" or "power>90%"',
            "fan": '"fan>80"', "processes": '"processes>4"'}[metric]


def _unit(metric: str, unit: str, limit: float, num: str, text: str) -> tuple[str, float]:
    u = unit.lower().lstrip("°")
    bad = ConfigError(f"bad threshold rule {text!r}: unit {unit!r} does not fit {metric} "
                      f"(e.g. {_example(metric)})")
    if metric == "temperature":
        if u not in ("", "c"):
            raise bad
        return "C", limit
    if metric in ("utilization", "fan"):
        if u not in ("", "%"):
            raise bad
        if not 0 <= limit <= 100:
            raise ConfigError(f"bad threshold rule {text!r}: {metric} is a percentage between 0 and 100")
        return "%", limit
    if metric == "memory":
        if u in ("", "%"):
            if not 0 <= limit <= 100:
                raise ConfigError(f"bad threshold rule {text!r}: a memory percentage is between 0 and 100 "
                                  f"(for an amount, give a unit: memory>70GiB)")
            return "%", limit
        try:
            return "B", float(parse_bytes(num + unit))
        except ValueError:
            raise bad from None
    if metric == "power":
        if u in ("", "w"):
            return "W", limit
        if u == "%":
            return "%", limit
        raise bad
    if metric == "processes":
        if u:
            raise bad
        return "", limit
    raise AssertionError(metric)  # pragma: no cover


def _rule_from_entry(entry: Any, where: str) -> Rule:
    if isinstance(entry, str):
        return parse_rule(entry)
    if isinstance(entry, dict):
        unknown = set(entry) - {"rule", "name"}
        if unknown:
            raise ConfigError(f"{where}: unknown key(s) {', '.join(sorted(unknown))} (expected \"rule\" and "
                              f"optionally \"name\")")
        if not isinstance(entry.get("rule"), str):
            raise ConfigError(f"{where}: \"rule\" must be a string such as \"temperature>85\"")
        name = entry.get("name")
        if name is not None and (not isinstance(name, str) or not _NAME.fullmatch(name)):
            raise ConfigError(f"{where}: \"name\" must be a word of letters, digits, '_', '.', '-' "
                              f"(e.g. \"gpu-hot\"), not {name!r}")
        return parse_rule(entry["rule"], name=name)
    raise ConfigError(f"{where}: a rule must be a string or an object with \"rule\", not {type(entry).__name__}")


def load_rules_file(path: str | Path) -> list[Rule]:
    """Rules from a JSON config file: ``{"thresholds": [...]}`` or a bare list."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read threshold file {p}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"threshold file {p} is not UTF-8 text") from None
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise ConfigError(f"threshold file {p} is not valid JSON: {exc}") from None
    if isinstance(data, dict):
        if "thresholds" not in data:
            raise ConfigError(f"threshold file {p}: expected a \"thresholds\" list")
        data = data["thresholds"]
    if not isinstance(data, list):
        raise ConfigError(f"threshold file {p}: \"thresholds\" must be a list of rules")
    rules = []
    for i, entry in enumerate(data):
        try:
            rules.append(_rule_from_entry(entry, f"threshold file {p}, rule {i + 1}"))
        except ConfigError as exc:
            msg = str(exc)
            if not msg.startswith("threshold file"):
                msg = f"threshold file {p}, rule {i + 1}: {msg}"
            raise ConfigError(msg) from None
    return rules


def load_rules(rules: Iterable[str | Rule] = (), files: Iterable[str | Path] = ()) -> list[Rule]:
    """Rules from config files, then from strings (e.g. ``--threshold`` flags).  A later rule with
    the same name replaces an earlier one, so the command line overrides a file."""
    out: dict[str, Rule] = {}
    for f in files:
        for r in load_rules_file(f):
            out[r.name] = r
    for given in rules:
        rule = given if isinstance(given, Rule) else parse_rule(given)
        out[rule.name] = rule
    return list(out.values())


def rule_specs(rules: Iterable[str] = (), files: Iterable[str | Path] = ()) -> list[str]:
    """:func:`load_rules`, as strings that parse back to the same rules (for a daemon's config and
    the command line of a background daemon).  Raises ConfigError."""
    return [r.spec for r in load_rules(rules, files)]


@dataclass
class ThresholdEvent:
    """A rule changed state on one GPU."""

    state: str  # EXCEEDED or CLEARED
    rule: Rule
    gpu: str  # UUID
    index: int | None
    value: float | None
    ts: float
    # when the condition started to hold
    since: float
    hostname: str = ""
    node_id: str = ""
    gpu_name: str | None = None

    @property
    def event(self) -> str:
        """The fleet event name: ``threshold_exceeded`` or ``threshold_cleared``."""
        return f"threshold_{self.state}"

    @property
    def message(self) -> str:
        r = self.rule
        where = f"{self.hostname} GPU {self.index if self.index is not None else self.gpu}"
        if r.metric == "lost":
            what = "lost" if self.state == EXCEEDED else "back"
            return f"{where} {what} ({r.spec})"
        reading = f"{r.metric} {format_value(self.value, r.unit)}"
        if self.state == EXCEEDED:
            dur = f" for {_fmt_num(r.duration)}s" if r.duration else ""
            return f"{where} {reading} {r.op} {format_value(r.limit, r.unit)}{dur} ({r.spec})"
        return f"{where} {reading}: cleared ({r.spec})"

    def to_dict(self) -> dict[str, Any]:
        """The ``threshold`` event data of docs/wire-format.md, plus context for displays."""
        return {
            "state": self.state,
            "rule": self.rule.name,
            "expr": self.rule.text,
            "metric": self.rule.metric,
            "limit": self.rule.limit,
            "unit": self.rule.unit,
            "gpu": self.gpu,
            "index": self.index,
            "name": self.gpu_name,
            "value": self.value,
            "ts": self.ts,
            "since": self.since,
            "hostname": self.hostname,
            "node_id": self.node_id,
            "message": self.message,
        }


@dataclass
class _Known:
    index: int
    name: str | None


@dataclass
class ThresholdEngine:
    """Evaluates rules on each sample.  Not thread-safe; call :meth:`update` from one task."""

    rules: Sequence[Rule]
    _pending: dict[tuple[int, str], float] = field(default_factory=dict, repr=False)  # -> since
    _active: dict[tuple[int, str], ThresholdEvent] = field(default_factory=dict, repr=False)
    _known: dict[str, _Known] = field(default_factory=dict, repr=False)

    def update(self, snap: HostSnapshot, now: float | None = None) -> list[ThresholdEvent]:
        """Evaluate every rule on every GPU of ``snap``; return the state changes, oldest rule first."""
        now = snap.timestamp if now is None else now
        events: list[ThresholdEvent] = []
        present = {g.uuid for g in snap.gpus}
        for g in snap.gpus:
            self._known[g.uuid] = _Known(g.index, g.name)
            for k, rule in enumerate(self.rules):
                self._step(k, rule, g.uuid, g.index, g.name, rule.value(g), snap, now, events)
        for uuid, known in self._known.items():
            if uuid in present:
                continue
            for k, rule in enumerate(self.rules):
                value = 1.0 if rule.metric == "lost" else None
                key = (k, uuid)
                # vanished: its readings are gone
                if value is None and key in self._active:
                    self._pending.pop(key, None)
                    events.append(self._event(CLEARED, rule, uuid, known.index, known.name, None, snap, now,
                                              self._active.pop(key).since))
                    continue
                self._step(k, rule, uuid, known.index, known.name, value, snap, now, events)
        return events

    def _step(self, k: int, rule: Rule, uuid: str, index: int, name: str | None, value: float | None,
              snap: HostSnapshot, now: float, events: list[ThresholdEvent]) -> None:
        key = (k, uuid)
        if value is None:
            self._pending.pop(key, None)
            return
        if rule.holds(value):
            if key in self._active:
                return
            since = self._pending.setdefault(key, now)
            if now - since >= rule.duration:
                ev = self._event(EXCEEDED, rule, uuid, index, name, value, snap, now, since)
                self._active[key] = ev
                self._pending.pop(key, None)
                events.append(ev)
        else:
            self._pending.pop(key, None)
            fired = self._active.pop(key, None)
            if fired is not None:
                events.append(self._event(CLEARED, rule, uuid, index, name, value, snap, now, fired.since))

    @staticmethod
    def _event(state: str, rule: Rule, uuid: str, index: int, name: str | None, value: float | None,
               snap: HostSnapshot, now: float, since: float) -> ThresholdEvent:
        return ThresholdEvent(state=state, rule=rule, gpu=uuid, index=index, value=value, ts=now, since=since,
                              hostname=snap.hostname, node_id=snap.node_id, gpu_name=name)

    def active(self) -> list[ThresholdEvent]:
        """The rules exceeded right now (their ``exceeded`` events), by GPU index then rule."""
        return sorted(self._active.values(), key=lambda e: (e.index if e.index is not None else -1, e.rule.name))
