"""The daemon's lease hooks into the usage history: each writes its change, and a history that fails
to write is logged, never a reason to refuse or end a lease."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from gpusd.daemon.recording import Recording


class _Recorder:
    def __init__(self, fail: bool) -> None:
        self.fail = fail
        self.calls: list[tuple[Any, ...]] = []

    def _write(self, *args: Any) -> None:
        if self.fail:
            raise OSError(28, "No space left on device")
        self.calls.append(args)

    def lease_started(self, *args: Any) -> None:
        self._write("started", *args[:-1])

    def lease_ended(self, *args: Any) -> None:
        self._write("ended", *args[:-1])

    def mark_timed_out(self, *args: Any) -> None:
        self._write("timed out", *args[:-1])


def _recording(recorder: _Recorder | None) -> Recording:
    rec = Recording.__new__(Recording)  # only the recorder matters to the lease hooks
    rec.recorder = recorder  # type: ignore[assignment]
    return rec


def _hooks(rec: Recording) -> None:
    rec.lease_started("L1", "alice", 1000, "train", ["GPU-a"])
    rec.lease_timed_out("L1")
    rec.lease_ended("L1")


def test_each_hook_writes_its_change() -> None:
    recorder = _Recorder(fail=False)
    _hooks(_recording(recorder))
    assert recorder.calls == [("started", "L1", "alice", 1000, "train", ["GPU-a"]), ("timed out", "L1"),
                              ("ended", "L1")]


def test_a_failing_history_is_logged_not_raised(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="gpusd.history"):
        _hooks(_recording(_Recorder(fail=True)))
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 3
    assert said[0].startswith("history: cannot record lease L1: ")
    assert said[1].startswith("history: cannot record the time-out of lease L1: ")
    assert said[2].startswith("history: cannot record the end of lease L1: ")
    assert "No space left" in said[0]


def test_no_history_no_write() -> None:
    _hooks(_recording(None))  # a daemon without history: the hooks do nothing
