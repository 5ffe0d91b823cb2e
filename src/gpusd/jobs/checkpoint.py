"""NVIDIA's ``cuda-checkpoint`` utility, detected at run time: transparent moves (docs/jobs.md).

``gpusd run --cuda-checkpoint`` looks for the tool on ``PATH`` and asks it (``--help``) whether it has
the actions and the GPU remapping a move needs (``--action lock|checkpoint|restore|unlock``, driver
r570+; ``--device-map``, driver r580+).  A move then checkpoints the CUDA state of the command's
processes and restores it onto the new GPU, without a restart:

    cuda-checkpoint --get-state --pid PID                          (which processes have CUDA state)
    cuda-checkpoint --action lock --pid PID --timeout MS
    cuda-checkpoint --action checkpoint --pid PID
    cuda-checkpoint --action restore --pid PID --device-map OLD=NEW,...
    cuda-checkpoint --action unlock --pid PID

Every call is an argument list (no shell), bounded in time; any failure raises
:class:`CheckpointFailed` after putting the processes back as they were (restored on their old GPUs
and unlocked), and the caller moves the job with the job protocol instead.  Verified here only
against a fake tool: no GPU.
"""

from __future__ import annotations

import os
import shutil
import subprocess

from ..ids import GpuUuid
from ..sanitize import printable

# typing is not imported at run time: start-up time
TYPE_CHECKING = False
if TYPE_CHECKING:  # pragma: no cover
    from typing import Mapping, Sequence

# seconds, every call of the tool
CALL_TIMEOUT = 30.0
# the command's process tree we look at, at most
MAX_PROCESSES = 64
# characters of the tool's output kept for a message
MAX_OUTPUT = 300
_STATES = ("running", "locked", "checkpointed", "failed")


class CheckpointFailed(Exception):
    """The tool failed (or cannot do the move): the message says why, bounded and printable."""


def find_cuda_checkpoint() -> str | None:
    """The path of an executable ``cuda-checkpoint`` on PATH, or None."""
    path = shutil.which("cuda-checkpoint")
    return path if path and os.access(path, os.X_OK) else None


def _printable(text: str) -> str:
    """The tool's output, for a log line or an event: one line, printable, bounded."""

    return printable(" ".join(text.split()), MAX_OUTPUT)


def process_tree(root: int, limit: int = MAX_PROCESSES) -> list[int]:
    """``root`` and its descendants (from /proc), root first, at most ``limit`` processes."""
    children: dict[int, list[int]] = {}
    try:
        names = os.listdir("/proc")
    except OSError:
        return [root]
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read(4096)
            ppid = int(stat.rsplit(b")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(name))
    out: list[int] = []
    todo = [root]
    while todo and len(out) < limit:
        pid = todo.pop(0)
        out.append(pid)
        todo.extend(sorted(children.get(pid, [])))
    return out


class CudaCheckpoint:
    """The ``cuda-checkpoint`` tool at ``path``; every call bounded by ``timeout`` seconds."""

    def __init__(self, path: str, timeout: float = CALL_TIMEOUT) -> None:
        self.path = path
        self.timeout = timeout
        self._support: str | None = None
        self._probed = False

    def _run(self, args: Sequence[str]) -> subprocess.CompletedProcess[str]:
        try:
            return subprocess.run([self.path, *args], capture_output=True, text=True, errors="replace",
                                  timeout=self.timeout, stdin=subprocess.DEVNULL, check=False)
        except subprocess.TimeoutExpired:
            raise CheckpointFailed(f"cuda-checkpoint {' '.join(args[:2])} did not answer within "
                                   f"{self.timeout:g}s") from None
        except OSError as exc:
            raise CheckpointFailed(f"cuda-checkpoint could not be run: {exc.strerror or exc}") from None

    def call(self, args: Sequence[str]) -> str:
        """Run the tool; its output, or :class:`CheckpointFailed` when it exits non-zero."""
        r = self._run(args)
        if r.returncode != 0:
            said = _printable(r.stderr or r.stdout) or "no message"
            raise CheckpointFailed(f"cuda-checkpoint {' '.join(args[:2])} failed (exit {r.returncode}): {said}")
        return r.stdout

    def unsupported(self) -> str | None:
        """Why a move cannot use the tool (it lacks ``--action`` or ``--device-map``), or None.
        Asked once (``--help``), as CRIU's CUDA plugin asks it for ``--action``."""
        if not self._probed:
            try:
                text = self.call(["--help"])
            except CheckpointFailed as exc:
                self._support = str(exc)
            else:
                if "--action" not in text:
                    self._support = "cuda-checkpoint has no --action (driver r570 or later is needed)"
                elif "--device-map" not in text:
                    self._support = ("cuda-checkpoint has no --device-map: it cannot restore onto another GPU "
                                     "(driver r580 or later is needed)")
            self._probed = True
        return self._support

    def state(self, pid: int) -> str | None:
        """``running``, ``locked``, ``checkpointed`` or ``failed``; None when ``pid`` has no CUDA state
        (the tool says no, or says something else)."""
        r = self._run(["--get-state", "--pid", str(pid)])
        word = r.stdout.strip().split("\n", 1)[0].strip().lower() if r.returncode == 0 else ""
        return word if word in _STATES else None

    def cuda_processes(self, root: int) -> list[int]:
        """The processes of ``root``'s tree with CUDA state, all ``running``; CheckpointFailed when
        one is in another state (someone else is checkpointing it) or none has CUDA state."""
        pids: list[int] = []
        for pid in process_tree(root):
            s = self.state(pid)
            if s is None:
                continue
            if s != "running":
                raise CheckpointFailed(f"process {pid} of the command is {s}, not running (cuda-checkpoint "
                                       "--get-state): left alone")
            pids.append(pid)
        if not pids:
            raise CheckpointFailed("no process of the command has CUDA state (cuda-checkpoint --get-state)")
        return pids

    def migrate(self, root: int, mapping: Mapping[str, str]) -> list[int]:
        """Move the CUDA state of ``root``'s processes onto other GPUs: lock, checkpoint, restore with
        ``mapping`` (old UUID -> new UUID, every GPU the processes have), unlock.  The pids moved; on
        any failure the processes are put back on their GPUs and unlocked, then CheckpointFailed."""
        bad = [u for pair in mapping.items() for u in pair if not GpuUuid.is_valid(u)]
        if bad:
            raise CheckpointFailed(f"not a GPU UUID cuda-checkpoint can map: {_printable(repr(bad[0]))}")
        why = self.unsupported()
        if why is not None:
            raise CheckpointFailed(why)
        pids = self.cuda_processes(root)
        device_map = ",".join(f"{old}={new}" for old, new in mapping.items())
        # the tool gives up before we stop waiting
        lock_ms = str(max(1, int(self.timeout * 1000) - 1000))
        touched: list[int] = []
        try:
            for pid in pids:
                touched.append(pid)
                self.call(["--action", "lock", "--pid", str(pid), "--timeout", lock_ms])
            for pid in pids:
                self.call(["--action", "checkpoint", "--pid", str(pid)])
            for pid in pids:
                self.call(["--action", "restore", "--pid", str(pid), "--device-map", device_map])
            for pid in pids:
                self.call(["--action", "unlock", "--pid", str(pid)])
        except Exception as exc:
            # whatever went wrong, nothing stays locked
            left = self.put_back(touched)
            what = str(exc) if isinstance(exc, CheckpointFailed) else _printable(f"{type(exc).__name__}: {exc}")
            raise CheckpointFailed(f"{what}; {left}") from None
        return pids

    def put_back(self, pids: Sequence[int]) -> str:
        """After a failure: each process restored where it was (no device map) and unlocked, as far as
        its state says; what happened, in words.  (With several processes, one already restored onto the
        new GPU is unlocked there: the caller's fallback restarts them all on the new GPU anyway.)"""
        stuck: list[str] = []
        for pid in pids:
            try:
                s = self.state(pid)
                if s == "checkpointed":
                    self.call(["--action", "restore", "--pid", str(pid)])
                    s = self.state(pid)
                if s == "locked":
                    self.call(["--action", "unlock", "--pid", str(pid)])
                    s = self.state(pid)
                if s not in (None, "running"):
                    stuck.append(f"{pid} ({s})")
            except CheckpointFailed as exc:
                stuck.append(f"{pid} ({exc})")
        if stuck:
            return "could not put back process " + ", ".join(stuck)[:MAX_OUTPUT]
        return "the processes run on their old GPUs again"
