"""A job's control socket carries each refusal's code (docs/errors.md, docs/jobs.md): the supervisor's
answers are encoded by gpusd.jobs.control, and gpusd grow/shrink rebuild the error (and its exit code)
from them, from a 0.2 supervisor's answers (no code) too."""

from __future__ import annotations

import json

import pytest

from gpusd.cli.exits import exit_code_for
from gpusd.errors import GpusdError, NoGpuAvailable, WaitTimeout
from gpusd.jobs import control
from gpusd.jobs.supervisor import _refusal


def _line(answer: dict[str, object]) -> dict[str, object]:
    raw = control.encode(answer)
    assert raw.endswith(b"\n") and raw.count(b"\n") == 1
    return json.loads(raw)


def test_a_plain_refusal_gets_code_error() -> None:
    d = _line({"ok": False, "message": "job 3f9c0a1b22de is not preemptible"})
    assert (d["ok"], d["code"], d["error"]) == (False, "error", "error")
    assert d["message"] == "job 3f9c0a1b22de is not preemptible"
    exc = control.refused(d, "job 3f9c0a1b22de: ")
    assert type(exc) is GpusdError and exit_code_for(exc) == 1
    assert str(exc) == "job 3f9c0a1b22de: job 3f9c0a1b22de is not preemptible"


@pytest.mark.parametrize("exc, code, status", [
    (NoGpuAvailable("no GPUs available"), "no_gpu", 4),
    (WaitTimeout("waited 5s"), "timeout", 5),
    (GpusdError("another change in progress"), "error", 1),
])
def test_a_grow_refusal_keeps_its_exit_code(exc: GpusdError, code: str, status: int) -> None:
    d = _line(_refusal(exc))
    assert d["code"] == code and d["error"] == code  # the 0.2 kind is the same word for these
    back = control.refused(d)
    assert type(back) is type(exc) and exit_code_for(back) == status


def test_what_a_0_2_supervisor_answers_is_still_read() -> None:
    assert type(control.refused({"ok": False, "error": "timeout", "message": "m"})) is WaitTimeout
    assert type(control.refused({"ok": False, "error": "no_gpu", "message": "m"})) is NoGpuAvailable
    assert type(control.refused({"ok": False, "message": "m"})) is GpusdError


def test_an_answer_that_did_what_was_asked_is_sent_as_it_is() -> None:
    ok = {"ok": True, "devices": ["GPU-1"], "message": "grown"}
    assert _line(ok) == ok
    assert control.refused(ok) is None
