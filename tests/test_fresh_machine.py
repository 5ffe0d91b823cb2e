"""The README's test command on a fresh machine: every package the tests import is declared.

A package the suite imports but no extra names passes on a developer's machine that has it from
elsewhere and stops a user's fresh virtual environment at collection. This reads the imports the
tests, their helpers and the benches make (the syntax tree: imports inside functions too) and checks
each third-party one against the project's dependencies and extras in pyproject.toml.
"""
from __future__ import annotations

import ast
import re
import sys
from importlib.metadata import packages_distributions
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib", reason="reading pyproject.toml needs Python 3.11's tomllib")

REPO = Path(__file__).resolve().parent.parent

# Modules the suite may import without a pyproject line: they come with Python or with the tests.
OURS = {"gpusd", "gpisd", "gpu_optimizer", "tests"}
# Import names whose distribution is not installed here to be looked up (the engines extra, which
# CI installs): module -> distribution as PyPI names it.
KNOWN = {"torch": "torch", "ray": "ray", "deepspeed": "deepspeed", "dns": "dnspython",
         "yaml": "pyyaml", "pynvml": "nvidia-ml-py"}


def _declared() -> set[str]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    specs = list(project["dependencies"])
    for extra in ("test", "engines"):
        specs += project["optional-dependencies"][extra]
    return {_norm(re.split(r"[<>=!~\[; ]", s, maxsplit=1)[0]) for s in specs}


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _local_modules() -> set[str]:
    names = set()
    for folder in (REPO / "tests", REPO / "bench"):
        for p in folder.rglob("*.py"):
            names.add(p.stem)
        for p in folder.rglob("__init__.py"):
            names.add(p.parent.name)
    return names


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), str(path))
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.split(".")[0])
    return found


def test_every_package_the_tests_import_is_declared() -> None:
    declared = _declared()
    local = _local_modules() | OURS | set(sys.stdlib_module_names)
    dists = packages_distributions()
    missing = {}
    for folder in ("tests", "bench"):
        for path in sorted((REPO / folder).rglob("*.py")):
            for module in _imports(path) - local:
                names = {_norm(d) for d in dists.get(module, [])} or {_norm(KNOWN.get(module, module))}
                if not names & declared:
                    missing.setdefault(module, path.relative_to(REPO).as_posix())
    assert not missing, ("imported by the tests but in neither the dependencies nor the test/engines extras "
                         f"of pyproject.toml (a fresh venv stops at collection): {missing}")
