"""The fault campaign's offline checker (bench/faults_check.py, docs/faults.md) on synthetic records: it
must report each kind of violation it promises to find, put it down to the fault that was running, and
report nothing on a clean log."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parents[2] / "bench"
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))

import faults_check  # noqa: E402

S = faults_check.NS
GPU_A, GPU_B = "GPU-aaaa", "GPU-bbbb"
GPU_HOST = {GPU_A: "node-1", GPU_B: "node-1"}


def job(name: str, gpu: str, start: float, end: float | None, kind: str = "run", rc: int | None = 0,
        reason: str = "", wall0: float = 1000.0) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """A job's own lines (start, and end unless None) and its launcher's record."""
    lines = [{"ev": "start", "job": name, "t": int(start * S), "wall": wall0 + start, "cvd": gpu}]
    if end is not None:
        lines.append({"ev": "end", "job": name, "t": int(end * S), "wall": wall0 + end, "cvd": gpu})
    launch = {"job": name, "kind": kind, "t0": int((start - 0.5) * S), "t1": int(((end or start) + 0.5) * S),
              "rc": rc, "reason": reason}
    return lines, launch


def observe(t: float, *devices: str) -> dict[str, Any]:
    return {"t": int(t * S), "host": "node-1", "ok": True,
            "leases": [{"device": d, "lease_id": f"L{d}", "pid": 1} for d in devices]}


def run_check(jobs: list[tuple[list[dict[str, Any]], dict[str, Any]]], faults: list[dict[str, Any]] = (),
              observations: list[dict[str, Any]] | None = None, history: list[dict[str, Any]] | None = None,
              ) -> faults_check.Report:
    lines = [ln for ls, _ in jobs for ln in ls]
    return faults_check.check(lines, [lc for _, lc in jobs], list(faults), observations or [], history, GPU_HOST,
                              ttl_s=5, delay_s=10, horizon=int(1000 * S), kinds=["kill9", "sigstop"])


def kinds(report: faults_check.Report) -> list[str]:
    return [v.what for v in report.violations]


def test_a_clean_log_has_no_violation() -> None:
    jobs = [job("a", GPU_A, 10, 13), job("b", GPU_A, 13.5, 16), job("c", GPU_B, 11, 15)]
    obs = [observe(t, GPU_A, GPU_B) for t in (12, 14.5)]
    hist = [{"gpus": [GPU_A], "start": 1010.1, "last": 1013, "ended": 1013},
            {"gpus": [GPU_A], "start": 1013.6, "last": 1016, "ended": 1016},
            {"gpus": [GPU_B], "start": 1011.2, "last": 1015, "ended": None}]
    report = run_check(jobs, observations=obs, history=hist)
    assert report.violations == [] and report.total() == 0
    assert report.started == 3 and report.sampled == 3


def test_two_jobs_on_one_gpu_at_overlapping_times_are_a_double_grant_put_down_to_the_running_fault() -> None:
    jobs = [job("a", GPU_A, 10, 20), job("b", GPU_A, 15, 18), job("c", GPU_B, 15, 18)]
    faults = [{"kind": "kill9", "host": "node-1", "t0": int(12 * S), "t1": int(14 * S)},
              {"kind": "sigstop", "host": "node-1", "t0": int(100 * S), "t1": int(101 * S)}]
    report = run_check(jobs, faults)
    assert kinds(report) == ["double_grants"]
    [v] = report.violations
    assert "b" in v.detail and "a" in v.detail and GPU_A in v.detail
    assert v.faults == ["kill9"]
    counts = report.counts()
    assert counts["kill9"]["double_grants"] == 1 and counts["sigstop"]["double_grants"] == 0
    assert report.injected == {"kill9": 1, "sigstop": 1}
    assert "kill9" in report.table() and "violations 1" in report.table()


def test_a_job_still_running_when_its_launcher_ended_counts_as_using_its_gpu() -> None:
    # no end line: the job used its GPU until its launcher returned (at 30.5 s)
    jobs = [job("a", GPU_A, 10, None, rc=137, reason="gpusd: the command was killed (SIGKILL)"),
            job("b", GPU_A, 25, 28)]
    jobs[0][1]["t1"] = int(30.5 * S)
    report = run_check(jobs)
    assert kinds(report) == ["double_grants"]
    assert report.counts()["none"]["double_grants"] == 1  # no fault ran then


def test_a_job_that_started_and_never_ended_without_a_reason_is_lost() -> None:
    silent = job("a", GPU_A, 10, None, rc=0)
    said = job("b", GPU_B, 10, None, rc=1, reason="gpusd: lost the lease on GPU-bbbb: stopping")
    mute = job("c", GPU_B, 40, None, rc=143, reason="")
    report = run_check([silent, said, mute])
    lost = [v for v in report.violations if v.what == "lost_jobs"]
    assert sorted(v.detail.split()[1] for v in lost) == ["a", "c"]


def test_a_running_jobs_gpu_missing_from_its_hosts_leases_is_a_lost_lease() -> None:
    jobs = [job("a", GPU_A, 10, 20), job("b", GPU_B, 10, 20)]
    obs = [observe(12, GPU_A, GPU_B), observe(15, GPU_B), observe(17, GPU_B),
           {"t": int(16 * S), "host": "node-1", "ok": False, "error": "timeout"}]
    report = run_check(jobs, [{"kind": "kill9", "host": "node-1", "t0": int(14 * S), "t1": int(15 * S)}], obs)
    assert kinds(report) == ["lost_leases"]  # once for the job, not per observation
    assert "job a" in report.violations[0].detail and report.violations[0].faults == ["kill9"]


def test_a_lease_seen_past_ttl_and_delay_after_its_holder_ended_is_stale() -> None:
    jobs = [job("a", GPU_A, 10, 20)]  # launcher ended at 20.5 s; allowance 5 + 10 s
    ok = run_check(jobs, observations=[observe(t, GPU_A) for t in (15, 30, 35)])
    assert ok.violations == []
    late = run_check(jobs, observations=[observe(t, GPU_A) for t in (15, 36, 40)])
    assert kinds(late) == ["stale_leases"]  # once per lease


def test_a_finished_job_missing_from_the_usage_history_is_a_history_miss() -> None:
    jobs = [job("a", GPU_A, 10, 13), job("b", GPU_B, 10, 13)]
    hist = [{"gpus": [GPU_A], "start": 1010.0, "last": 1013.0, "ended": 1013.0},
            {"gpus": [GPU_B], "start": 1100.0, "last": 1110.0, "ended": 1110.0}]  # another time: not b's
    report = run_check(jobs, history=hist)
    assert kinds(report) == ["history_misses"] and "job b" in report.violations[0].detail


def test_torn_and_foreign_lines_of_a_log_are_skipped(tmp_path: Path) -> None:
    log = tmp_path / "jobs.jsonl"
    log.write_text('{"ev": "start", "job": "a", "t": 1, "cvd": "GPU-aaaa"}\n[1, 2]\nnot json\n{"ev": "en')
    assert faults_check.read_jsonl(log) == [{"ev": "start", "job": "a", "t": 1, "cvd": "GPU-aaaa"}]
    assert faults_check.read_jsonl(tmp_path / "missing") == []


def test_indices_are_read_as_the_gpus_of_the_host_whose_namespace_the_job_ran_in() -> None:
    # two hosts' GPU 0 are two GPUs: jobs on each at once are no double grant, on one host they are
    table = {"4026531": {"0": GPU_A}, "4026532": {"0": GPU_B}}
    lines = [{"ev": "start", "job": "a", "t": 10 * S, "cvd": "0", "net": "4026531"},
             {"ev": "start", "job": "b", "t": 11 * S, "cvd": "0", "net": "4026532"},
             {"ev": "start", "job": "c", "t": 12 * S, "cvd": "0", "net": "4026531"},
             {"ev": "start", "job": "d", "t": 13 * S, "cvd": "0", "net": "999"}]
    resolved = faults_check.resolve_indices(lines, table)
    assert [ln["cvd"] for ln in resolved] == [GPU_A, GPU_B, GPU_A, "0"]
    report = faults_check.check(resolved[:3], [], [], [], None, GPU_HOST, 5, 10, horizon=20 * S)
    [v] = [v for v in report.violations if v.what == "double_grants"]
    assert "job c" in v.detail and "job a" in v.detail


def test_a_violation_is_put_down_to_the_last_fault_on_its_host_before_it() -> None:
    jobs = [job("a", GPU_A, 10, 20), job("b", GPU_A, 16, 18)]  # double grant at 16 s on node-1
    faults = [{"kind": "kill9", "host": "node-1", "t0": int(12 * S), "t1": int(13 * S)},
              {"kind": "sigstop", "host": "node-2", "t0": int(14 * S), "t1": int(15 * S)},  # another host
              {"kind": "corrupt", "host": "node-1", "t0": int(11 * S), "t1": int(12 * S)}]  # earlier
    report = run_check(jobs, faults)
    [v] = report.violations
    assert v.host == "node-1" and v.faults == ["kill9"]


def test_recheck_reads_a_kept_campaign_and_exits_1_on_a_violation(tmp_path: Path) -> None:
    import json
    import subprocess

    (a_lines, a_launch), (b_lines, b_launch) = job("a", GPU_A, 10, 20), job("b", "0", 15, 18, kind="fleet")
    b_lines = [dict(ln, net="77") for ln in b_lines]  # a fleet job that got an index, on node-1's namespace
    (tmp_path / "jobs.jsonl").write_text("".join(json.dumps(ln) + "\n" for ln in a_lines + b_lines))
    (tmp_path / "launches.jsonl").write_text(json.dumps(a_launch) + "\n" + json.dumps(b_launch) + "\n")
    (tmp_path / "faults.jsonl").write_text(json.dumps({"kind": "kill9", "host": "node-1", "t0": 14 * S,
                                                       "t1": 15 * S}) + "\n")
    (tmp_path / "leases.jsonl").write_text("")
    (tmp_path / "meta.json").write_text(json.dumps({
        "gpu_host": GPU_HOST, "indices": {"77": {"0": GPU_A}}, "ttl": 5, "delay": 10, "horizon": 100 * S,
        "sample": 10, "seed": 1, "kinds": ["kill9"]}))
    r = subprocess.run([sys.executable, str(BENCH / "bench_faults.py"), "--recheck", str(tmp_path), "--json"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 1, r.stdout + r.stderr
    summary = json.loads(r.stdout.strip().splitlines()[-1])
    assert summary["violations"] == 1 and summary["counts"]["kill9"]["double_grants"] == 1
    assert "Traceback" not in r.stderr
    r = subprocess.run([sys.executable, str(BENCH / "bench_faults.py"), "--recheck", str(tmp_path / "nothing")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "no campaign records" in r.stderr and "Traceback" not in r.stderr


def test_a_second_daemon_that_came_up_and_a_daemon_that_died_are_violations() -> None:
    faults = [{"kind": "second_daemon", "host": "node-1", "t0": 10 * S, "t1": 12 * S, "second_started": True},
              {"kind": "second_daemon", "host": "node-2", "t0": 20 * S, "t1": 22 * S, "second_started": False},
              {"kind": "disk_full", "host": "node-2", "t0": 40 * S, "t1": 43 * S, "died": True}]
    report = run_check([], faults)
    assert sorted(kinds(report)) == ["daemon_deaths", "second_daemons"]
    counts = report.counts()
    assert counts["second_daemon"]["second_daemons"] == 1 and counts["disk_full"]["daemon_deaths"] == 1


def test_a_job_that_ran_while_its_daemons_clock_was_stepped_is_not_compared_with_the_history() -> None:
    # only the daemon's wall clock moves (libfaketime): its history is stamped on another clock then
    jobs = [job("a", GPU_A, 10, 13), job("b", GPU_B, 30, 33)]
    step = [{"kind": "clock_step", "host": "node-1", "t0": 9 * S, "t1": 12 * S, "step_s": 40}]
    report = run_check(jobs, step, history=[])
    assert kinds(report) == ["history_misses"] and "job b" in report.violations[0].detail
    assert report.sampled == 1
