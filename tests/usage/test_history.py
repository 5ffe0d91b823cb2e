"""The usage history: what is recorded, what `gpusd report` makes of it, crashes, retention."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from gpusd.cli import main
from gpusd.usage import query, report
from gpusd.usage.db import COARSE, FINE, Retention, connect, prune, size_bytes
from gpusd.usage.recorder import Accountant
from history_helpers import HOUR, T0, record_scenario
from tests_paths import SRC

INTERVAL = 10.0
TOL = INTERVAL / HOUR  # one sampling interval, in hours


def run_report(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(["report", *args])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(scope="module")
def scenario_db(tmp_path_factory: pytest.TempPathFactory) -> Path:
    db = tmp_path_factory.mktemp("hist") / "history.sqlite"
    record_scenario(db, hours=6.0, interval=INTERVAL)
    return db


def period() -> list[str]:
    return ["--from", str(T0), "--to", str(T0 + 6 * HOUR + INTERVAL)]


def test_report_by_user_gives_the_gpu_hours_the_scenario_implies(scenario_db, capsys):
    """Two users, a reservation left idle, one GPU never used (tests/scenarios/two_users.json):
    alice runs on GPU 0 for 2 h; bob leases GPU 1 and runs on it for 3 h (hours 1-4); carol reserves
    GPU 2 for 3 h and never uses it; GPU 3 idles."""
    code, out, _ = run_report(capsys, "--db", str(scenario_db), *period(), "--by", "user", "--format", "json")
    assert code == 0
    r = json.loads(out)
    rows = {row["user"]: row for row in r["rows"]}
    assert set(rows) == {"alice", "bob", "carol"}
    assert rows["alice"]["gpu_hours_used"] == pytest.approx(2.0, abs=TOL)
    assert rows["alice"]["gpu_hours_held"] == 0
    assert rows["bob"]["gpu_hours_used"] == pytest.approx(3.0, abs=TOL)
    assert rows["bob"]["gpu_hours_held"] == pytest.approx(3.0, abs=TOL)
    assert rows["bob"]["idle_held_hours"] == pytest.approx(0.0, abs=TOL)  # his GPU worked while he held it
    assert rows["carol"]["gpu_hours_used"] == 0
    assert rows["carol"]["gpu_hours_held"] == pytest.approx(3.0, abs=TOL)
    assert rows["carol"]["idle_held_hours"] == pytest.approx(3.0, abs=TOL)
    assert rows["alice"]["mean_util"] == pytest.approx(80.0, abs=0.5)
    assert rows["bob"]["mean_util"] == pytest.approx(60.0, abs=0.5)
    # energy: A100 simulated power is 400 W x (0.15 + 0.8 util): alice 2 h at 80 % = 0.8 x 316 W... per hour
    assert rows["alice"]["energy_kwh"] == pytest.approx(2 * 400 * (0.15 + 0.8 * 0.8) / 1000, rel=0.01)
    # the idle reservation is flagged, bob's busy lease is not
    idle = r["idle_reservations"]
    assert [(j["user"], j["kind"]) for j in idle] == [("carol", "lease")]
    assert idle[0]["idle_hours"] == pytest.approx(3.0, abs=TOL)
    # the GPU nobody used
    assert [g["index"] for g in r["never_used"]] == [3]
    assert r["totals"]["gpu_hours_observed"] == pytest.approx(4 * 6.0, abs=4 * TOL)
    # top jobs: bob's 3 GPU-hours before alice's 2
    assert [(j["user"], round(j["gpu_hours"], 2)) for j in r["top_jobs"]] == [("bob", 3.0), ("alice", 2.0)]


def test_report_table_and_csv_name_the_idle_reservation(scenario_db, capsys):
    code, out, _ = run_report(capsys, "--db", str(scenario_db), *period())
    assert code == 0
    assert "GPU-h used" in out and "alice" in out
    idle_part = out.split("Idle reservations")[1]
    assert "carol" in idle_part.splitlines()[3] and "bob" not in idle_part.split("GPUs never used")[0]
    assert "lab-node-1 #3" in out  # never used
    code, out, _ = run_report(capsys, "--db", str(scenario_db), *period(), "--by", "gpu", "--format", "csv")
    lines = out.splitlines()
    assert lines[0].startswith("gpu,gpu_hours_used,gpu_hours_held,idle_held_hours,mean_util,energy_kwh")
    assert len(lines) == 5


def test_report_by_host_and_model_aggregate_every_gpu(scenario_db, capsys):
    _, out, _ = run_report(capsys, "--db", str(scenario_db), *period(), "--by", "model", "--format", "json")
    (row,) = json.loads(out)["rows"]
    assert row["model"] == "A100-SXM4-80GB"
    assert row["gpu_hours_used"] == pytest.approx(5.0, abs=2 * TOL)
    # mean utilisation over all four GPUs and six hours: (2 x 80 + 3 x 60) / 24
    assert row["mean_util"] == pytest.approx((2 * 80 + 3 * 60) / 24, abs=0.2)


def test_a_range_inside_the_recording_counts_only_that_range(scenario_db, capsys):
    _, out, _ = run_report(capsys, "--db", str(scenario_db), "--from", str(T0 + HOUR), "--to", str(T0 + 2 * HOUR),
                           "--format", "json")
    rows = {row["user"]: row for row in json.loads(out)["rows"]}
    assert rows["alice"]["gpu_hours_used"] == pytest.approx(1.0, abs=TOL)
    assert rows["bob"]["gpu_hours_used"] == pytest.approx(1.0, abs=TOL)


def test_bad_periods_and_missing_history_are_clear_errors(tmp_path, capsys):
    code, _, err = run_report(capsys, "--db", str(tmp_path / "none.sqlite"))
    assert code == 1 and "cannot read the history database" in err
    with pytest.raises(SystemExit) as exc:  # a usage error, like any other duration's
        run_report(capsys, "--db", str(tmp_path / "none.sqlite"), "--since", "soon")
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "--since" in err and "not a duration" in err
    code, _, err = run_report(capsys, "--db", "x", "--from", "2026-11-02", "--to", "2026-11-01")
    assert code != 0 and "before" in err


def test_series_picks_the_tier_and_bounds_the_points(scenario_db):
    conn = connect(scenario_db, readonly=True)
    now = T0 + 6 * HOUR
    s = query.series(conn, "0", 6 * HOUR, now, Retention())
    assert s["tier"] == "fine" and len(s["t"]) <= query.MAX_POINTS
    hours = {int((t - T0) // HOUR): u for t, u in zip(s["t"], s["util"]) if u is not None}
    assert hours[0] == 80 and hours[1] == 80 and hours[3] == 0
    # older than the fine tier keeps: from the coarse one
    s = query.series(conn, "0", 30 * 86400, now + 5 * 86400, Retention())
    assert s["tier"] == "hourly" and s["step"] == 3600 and max(u for u in s["util"] if u is not None) == 80
    s = query.series(conn, "0", 4 * 86400, now + 3 * 86400, Retention())
    assert s["tier"] == "coarse" and s["step"] % 300 == 0
    with pytest.raises(KeyError):
        query.series(conn, "GPU-nope", HOUR, now, Retention())
    conn.close()


def test_restart_counts_nothing_twice_and_the_downtime_not_at_all(tmp_path):
    """A daemon stopped (or killed) and started again: the hours before and after add up, the gap
    between them is not counted, and a job still running continues its record."""
    from gpusd.inventory.simulated import SimulatedBackend
    from history_helpers import SCENARIO, Clock

    db = tmp_path / "h.sqlite"
    clock = Clock()
    backend = SimulatedBackend(str(SCENARIO), node="n", clock=clock)

    def run(start: float, end: float) -> None:
        acc = Accountant(connect(db), INTERVAL)  # a new daemon process: nothing in memory
        t = start
        while t <= end:
            clock.t = T0 + t
            acc.add(backend.snapshot())
            t += INTERVAL
        # no close: as if killed after its last commit

    run(0, 1800)
    run(2400, 3600)  # down for 10 minutes
    conn = connect(db, readonly=True)
    observed = conn.execute("SELECT sum(seconds) FROM series WHERE tier=? AND gpu=1", (COARSE,)).fetchone()[0]
    assert observed == pytest.approx(1800 + 1200)
    jobs = conn.execute("SELECT user, start, last, ended, gpu_s FROM jobs WHERE kind='process' "
                        "AND user='alice'").fetchall()
    assert len(jobs) == 1  # alice's job continued across the restart
    user, start, last, ended, gpu_s = jobs[0]
    assert user == "alice" and start == T0 and last == T0 + 3600 and ended is None
    assert gpu_s == pytest.approx(1800 + 1200)
    assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"


def test_sigkill_while_recording_loses_at_most_one_interval(tmp_path):
    """A recorder process killed with SIGKILL mid-write: the database opens, is intact, and holds every
    interval but the last one's (each sample is one transaction)."""
    db = tmp_path / "h.sqlite"
    code = textwrap.dedent(f"""
        import sys, time
        sys.path[:0] = [{str(SRC)!r}]
        from gpusd.model import GpuInfo, HostSnapshot, ProcessInfo
        from gpusd.usage.db import connect
        from gpusd.usage.recorder import Accountant
        acc = Accountant(connect({str(db)!r}), 1.0)
        for i in range(10**6):
            gpus = [GpuInfo(index=k, uuid=f"GPU-{{k}}", utilization_gpu=50.0, power_draw=100.0,
                            processes=[ProcessInfo(pid=10 + k, user="u")]) for k in range(8)]
            acc.add(HostSnapshot(hostname="h", node_id="n", timestamp=1e9 + i, gpus=gpus))
            print(i, flush=True)
    """)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    last = -1
    assert proc.stdout is not None
    for line in proc.stdout:
        last = int(line)
        if last >= 300:
            break
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    conn = connect(db)  # the daemon's restart: opens read-write, recovers the WAL
    assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    per_gpu = [r[0] for r in conn.execute("SELECT sum(seconds) FROM series WHERE tier=? GROUP BY gpu", (FINE,))]
    assert len(per_gpu) == 8
    # everything up to the last sample it reported is there (more may have landed before the kill)...
    assert min(per_gpu) >= last - 1
    # ...and exactly the intervals between its first and its last committed sample, on every GPU
    span = conn.execute("SELECT max(last) - min(start) FROM jobs").fetchone()[0]
    assert per_gpu == [span] * 8  # one transaction per sample: never half a sample, never one twice


def test_retention_and_the_size_bound_drop_the_oldest_data(tmp_path):
    db = tmp_path / "h.sqlite"
    conn = connect(db)
    acc = Accountant(conn, 300.0, Retention(fine_keep=3600, retention=10 * 86400))
    from gpusd.model import GpuInfo, HostSnapshot

    for i in range(20 * 288):  # 20 days at 5 minutes
        gpus = [GpuInfo(index=k, uuid=f"GPU-{k}", utilization_gpu=10.0) for k in range(8)]
        acc.add(HostSnapshot(hostname="h", node_id="n", timestamp=T0 + i * 300, gpus=gpus))
    end = T0 + 20 * 86400
    prune(conn, end, Retention(fine_keep=3600, retention=10 * 86400))
    oldest_coarse = conn.execute("SELECT min(ts) FROM series WHERE tier=?", (COARSE,)).fetchone()[0]
    oldest_fine = conn.execute("SELECT min(ts) FROM series WHERE tier=?", (FINE,)).fetchone()[0]
    assert oldest_coarse >= end - 10 * 86400 - 300 and oldest_fine >= end - 3600 - 10
    before = size_bytes(conn)
    bound = before // 2
    prune(conn, end, Retention(fine_keep=3600, retention=10 * 86400, max_bytes=bound))
    assert size_bytes(conn) <= bound
    newest = conn.execute("SELECT max(ts) FROM series WHERE tier=?", (COARSE,)).fetchone()[0]
    assert newest >= end - 600  # the newest data stays

    # a bound smaller than two days of fine data: the fine tier is trimmed too, oldest hours first
    conn = connect(tmp_path / "fine.sqlite")
    acc = Accountant(conn, 10.0)
    for i in range(6 * 360):  # six hours at 10 s
        gpus = [GpuInfo(index=k, uuid=f"GPU-{k}", utilization_gpu=10.0) for k in range(8)]
        acc.add(HostSnapshot(hostname="h", node_id="n", timestamp=T0 + i * 10, gpus=gpus))
    end = T0 + 6 * HOUR
    bound = size_bytes(conn) // 2
    prune(conn, end, Retention(max_bytes=bound))
    assert size_bytes(conn) <= bound
    oldest, newest = conn.execute("SELECT min(ts), max(ts) FROM series WHERE tier=?", (FINE,)).fetchone()
    assert oldest >= T0 + HOUR and newest >= end - 60


def test_the_database_is_private_and_never_opened_through_a_link(tmp_path):
    db = tmp_path / "h.sqlite"
    connect(db).close()
    assert (db.stat().st_mode & 0o777) == 0o600
    link = tmp_path / "link.sqlite"
    link.symlink_to(tmp_path / "elsewhere.sqlite")
    with pytest.raises(OSError):
        connect(link)
    assert not (tmp_path / "elsewhere.sqlite").exists()


def test_merging_many_hosts_and_hostile_answers():
    """Answers from other daemons are hostile: wrong types are skipped, numbers must be numbers."""
    good = {"host": "a", "from": 0, "to": 10, "private": True,
            "gpus": [{"uuid": "G1", "index": 0, "model": "NVIDIA H100", "seconds": 3600, "util_s": 1800 * 100,
                      "util_n": 3600, "energy_j": 3.6e6, "busy_s": 1800, "held_s": 0}],
            "users": [{"gpu": "G1", "kind": "use", "user": "x", "seconds": 1800, "util_s": 1800 * 100,
                       "energy_j": 3.6e6, "idle_s": 0}], "jobs": [], "idle_reservations": [], "timeline": {}}
    bad = {"host": ["x"], "from": "0", "private": True, "gpus": ["nope", {"uuid": 5, "seconds": "many"}],
           "users": [None, {"gpu": "G9", "kind": "use", "user": 7, "seconds": float("nan")}], "jobs": [1],
           "timeline": {"points": [[1, "x"], "y"]}}
    r = report.build([good, bad], "user")
    rows = {row["user"]: row for row in r["rows"]}
    assert rows["x"]["gpu_hours_used"] == 0.5 and rows["x"]["energy_kwh"] == 1.0
    assert r["totals"]["gpus"] == 1
    r = report.build([good], "host")
    assert r["rows"][0]["host"] == "a" and r["rows"][0]["mean_util"] == 50.0


def test_the_tiers_agree_on_a_range_with_partial_hours(scenario_db):
    """A range older than the fine tier is read as whole hours (hourly tier) plus its partial hours
    (5-minute tier): the same figures as the fine tier gives, to the 5-minute bucket."""
    conn = connect(scenario_db, readonly=True)
    start, end = T0 + 1500, T0 + 5 * HOUR + 600
    fine = query.usage(conn, start, end, T0 + 6 * HOUR, Retention(), True)
    old = query.usage(conn, start, end, T0 + 10 * 86400, Retention(), True)
    assert fine["tier"] == "fine" and old["tier"] == "coarse"
    assert query.spans(start, end, T0 + 10 * 86400, Retention())[1][0] == 2  # the hourly tier in the middle

    def per_user(a):
        out = {}
        for u in a["users"]:
            out[(u["user"], u["kind"])] = out.get((u["user"], u["kind"]), 0) + u["seconds"]
        return out

    f, o = per_user(fine), per_user(old)
    assert set(f) == set(o)
    for k in f:
        assert o[k] == pytest.approx(f[k], abs=300)
    conn.close()


@pytest.mark.parametrize("flag, value, named", [("--retention", "0.5", "--retention"),
                                                ("--history-size", "0.1", "--history-size"),
                                                ("--idle-after", "1e9", "--idle-after")])
def test_history_options_out_of_range_are_usage_errors(flag, value, named, tmp_path):
    env = dict(os.environ, GPUSD_STATE_DIR=str(tmp_path), GPUSD_INTERFACES="127.0.0.1", PYTHONPATH=str(SRC))
    r = subprocess.run([sys.executable, "-m", "gpusd", "start", "--foreground", "--simulate", "1xT4",
                        "--interface", "127.0.0.1", "--port", "0", flag, value], env=env, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2 and named in r.stderr and "Traceback" not in r.stderr


def _answer_with_user(name: str) -> dict:
    return {"host": "h", "from": 0, "to": 3600, "private": True,
            "gpus": [{"uuid": "G1", "index": 0, "model": "NVIDIA A100", "seconds": 3600, "util_s": 0, "util_n": 3600,
                      "energy_j": 0, "busy_s": 3600, "held_s": 0}],
            "users": [{"gpu": "G1", "kind": "use", "user": name, "seconds": 3600, "util_s": 0, "energy_j": 0,
                       "idle_s": 0}],
            "jobs": [{"kind": "process", "user": name, "command": name, "gpus": ["G1"], "start": 0, "last": 3600,
                      "gpu_s": 3600}], "idle_reservations": [], "timeline": {"points": [[0, 5.0]]}}


def test_user_names_cannot_inject_into_html_csv_or_the_terminal():
    """A user name is whatever the account is called: it must not end a script in the HTML report,
    start a formula in a spreadsheet, or move the terminal's cursor."""
    from gpusd.views.report import render

    evil = "</script><script>alert(1)</script><b>x"
    r = report.build([_answer_with_user(evil)], "user")
    html = render(r, "html")
    assert "<script>alert(1)" not in html and "<b>x" not in html
    assert "&lt;/script&gt;&lt;script&gt;alert(1)" in html  # shown, escaped, in the tables
    csv_text = render(report.build([_answer_with_user("=HYPERLINK(\"http://x\")")], "user"), "csv")
    import csv

    (header, row) = list(csv.reader(csv_text.splitlines()))
    assert row[0] == "'=HYPERLINK(\"http://x\")"  # text to a spreadsheet, not a formula
    table = render(report.build([_answer_with_user("mallory\x1b[2J\x1b]0;owned\x07")], "user"), "table")
    assert "\x1b" not in table and "\x07" not in table and "mallory" in table



def test_no_control_byte_of_a_user_name_reaches_the_html_report_or_json():
    """``cat report.html`` in a terminal: the HTML rule (gpusd.sanitize.for_html) strips escape
    sequences and control bytes as the terminal rule does; JSON carries them only as \\u escapes."""
    from gpusd.sanitize import dumps
    from gpusd.views.report import render

    r = report.build([_answer_with_user("mallory\x1b[2J\x1b]0;owned\x07\x9b31m")], "user")
    html = render(r, "html")
    body = html.split("<script", 1)[0]  # the tables (the embedded chart data is JSON: \u escapes)
    assert "mallory" in body
    assert not [c for c in html if (ord(c) < 0x20 and c not in "\n\t") or 0x7f <= ord(c) <= 0x9f]
    assert not [c for c in dumps({"u": "a\x1b[2J\x07\x9b"}) if ord(c) < 0x20 or ord(c) >= 0x7f]


def test_job_records_hold_owner_gpus_times_peak_memory_and_energy(scenario_db, tmp_path):
    conn = connect(scenario_db, readonly=True)
    rows = {r[0]: r[1:] for r in conn.execute(
        "SELECT user, kind, gpus, start, ended, gpu_s, util_s, energy_j, peak_mem, idle_s FROM jobs "
        "WHERE kind='process'")}
    kind, gpus, start, ended, gpu_s, util_s, energy, peak, idle = rows["alice"]
    assert json.loads(gpus) == [r[0] for r in conn.execute("SELECT uuid FROM gpus WHERE idx=0")]
    assert start == T0 and ended == pytest.approx(T0 + 2 * HOUR - INTERVAL)
    assert gpu_s == pytest.approx(2 * HOUR, abs=INTERVAL) and util_s / gpu_s == pytest.approx(80)
    assert energy == pytest.approx(2 * HOUR * 400 * (0.15 + 0.8 * 0.8), rel=0.01)
    assert peak == 20 * 2**30 and idle == 0
    lease = conn.execute("SELECT user, gpu_s, idle_s FROM jobs WHERE kind='lease' AND user='carol'").fetchone()
    assert lease[1] == pytest.approx(3 * HOUR, abs=INTERVAL) and lease[2] == pytest.approx(lease[1])
    conn.close()
    # the uid of an account of this machine is looked up on the daemon's host
    import getpass
    import pwd

    from gpusd.model import GpuInfo, HostSnapshot, ProcessInfo

    me = getpass.getuser()
    acc = Accountant(connect(tmp_path / "u.sqlite"), 1.0)
    acc.add(HostSnapshot(hostname="h", node_id="n", timestamp=T0, gpus=[
        GpuInfo(index=0, uuid="G", processes=[ProcessInfo(pid=1, user=me)])]))
    assert acc.conn.execute("SELECT uid FROM jobs").fetchone()[0] == pwd.getpwnam(me).pw_uid
