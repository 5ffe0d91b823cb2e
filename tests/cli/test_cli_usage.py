"""What a newcomer types wrong: memory without a unit, negative durations, broken scenarios, unknown
flags.  Each gets one clear line and exit 2, never a silent misreading or a traceback."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import gpusd_cli
from gpusd.cli import main
from gpusd.units import parse_memory

GiB = 2**30


@pytest.fixture(autouse=True)
def _loopback_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """Should a command get past its checks anyway, it browses 127.0.0.1 only."""
    monkeypatch.setenv("GPUSD_INTERFACES", "127.0.0.1")


def cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    """Run the CLI in this process; (exit code, stdout, stderr)."""
    try:
        rc = main(argv)
    except SystemExit as exc:
        rc = exc.code if isinstance(exc.code, int) else 1
    out, err = capsys.readouterr()
    return rc, out, err


# -- memory amounts ---------------------------------------------------------------------------------
@pytest.mark.parametrize("flag", ["--min-free", "--memory"])
def test_bare_number_above_one_is_refused_with_a_hint(flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = cli(["select", flag, "20", "--simulate", "2xA100-80GB"], capsys)
    assert rc == 2 and out == ""
    assert "did you mean 20GiB?" in err and flag in err and "Traceback" not in err


def test_list_min_free_needs_a_unit(capsys: pytest.CaptureFixture[str]) -> None:
    rc, _, err = cli(["list", "--min-free", "20", "--timeout", "0", "--interface", "127.0.0.1"], capsys)
    assert rc == 2 and "did you mean 20GiB?" in err


def test_ratios_and_amounts_mean_what_they_say() -> None:
    assert parse_memory("1") == parse_memory("1.0") == 1.0  # both: all of it
    assert parse_memory("0.25") == parse_memory("25%") == 0.25
    assert parse_memory("20GiB") == 20 * GiB and parse_memory("20B") == 20
    with pytest.raises(ValueError, match="did you mean 1.5GiB"):
        parse_memory("1.5")
    with pytest.raises(ValueError, match="negative"):
        parse_memory("-3")
    with pytest.raises(ValueError, match="unit"):
        parse_memory("0.5", ratio=False)


def test_client_min_free_needs_a_unit() -> None:
    from gpusd.discovery.client import AsyncClient

    with pytest.raises(ValueError, match="did you mean 20GiB"):
        AsyncClient(min_free_memory="20", interfaces=["127.0.0.1"])
    assert AsyncClient(min_free_memory="20GiB", interfaces=["127.0.0.1"]).filters.min_free_memory == 20 * GiB


def test_python_api_refuses_a_float_that_is_no_ratio() -> None:
    from gpusd.alloc.select import Constraints
    from gpusd.errors import ConfigError

    with pytest.raises(ConfigError, match="20GiB"):
        Constraints.build(min_free=20.0)
    assert Constraints.build(min_free=20 * GiB).min_free == 20 * GiB


# -- durations ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("argv, flag", [
    (["select", "--wait", "--timeout", "-1", "--simulate", "1xT4"], "--timeout"),
    (["run", "--wait", "--timeout", "nan", "--simulate", "1xT4", "--", "true"], "--timeout"),
    (["scan", "--timeout", "-1"], "--timeout"),
    (["list", "--timeout", "-0.5"], "--timeout"),
    (["watch", "--duration", "-1"], "--duration"),
    (["watch", "--duration", "0"], "--duration"),  # 0 used to mean "forever"
    (["start", "--interval", "-1", "--simulate", "1xT4"], "--interval"),
    (["start", "--timeout", "-1", "--simulate", "1xT4"], "--timeout"),
    (["stop", "--timeout", "-1"], "--timeout"),
    (["demo", "--duration", "-5"], "--duration"),
    (["top", "--once", "--interval", "-1"], "--interval"),
    (["top", "--once", "--wait", "-1"], "--wait"),
    (["export", "prometheus-sd", "--wait", "-1"], "--wait"),
    (["export", "prometheus-sd", "--interval", "inf"], "--interval"),
])
def test_negative_or_endless_durations_are_refused(argv: list[str], flag: str,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    from gpusd.cli import build_parser

    # Parsing alone: a command that accepted the value would browse, wait or run for ever.
    with pytest.raises(SystemExit) as exc:
        build_parser(argv[0]).parse_args(argv)
    err = capsys.readouterr().err
    assert exc.value.code == 2, err
    assert flag in err and "seconds" in err and "Traceback" not in err


def test_library_refuses_a_negative_timeout() -> None:
    import gpusd
    from gpusd.errors import ConfigError

    with pytest.raises(ConfigError, match="timeout"):
        gpusd.select(count=1, wait=True, timeout=-1, simulate="1xT4", lease=False)


# -- scenario files ---------------------------------------------------------------------------------
def _scenario(tmp_path: Path, gpus: list[dict[str, object]]) -> str:
    path = tmp_path / "scenario.json"
    path.write_text(json.dumps({"gpus": gpus}))
    return str(path)


def test_scenario_names_the_missing_key(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, _, err = cli(["devices", "--simulate", _scenario(tmp_path, [{"util": {"min": 10}}])], capsys)
    assert rc == 2
    assert "missing the key 'max'" in err and "gpus[0].util" in err
    assert "('max')" not in err  # not the bare KeyError text


@pytest.mark.parametrize("memory", ["90GiB", {"min": "1GiB", "max": "81GiB"}, {"steps": ["1GiB", "100GiB"]}])
def test_scenario_memory_over_the_total_is_refused(tmp_path: Path, memory: object,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    spec = _scenario(tmp_path, [{"model": "A100-80GB", "memory_used": "1GiB"},
                                {"model": "A100-80GB", "memory_used": memory}])
    rc, out, err = cli(["devices", "--json", "--simulate", spec], capsys)
    assert rc == 2 and out == ""
    assert "gpus[1].memory_used" in err and "80.0GiB" in err


def test_scenario_processes_over_the_total_are_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    spec = _scenario(tmp_path, [{"model": "RTX4090", "processes": [{"pid": 1, "memory": "20GiB"},
                                                                   {"pid": 2, "memory": "20GiB"}]}])
    rc, out, err = cli(["devices", "--json", "--simulate", spec], capsys)
    assert rc == 2 and out == "" and "processes of gpus[0]" in err and "40.0GiB" in err
    spec = _scenario(tmp_path, [{"model": "RTX4090", "processes": [{"pid": 1, "memory": "lots"}]}])
    rc, out, err = cli(["devices", "--json", "--simulate", spec], capsys)
    assert rc == 2 and "gpus[0].processes[0].memory" in err


def test_scenario_within_bounds_still_works(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    spec = _scenario(tmp_path, [{"model": "A100-80GB", "memory_used": "80GiB", "util": {"min": 0, "max": 100}}])
    rc, out, _ = cli(["devices", "--json", "--simulate", spec], capsys)
    assert rc == 0 and json.loads(out)["gpus"][0]["memory_used"] == 80 * GiB


# -- usage errors -----------------------------------------------------------------------------------
@pytest.mark.parametrize("argv, prog", [
    (["list", "-n", "3"], "gpusd list"),
    (["devices", "--jsonn"], "gpusd devices"),
    (["export", "prometheus-sd", "--bad"], "gpusd export prometheus-sd"),
    (["select", "--count", "x"], "gpusd select"),
    (["report", "--since", "-1h"], "gpusd report"),
])
def test_usage_error_is_one_line_naming_the_command(argv: list[str], prog: str,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """No 13-17-line usage block before the error: the one line, and where the options are."""
    rc, _, err = cli(argv, capsys)
    assert rc == 2
    assert err.splitlines()[0].startswith(f"{prog}: error: "), err
    assert err.splitlines()[1:] == [f"see {prog} --help"], err
    assert "usage:" not in err and "COMMAND ..." not in err


def test_top_level_usage_error_points_at_the_top_level_help(capsys: pytest.CaptureFixture[str]) -> None:
    rc, _, err = cli(["--bogus"], capsys)
    assert rc == 2 and err == "gpusd: error: unrecognized arguments: --bogus\nsee gpusd --help\n"


def test_usage_error_as_a_user_sees_it() -> None:
    r = gpusd_cli(["scan", "--json", "--nope"])
    assert r.returncode == 2 and r.stderr.startswith("gpusd scan: error: ") and "--nope" in r.stderr
    assert len(r.stderr.splitlines()) == 2
