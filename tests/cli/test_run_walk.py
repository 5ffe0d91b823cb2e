"""`gpusd run -n 2 -- cmd` is the library's once its command line is parsed (docs/architecture.md, "Where to
start"): the CLI turns the arguments into one JobSpec (``gpusd.cli.options.job_spec``) and hands it to
``gpusd.jobs.supervisor.run_job``; from then until the job's exit status comes back, no code of a
``gpusd.cli`` module runs -- in any thread of the process.  A profiler (``sys.setprofile`` and
``threading.setprofile``) records every Python function and module body entered, in a fresh interpreter,
on a simulated host (no daemon: the lease is taken in the test's own lock directory)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"

# Run main() under a profiler; report (on stderr) the gpusd.cli code entered while the library ran the job.
PROBE = r"""
import json, sys, threading

seen = {"spec": 0, "run_job": 0, "returned": 0}
inside = []
entered = []

def prof(frame, event, arg):
    if event not in ("call", "return"):
        return
    module = frame.f_globals.get("__name__", "")
    name = frame.f_code.co_name
    if event == "return":
        if module == "gpusd.cli.options" and name == "job_spec":
            seen["spec"] += 1
        elif module == "gpusd.jobs.supervisor" and name == "run_job" and inside:
            inside.pop()
            seen["returned"] += 1
        return
    if module == "gpusd.jobs.supervisor" and name == "run_job" and seen["spec"]:
        inside.append(frame)
        seen["run_job"] += 1
    elif inside and module.startswith("gpusd.cli"):
        entered.append(f"{module}:{name} ({threading.current_thread().name})")

threading.setprofile(prof)
sys.setprofile(prof)
if PLANT:  # the self-check: CLI code called from inside the library's run
    from gpusd.cli.alloc import _quote
    from gpusd.jobs import supervisor

    real = supervisor.Supervisor.run

    def run(self):
        t = threading.Thread(target=_quote, args=("x",), name="planted")
        t.start()
        t.join()
        _quote("y")
        return real(self)

    supervisor.Supervisor.run = run
from gpusd.cli import main
try:
    rc = main(sys.argv[1:])
except SystemExit as exc:
    rc = exc.code
sys.setprofile(None)
threading.setprofile(None)
sys.stderr.write("\nWALK " + json.dumps({"rc": rc, "seen": seen, "entered": entered}) + "\n")
"""


def _walk(*args: str, plant: bool = False) -> dict[str, object]:
    env = dict(os.environ, PYTHONPATH=str(SRC))
    r = subprocess.run([sys.executable, "-c", f"PLANT = {plant}\n" + PROBE, *args], env=env, capture_output=True,
                       text=True, timeout=120)
    line = next((ln for ln in r.stderr.splitlines() if ln.startswith("WALK ")), None)
    assert line is not None, r.stderr
    walk: dict[str, object] = json.loads(line[len("WALK "):])
    return walk


def test_a_run_calls_no_cli_code_once_its_spec_is_made(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    walk = _walk("run", "-n", "2", "--simulate", "4xA100-80GB", "--",
                 "sh", "-c", f'echo "$CUDA_VISIBLE_DEVICES" > {marker}')
    assert walk["rc"] == 0, walk
    assert marker.read_text().strip().count(",") == 1  # the command ran, on two GPUs
    # the walk went as the doc says: one spec made by the CLI, one run of it by the library, which came back
    assert walk["seen"] == {"spec": 1, "run_job": 1, "returned": 1}
    assert walk["entered"] == []


def test_the_walk_sees_cli_code_run_inside_the_library_in_any_thread() -> None:
    """The probe is not blind: CLI code the library's run would call (here planted in the supervisor's run, in
    a thread of its own and in the main thread) is reported."""
    walk = _walk("run", "-n", "2", "--simulate", "4xA100-80GB", "--", "true", plant=True)
    assert walk["rc"] == 0, walk
    assert walk["entered"] == ["gpusd.cli.alloc:_quote (planted)", "gpusd.cli.alloc:_quote (MainThread)"]
