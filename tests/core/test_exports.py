"""The public names of gpusd: every one resolves, and a type checker sees each as what it is (the
TYPE_CHECKING block of gpusd/__init__.py mirrors _LAZY), so ``gpusd.Client`` is not ``Any``."""

from __future__ import annotations

import ast
import os
import shutil
from pathlib import Path

import pytest

import gpusd

INIT = Path(gpusd.__file__)
SRC = INIT.parent.parent


def test_every_exported_name_resolves() -> None:
    for name in gpusd.__all__:
        assert getattr(gpusd, name) is not None, name
    assert set(dir(gpusd)) == set(gpusd.__all__)
    with pytest.raises(AttributeError):
        gpusd.NoSuchName  # type: ignore[attr-defined]  # noqa: B018


def _type_checking_names() -> dict[str, str]:
    """name -> module for the imports under ``if TYPE_CHECKING:`` in gpusd/__init__.py."""
    tree = ast.parse(INIT.read_text())
    out: dict[str, str] = {}
    for node in tree.body:
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            for imp in node.body:
                assert isinstance(imp, ast.ImportFrom)
                for alias in imp.names:
                    assert alias.asname in (None, alias.name)
                    out[alias.name] = "gpusd." + (imp.module or "")
    return out


def test_type_checking_block_mirrors_lazy() -> None:
    assert _type_checking_names() == gpusd._LAZY


def test_aliases_resolve_the_same_objects() -> None:
    import gpisd

    assert gpisd.Client is gpusd.Client and gpisd.select is gpusd.select
    assert set(gpisd.__all__) == set(gpusd.__all__)


@pytest.mark.skipif(shutil.which("mypy") is None and not os.environ.get("CI"), reason="mypy is not installed")
def test_mypy_sees_every_lazy_name_as_its_real_type(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Assigning each name to an ``int`` is a type error only if mypy knows what the name is (an
    ``Any`` would pass silently)."""
    from mypy import api

    monkeypatch.setenv("MYPYPATH", str(SRC))  # this source tree, whatever is installed
    snippet = tmp_path / "snippet.py"
    names = sorted(gpusd._LAZY)
    snippet.write_text("import gpusd\n" + "".join(f"x_{n}: int = gpusd.{n}\n" for n in names))
    out, err, _ = api.run([str(snippet), "--no-incremental", "--follow-imports=silent",
                           "--python-version=3.10", f"--cache-dir={tmp_path / 'cache'}"])
    flagged = {line.split(":")[1] for line in out.splitlines() if "Incompatible types in assignment" in line}
    missing = [n for i, n in enumerate(names, start=2) if str(i) not in flagged]
    assert missing == [], out + err
