"""The public names of gpusd: every one resolves, and a type checker sees each as what it is (the
TYPE_CHECKING block of gpusd/__init__.py is checked against _LAZY and _DEPRECATED), so ``gpusd.Client`` is
not ``Any``.  ``python3 tests/core/test_exports.py`` prints the block the tables call for."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import os
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


def type_checking_block(table: dict[str, str]) -> str:
    """The TYPE_CHECKING block for ``table`` (name -> module), in the order ruff's isort keeps."""
    def key(item: tuple[str, str]) -> tuple[str, int, str]:
        name, module = item
        kind = 0 if name.isupper() else 1 if name[:1].isupper() else 2  # constants, classes, the rest
        return module, kind, name.lower()

    return "".join(f"    from .{module.removeprefix('gpusd.')} import (\n        {name} as {name},\n    )\n"
                   for name, module in sorted(table.items(), key=key))


def test_type_checking_block_mirrors_lazy() -> None:
    """Every public and deprecated name, and nothing else, is imported for type checkers from the module
    the lazy table names; on a difference the message is the block to paste."""
    table = {**gpusd._LAZY, **gpusd._DEPRECATED}
    assert _type_checking_names() == table, "the TYPE_CHECKING block of gpusd/__init__.py should read:\n" + \
        type_checking_block(table)


def test_deprecated_names_resolve_with_a_warning() -> None:
    """The internals 0.2 exported (``gpusd.LeaseStore``, ``gpusd.open_backend``) still resolve, warn, and
    are out of ``__all__`` and ``dir(gpusd)``."""
    for name, module in gpusd._DEPRECATED.items():
        assert name not in gpusd.__all__ and name not in dir(gpusd)
        with pytest.warns(DeprecationWarning, match=module):
            value = getattr(gpusd, name)
        assert value is getattr(importlib.import_module(module), name)


def test_aliases_resolve_the_same_objects() -> None:
    import gpisd

    assert gpisd.Client is gpusd.Client and gpisd.select is gpusd.select
    assert set(gpisd.__all__) == set(gpusd.__all__)


@pytest.mark.skipif(importlib.util.find_spec("mypy") is None and not os.environ.get("CI"),
                    reason="mypy is not installed (tests/core/test_public_api.py pins the names without it)")
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


if __name__ == "__main__":  # print the TYPE_CHECKING block the tables call for
    print(type_checking_block({**gpusd._LAZY, **gpusd._DEPRECATED}), end="")
