"""Paths the tests share (test files sit one level down, in a folder per package)."""

from pathlib import Path

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
SRC = REPO / "src"
