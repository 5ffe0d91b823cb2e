"""The fault campaign's short run (bench/bench_faults.py, docs/faults.md): root daemons with fake NVIDIA GPUs
as the lease authorities of a namespace LAN, short jobs through every path (local run, run --wait,
run --fleet over SSH, reserve), and one of every fault kind at least; the offline checker must find no
double grant, no lost job, no lost or stale lease and no job missing from the history.

The campaign is a separate process (it runs in its own mount namespace) bounded here; it cleans up every
namespace and process it started, by pid, also when it is stopped.  Skipped (with the reason) without
root or ``ip netns``."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from netns import unavailable

BENCH = Path(__file__).resolve().parents[2] / "bench" / "bench_faults.py"
DURATION = 60  # seconds of jobs and faults (more until each kind ran once); with set-up and checks 2-3 minutes


@pytest.mark.timeout(420)
def test_a_short_fault_campaign_finds_no_double_grant_lost_job_lost_lease_or_history_miss(tmp_path: Path) -> None:
    why = unavailable()
    if why:
        pytest.skip(why)
    out = tmp_path / "campaign"
    argv = [sys.executable, str(BENCH), "--duration", str(DURATION), "--seed", "31", "--hosts", "2", "--gap", "2",
            "--min-rounds", "1", "--out", str(out), "--json"]
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        text, _ = p.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        p.send_signal(signal.SIGTERM)  # the campaign cleans up on SIGTERM
        text, _ = p.communicate(timeout=60)
        pytest.fail(f"the campaign did not finish in 300 s:\n{text[-3000:]}")
    assert p.returncode in (0, 1), text[-3000:]  # 2: it could not run at all
    summary = json.loads(text.strip().splitlines()[-1])
    ran = summary["injected"]
    assert {"kill9", "sigstop", "split_long", "disk_full", "corrupt", "second_daemon"} <= set(ran), text
    assert all(ran[k] >= 1 for k in ran), text  # every kind not skipped (with its reason), at least once
    assert summary["started"] >= 10, text  # jobs really ran between the faults
    assert summary["violations"] == 0, text
