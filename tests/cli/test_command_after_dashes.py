"""The command after ``--`` (``gpusd run``, ``launch``, ``hostfile``): the ``--`` that separates it from
gpusd's options is never part of it, and nothing after it is a command none."""

from __future__ import annotations

import pytest

from gpusd.cli import build_parser, main
from gpusd.cli.options import after_dashes


def _said(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    try:
        rc = main(argv)
    except SystemExit as exc:
        rc = exc.code if isinstance(exc.code, int) else 1
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return rc, err


def test_run_with_nothing_after_the_dashes_names_what_is_missing(capsys: pytest.CaptureFixture[str]) -> None:
    rc, err = _said(["run", "--"], capsys)
    assert rc == 2 and "no command given: gpusd run [options] -- CMD [ARGS...]" in err, err


def test_launch_with_nothing_after_the_dashes_names_what_is_missing(capsys: pytest.CaptureFixture[str]) -> None:
    rc, err = _said(["launch", "-n", "1", "torchrun", "--"], capsys)
    assert rc == 2 and "launch needs the program to run after ENGINE" in err, err


def test_only_the_first_dashes_are_gpusds() -> None:
    args = build_parser("run").parse_args(["run", "--", "prog", "--", "-x"])
    assert after_dashes(args.cmd) == ["prog", "--", "-x"]
    assert after_dashes(["--", "--", "prog"]) == ["--", "prog"]  # a program that is itself called "--"
    assert after_dashes(["prog", "-x"]) == ["prog", "-x"]
    assert after_dashes([]) == []
