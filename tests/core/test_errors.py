"""One exception hierarchy (gpusd.errors), exported from gpusd; exit codes belong to the CLI."""

from __future__ import annotations

import re

import pytest

import gpusd
import gpusd.errors as errors
from gpusd.cli.exits import exit_code_for
from tests_paths import REPO


def test_every_error_is_exported_from_gpusd_and_is_a_gpusd_error() -> None:
    for name in errors.__all__:
        cls = getattr(gpusd, name)
        assert cls is getattr(errors, name)
        assert issubclass(cls, gpusd.GpusdError)
        assert name in gpusd.__all__


def test_config_error_from_select_is_the_exported_one() -> None:
    with pytest.raises(gpusd.ConfigError):
        gpusd.select(count=0)


def test_value_error_compatibility() -> None:
    """Callers that caught ValueError from the decoders and from bad values still do."""
    from gpusd.wire.sse import SSEError as FromSse
    from gpusd.wire.txt import TxtError as FromTxt

    assert FromTxt is gpusd.TxtError and FromSse is gpusd.SSEError
    for cls in (gpusd.TxtError, gpusd.SSEError, gpusd.WireError, gpusd.ConfigError):
        assert issubclass(cls, ValueError)
    with pytest.raises(ValueError):
        gpusd.HostSnapshot.from_dict({"hostname": 1})


def test_library_errors_carry_no_exit_code() -> None:
    for name in errors.__all__:
        assert not hasattr(getattr(errors, name), "exit_code"), name


@pytest.mark.parametrize("exc, code", [
    (gpusd.GpusdError("x"), 1),
    (gpusd.ConfigError("x"), 2),
    (gpusd.BackendUnavailable("x"), 3),
    (gpusd.NoGpuAvailable("x"), 4),
    (gpusd.WaitTimeout("x"), 5),
    (gpusd.NoDaemon("x"), 6),
    (gpusd.SourceError("x"), 6),
    (gpusd.TxtError("x"), 1),
    (gpusd.DaemonStartFailed("x", 3), 3),
    (gpusd.DaemonStartFailed("x", 9), 1),
])
def test_the_cli_maps_errors_to_the_documented_codes(exc: BaseException, code: int) -> None:
    assert exit_code_for(exc) == code
    docs = (REPO / "docs" / "cli.md").read_text()
    assert re.search(rf"^\| {code} \|", docs, re.M), f"exit code {code} is not in docs/cli.md"


def test_old_exit_code_names_still_resolve() -> None:
    from gpusd.errors import EXIT_NO_DAEMON, EXIT_USAGE

    assert (EXIT_USAGE, EXIT_NO_DAEMON) == (2, 6)
