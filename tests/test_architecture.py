"""The layout rules of docs/architecture.md, checked on the source: who may import whom."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src"
PKG = SRC / "gpusd"


def _module_name(path: Path) -> str:
    rel = path.relative_to(SRC).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path: Path) -> set[str]:
    """Every gpusd module ``path`` imports, at run time or for type checking (lazy imports included)."""
    me = _module_name(path)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            out.add(mod)
            # "from . import x" / "from .pkg import mod": the names may be modules too
            out.update(f"{mod}.{a.name}" for a in node.names)
    return {m for m in out if m == "gpusd" or m.startswith("gpusd.")}


def test_the_daemon_parts_never_import_the_daemon_object() -> None:
    """The announcer, the fleet client and the HTTP handlers get the config and an identity, not
    the Daemon: only the package's lazy export and the process manager import daemon/service.py."""
    allowed = {"gpusd.daemon", "gpusd.daemon.process"}
    offenders = {
        _module_name(p)
        for p in PKG.rglob("*.py")
        if "gpusd.daemon.service" in imports_of(p) and _module_name(p) not in allowed
        and not _module_name(p).startswith("gpusd.cli")
    }
    assert offenders == set()


def test_import_scanner_sees_relative_and_lazy_imports() -> None:
    """The scanner the layout tests rely on finds a lazy relative import inside a function."""
    assert "gpusd.daemon.service" in imports_of(PKG / "daemon" / "process.py")
    assert "gpusd.wire.sse" in imports_of(PKG / "daemon" / "fleet.py")
