"""The layout rules of docs/architecture.md, checked on the source: who may import whom."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src"  # tests/ sits beside src/
PKG = SRC / "gpusd"


def _module_name(path: Path) -> str:
    rel = path.relative_to(SRC).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path: Path, me: str | None = None) -> set[str]:
    """Every gpusd module ``path`` imports, at run time or for type checking (lazy imports included)."""
    me = me or _module_name(path)
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


# Which gpusd packages each package may import (docs/architecture.md).  Core modules are the leaves.
CORE = {"model", "units", "errors", "ids", "identity", "sanitize", "topology", "_version"}
ALLOWED: dict[str, set[str]] = {
    **{c: CORE for c in CORE},
    "wire": CORE,
    "inventory": CORE,
    "thresholds": CORE,
    "alloc": CORE | {"inventory"},
    "jobs": CORE | {"inventory", "alloc"},
    "discovery": CORE | {"wire"},
    "usage": CORE,
    "daemon": CORE | {"wire", "inventory", "alloc", "discovery", "thresholds", "usage", "jobs", "slurm"},
    "views": CORE | {"wire", "inventory", "alloc", "discovery", "thresholds", "usage", "jobs"},
    "engines": CORE | {"alloc"},
    "pool": CORE | {"wire", "inventory", "alloc", "discovery", "engines"},
    "slurm": CORE | {"alloc"},
}
# Known, documented exceptions: (importing module, imported module).
EXCEPTIONS = {("gpusd.errors", "gpusd.cli"), ("gpusd.errors", "gpusd.cli.exits")}  # deprecated EXIT_* names


def _part(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def layer_violations(files: list[tuple[str, Path]] | None = None) -> list[str]:
    out = []
    for me, path in files if files is not None else [(_module_name(p), p) for p in sorted(PKG.rglob("*.py"))]:
        allowed = ALLOWED.get(_part(me))
        if allowed is None:  # cli, the top level and __main__ may import anything
            continue
        for target in sorted(imports_of(path, me)):
            part = _part(target)
            if part in ("", _part(me)) or part in allowed or (me, target) in EXCEPTIONS:
                continue
            if not (PKG / part).is_dir() and not (PKG / f"{part}.py").exists():
                continue  # "from .model import X" also yields "gpusd.model.X": X is a name, not a module
            out.append(f"{me} imports {target}")
    return out


def test_packages_import_only_what_docs_architecture_allows() -> None:
    assert layer_violations() == []


def test_every_package_is_described_in_docs_architecture() -> None:
    text = (SRC.parent / "docs" / "architecture.md").read_text()
    packages = {p.name for p in PKG.iterdir() if p.is_dir() and not p.name.startswith("__")}
    packages |= {p.stem for p in PKG.glob("*.py") if not p.stem.startswith("__") and p.stem != "_local"}
    missing = [name for name in sorted(packages) if f"`{name}`" not in text]
    assert missing == []


def test_the_rule_check_catches_a_forbidden_import(tmp_path: Path) -> None:
    """A wire module importing the daemon lazily, or discovery importing views, is reported (the check
    is not vacuous); an allowed import is not."""
    probe = tmp_path / "probe.py"
    probe.write_text("from ..model import GpuInfo\n\ndef f():\n    from ..daemon import service\n")
    assert layer_violations([("gpusd.wire.probe", probe)]) == ["gpusd.wire.probe imports gpusd.daemon",
                                                              "gpusd.wire.probe imports gpusd.daemon.service"]
    probe.write_text("import gpusd.views.top\n")
    assert layer_violations([("gpusd.discovery.probe", probe)]) == ["gpusd.discovery.probe imports gpusd.views.top"]
