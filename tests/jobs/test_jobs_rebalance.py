"""Issue 13: rebalancing (docs/jobs.md) — a daemon with --rebalance-policy on the fake NVML moves a
preemptible job off a GPU the test makes hot, pauses a pausable job while its GPU is too hot, and
never moves a job twice within the rate-limit period under an oscillating load."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from daemon_helpers import unique_session
from fakenvml import fake_uuid, make_gpus
from gpusd.jobs.rebalance import Policy, Rebalancer
from gpusd.jobs.record import JobRecord
from gpusd.model import GpuInfo, HostSnapshot
from jobs_helpers import (
    GPUSD,
    fake_calls,
    fake_cuda_checkpoint,
    fake_state,
    job_env,
    job_script,
    jobs_json,
    leases_json,
    log_events,
)
from waiting import wait_until_sync


@pytest.fixture
def daemon(fake_nvml, cli_env, tmp_path):
    """A daemon sampling the fake NVML every 0.2 s, rebalancing after 0.5 s of heat."""
    policy = tmp_path / "policy.json"
    policy.write_text(json.dumps({"util_above": 90, "hot_for": 0.5, "idle_below": 10, "min_interval": 600,
                                  "pause_temp": 90, "resume_margin": 5}))
    state = tmp_path / "state"
    session = unique_session("jobs")
    env = job_env(cli_env, GPUSD_STATE_DIR=str(state), GPUSD_INTERFACES="127.0.0.1", GPUSD_MDNS_FAST="1")
    for var in ("GPUSD_SIMULATE", "GPUSD_HOSTNAME", "GPUSD_TOKEN"):
        env.pop(var, None)
    fake_nvml.write(make_gpus(3, util_gpu=0))
    r = subprocess.run([*GPUSD, "start", "--interface", "127.0.0.1", "--port", "0", "--session",
                        session, "--interval", "0.2", "--fleet-view", "off", "--no-record",
                        "--rebalance-policy", str(policy)], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    info = json.loads((state / "gpusd.json").read_text())
    try:
        yield {"env": env, "state": state, "port": info["port"], "session": session}
    finally:
        subprocess.run([*GPUSD, "stop", "--force"], env=env, capture_output=True, timeout=60)


def _hot(fake_nvml, hot: dict[int, dict[str, int]]) -> None:
    gpus = make_gpus(3, util_gpu=0)
    for i, values in hot.items():
        for k, v in values.items():
            setattr(gpus[i], k, v)
    fake_nvml.write(gpus)


def test_a_job_on_a_hot_gpu_moves_to_an_idle_one_and_finishes_there(daemon, fake_nvml, tmp_path):
    log, ckpt, result = tmp_path / "log", tmp_path / "ckpt", tmp_path / "result"
    env = job_env(daemon["env"], JOBLOG=str(log), CKPT=str(ckpt), RESULT=str(result), STEPS="1000")
    events = subprocess.Popen(["curl", "-sN", f"http://127.0.0.1:{daemon['port']}/api/v1/events"],
                              stdout=subprocess.PIPE, text=True) if _has_curl() else None
    watch = subprocess.Popen([*GPUSD, "watch", "--json", "--session", daemon["session"], "--duration", "90"],
                             env=env, text=True, stdout=subprocess.PIPE)
    p = subprocess.Popen([*GPUSD, "run", "--preemptible", "--grace", "30", "--", sys.executable,
                          str(job_script(tmp_path))], env=env, text=True, stderr=subprocess.PIPE)
    watched = _Lines(watch)
    try:
        start = wait_until_sync(lambda: [e for e in log_events(log) if e["event"] == "start"], timeout=30)
        assert start[0]["gpus"] == "0"
        # gpusd watch follows the daemon (its first line: the host) before the move can happen: on a loaded
        # machine its start-up and browse could otherwise outlast the 0.5 s of heat the policy waits for
        assert watched.until(lambda events: events, timeout=60), "gpusd watch printed nothing within 60 s"
        _hot(fake_nvml, {0: {"util_gpu": 99}})  # something else loads GPU 0
        assert p.wait(timeout=120) == 0
        got = log_events(log)
        starts = [e for e in got if e["event"] == "start"]
        assert [s["gpus"] for s in starts] == ["0", "1"]  # moved to the idle GPU 1 ...
        assert [e for e in got if e["event"] == "done"][0]["gpus"] == "1"  # ... and finished there
        assert starts[1]["step"] == [e for e in got if e["event"] == "stopped"][0]["step"] > 0  # from its checkpoint
        assert result.read_text() == "1000"
        text = (daemon["state"] / "gpusd.log").read_text()
        assert "GPU 0 utilisation 99% > 90%" in text and "GPU 1 is idle" in text  # the reason, in the log
        assert "moving to GPU 1" in p.stderr.read()
        # the watch prints the move as it hears it (a loaded machine may run it seconds late): wait for it
        moves = [e["data"] for e in watched.until(lambda events: [e for e in events if e["event"] == "job"],
                                                  timeout=30)]
        assert moves and moves[0]["action"] == "move" and moves[0]["ok"] is True  # gpusd watch shows it ...
        assert "GPU 0 utilisation 99% > 90%" in moves[0]["reason"]  # ... with its reason
        if events is not None:
            seen = wait_until_sync(lambda: _job_events(events), timeout=10)
            assert seen[0]["action"] == "move" and seen[0]["ok"] and seen[0]["to"] == 1
            assert "utilisation 99%" in seen[0]["reason"]
    finally:
        for proc in (p, events, watch):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()


def _has_curl() -> bool:
    import shutil

    return shutil.which("curl") is not None


class _Lines:
    """The JSON lines a process prints, read from its descriptor as they come."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.fd = proc.stdout.fileno()
        self.text = ""

    def until(self, found, timeout: float) -> list[dict[str, object]]:
        """Read until ``found(events so far)`` is true (returned) or ``timeout`` seconds pass ([])."""
        import selectors
        import time

        sel = selectors.DefaultSelector()
        sel.register(self.fd, selectors.EVENT_READ)
        deadline = time.monotonic() + timeout
        while True:
            events = [json.loads(line) for line in self.text.split("\n")[:-1] if line.strip()]
            hit = found(events)
            left = deadline - time.monotonic()
            if hit or left <= 0:
                return hit or []
            if sel.select(timeout=left):
                chunk = os.read(self.fd, 1 << 16)
                if not chunk:
                    return found(events) or []
                self.text += chunk.decode()


def _job_events(proc: subprocess.Popen[str]) -> list[dict[str, object]]:
    import selectors

    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    out: list[dict[str, object]] = []
    event = None
    while sel.select(timeout=0.5):
        line = proc.stdout.readline()
        if not line:
            break
        if line.startswith("event:"):
            event = line.split(":", 1)[1].strip()
        elif line.startswith("data:") and event == "job":
            out.append(json.loads(line.split(":", 1)[1]))
            return out
    return out


# -- with cuda-checkpoint: a fake tool here, the real one only on a GPU machine ---------

def _ckpt_env(daemon, tmp_path, **extra: str) -> tuple[dict[str, str], object]:
    bindir, state = fake_cuda_checkpoint(tmp_path)
    env = job_env(daemon["env"], PATH=f"{bindir}:{os.environ['PATH']}", FAKE_CKPT_DIR=str(state), **extra)
    return env, state


def _moves(state, pid: int) -> list[list[str]]:
    return [c for c in fake_calls(state) if "--action" in c and c[c.index("--pid") + 1] == str(pid)]


def test_with_cuda_checkpoint_a_job_moves_to_the_idle_gpu_without_a_restart(daemon, fake_nvml, tmp_path):
    log, stop = tmp_path / "log", tmp_path / "stop"
    env, state = _ckpt_env(daemon, tmp_path, JOBLOG=str(log), STOPFILE=str(stop))
    p = subprocess.Popen([*GPUSD, "run", "--preemptible", "--cuda-checkpoint", "--", sys.executable,
                          str(job_script(tmp_path))], env=env, text=True, stderr=subprocess.PIPE)
    try:
        wait_until_sync(lambda: [e for e in log_events(log) if e["event"] == "start"], timeout=30)
        child = int(jobs_json(env)[0]["child"])
        _hot(fake_nvml, {0: {"util_gpu": 99}})
        wait_until_sync(lambda: [e for e in log_events(log) if e["event"] == "change" and e["gpus"] == "1"],
                        timeout=60, what="the job told of its new GPU")
        job = jobs_json(env)[0]
        assert job["child"] == child and job["restarts"] == 0 and job["state"] == "running"  # same process
        assert job["devices"] == [fake_uuid(1)] and "cuda-checkpoint" in str(job["reason"])
        os.kill(child, 0)  # still alive
        # the tool, for the command's process: lock, checkpoint, restore onto GPU 1's UUID, unlock
        acts = _moves(state, child)
        assert [c[1] for c in acts] == ["lock", "checkpoint", "restore", "unlock"]
        assert acts[2][-2:] == ["--device-map", f"{fake_uuid(0)}={fake_uuid(1)}"]
        assert fake_state(state, child) == "running"
        held = [le for le in leases_json(env)["leases"] if le.get("job") == job["job"]]
        assert [le["device"] for le in held] == [fake_uuid(1)]  # the old GPU is released ...
        other = subprocess.run([*GPUSD, "run", "--include", "0", "--", "true"], env=env, capture_output=True,
                               text=True, timeout=60)
        assert other.returncode == 0, other.stderr  # ... for anyone, though the command still has its descriptor
        stop.write_text("")
        assert p.wait(timeout=60) == 0
        got = log_events(log)
        assert [e["event"] for e in got if e["event"] == "start"] == ["start"]  # never restarted
        assert [e for e in got if e["event"] == "done"][0]["gpus"] == "1"
        err = p.stderr.read()
        assert "cuda-checkpoint: a move restores the job's CUDA state on the new GPU" in err  # detected at start
        assert "moved to GPU 1 by cuda-checkpoint, without a restart" in err
        text = (daemon["state"] / "gpusd.log").read_text()
        assert "GPU 0 utilisation 99% > 90%" in text and "by cuda-checkpoint" in text  # the event says how
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


def test_when_cuda_checkpoint_fails_the_job_is_moved_with_the_protocol(daemon, fake_nvml, tmp_path):
    log, ckpt, result = tmp_path / "log", tmp_path / "ckpt", tmp_path / "result"
    env, state = _ckpt_env(daemon, tmp_path, JOBLOG=str(log), CKPT=str(ckpt), RESULT=str(result), STEPS="1000")
    (state / "fail-restore").write_text("exit")  # restoring onto another GPU fails: "invalid argument"
    p = subprocess.Popen([*GPUSD, "run", "--preemptible", "--cuda-checkpoint", "--", sys.executable,
                          str(job_script(tmp_path))], env=env, text=True, stderr=subprocess.PIPE)
    try:
        wait_until_sync(lambda: [e for e in log_events(log) if e["event"] == "start"], timeout=30)
        child = int(jobs_json(env)[0]["child"])
        _hot(fake_nvml, {0: {"util_gpu": 99}})
        assert p.wait(timeout=120) == 0
        got = log_events(log)
        starts = [e for e in got if e["event"] == "start"]
        assert [s["gpus"] for s in starts] == ["0", "1"] and starts[1]["restarts"] == "1"  # restarted on GPU 1
        assert [e for e in got if e["event"] == "done"][0]["gpus"] == "1" and result.read_text() == "1000"
        assert starts[1]["step"] == [e for e in got if e["event"] == "stopped"][0]["step"] > 0  # from its checkpoint
        # the tool was undone before the SIGTERM: restored where it was, unlocked
        assert [c[1] for c in _moves(state, child)] == ["lock", "checkpoint", "restore", "restore", "unlock"]
        assert fake_state(state, child) == "running"
        err = p.stderr.read()
        assert "with the job protocol (SIGTERM, restart): cuda-checkpoint failed" in err and "invalid argument" in err
        text = (daemon["state"] / "gpusd.log").read_text()
        assert "cuda-checkpoint failed" in text and "job protocol" in text  # the event says why
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


def test_a_pausable_job_is_paused_while_its_gpu_is_too_hot(daemon, fake_nvml, tmp_path):
    env = job_env(daemon["env"])
    p = subprocess.Popen([*GPUSD, "run", "--pausable", "--", "sleep", "60"], env=env, text=True)
    try:
        job = wait_until_sync(lambda: [j for j in jobs_json(env) if j["state"] == "running"], timeout=30)[0]
        child = int(job["child"] or 0) if job.get("child") else None
        _hot(fake_nvml, {0: {"temperature": 95}})
        paused = wait_until_sync(lambda: [j for j in jobs_json(env) if j["state"] == "paused"], timeout=30)
        assert "temperature 95°C > 90°C" in str(paused[0]["reason"])
        if child:
            assert _proc_state(child) == "T"  # stopped
        _hot(fake_nvml, {0: {"temperature": 80}})
        wait_until_sync(lambda: [j for j in jobs_json(env) if j["state"] == "running"], timeout=30)
        text = (daemon["state"] / "gpusd.log").read_text()
        assert "pausing job" in text and "resuming job" in text
    finally:
        p.send_signal(signal.SIGTERM)
        p.wait(timeout=30)


def _proc_state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


# -- the policy alone: no thrashing under an oscillating load --------------------------------------

def _snap(utils: list[float]) -> HostSnapshot:
    gpus = [GpuInfo(index=i, uuid=f"GPU-{i}", utilization_gpu=u, temperature=40) for i, u in enumerate(utils)]
    return HostSnapshot(hostname="h", node_id="n", timestamp=0.0, gpus=gpus)


def test_no_thrashing_under_an_oscillating_load():
    """Load swings between GPU 0 and GPU 1 every 2 s for 10 minutes: each job moves at most once per
    rate-limit period (here 60 s), however often the heat moves."""
    r = Rebalancer(Policy(util_above=90, hot_for=1, idle_below=10, min_interval=60))
    job = JobRecord(job="a" * 12, pid=1, devices=["GPU-0"], preemptible=True, state="running", uid=0)
    moves: list[float] = []
    for step in range(600):
        t = float(step)
        hot = (step // 2) % 2  # GPU 0 hot for 2 s, then GPU 1 for 2 s ...
        utils = [99.0, 0.0, 0.0] if hot == 0 else [0.0, 99.0, 0.0]
        for d in r.decide(_snap(utils), [job], now=t):
            assert d.action == "move" and d.job == job.job and "for" in d.reason
            moves.append(t)
            job.devices = [f"GPU-{d.to}"]  # the job now runs there
    assert moves, "the job was never moved"
    assert all(b - a >= 60 for a, b in zip(moves, moves[1:]))
    assert len(moves) <= 600 // 60 + 1


def test_a_gpu_hot_for_less_than_the_set_time_moves_nothing():
    r = Rebalancer(Policy(util_above=90, hot_for=30, idle_below=10, min_interval=60))
    job = JobRecord(job="b" * 12, pid=1, devices=["GPU-0"], preemptible=True, state="running", uid=0)
    assert r.decide(_snap([99, 0]), [job], now=0.0) == []
    assert r.decide(_snap([99, 0]), [job], now=29.0) == []
    assert r.decide(_snap([50, 0]), [job], now=31.0) == []  # cooled down: the clock restarts
    assert r.decide(_snap([99, 0]), [job], now=32.0) == []
    moved = r.decide(_snap([99, 0]), [job], now=62.5)
    assert [d.to for d in moved] == [1]
    not_preemptible = JobRecord(job="c" * 12, pid=1, devices=["GPU-0"], state="running", uid=0)
    assert Rebalancer(Policy(hot_for=0)).decide(_snap([99, 0]), [not_preemptible], now=5.0) == []


def test_a_bad_policy_file_is_a_clear_error(fake_nvml, cli_env, tmp_path):
    from gpusd.errors import ConfigError

    for text, why in (('{"util_above": "hot"}', "must be a number"), ('{"speed": 1}', "unknown"),
                      ("[1]", "JSON object"), ("{", "not JSON")):
        f = tmp_path / "p.json"
        f.write_text(text)
        with pytest.raises(ConfigError, match=why):
            Policy.load(f)
    assert os.path.exists(f)
