"""The CLI turns its arguments into typed values at its edge (issue 19, point 12): below ``gpusd.cli`` no
module imports argparse, annotates a parameter as an argparse namespace, or reads a CLI-shaped ``args``
parameter's attributes — except the modules listed here, which parse their own small command line."""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[2] / "src" / "gpusd"

# module (relative to src/gpusd) -> why it may parse a command line of its own
OWN_COMMAND_LINE = {
    "job.py": "`python -m gpusd.job`: the job protocol's helper for jobs, standard library only (docs/jobs.md)",
    "engines/hold.py": "`python3 -m gpusd.engines.hold`: the guard that runs on each remote host of a placement",
    "engines/jobguard.py": "`python3 -m gpusd.engines.jobguard`: the guard of each host's part of a launched job",
}
NAMESPACE_NAMES = {"args", "ns", "namespace", "opts", "options"}  # what a parsed command line is called


def _offences(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), str(path))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import) and any(a.name == "argparse" for a in node.names):
            out.append(f"line {node.lineno}: import argparse")
        elif isinstance(node, ast.ImportFrom) and node.module == "argparse":
            out.append(f"line {node.lineno}: from argparse import ...")
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            params = [*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs]
            for arg in params:
                if arg.annotation is not None and ("Namespace" in ast.unparse(arg.annotation)
                                                   or "argparse" in ast.unparse(arg.annotation)):
                    out.append(f"line {node.lineno}: {node.name}({arg.arg}: {ast.unparse(arg.annotation)})")
            # a parameter called args (or ns...) without a type of its own, whose attributes are read
            names = {a.arg for a in params if a.annotation is None or ast.unparse(a.annotation).strip("'\"")
                     in ("Any", "object", "typing.Any")} & NAMESPACE_NAMES
            for inner in ast.walk(node):
                if isinstance(inner, ast.Attribute) and isinstance(inner.value, ast.Name) and inner.value.id in names:
                    out.append(f"line {inner.lineno}: {node.name} reads {inner.value.id}.{inner.attr}")
                    break
                if (isinstance(inner, ast.Call) and isinstance(inner.func, ast.Name)
                        and inner.func.id in ("getattr", "hasattr") and inner.args
                        and isinstance(inner.args[0], ast.Name) and inner.args[0].id in names):
                    out.append(f"line {inner.lineno}: {node.name} calls {inner.func.id}({inner.args[0].id}, ...)")
                    break
    return out


def test_no_module_below_the_cli_sees_an_argparse_namespace() -> None:
    found = {}
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(PKG).as_posix()
        if rel.startswith("cli/") or rel in OWN_COMMAND_LINE:
            continue
        offences = _offences(path)
        if offences:
            found[rel] = offences
    assert found == {}, "parse at the CLI's edge (gpusd.cli.options) and pass typed values: " + repr(found)


def test_the_exceptions_still_parse_a_command_line_of_their_own() -> None:
    """An exception that no longer needs its place goes from the list."""
    for rel in OWN_COMMAND_LINE:
        assert _offences(PKG / rel), rel


def test_the_check_finds_what_it_forbids(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text("def constraints_from_args(args):\n    return getattr(args, 'count')\n\n"
                   "def f(ns: 'argparse.Namespace') -> int:\n    return ns.count\n")
    assert len(_offences(bad)) == 2  # getattr(args, ...); the annotation
    bad.write_text("import argparse\n")
    assert _offences(bad) == ["line 1: import argparse"]
    bad.write_text("def g(*args):\n    return args.count\n\ndef h(x):\n    return x.args\n\n"
                   "def i(opts: 'LaunchOptions') -> str:\n    return opts.chdir\n")
    assert _offences(bad) == []  # *args is no namespace, nor an attribute named args, nor a typed value
