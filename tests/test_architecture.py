"""docs/architecture.md checked against the source: who may import whom, and every package and module named.

The rules are the doc's ``layers`` block (the map at its top): one line per part of gpusd (a package, a
top-level module, or ``core``), ``PART ─▶ the parts it may import``.  The code is checked against the
block (no import the block does not allow), and the block against the code (no allowed edge left unused
without a note, no part the code lacks).  Every module must be named in its package's paragraph.  A
failure says which line of the doc to add or change.
"""

from __future__ import annotations

import ast
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src"  # tests/ sits beside src/
PKG = SRC / "gpusd"
DOC = SRC.parent / "docs" / "architecture.md"


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
            # "from . import x" / "from .pkg import mod": the names may be modules too; where all are,
            # the modules are what is imported (a package's __init__ is loaded by any of its modules)
            names = [f"{mod}.{a.name}" for a in node.names]
            if not all(_is_module(n) for n in names):
                out.add(mod)
            out.update(names)
    return {m for m in out if m == "gpusd" or m.startswith("gpusd.")}


def _is_module(name: str) -> bool:
    """``gpusd.a.b`` names a module or package of the source (not a name inside one)."""
    rel = Path(*name.split(".")[1:]) if "." in name else Path()
    return (PKG / rel).is_dir() or (PKG / rel).with_suffix(".py").exists()


# -- the doc's rules ---------------------------------------------------------------------------------


@dataclass
class Rules:
    core: set[str] = field(default_factory=set)  # the core's modules: one part
    allowed: dict[str, set[str]] = field(default_factory=dict)  # part -> parts it may import ("*": any)
    unused: dict[str, set[str]] = field(default_factory=dict)  # allowed edges noted as unused today
    exceptions: set[tuple[str, str]] = field(default_factory=set)  # (module, module or package it may import)

    def part(self, module: str) -> str:
        """The part a module belongs to: ``gpusd`` (the package's __init__), ``core``, a package, or a
        top-level module."""
        if module == "gpusd":
            return "gpusd"
        top = module.split(".")[1]
        return "core" if top in self.core else top


_ARROW = re.compile(r"^(?P<part>[\w.]+)\s*(?:─▶|->)\s*(?P<targets>[^#]*?)\s*(?:#\s*(?P<note>.*))?$")


def parse_rules(text: str) -> Rules:
    """The ``layers`` block of docs/architecture.md:

    * ``core = model units ...``: the modules of the core, which import only each other;
    * ``PART ─▶ A B C  # note``: PART may import the parts A, B and C (``*``: any part; nothing: none);
      a note ``unused: B (why)`` says an allowed edge no module uses today, and why it stays;
    * ``gpusd.errors ─▶ gpusd.cli.exits  # why``: one module's documented exception to its part's rule.
    """
    block = re.search(r"^```layers\n(.*?)^```", text, re.S | re.M)
    assert block, "docs/architecture.md has no ```layers block (the map the layout tests read)"
    rules = Rules()
    for n, line in enumerate(block.group(1).splitlines(), start=1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("core ="):
            rules.core = set(line.split("=", 1)[1].split("#")[0].split())
            continue
        m = _ARROW.match(line)
        assert m, f"docs/architecture.md, layers block line {n}: cannot read {line!r}"
        part, targets, note = m["part"], set(m["targets"].split()), m["note"] or ""
        if part.startswith("gpusd."):
            for t in targets:
                rules.exceptions |= {(part, t), (part, t.rpartition(".")[0])} if t.count(".") > 1 else {(part, t)}
            continue
        rules.allowed[part] = targets
        unused = re.search(r"unused:\s*([\w\s]+)", note)
        if unused:
            rules.unused[part] = set(unused.group(1).split())
    rules.allowed.setdefault("core", set())
    return rules


def doc_rules() -> Rules:
    return parse_rules(DOC.read_text())


def _source_files() -> list[tuple[str, Path]]:
    return [(_module_name(p), p) for p in sorted(PKG.rglob("*.py"))]


def code_parts(rules: Rules) -> set[str]:
    return {rules.part(me) for me, _ in _source_files()}


def layer_violations(files: list[tuple[str, Path]] | None = None, rules: Rules | None = None) -> list[str]:
    """Every import of the source the doc's rules do not allow, as ``A imports B``."""
    rules = rules or doc_rules()
    out = []
    for me, path in files if files is not None else _source_files():
        mine = rules.part(me)
        allowed = rules.allowed.get(mine, set())
        if "*" in allowed:
            continue
        for target in sorted(imports_of(path, me)):
            theirs = rules.part(target) if target != "gpusd" else "gpusd"
            if theirs == mine or theirs in allowed or (me, target) in rules.exceptions:
                continue
            if not _is_module(target):
                continue  # "from .model import X" also yields "gpusd.model.X": X is a name, not a module
            out.append(f"{me} imports {target}")
    return out


def used_edges(rules: Rules) -> dict[str, set[str]]:
    """part -> the other parts its modules import (exceptions left out)."""
    out: dict[str, set[str]] = {}
    for me, path in _source_files():
        mine = rules.part(me)
        for target in imports_of(path, me):
            if (me, target) in rules.exceptions or not _is_module(target):
                continue
            theirs = rules.part(target)
            if theirs != mine:
                out.setdefault(mine, set()).add(theirs)
    return out


# -- the tests --------------------------------------------------------------------------------------


def test_packages_import_only_what_docs_architecture_allows() -> None:
    """Each line is an import the layers block of docs/architecture.md does not allow: remove the import,
    or (a decision) add the edge to the block and say why in the package's paragraph."""
    assert layer_violations() == []


def test_every_part_of_the_code_has_a_line_in_the_layers_block() -> None:
    rules = doc_rules()
    parts = code_parts(rules)
    missing = sorted(parts - set(rules.allowed))
    assert missing == [], (f"add a line `PART ─▶ ...` to the layers block of docs/architecture.md for {missing}"
                           " (or the module to its `core =` line)")
    gone = sorted(set(rules.allowed) - parts)
    assert gone == [], f"the layers block names parts the code does not have: {gone}"
    named = {t for targets in rules.allowed.values() for t in targets} - {"*"}
    assert sorted(named - parts) == [], "the layers block allows imports of parts the code does not have"
    assert sorted(rules.core - {m.split(".")[1] for m, _ in _source_files() if "." in m}) == []


def test_every_allowed_edge_is_used_or_noted() -> None:
    """The block says exactly what the code does: an allowed edge no module uses is noted ``unused: X (why)``,
    and a noted one that is used has its note dropped."""
    rules, used = doc_rules(), used_edges(doc_rules())
    problems = []
    for part, targets in sorted(rules.allowed.items()):
        if "*" in targets:
            continue
        noted = rules.unused.get(part, set())
        for t in sorted(targets - used.get(part, set()) - noted):
            problems.append(f"{part} ─▶ {t}: no module of {part} imports {t}: drop it or note `unused: {t} (why)`")
        for t in sorted(noted & used.get(part, set())):
            problems.append(f"{part} ─▶ {t}: noted unused, but imported: drop the note")
        for t in sorted(noted - targets):
            problems.append(f"{part}: the note names {t}, which the line does not allow")
    assert problems == []


def _paragraphs(text: str) -> dict[str, str]:
    """Each part's paragraph (starting ``**`part`.**`` or ``**Core: ...**`` / ``**Top level: ...**``), with
    the table that follows it, where one does."""
    out: dict[str, str] = {}
    blocks: list[str] = []
    for block in re.split(r"\n\s*\n", text):
        if block.strip().startswith("|") and blocks:  # a table belongs to the paragraph before it
            blocks[-1] += "\n\n" + block
        else:
            blocks.append(block)
    for para in blocks:
        head = re.match(r"\*\*(.*?)\*\*", para.strip())
        if not head:
            continue
        for name in re.findall(r"`([\w./]+)`", head.group(1)):
            out.setdefault(name.removesuffix(".py").removeprefix("gpusd/"), para)
    return out


def test_every_module_is_named_in_its_packages_paragraph() -> None:
    """A module of package P is named in P's paragraph as `P.mod` or `mod`; a top-level module or a package
    in its own (or the core's) paragraph."""
    text = DOC.read_text()
    paras = _paragraphs(text)
    missing = []
    for me, path in _source_files():
        parts = me.split(".")
        if len(parts) == 1 or parts[-1] == "__main__" and len(parts) == 2:
            continue
        if len(parts) == 2:  # a package or a top-level module: it heads (or is named in) a paragraph
            name = parts[1]
            if name not in paras and f"`{name}`" not in text and f"`{name}.py`" not in text:
                missing.append(f"{me}: name `{name}` in docs/architecture.md (a paragraph of its own, or the core's)")
            continue
        package, mod = parts[1], ".".join(parts[2:])
        if path.name == "__init__.py":
            continue
        para = paras.get(package)
        if para is None:
            missing.append(f"{me}: docs/architecture.md has no paragraph **`{package}`.**")
        elif f"`{package}.{mod}`" not in para and f"`{mod}`" not in para:
            missing.append(f"{me}: add `{package}.{mod}` (what it does) to the paragraph of `{package}` "
                           "in docs/architecture.md")
    assert missing == []


def test_the_modules_the_doc_names_exist() -> None:
    """`pkg.mod` in the doc names a module of the code, or a function or class of the package's
    __init__.py (a renamed or deleted module leaves no stale line)."""
    text = DOC.read_text()
    packages = {p.name for p in PKG.iterdir() if p.is_dir() and (p / "__init__.py").exists()}

    def exists(name: str) -> bool:
        package, _, attr = name.partition(".")
        init = (PKG / package / "__init__.py").read_text()
        return _is_module(f"gpusd.{name}") or re.search(rf"^(?:def|class) {attr}\b", init, re.M) is not None

    stale = sorted({name for name in re.findall(r"`([a-z_]+\.[a-z_]+)`", text)
                    if name.split(".")[0] in packages and not exists(name)})
    assert stale == []


def test_the_job_side_of_the_job_protocol_is_standard_library_only() -> None:
    """gpusd/job.py runs inside users' jobs (docs/jobs.md): it imports nothing of gpusd and nothing outside
    the standard library, at run time or lazily."""
    path = PKG / "job.py"
    assert imports_of(path) == set()
    tops = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            tops |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level:
            tops.add((node.module or "").split(".")[0])
    assert sorted(tops - set(sys.stdlib_module_names) - {"__future__"}) == []


def test_the_per_rank_wrapper_imports_only_the_standard_library_at_start() -> None:
    """engines/rank_gpu.py runs once per rank under mpirun (docs/engines.md): at module level it imports
    the standard library only (a non-NVIDIA rank imports the vendors' rules when it needs them)."""
    tree = ast.parse((PKG / "engines" / "rank_gpu.py").read_text())
    tops = set()
    for node in tree.body:
        if isinstance(node, ast.Import):
            tops |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            tops.add("gpusd" if node.level else (node.module or "").split(".")[0])
    assert sorted(tops - set(sys.stdlib_module_names) - {"__future__"}) == []


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


def test_the_rule_check_catches_a_forbidden_import(tmp_path: Path) -> None:
    """A wire module importing the daemon lazily, or discovery importing views, is reported (the check
    is not vacuous); an allowed import is not."""
    probe = tmp_path / "probe.py"
    probe.write_text("from ..model import GpuInfo\n\ndef f():\n    from ..daemon import service\n")
    assert layer_violations([("gpusd.wire.probe", probe)]) == ["gpusd.wire.probe imports gpusd.daemon.service"]
    probe.write_text("import gpusd.views.top\n")
    assert layer_violations([("gpusd.discovery.probe", probe)]) == ["gpusd.discovery.probe imports gpusd.views.top"]
    probe.write_text("import gpusd.cli\n")
    assert layer_violations([("gpusd.job", probe)]) == ["gpusd.job imports gpusd.cli"]


def test_the_rules_parser_reads_each_kind_of_line() -> None:
    rules = parse_rules("```layers\ncore = model units\nwire ─▶ core\nviews -> core wire  # unused: wire (soon)\n"
                        "gpusd.errors ─▶ gpusd.cli.exits  # the old names\njob ─▶\n```\n")
    assert rules.core == {"model", "units"} and rules.allowed["wire"] == {"core"}
    assert rules.allowed["views"] == {"core", "wire"} and rules.unused["views"] == {"wire"}
    assert rules.allowed["job"] == set()
    assert rules.exceptions == {("gpusd.errors", "gpusd.cli.exits"), ("gpusd.errors", "gpusd.cli")}
    assert rules.part("gpusd.model") == "core" and rules.part("gpusd.wire.txt") == "wire"


def test_every_package_docstring_names_its_modules() -> None:
    """A package's docstring is its table of contents: each module named (``:mod:`.mod```).  The CLI's
    modules, one per group of commands, are listed in docs/architecture.md and docs/cli.md instead."""
    missing = []
    for init in sorted(PKG.glob("*/__init__.py")):
        package = init.parent.name
        if package == "cli":
            continue
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        for mod in sorted(p.stem for p in init.parent.glob("*.py") if p.stem != "__init__"):
            if f":mod:`.{mod}`" not in doc:
                missing.append(f"gpusd.{package}.{mod}: name it in gpusd/{package}/__init__.py's docstring "
                               f"(* :mod:`.{mod}` — what it does)")
    assert missing == []


# -- vendor knowledge behind one seam --------------------------------------------------------------
# Each vendor's rules (visibility variables, UUIDs, exporters, ...) belong to gpusd.inventory.vendors;
# every other module asks it instead of comparing a GPU's vendor with a name.
VENDOR_NAMES = frozenset({"nvidia", "amd", "intel", "simulated"})


def vendor_comparisons(tree: ast.AST) -> list[int]:
    """The lines of ``tree`` that compare something with a vendor's name (``== "amd"``,
    ``in ("nvidia", ...)``)."""
    def names(node: ast.AST) -> bool:
        if isinstance(node, ast.Constant):
            return node.value in VENDOR_NAMES
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            return any(names(e) for e in node.elts)
        return False

    return [node.lineno for node in ast.walk(tree)
            if isinstance(node, ast.Compare) and any(names(x) for x in (node.left, *node.comparators))]


def test_no_module_outside_inventory_compares_vendor_names() -> None:
    found = []
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(PKG).as_posix()
        if rel.startswith("inventory/"):
            continue
        found += [f"{rel}:{line}" for line in vendor_comparisons(ast.parse(path.read_text()))]
    assert found == [], f"ask gpusd.inventory.vendors instead of comparing vendor names: {found}"


def test_the_vendor_check_sees_each_form_of_comparison() -> None:
    code = 'a == "amd"\nif "intel" != b: pass\nc in ("x", "nvidia")\nd == vendor\ne in VENDORS\n'
    assert vendor_comparisons(ast.parse(code)) == [1, 2, 3]


# -- the map's routes and facts -------------------------------------------------------------------------
def _module_path(name: str) -> Path | None:
    rel = PKG.joinpath(*name.split("."))
    if (rel / "__init__.py").exists():
        return rel / "__init__.py"
    return rel.with_suffix(".py") if rel.with_suffix(".py").exists() else None


def doc_routes(text: str) -> dict[str, list[str]]:
    """The ``routes`` block: each line ``what: a → b → c`` (modules of gpusd, without the prefix)."""
    block = re.search(r"```routes\n(.*?)```", text, re.S)
    assert block is not None, "docs/architecture.md has no ```routes block"
    out = {}
    for line in block.group(1).splitlines():
        if line.strip():
            what, _, chain = line.rpartition(": ")
            out[what] = [m.strip() for m in chain.split("→")]
    return out


def test_the_routes_of_the_map_follow_the_imports() -> None:
    """Every module a route names exists, and each imports the next (at the top or lazily)."""
    routes = doc_routes(DOC.read_text())
    assert {"gpusd run -n 2 -- cmd", "the daemon, sample to wire"} <= set(routes)
    assert any(r.startswith("gpusd list") for r in routes)
    problems = []
    for what, chain in routes.items():
        for a, b in zip(chain, chain[1:]):
            path = _module_path(a)
            if path is None or _module_path(b) is None:
                problems.append(f"{what}: no module {a if path is None else b}")
            elif f"gpusd.{b}" not in imports_of(path, f"gpusd.{a}"):
                problems.append(f"{what}: {a} does not import {b}")
    assert problems == []


def test_a_run_enters_no_cli_module_after_the_command_line_is_parsed() -> None:
    chain = doc_routes(DOC.read_text())["gpusd run -n 2 -- cmd"]
    assert chain[:2] == ["cli", "cli.alloc"] and not any(m.startswith("cli") for m in chain[2:])
    # cli.alloc hands the leased run to the library: it imports no other CLI module for it
    alloc = (PKG / "cli" / "alloc.py").read_text()
    run = alloc[alloc.index("def run_command"):alloc.index("\ndef ", alloc.index("def run_command") + 1)]
    assert "from .jobs import" not in run and "from ..jobs.supervisor import run_job" in run


def test_each_owner_in_the_facts_table_exists() -> None:
    import importlib

    rows = re.findall(r"^\| [^|]+ \| `gpusd\.([\w.]+):(\w+)` \| `([\w/.]+)` \|$", DOC.read_text(), re.M)
    assert len(rows) >= 10
    for module, name, test in rows:
        assert hasattr(importlib.import_module(f"gpusd.{module}"), name), f"gpusd.{module}:{name}"
        assert (SRC.parent / test).exists(), test


def test_one_reader_of_the_local_daemons_state_files() -> None:
    """Whether this host's daemon runs and where it serves is read in gpusd.localdaemon only: no other module
    spells the names of its pid file or its gpusd.json (it asks, or takes PID_FILE/INFO_FILE from there)."""
    names = {"gpusd.pid", "gpusd.json"}
    spelled = []
    for me, path in _source_files():
        if me == "gpusd.localdaemon":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in names:
                spelled.append(f"{me}:{node.lineno}")
    assert spelled == []
    from gpusd import localdaemon

    assert {localdaemon.PID_FILE, localdaemon.INFO_FILE} == names  # the check looks for the names in use


def test_comments_and_docstrings_cite_no_issue_numbers() -> None:
    """History belongs in git: comments and docstrings say why, not which issue of gpusd."""
    found = []
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(PKG).as_posix()
        for i, line in enumerate(path.read_text().splitlines()):
            # gpusd's own issues ("issue 24", "(#31)"); another project's ("nccl-tests #178") are sources
            if re.search(r"\b[Ii]ssues? ?#?\d+\b|\(#\d+\)", line):
                found.append(f"{rel}:{i + 1}")
    assert found == []


# -- no import cycle inside a package --------------------------------------------------------------------
def package_cycles() -> list[set[str]]:
    """The import cycles among the modules of one package (files, lazy and type-checking imports
    included): each a set of module names without the ``gpusd.`` prefix."""
    files = dict(_source_files())
    graph: dict[str, set[str]] = {}
    for me, path in files.items():
        if path.name == "__init__.py":
            continue
        package = me.rpartition(".")[0]
        deps = set()
        for d in imports_of(path, me):
            while d and d not in files:
                d = d.rpartition(".")[0]
            if d and d != me and files[d].name != "__init__.py" and d.rpartition(".")[0] == package:
                deps.add(d)
        graph[me] = deps
    # strongly connected components (Tarjan), iteratively
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[set[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            for w in it:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                    break
                if w in on:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = set()
                    while True:
                        w = stack.pop()
                        on.discard(w)
                        comp.add(w.removeprefix("gpusd."))
                        if w == v:
                            break
                    if len(comp) > 1:
                        out.append(comp)
    return out


def test_no_import_cycle_inside_a_package() -> None:
    """Modules of one package never import each other (lazily or for type checking either): what both
    sides need lives in the lower one, or is passed in."""
    assert [sorted(c) for c in package_cycles()] == []


# -- imports inside functions: kept for start-up, and said so once per module ------------------------------
LAZY_MARKER = "# Imports inside functions: "
LAZY_QUICK = "start-up (quick commands import this module)"
# "start-up (gpusd COMMAND imports this module)": a command whose module set tests/commandpaths.py pins
LAZY_COMMAND = re.compile(r"start-up \(gpusd ([a-z-]+) imports this module\)")
LAZY_REASONS = {
    LAZY_QUICK,
    "start-up (a command's own module)",
    "optional or heavy packages",
    "memory at rest (loaded on request)",
}


def lazy_imports(tree: ast.AST) -> list[tuple[int, str]]:
    """The imports inside functions of a module's syntax tree (those for type checking left out): each
    its line and its kind, ``gpusd``, ``third`` (a third-party package) or ``std`` (the standard library)."""
    out: list[tuple[int, str]] = []

    def walk(node: ast.AST, inside: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                continue
            if inside and isinstance(child, (ast.Import, ast.ImportFrom)):
                if isinstance(child, ast.ImportFrom) and child.level:
                    names = ["gpusd"]
                elif isinstance(child, ast.ImportFrom):
                    names = [child.module or ""]
                else:
                    names = [a.name for a in child.names]
                for name in names:
                    top = name.split(".")[0]
                    kind = "gpusd" if top == "gpusd" else "std" if top in sys.stdlib_module_names else "third"
                    out.append((child.lineno, kind))
            walk(child, inside or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    walk(tree, False)
    return out


def lazy_marker_problems(files: list[tuple[str, Path]], quick: frozenset[str],
                         paths: dict[str, frozenset[str]] | None = None) -> list[str]:
    """What the rule of docs/architecture.md ("Imports inside functions") finds wrong in ``files``: a
    module that must carry the marker line and does not, one that carries it without need or more than
    once or below its first definition, an unknown reason, or a start-up reason off its command's path
    (``quick``: the quick commands', ``paths``: other commands' by name)."""
    paths = paths or {}
    problems = []
    for me, path in files:
        text = path.read_text()
        tree = ast.parse(text, str(path))
        kinds = {kind for _, kind in lazy_imports(tree)}
        needs = bool(kinds & {"gpusd", "third"}) or (me not in quick and bool(kinds))
        lines = [(i + 1, ln) for i, ln in enumerate(text.splitlines()) if ln.startswith(LAZY_MARKER)]
        first_def = min((n.lineno for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef,
                                                                         ast.ClassDef))), default=10**9)
        if needs and not lines:
            problems.append(f"{me}: imports inside functions, and no line '{LAZY_MARKER}REASON.'")
        elif not kinds and lines:
            problems.append(f"{me}: a marker line, and no import inside a function")
        if len(lines) > 1:
            problems.append(f"{me}: {len(lines)} marker lines (one per module)")
        for number, line in lines:
            if number > first_def:
                problems.append(f"{me}:{number}: the marker line belongs near the top, before the imports")
            reasons = line[len(LAZY_MARKER):].rstrip(".").split("; ")
            for r in reasons:
                command = LAZY_COMMAND.fullmatch(r)
                if command and command[1] not in paths:
                    problems.append(f"{me}:{number}: gpusd {command[1]}'s modules: not pinned (commandpaths.py)")
                elif command and me not in paths[command[1]]:
                    problems.append(f"{me}:{number}: gpusd {command[1]} does not import it (tests/commandpaths.py)")
                elif not command and r not in LAZY_REASONS:
                    problems.append(f"{me}:{number}: unknown reason {r!r}")
            if LAZY_QUICK in reasons and me not in quick:
                problems.append(f"{me}:{number}: no quick command imports it (tests/quickpath.py)")
    return problems


def test_lazy_imports_are_marked_once_with_a_known_reason() -> None:
    from commandpaths import PATHS
    from quickpath import QUICK

    assert lazy_marker_problems(_source_files(), QUICK, PATHS) == []


def test_the_lazy_import_rule_sees_each_kind_of_mistake(tmp_path: Path) -> None:
    def check(me: str, text: str, quick: frozenset[str] = frozenset(), listed: frozenset[str] = frozenset()
              ) -> list[str]:
        path = tmp_path / f"{me}.py"
        path.write_text(text)
        return lazy_marker_problems([(me, path)], quick, {"list": listed})

    lazy_gpusd = "def f():\n    from .model import GpuInfo\n"
    lazy_std = "def f():\n    import json\n"
    assert check("a", lazy_gpusd) != []  # unmarked
    assert check("a", lazy_std, frozenset({"a"})) == []  # the standard library's, on the quick path
    assert check("a", lazy_std) != []  # ... off it
    assert check("a", f"{LAZY_MARKER}{LAZY_QUICK}.\n" + lazy_gpusd, frozenset({"a"})) == []
    assert check("a", f"{LAZY_MARKER}{LAZY_QUICK}.\n" + lazy_gpusd) != []  # not on the quick path
    assert check("a", f"{LAZY_MARKER}because.\n" + lazy_gpusd) != []  # no such reason
    on_list = f"{LAZY_MARKER}start-up (gpusd list imports this module).\n"
    assert check("a", on_list + lazy_gpusd, listed=frozenset({"a"})) == []
    assert check("a", on_list + lazy_gpusd, frozenset({"a"})) != []  # not on gpusd list's path
    assert check("a", on_list.replace("list", "lost") + lazy_gpusd, listed=frozenset({"a"})) != []  # not pinned
    assert check("a", f"{LAZY_MARKER}not yet hoisted.\n" + lazy_gpusd) != []  # a reason no longer given
    assert check("a", f"{LAZY_MARKER}optional or heavy packages.\n") != []  # nothing to mark
    assert check("a", lazy_gpusd + f"{LAZY_MARKER}optional or heavy packages.\n") != []  # below a definition
    typed = "if TYPE_CHECKING:\n    from .model import GpuInfo\n"
    assert check("a", typed) == []  # an import for type checking is not lazy
