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


def _table() -> dict[str, tuple[str, str]]:
    """docs/errors.md's table: class name -> (exit, HTTP) columns."""
    text = (REPO / "docs" / "errors.md").read_text()
    rows = re.findall(r"^\| `\w+` \| `(\w+)` \| [^|]* \| ([^|]*) \| ([^|]*) \|", text, re.M)
    return {name: (exit_.strip(), http.strip()) for name, exit_, http in rows}


ALL_CLASSES = [*(getattr(errors, n) for n in errors.__all__), errors.OverCap, errors.PlacementError]


@pytest.mark.parametrize("cls", ALL_CLASSES, ids=lambda c: c.__name__)
def test_each_class_carries_the_exit_and_http_status_docs_errors_lists(cls: type[errors.GpusdError]) -> None:
    exit_, http = _table()[cls.__name__]
    if cls is not errors.DaemonStartFailed:
        assert exit_ == str(cls.exit_status)
        assert exit_code_for(cls("x")) == cls.exit_status
    assert http.split()[0] == str(cls.http_status)
    exc = errors.DaemonStartFailed("x", 3) if cls is errors.DaemonStartFailed else cls("x")
    status, body = errors.http_answer(exc)
    assert status == cls.http_status and body["code"] == cls.code and body["error"] == "x"
    assert body.get("reason") == (http.split()[1].strip("`") if " " in http else None)


def test_http_answer_of_anything_else_and_an_explicit_reason() -> None:
    assert errors.http_answer(OSError("disk"))[0] == 503
    status, body = errors.http_answer(errors.OverCap("cap"), "fleet_cap")
    assert (status, body["reason"], body["code"]) == (429, "fleet_cap", "no_gpu")


def test_no_gpusd_error_class_is_defined_outside_errors_py() -> None:
    """Every class of the tree lives in errors.py (its code, exit and HTTP status beside the others)."""
    import ast

    names = {c.__name__ for c in ALL_CLASSES} | {"GpusdError"}
    for path in (REPO / "src" / "gpusd").rglob("*.py"):
        if path.name == "errors.py" and path.parent.name == "gpusd":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                bases = {b.id if isinstance(b, ast.Name) else b.attr if isinstance(b, ast.Attribute) else ""
                         for b in node.bases}
                assert not bases & names, f"{path}: class {node.name} is an error class outside errors.py"


@pytest.mark.parametrize("exc, status, says", [
    (FileNotFoundError(2, "No such file"), 127, "command not found: prog"),
    (PermissionError(13, "Permission denied"), 126, "permission denied: prog"),
])
def test_exec_failure_is_the_shells_convention(exc: OSError, status: int, says: str) -> None:
    assert errors.exec_failure(exc, "prog") == (status, says)


def test_no_module_writes_the_exec_statuses_itself() -> None:
    """127/126 come from errors.exec_failure (or its EXIT_NOT_FOUND / EXIT_CANNOT_EXECUTE)."""
    for path in (REPO / "src" / "gpusd").rglob("*.py"):
        rel = path.relative_to(REPO / "src" / "gpusd").as_posix()
        if rel == "errors.py":
            continue
        written = re.search(r"(return|status =|rc =) 12[67]\b", path.read_text())
        assert not written, f"{rel} writes an exec status itself"


def test_no_daemon_handler_picks_an_error_status_by_hand() -> None:
    """The daemon's HTTP error answers take their status from the error's class (errors.http_answer)."""
    for path in (REPO / "src" / "gpusd" / "daemon").glob("*.py"):
        text = path.read_text()
        assert not re.search(r"return \d{3}, \{?\**to_wire\(", text), f"{path.name} picks an HTTP status by hand"


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


# -- codes and the wire ------------------------------------------------------------------
CLASSES = [getattr(errors, n) for n in errors.__all__]


def test_every_class_has_its_own_unique_code_and_docs_errors_lists_it() -> None:
    codes = [cls.__dict__.get("code") for cls in CLASSES]
    assert all(isinstance(c, str) and re.fullmatch(r"[a-z_]{2,20}", c) for c in codes), codes
    assert len(set(codes)) == len(codes)
    table = (REPO / "docs" / "errors.md").read_text()
    for cls in CLASSES:
        assert re.search(rf"^\| `{cls.code}` \| `{cls.__name__}` \|", table, re.M), f"{cls.code} not in docs/errors.md"


def _example(cls: type[errors.GpusdError]) -> errors.GpusdError:
    if cls is errors.DaemonStartFailed:
        return cls("the daemon exited", 3)
    return cls("it failed\x1b[31m here")


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_to_wire_from_wire_round_trips_every_class(cls: type[errors.GpusdError]) -> None:
    import json

    exc = _example(cls)
    for http in (False, True):
        d = json.loads(json.dumps(errors.to_wire(exc, http=http)))  # what the other side reads
        assert d["code"] == cls.code
        back = errors.from_wire(d, "host: ")
        assert type(back) is cls
        assert str(back).startswith("host: ") and str(exc).split("\x1b")[0] in str(back)
        assert "\x1b" not in str(back)  # sanitised for a terminal
        assert exit_code_for(back) == exit_code_for(exc)
    sock = errors.to_wire(exc)
    assert sock["ok"] is False and sock["message"] == str(exc)
    assert sock["error"] in ("usage", "no_gpu", "timeout", "error")  # what a 0.2 client understands
    if cls is errors.DaemonStartFailed:
        assert errors.from_wire(sock).status == 3  # type: ignore[attr-defined]


@pytest.mark.parametrize("reply, cls", [
    ({"ok": False, "error": "no_gpu", "message": "m"}, errors.NoGpuAvailable),  # a 0.2 lease socket
    ({"ok": False, "error": "timeout", "message": "m"}, errors.WaitTimeout),
    ({"ok": False, "error": "usage", "message": "m"}, errors.ConfigError),
    ({"ok": False, "error": "error", "message": "m"}, errors.GpusdError),
    ({"ok": False, "message": "m"}, errors.GpusdError),  # a 0.2 supervisor's refusal
    ({"error": "m"}, errors.GpusdError),  # a 0.2 HTTP error body
    ({"error": "m", "reason": "no_gpu"}, errors.NoGpuAvailable),
    ({"ok": False, "code": "from_0.4", "error": "no_gpu", "message": "m"}, errors.NoGpuAvailable),  # newer peer
    ({"ok": False, "code": 7, "error": ["x"], "message": "m"}, errors.GpusdError),  # hostile types
])
def test_from_wire_reads_old_and_unknown_replies(reply: dict[str, object], cls: type) -> None:
    got = errors.from_wire(reply)
    assert type(got) is cls and str(got) == "m"


def test_from_wire_of_garbage_is_a_gpusd_error() -> None:
    assert type(errors.from_wire(["not", "a", "dict"])) is errors.GpusdError
    assert str(errors.from_wire({"ok": False})) == "the peer refused the request"
    long = errors.from_wire({"ok": False, "message": "x" * 100_000})
    assert len(str(long)) <= errors.MAX_MESSAGE + 5


def test_a_bad_token_is_caught_as_a_gpusd_error() -> None:
    """0.2: ``gpusd.AsyncClient(token="x")`` raised SecretError(ValueError), which ``except GpusdError``
    missed; it is a ConfigError now (exit 2, as the CLI already made it), still a ValueError."""
    with pytest.raises(gpusd.GpusdError, match="at least 16 bytes") as info:
        gpusd.AsyncClient(token="x")
    assert isinstance(info.value, gpusd.SecretError) and isinstance(info.value, ValueError)
    assert isinstance(info.value, gpusd.ConfigError) and exit_code_for(info.value) == 2
    from gpusd.wire.signing import check_secret

    with pytest.raises(gpusd.SecretError):
        check_secret("short")


def test_source_error_is_no_longer_a_no_daemon_but_exits_the_same() -> None:
    assert not issubclass(gpusd.SourceError, gpusd.NoDaemon)
    assert exit_code_for(gpusd.SourceError("x")) == exit_code_for(gpusd.NoDaemon("x")) == 6


@pytest.mark.parametrize("exc, status", [
    (gpusd.IdError("x"), 2),
    (gpusd.SecretError("x"), 2),
    (gpusd.SSEError("x"), 1),
    (gpusd.LockBusy("x"), 1),
    (gpusd.AlreadyRunning("x"), 7),
    (gpusd.DiskFull("x"), 1),
    (ValueError("x"), 1),
    (KeyError("x"), 1),
])
def test_more_exit_codes(exc: BaseException, status: int) -> None:
    assert exit_code_for(exc) == status


def test_subclasses_keep_their_base_code_and_old_import_names() -> None:
    from gpusd.alloc.policy import OverCap
    from gpusd.engines.placement import PlacementError

    assert OverCap is errors.OverCap and PlacementError is errors.PlacementError
    assert errors.to_wire(OverCap("cap"))["code"] == "no_gpu" and exit_code_for(OverCap("cap")) == 4
    assert errors.to_wire(PlacementError("p"))["code"] == "error" and exit_code_for(PlacementError("p")) == 1
