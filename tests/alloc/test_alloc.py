"""Allocation end to end: the CLI and the Python API on the fake NVML, with real processes."""

import json
import os
import signal
import subprocess
import sys
import time
import warnings

import pytest

from conftest import gpusd_cli
from fakenvml import FakeProcess, make_gpus
from waiting import wait_until_sync

GiB = 2**30
GPUSD = [sys.executable, "-m", "gpusd"]


def _kill_group(proc):
    """SIGKILL a job started with start_new_session (gpusd run and its command), if still there."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def _leases(env):
    r = gpusd_cli(["leases", "--json"], env=env)
    return json.loads(r.stdout)


# -- the environment -------------------------------------------------------------------------------

def test_env_prints_cuda_device_order_with_indices(fake_nvml, cli_env):
    gpus = make_gpus(4, util_gpu=50)
    gpus[1].util_gpu = 0
    gpus[3].util_gpu = 5
    fake_nvml.write(gpus)
    r = gpusd_cli(["env", "-n", "2"], env=cli_env)
    assert r.returncode == 0, r.stderr
    out = subprocess.run(["bash", "-c", f'eval "{r.stdout}"; echo "$CUDA_VISIBLE_DEVICES $CUDA_DEVICE_ORDER"'],
                         capture_output=True, text=True).stdout.strip()
    assert out == "1,3 PCI_BUS_ID"
    r = gpusd_cli(["env", "-n", "1", "--uuid"], env=cli_env)
    assert f"CUDA_VISIBLE_DEVICES={gpus[1].uuid}" in r.stdout and "CUDA_DEVICE_ORDER=PCI_BUS_ID" in r.stdout


def test_nothing_qualifies_gives_a_distinct_exit_code(fake_nvml, cli_env):
    fake_nvml.write(make_gpus(2, memory_used=79 * GiB))
    r = gpusd_cli(["select", "--min-free", "8GiB"], env=cli_env)
    assert r.returncode == 4
    assert "no GPUs available: need 1, 0 qualify" in r.stderr and "Traceback" not in r.stderr
    r = gpusd_cli(["run", "--min-free", "8GiB", "--wait", "--timeout", "0.5", "--", "true"], env=cli_env)
    assert r.returncode == 5 and "gave up waiting after 0.5s" in r.stderr


def test_bad_flags_are_usage_errors(fake_nvml, cli_env):
    fake_nvml.write(make_gpus(1))
    for args in (["select", "--min-free", "lots"], ["select", "-n", "0"], ["run"], ["select", "--timeout", "3"]):
        r = gpusd_cli(args, env=cli_env)
        assert r.returncode == 2, (args, r.stderr)
        assert "Traceback" not in r.stderr and r.stderr.strip()


# -- gpusd run -------------------------------------------------------------------------------------

def test_run_sets_the_environment_and_returns_the_exit_code(fake_nvml, cli_env):
    fake_nvml.write(make_gpus(2))
    r = gpusd_cli(["run", "-n", "2", "--", "sh", "-c", 'echo "$CUDA_VISIBLE_DEVICES $CUDA_DEVICE_ORDER"; exit 7'],
                  env=cli_env)
    assert r.returncode == 7
    assert r.stdout.strip() == "0,1 PCI_BUS_ID"
    assert gpusd_cli(["run", "--", "sh", "-c", "kill -TERM $$"], env=cli_env).returncode == 128 + 15
    r = gpusd_cli(["run", "--", "no-such-command-xyz"], env=cli_env)
    assert r.returncode == 127 and "command not found" in r.stderr


def test_run_forwards_signals_and_holds_the_lease_while_the_command_lives(fake_nvml, cli_env, tmp_path):
    fake_nvml.write(make_gpus(1))
    script = tmp_path / "job.py"
    script.write_text(
        "import signal, sys, time\n"
        "signal.signal(signal.SIGTERM, lambda *a: sys.exit(42))\n"
        "print('ready', flush=True)\n"
        "time.sleep(60)\n")
    p = subprocess.Popen([*GPUSD, "run", "--", sys.executable, str(script)], env=cli_env, stdout=subprocess.PIPE,
                         text=True)
    try:
        assert p.stdout.readline().strip() == "ready"
        held = _leases(cli_env)["leases"]
        assert len(held) == 1 and held[0]["pid"] == p.pid and "job.py" in held[0]["command"]
        p.send_signal(signal.SIGTERM)
        assert p.wait(timeout=20) == 42
        assert _leases(cli_env)["leases"] == []
    finally:
        p.kill()


def test_64_concurrent_jobs_never_share_a_gpu(fake_nvml, cli_env, tmp_path):
    """Issue 3: 64 `gpusd run -n 1 --wait` on 8 GPUs — no GPU serves two at once, all finish."""
    fake_nvml.write(make_gpus(8))
    marks = tmp_path / "busy"
    marks.mkdir()
    log = tmp_path / "log"
    # mkdir is atomic: it fails if another job holds the same GPU at this moment.
    job = ('if mkdir "$MARKS/$CUDA_VISIBLE_DEVICES" 2>/dev/null; then echo "ok $CUDA_VISIBLE_DEVICES" >> "$LOG"; '
           'sleep 0.3; rmdir "$MARKS/$CUDA_VISIBLE_DEVICES"; else echo "COLLISION $CUDA_VISIBLE_DEVICES" >> "$LOG"; fi')
    env = dict(cli_env, MARKS=str(marks), LOG=str(log))
    procs = [subprocess.Popen([*GPUSD, "run", "-n", "1", "--wait", "--timeout", "240", "--", "sh", "-c", job],
                              env=env, stderr=subprocess.PIPE, text=True) for _ in range(64)]
    codes = [p.wait(timeout=300) for p in procs]
    errors = [p.stderr.read() for p in procs if p.returncode]
    lines = log.read_text().splitlines()
    assert codes == [0] * 64, errors[:3]
    assert [line for line in lines if line.startswith("COLLISION")] == []
    assert len(lines) == 64
    used = {line.split()[1] for line in lines}
    assert used <= {str(i) for i in range(8)} and len(used) >= 2
    assert _leases(cli_env) ["leases"] == [] and _leases(cli_env)["queued"] == []


def test_kill_9_of_a_holder_frees_its_gpu_for_the_next_job(fake_nvml, cli_env, tmp_path):
    fake_nvml.write(make_gpus(1))
    holder = subprocess.Popen([*GPUSD, "run", "--", "sleep", "120"], env=cli_env, start_new_session=True)
    try:
        wait_until_sync(lambda: len(_leases(cli_env)["leases"]) == 1, timeout=20.0)
        out = tmp_path / "second"
        second = subprocess.Popen([*GPUSD, "run", "--wait", "--timeout", "60", "--", "sh", "-c",
                                   f'echo "$CUDA_VISIBLE_DEVICES" > {out}'], env=cli_env)
        wait_until_sync(lambda: len(_leases(cli_env)["queued"]) == 1, timeout=20.0)
        time.sleep(0.5)
        assert second.poll() is None and not out.exists()  # still waiting: the GPU is taken
        os.killpg(holder.pid, signal.SIGKILL)  # gpusd run and its command, without any clean-up
        assert second.wait(timeout=30) == 0
        assert out.read_text().strip() == "0"
    finally:
        _kill_group(holder)


def test_lease_outlives_a_killed_runner_while_its_command_runs(fake_nvml, cli_env):
    fake_nvml.write(make_gpus(1))
    runner = subprocess.Popen([*GPUSD, "run", "--", "sleep", "120"], env=cli_env, start_new_session=True)
    try:
        wait_until_sync(lambda: len(_leases(cli_env)["leases"]) == 1, timeout=20.0)
        os.kill(runner.pid, signal.SIGKILL)  # only gpusd run; `sleep` still uses the GPU
        runner.wait()
        r = gpusd_cli(["select"], env=cli_env)
        assert r.returncode == 4 and "leased by" in r.stderr  # the command inherited the lease
        os.killpg(runner.pid, signal.SIGKILL)  # now the command too
        wait_until_sync(lambda: gpusd_cli(["select"], env=cli_env).returncode == 0, timeout=20.0)
    finally:
        _kill_group(runner)


def test_fifo_queue_does_not_starve_a_multi_gpu_job(fake_nvml, cli_env, tmp_path):
    fake_nvml.write(make_gpus(2))
    order = tmp_path / "order"
    first = subprocess.Popen([*GPUSD, "run", "--include", "0", "--", "sleep", "120"], env=cli_env,
                             start_new_session=True)
    try:
        wait_until_sync(lambda: len(_leases(cli_env)["leases"]) == 1, timeout=20.0)
        big = subprocess.Popen([*GPUSD, "run", "-n", "2", "--wait", "--timeout", "60", "--", "sh", "-c",
                                f"echo big >> {order}; sleep 1"], env=cli_env)
        wait_until_sync(lambda: len(_leases(cli_env)["queued"]) == 1, timeout=20.0)
        small = subprocess.Popen([*GPUSD, "run", "-n", "1", "--wait", "--timeout", "60", "--", "sh", "-c",
                                  f"echo small >> {order}"], env=cli_env)
        wait_until_sync(lambda: len(_leases(cli_env)["queued"]) == 2, timeout=20.0)
        # GPU 1 is free, but the 2-GPU job came first: the 1-GPU job must not overtake it,
        # and a job that does not wait is told so instead of jumping the queue.
        time.sleep(1.0)
        assert not order.exists()
        r = gpusd_cli(["run", "--", "true"], env=cli_env)
        assert r.returncode == 4 and "waiting for GPUs ahead" in r.stderr
        os.killpg(first.pid, signal.SIGKILL)
        assert big.wait(timeout=30) == 0 and small.wait(timeout=30) == 0
        assert order.read_text().split() == ["big", "small"]
    finally:
        _kill_group(first)


# -- the Python API --------------------------------------------------------------------------------

def test_requested_memory_is_counted_before_the_job_allocates(fake_nvml_inprocess):
    import gpusd

    gpus = make_gpus(2, memory_used=40 * GiB)
    gpus[1].util_gpu = 90
    fake_nvml_inprocess.write(gpus)
    job = gpusd.select(share=True, memory="30GiB")  # nothing allocated on the GPU yet
    assert job.indices == [0]
    # 80 - 40 used - 30 reserved = 10 GiB: a job needing 20 GiB must go elsewhere
    other = gpusd.select(share=True, min_free="20GiB")
    assert other.indices == [1]
    with pytest.raises(gpusd.NoGpuAvailable, match="GPU 0: 10.0GiB free"):
        gpusd.select(share=True, min_free="20GiB", include=[0])
    # once the job has allocated its 30 GiB the reservation is not counted twice
    gpus[0].memory_used = 70 * GiB
    gpus[0].processes = [FakeProcess(os.getpid(), 30 * GiB)]
    fake_nvml_inprocess.write(gpus)
    assert gpusd.select(share=True, min_free="10GiB", include=[0], lease=False).indices == [0]
    job.release()
    other.release()


def test_select_lease_is_exclusive_until_released(fake_nvml_inprocess):
    import gpusd

    fake_nvml_inprocess.write(make_gpus(2))
    with gpusd.select(count=1) as a:
        b = gpusd.select(count=1)
        assert a.uuids != b.uuids
        with pytest.raises(gpusd.NoGpuAvailable, match="leased by"):
            gpusd.select(count=1)
        b.release()
    assert gpusd.select(count=2).indices == [0, 1]


def test_selection_env_and_apply(fake_nvml_inprocess, monkeypatch):
    import gpusd

    fake_nvml_inprocess.write(make_gpus(3))
    sel = gpusd.select(count=2, lease=False)
    assert sel.env() == {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": "0,1"}
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    sel.apply()
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "0,1" and os.environ["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"


def test_seed_names_work_as_written(fake_nvml_inprocess, monkeypatch):
    gpus = make_gpus(4, util_gpu=60, memory_used=10 * GiB)
    gpus[2].util_gpu = 3
    gpus[2].memory_used = GiB
    fake_nvml_inprocess.write(gpus)
    from gpu_optimizer import GpuOptimizer

    assert GpuOptimizer().get_min_load_gpu() == 2

    import gpusd

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    gpusd.set_cuda_visible_devices([1, 3])
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "1,3"
    assert os.environ["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"

    import gpisd

    assert gpisd.select is gpusd.select and gpisd.Client is gpusd.Client


def test_warns_when_cuda_is_already_initialised(monkeypatch):
    import types

    import gpusd

    fake_torch = types.SimpleNamespace(cuda=types.SimpleNamespace(is_initialized=lambda: True))
    monkeypatch.setitem(sys.modules, "torch", fake_torch)
    with pytest.warns(gpusd.CudaAlreadyInitializedWarning, match="no effect"):
        gpusd.set_cuda_visible_devices([0])
    fake_torch.cuda.is_initialized = lambda: False
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        gpusd.set_cuda_visible_devices([0])


def test_run_mig_slices_are_given_by_uuid(fake_nvml, cli_env):
    from fakenvml import FakeMig

    gpus = make_gpus(1, mig_mode=1)
    gpus[0].migs = [FakeMig("1g.10gb", "MIG-11111111-2222-3333-4444-555555555555", 10 * GiB, 0, 1, 0)]
    fake_nvml.write(gpus)
    r = gpusd_cli(["run", "--mig", "--", "sh", "-c", 'echo "$CUDA_VISIBLE_DEVICES"'], env=cli_env)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "MIG-11111111-2222-3333-4444-555555555555"
    r = gpusd_cli(["run", "--", "true"], env=cli_env)
    assert r.returncode == 4 and "MIG mode" in r.stderr


def test_load_of_an_ended_lease_does_not_keep_its_gpu_busy(fake_nvml_inprocess):
    """The window average must not hold a just-finished gpusd job's load against its GPU."""
    import gpusd

    gpus = make_gpus(1, util_gpu=95)
    fake_nvml_inprocess.write(gpus)
    job = gpusd.select(count=1)
    for _ in range(3):
        gpusd.local_snapshot()  # the long-lived process builds up a window of 95 % samples
        time.sleep(0.2)
    gpus[0].util_gpu = 0  # the job ends
    fake_nvml_inprocess.write(gpus)
    time.sleep(0.4)
    assert gpusd.local_snapshot().gpus[0].utilization_gpu > 50  # the window still remembers the job
    job.release()
    assert gpusd.select(count=1, max_util=50, lease=False).indices == [0]


def test_set_cuda_visible_devices_refuses_an_index_the_host_does_not_have(fake_nvml_inprocess, monkeypatch):
    """[1, 7] on a 4-GPU host: CUDA would stop at 7 and the process would see one GPU, silently."""
    fake_nvml_inprocess.write(make_gpus(4))
    import gpusd

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    with pytest.raises(ValueError, match=r"no GPU 7 on this host \(it has GPUs 0-3\)"):
        gpusd.set_cuda_visible_devices([1, 7])
    assert "CUDA_VISIBLE_DEVICES" not in os.environ
    gpusd.set_cuda_visible_devices([1, 3])
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "1,3"


def test_leases_names_each_gpu_by_the_number_users_choose_it_by(fake_nvml, cli_env):
    """`gpusd leases` lists GPU 2 as 2 (users choose by index), beside its UUID."""
    gpus = make_gpus(3)
    fake_nvml.write(gpus)
    p = subprocess.Popen([*GPUSD, "run", "--include", "2", "--", "sleep", "60"], env=cli_env, start_new_session=True)
    try:
        wait_until_sync(lambda: len(_leases(cli_env)["leases"]) == 1, timeout=20.0)
        r = gpusd_cli(["leases"], env=cli_env)
        assert r.returncode == 0, r.stderr
        lines = r.stdout.splitlines()
        head = next(line for line in lines if "LEASE" in line)
        assert head.split()[:2] == ["GPU", "DEVICE"]
        row = next(line for line in lines if gpus[2].uuid in line)
        assert row.split()[0] == "2"
    finally:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait(timeout=10)
