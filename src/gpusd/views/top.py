"""``gpusd top``: rendering the fleet with rich, and the view's state (sort, filter, keys).

:func:`render` turns a list of :class:`HostView` into one frame for a given terminal width:

* wide (about 120 columns and more): model, utilisation and memory bars, temperature, power,
  processes, leases and alerts;
* medium (about 75 and more): shorter bars, process and lease counts;
* narrow (40 and more): one compact row per GPU (utilisation and memory bars, temperature);
* tiny (under 40): one line of text per GPU.

A host that vanished stays on screen, dimmed and marked ``gone``, for ``HostBook.keep_gone`` seconds.

Every string from a host (its name, GPU names, users, commands, errors) is hostile: it goes through
:func:`gpusd.sanitize.for_terminal` and reaches rich only inside :class:`rich.text.Text` objects,
never as a plain ``str`` cell (which rich would parse as markup).
The live loop with keyboard handling is in :mod:`gpusd.views.live`.
"""

# Imports inside functions: optional or heavy packages.
from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from typing import TYPE_CHECKING, Any

from ..model import GpuInfo, display_name, shown_name
from ..sanitize import for_terminal
from ..units import format_bytes
from ..wire.fleet import RECORD_FIELDS, HostRecord
from .tables import container_tag

if TYPE_CHECKING:  # pragma: no cover
    from rich.console import RenderableType
    from rich.text import Text

    from ..thresholds import ThresholdEngine

SORT_KEYS = ("host", "util", "memory", "temp", "power", "free")
# characters of a host or GPU name shown
NAME_MAX = 64
# a user name or a command's program name
WORD_MAX = 32

_SORT_LABEL = {"host": "host/index", "util": "utilisation", "memory": "memory used", "temp": "temperature",
               "power": "power", "free": "free memory"}


@dataclass
class HostView(HostRecord):
    """One host as ``gpusd top`` shows it: the host record (:class:`gpusd.wire.fleet.HostRecord`), and
    what the screen remembers of it."""

    # time.time() when it vanished
    gone_since: float | None = None
    # GPU UUID -> exceeded rule names
    alerts: dict[str, list[str]] = field(default_factory=dict)
    # GPU UUID -> utilisation sparkline (views.spark)
    spark: dict[str, str] = field(default_factory=dict)
    # GPU UUID -> memory sparkline
    spark_mem: dict[str, str] = field(default_factory=dict)
    # the sparklines' window
    spark_label: str = "1h"

    @classmethod
    def of(cls, host: HostRecord, **changes: Any) -> HostView:
        """The view of ``host`` (a fleet view's record, a discovery client's host), with ``changes``."""
        fields_ = {name: getattr(host, name) for name in RECORD_FIELDS}
        fields_.update(changes)
        return cls(**fields_)

    @property
    def key(self) -> str:
        return self.node_id or self.hostname


class HostBook:
    """Remembers hosts across refreshes so a vanished host is shown as gone instead of jumping out,
    and (optionally) runs threshold rules on every snapshot seen."""

    def __init__(self, keep_gone: float = 60.0, engine_factory: Callable[[], ThresholdEngine] | None = None) -> None:
        self.keep_gone = keep_gone
        self._hosts: dict[str, HostView] = {}
        self._engines: dict[str, ThresholdEngine] = {}
        self._engine_factory = engine_factory
        # host -> (uuid, rule) -> rule name
        self._alerts: dict[str, dict[tuple[str, str], str]] = {}

    def update(self, seen: Iterable[HostView], now: float | None = None) -> list[HostView]:
        now = time.time() if now is None else now
        present = set()
        for h in seen:
            present.add(h.key)
            if not h.alive and h.gone_since is None:
                prev = self._hosts.get(h.key)
                h.gone_since = prev.gone_since if prev is not None and prev.gone_since else now
            if h.snapshot is None and h.key in self._hosts:
                h.snapshot = self._hosts[h.key].snapshot
            if h.alive and h.snapshot is not None:
                self._evaluate(h, now)
            h.alerts = self._alert_map(h.key)
            self._hosts[h.key] = h
        for key, h in list(self._hosts.items()):
            if key in present:
                continue
            if h.alive:
                h.alive, h.gone_since = False, now
            if h.gone_since is not None and now - h.gone_since > self.keep_gone:
                del self._hosts[key]
                self._engines.pop(key, None)
                self._alerts.pop(key, None)
        return list(self._hosts.values())

    def _evaluate(self, h: HostView, now: float) -> None:
        if self._engine_factory is None or h.snapshot is None:
            return
        engine = self._engines.get(h.key)
        if engine is None:
            engine = self._engines[h.key] = self._engine_factory()
        engine.update(h.snapshot, now)
        self._alerts[h.key] = {(e.gpu, e.rule.name): e.rule.name for e in engine.active()}

    def _alert_map(self, key: str) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {}
        for (uuid, _), name in sorted(self._alerts.get(key, {}).items()):
            out.setdefault(uuid, []).append(name)
        return out


@dataclass
class TopState:
    """Sort order, filter and the key handling of the live view."""

    sort: str = "host"
    reverse: bool = False
    filter: str = ""
    editing: bool = False  # typing a filter
    draft: str = ""
    help: bool = False
    # first line shown when the frame is taller than the terminal
    offset: int = 0

    def key(self, k: str) -> bool:
        """Handle one key; return False to quit."""
        if self.editing:
            if k in ("\r", "\n"):
                self.filter, self.editing = self.draft.strip(), False
            elif k == "\x1b":
                self.editing, self.draft = False, self.filter
            elif k in ("\x7f", "\b"):
                self.draft = self.draft[:-1]
            elif k == "\x15":  # ctrl-u
                self.draft = ""
            elif k.isprintable():
                self.draft += k
            return True
        if k in ("q", "Q", "\x03", "\x04"):
            return False
        if k == "s":
            self.sort = SORT_KEYS[(SORT_KEYS.index(self.sort) + 1) % len(SORT_KEYS)]
        elif k == "S":
            self.sort = SORT_KEYS[(SORT_KEYS.index(self.sort) - 1) % len(SORT_KEYS)]
        elif k == "r":
            self.reverse = not self.reverse
        elif k in ("/", "f"):
            # a new filter (the old one stays until Enter; Esc keeps it)
            self.editing, self.draft = True, ""
        elif k == "\x1b":
            # closes the help first, then clears the filter
            if self.help:
                self.help = False
            else:
                self.filter = ""
        elif k in ("h", "?"):
            self.help = not self.help
        elif k in ("j", "DOWN"):
            self.offset += 1
        elif k in ("k", "UP"):
            self.offset = max(0, self.offset - 1)
        elif k == "PGDN":
            self.offset += 10
        elif k == "PGUP":
            self.offset = max(0, self.offset - 10)
        elif k == "HOME":
            self.offset = 0
        return True

    @property
    def active_filter(self) -> str:
        return self.draft if self.editing else self.filter


def _sort_value(g: GpuInfo, key: str) -> float:
    """Bigger means 'more' (shown first when sorting by a metric); missing readings sort last."""
    if key == "util":
        v = g.utilization_gpu
    elif key == "memory":
        v = g.memory_used_ratio
    elif key == "temp":
        v = g.temperature
    elif key == "power":
        v = g.power_draw
    elif key == "free":
        v = g.memory_available
    else:
        return -float(g.index)
    v = None if v is None else _finite(float(v))
    return float("-inf") if v is None else v


def _matches(h: HostView, g: GpuInfo, terms: Sequence[str]) -> bool:
    """Every term is a substring of one of the GPU's fields, or (with ``*?[``) a glob matching one
    whole field; the model is matched as shown (:func:`gpusd.model.display_name`) and in full."""
    fields = [f.lower() for f in filter(None, [
        h.hostname, h.node_id, display_name(g.name), g.name, g.uuid, f"#{g.index}", g.pci_bus_id,
        *(p.user or "" for p in g.processes), *(p.command or "" for p in g.processes),
        *(le.user or "" for le in g.leases), *h.alerts.get(g.uuid, ()),
        "lost unhealthy" if not g.healthy else "", "gone" if not h.alive else "",
    ])]
    hay = " ".join(fields)
    for t in terms:
        if any(c in t for c in "*?["):
            if not any(fnmatchcase(f, t) for f in fields):
                return False
        elif t not in hay:
            return False
    return True


def arrange(hosts: Iterable[HostView], state: TopState) -> list[tuple[HostView, list[GpuInfo]]]:
    """Hosts and their GPUs in display order, filtered.  GPUs are sorted within their host; hosts by
    name, or by their top GPU when sorting by a metric."""
    terms = state.active_filter.lower().split()
    out = []
    for h in hosts:
        gpus = list(h.snapshot.gpus) if h.snapshot is not None else []
        if terms:
            gpus = [g for g in gpus if _matches(h, g, terms)]
            if not gpus and not all(t in f"{h.hostname} {h.node_id}".lower() for t in terms):
                continue
        if state.sort == "host":
            gpus.sort(key=lambda g: g.index, reverse=state.reverse)
        else:
            gpus.sort(key=lambda g: (_sort_value(g, state.sort), -g.index), reverse=not state.reverse)
        out.append((h, gpus))
    if state.sort == "host":
        out.sort(key=lambda hg: (hg[0].hostname.lower(), hg[0].node_id), reverse=state.reverse)
    else:
        def top(hg: tuple[HostView, list[GpuInfo]]) -> float:
            return max((_sort_value(g, state.sort) for g in hg[1]), default=float("-inf"))

        out.sort(key=lambda hg: (top(hg), hg[0].hostname.lower()), reverse=not state.reverse)
    return out


# ----------------------------------------------------------------------------------------- drawing

def _finite(v: float | None) -> float | None:
    return None if v is None or not math.isfinite(v) else v


def _level_style(pct: float | None) -> str:
    if pct is None:
        return "dim"
    if pct >= 90:
        return "bold red"
    if pct >= 70:
        return "yellow"
    return "green"


def bar(pct: float | None, width: int) -> Text:
    """``███████░░░░  63%``: a bar ``width`` cells wide followed by the percentage."""
    from rich.text import Text

    pct = _finite(pct)
    if pct is None:
        return Text("-".rjust(width + 5), style="dim")
    pct = max(0.0, min(100.0, pct))
    cells = pct / 100 * width
    full = int(cells)
    part = " ▏▎▍▌▋▊▉"[int((cells - full) * 8)] if full < width else ""
    filled = "█" * full + (part if part.strip() else "")
    t = Text(filled, style=_level_style(pct))
    t.append("░" * (width - len(filled)), style="bright_black")
    t.append(f" {pct:3.0f}%")
    return t


def _temp(g: GpuInfo) -> Text:
    from rich.text import Text

    if g.temperature is None:
        return Text("-", style="dim")
    style = "bold red" if g.temperature >= 85 else "yellow" if g.temperature >= 75 else ""
    return Text(f"{g.temperature}°C", style=style)


def _power(g: GpuInfo) -> str:
    draw, limit = _finite(g.power_draw), _finite(g.power_limit)
    if draw is None:
        return "-"
    if limit:
        return f"{draw:.0f}/{limit:.0f}W"
    return f"{draw:.0f}W"


def _short_name(name: str | None, vendor: str = "nvidia") -> str:
    """The shown name, with the vendor for a GPU that is not NVIDIA's (``MI300X [amd]``)."""
    return for_terminal(shown_name(for_terminal(name, 4 * NAME_MAX), vendor), NAME_MAX)


def _procs(g: GpuInfo, limit: int = 2) -> str:
    if not g.processes:
        return "-"
    parts = []
    for p in g.processes[:limit]:
        cmd = for_terminal(for_terminal(p.command, 1024).split(" ", 1)[0].rsplit("/", 1)[-1], WORD_MAX)
        who = for_terminal(p.user, WORD_MAX) or f"pid {p.pid}"
        what = f" {cmd}" if cmd else ""
        mem = f" {format_bytes(p.used_memory)}" if p.used_memory is not None else ""
        parts.append(f"{who}{what}{mem}{container_tag(p)}{f' unleased (gpusd adopt {p.pid})' if p.unleased else ''}")
    more = f" +{len(g.processes) - limit}" if len(g.processes) > limit else ""
    return ", ".join(parts) + more


def _leases(g: GpuInfo) -> str:
    if not g.leases:
        return "-"
    return ", ".join(f"{for_terminal(le.user, WORD_MAX) or 'pid ' + str(le.pid)}{' (shared)' if le.shared else ''}"
                     f"{_until(le.expires)}{' job ' + (for_terminal(le.job, 12) or '') if le.job else ''}"
                     f"{' not through the authority' if le.outside_authority else ''}"
                     f"{' OVER CAP' if le.over_cap else ''}"
                     for le in g.leases)


def _until(expires: float | None) -> str:
    """A remote lease's expiry (docs/pool.md), as the local clock reads it."""
    if expires is None:
        return ""

    return " until " + time.strftime("%H:%M:%S", time.localtime(expires))


def _mem_text(g: GpuInfo) -> str:
    if g.memory_total is None:
        return ""
    # unified memory: the host's
    shared = " shared" if g.memory_shared else ""
    return f" {format_bytes(g.memory_used)}/{format_bytes(g.memory_total)}{shared}"


def _host_header(h: HostView, gpus: Sequence[GpuInfo], now: float, width: int) -> Text:
    from rich.text import Text

    snap = h.snapshot
    t = Text()
    name = for_terminal(h.hostname, NAME_MAX) or "?"
    if not h.alive:
        ago = f" {now - h.gone_since:.0f}s ago" if h.gone_since else ""
        t.append(f"✖ {name}", style="bold bright_black")
        t.append(f"  gone{ago}", style="red")
        return t
    t.append("● ", style="green")
    t.append(name, style="bold cyan")
    # did not prove it holds the fleet secret (a stranger?): no private fields
    if h.verified is False:
        t.append("  [unverified]", style="bold yellow")
    if snap is None:
        t.append("  waiting for data…", style="dim")
        return t
    all_gpus = snap.gpus
    free = sum(1 for g in all_gpus if g.is_free)
    shown = f"{len(gpus)}/{len(all_gpus)}" if len(gpus) != len(all_gpus) else str(len(all_gpus))
    t.append(f"  {shown} GPU{'s' if len(all_gpus) != 1 else ''}, {free} free")
    if width >= 72:
        t.append(f"  driver {for_terminal(snap.driver_version, WORD_MAX) or '-'}  "
                 f"CUDA {for_terminal(snap.cuda_version, WORD_MAX) or '-'}", style="dim")
    if snap.simulated:
        t.append("  [SIMULATED]" if width >= 40 else " SIM", style="magenta")
    ahead = sorted((b for b in snap.bookings if b.end > now), key=lambda b: b.start)
    # the next booking of the host (docs/pool.md, "Time")
    if ahead:
        b = ahead[0]
        span = f"{time.strftime('%H:%M', time.localtime(b.start))}-{time.strftime('%H:%M', time.localtime(b.end))}"
        gpus_b = ",".join(str(i) for i in b.indices[:16])
        t.append(f"  {'held' if b.held else 'booked'} GPU {gpus_b} {span}"
                 + (f" +{len(ahead) - 1}" if len(ahead) > 1 else ""), style="yellow")
    age = now - snap.timestamp
    if age > 10:
        t.append(f"  stale {age:.0f}s", style="yellow")
    t.truncate(width, overflow="ellipsis")
    return t


def _status(g: GpuInfo, alerts: Sequence[str]) -> Text | None:
    from rich.text import Text

    if not g.healthy:
        return Text(f"LOST: {for_terminal(g.error, 2 * NAME_MAX) or 'unhealthy'}", style="bold red")
    if alerts:
        return Text("⚠ " + ", ".join(for_terminal(a, NAME_MAX) for a in alerts), style="bold red")
    return None


@dataclass
class _Layout:
    """How GPUs are drawn at one terminal width; column widths are shared by every host's table so
    the columns line up down the screen."""

    # "wide", "medium" or "narrow"
    kind: str
    bar: int = 8
    model: int = 14
    mem_text: int = 0
    power: int = 8
    procs: int = 0
    leases: int = 0
    # the utilisation sparkline's column (wide layout, when there is history)
    spark: int = 0
    # the memory sparkline's column (wide layout, when there is room)
    spark_mem: int = 0
    spark_label: str = "1h"

    @classmethod
    def of(cls, arranged: Sequence[tuple[HostView, list[GpuInfo]]], width: int) -> _Layout:
        gpus = [(h, g) for h, gs in arranged for g in gs]
        names = max((len(_short_name(g.name, g.vendor)) for _, g in gpus), default=5)
        power = max(5, max((len(_power(g)) for _, g in gpus), default=5))
        mem_text = max((len(_mem_text(g)) for _, g in gpus), default=0)
        procs = max(9, max((len(_procs(g)) for _, g in gpus), default=9))
        leases = max(15, max((len(_last_cell(h, g).plain) for h, g in gpus), default=15))
        spark = max((len(h.spark.get(g.uuid, "")) for h, g in gpus), default=0)
        label = next((h.spark_label for h, _ in gpus), "1h")
        # wide: 8 columns, 2 cells between columns; processes and leases get at least 12/15 cells
        for bar_w in (20, 12):
            model = max(5, min(names, 24))
            fixed = 2 + model + 2 * (bar_w + 5) + mem_text + 5 + power + 7 * 2
            room = width - fixed
            sp = spark if spark and room >= 12 + 15 + spark + 2 else 0
            room -= sp + 2 if sp else 0
            sm = sp if sp and room >= 12 + 15 + sp + 2 else 0
            room -= sm + 2 if sm else 0
            if room >= 12 + 15:
                p = min(procs, max(12, room - min(leases, room // 2)))
                return cls("wide", bar_w, model, mem_text, power, p, room - p, sp, sm, label)
        model = max(5, min(names, 14))
        for bar_w in (12, 8):
            if 2 + model + 2 * (bar_w + 5) + 5 + power + 5 + 6 * 2 <= width:
                return cls("medium", bar_w, model, 0, power)
        return cls("narrow", 8 if width >= 56 else 4)


def _last_cell(h: HostView, g: GpuInfo) -> Text:
    from rich.text import Text

    status = _status(g, h.alerts.get(g.uuid, []))
    if status is None:
        return Text(_leases(g))
    if not g.leases:
        return status
    return Text(_leases(g) + "  ").append_text(status)


def _gpu_table(h: HostView, gpus: Sequence[GpuInfo], lay: _Layout) -> RenderableType:
    from rich import box
    from rich.table import Table
    from rich.text import Text

    dim = not h.alive
    wide = lay.kind == "wide"
    table = Table(box=box.SIMPLE_HEAD, expand=False, show_edge=False, pad_edge=False, padding=(0, 1, 0, 0),
                  style="bright_black" if dim else "", header_style="bold")
    table.add_column("#", justify="right", no_wrap=True, width=2)
    table.add_column("MODEL", no_wrap=True, overflow="ellipsis", width=lay.model)
    table.add_column("UTIL", no_wrap=True, width=lay.bar + 5)
    if lay.spark:
        table.add_column(f"UTIL {lay.spark_label}", no_wrap=True, width=lay.spark)
    table.add_column("MEMORY", no_wrap=True, width=lay.bar + 5 + lay.mem_text)
    if lay.spark_mem:
        table.add_column(f"MEM {lay.spark_label}", no_wrap=True, width=lay.spark_mem)
    table.add_column("TEMP", justify="right", no_wrap=True, width=5)
    table.add_column("POWER", justify="right", no_wrap=True, width=lay.power)
    if wide:
        table.add_column("PROCESSES", overflow="ellipsis", no_wrap=True, width=lay.procs)
        table.add_column("LEASES / ALERTS", overflow="ellipsis", no_wrap=True, width=lay.leases)
    else:
        table.add_column("P/L", justify="right", no_wrap=True, width=5)
    for g in gpus:
        alerts = h.alerts.get(g.uuid, [])
        status = _status(g, alerts)
        style = "bright_black" if dim else None
        idx = Text(str(g.index), style="bold red" if status is not None and not dim else "")
        if not g.healthy:
            row: list[RenderableType] = [idx, Text(_short_name(g.name, g.vendor)), status or "", "", "", ""]
            row += ["", ""] if wide else [""]
            row[3:3] = [""] if lay.spark else []
            if lay.spark_mem:
                row.insert(5 if lay.spark else 4, "")
            table.add_row(*row, style=style)
            continue
        mem_pct = None if g.memory_used_ratio is None else 100 * g.memory_used_ratio
        mem = bar(mem_pct, lay.bar)
        if wide:
            mem.append(_mem_text(g), style="dim")
        row = [idx, Text(_short_name(g.name, g.vendor)), bar(g.utilization_gpu, lay.bar), mem, _temp(g),
               Text(_power(g))]
        if lay.spark:
            row.insert(3, Text(h.spark.get(g.uuid, ""), style="cyan"))
        if lay.spark_mem:
            row.insert(5 if lay.spark else 4, Text(h.spark_mem.get(g.uuid, ""), style="magenta"))
        if wide:
            row += [Text(_procs(g)), _last_cell(h, g)]
        else:
            pl = f"{len(g.processes)}/{len(g.leases)}"
            row += [Text(pl + (" ⚠" if alerts else ""), style="bold red" if alerts else "")]
        table.add_row(*row, style=style)
    return table


def _narrow_lines(h: HostView, gpus: Sequence[GpuInfo], width: int, lay: _Layout) -> list[Text]:
    from rich.text import Text

    lines = []
    for g in gpus:
        t = Text(f"{g.index:>2} ")
        if not g.healthy:
            t.append("LOST", style="bold red")
        else:
            mem_pct = None if g.memory_used_ratio is None else 100 * g.memory_used_ratio
            if width >= 40:
                t.append("U ")
                t.append_text(bar(g.utilization_gpu, lay.bar))
                t.append(" M ")
                t.append_text(bar(mem_pct, lay.bar))
            else:
                util = _finite(g.utilization_gpu)
                u = "-" if util is None else f"{util:.0f}%"
                m = "-" if mem_pct is None else f"{mem_pct:.0f}%"
                t.append(f"u{u} m{m}")
            t.append(" ")
            t.append_text(_temp(g))
            if h.alerts.get(g.uuid):
                t.append(" ⚠", style="bold red")
        if not h.alive:
            t.stylize("bright_black")
        t.truncate(width, overflow="ellipsis")
        lines.append(t)
    return lines


def render(hosts: Iterable[HostView], state: TopState | None = None, width: int = 120,
           now: float | None = None, title: str = "gpusd top", footer: bool = True,
           message: str | None = None, keys: bool = True) -> RenderableType:
    """One frame of ``gpusd top`` for a terminal ``width`` columns wide (``footer``: with the sort,
    filter and key line, the keys only with ``keys``; ``message``: an error line under the title)."""
    from rich.console import Group
    from rich.text import Text

    state = state or TopState()
    now = time.time() if now is None else now
    arranged = arrange(hosts, state)
    parts: list[RenderableType] = [_title(arranged, state, width, now, title)]
    if message:
        parts.append(Text(for_terminal(message, 4 * width), style="bold red", overflow="ellipsis", no_wrap=True))
    if not arranged:
        parts.append(Text("no hosts match the filter" if state.active_filter else "no hosts found (yet)",
                          style="yellow"))
    lay = _Layout.of(arranged, width)
    for h, gpus in arranged:
        parts.append(_host_header(h, gpus, now, width))
        if not gpus:
            continue
        if lay.kind == "narrow":
            parts.extend(_narrow_lines(h, gpus, width, lay))
        else:
            parts.append(_gpu_table(h, gpus, lay))
    if footer:
        parts.append(footer_line(state, width, keys))
    return Group(*parts)


HELP = ("keys: q quit · s/S next/previous sort · r reverse · / or f new filter (Enter apply, Esc cancel) · "
        "Esc close help, clear filter · ↑/↓ j/k PgUp/PgDn scroll · h help.  "
        "Filter terms match host, model, UUID, #index, users, commands, "
        "alerts, 'lost', 'gone'.")


def _title(arranged: Sequence[tuple[HostView, list[GpuInfo]]], state: TopState, width: int, now: float,
           title: str) -> Text:
    from rich.text import Text

    n_hosts = sum(1 for h, _ in arranged if h.alive)
    gpus = [g for h, gs in arranged if h.alive for g in gs]
    free = sum(1 for g in gpus if g.is_free)
    util = [u for u in (_finite(g.utilization_gpu) for g in gpus) if u is not None]
    t = Text(title, style="bold")
    t.append(f"  {n_hosts} host{'s' if n_hosts != 1 else ''}, {len(gpus)} GPU{'s' if len(gpus) != 1 else ''}, "
             f"{free} free")
    if util and width >= 60:
        t.append(f", mean util {sum(util) / len(util):.0f}%")
    if width >= 72:
        t.append("  " + time.strftime("%H:%M:%S", time.localtime(now)), style="dim")
    t.truncate(width, overflow="ellipsis")
    return t


def footer_line(state: TopState, width: int, keys: bool = True) -> RenderableType:
    """The bottom line: sort order, filter, keys (and the key help when toggled with ``h``); without
    ``keys`` (``top --once``: nothing reads them) sort and filter only."""
    from rich.text import Text

    arrow = "↑" if (state.reverse if state.sort != "host" else not state.reverse) else "↓"
    t = Text()
    t.append("sort ", style="dim")
    t.append(f"{_SORT_LABEL[state.sort] if width >= 60 else state.sort} {arrow}", style="bold")
    if state.editing:
        t.append("  filter: ", style="dim")
        t.append(state.draft + "▏", style="bold reverse")
    elif state.filter:
        t.append("  filter: ", style="dim")
        t.append(state.filter, style="bold yellow")
    if not keys:
        pass
    elif width >= 72:
        t.append("   q quit  s sort  r reverse  / filter  h help", style="dim")
    elif width >= 40:
        t.append("  q s r / h", style="dim")
    t.truncate(width, overflow="ellipsis")
    if state.help and keys:
        from rich.console import Group

        return Group(Text(HELP, style="dim"), t)
    return t


def render_text(hosts: Iterable[HostView], state: TopState | None = None, width: int = 120,
                color: bool = False, now: float | None = None) -> str:
    """One frame as a string (``gpusd top --once``)."""
    from rich.console import Console

    console = Console(width=width, record=False, force_terminal=color, no_color=not color,
                      color_system="truecolor" if color else None, legacy_windows=False, highlight=False)
    with console.capture() as cap:
        console.print(render(hosts, state, width=width, now=now, keys=False))
    return "\n".join(line.rstrip() for line in cap.get().splitlines()) + "\n"
