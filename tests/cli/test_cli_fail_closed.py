"""Issue 18, item 2: ``eval "$(gpusd env ...)"`` fails closed: when gpusd env fails, eval returns non-zero
and no GPU is left visible (docs/cli.md, "Allocation")."""

from __future__ import annotations

import subprocess
import sys

from fakenvml import make_gpus


def _eval(cli_env: dict[str, str], args: str, before: str = "export CUDA_VISIBLE_DEVICES=0,1") -> list[str]:
    """What a user's shell sees: eval's status, then CUDA_VISIBLE_DEVICES (or 'unset')."""
    script = (f'{before}; eval "$({sys.executable} -m gpusd env {args})"; echo "status=$?"; '
              'echo "visible=${CUDA_VISIBLE_DEVICES-unset}"')
    r = subprocess.run(["bash", "-c", script], env=cli_env, capture_output=True, text=True, timeout=60)
    assert "Traceback" not in r.stderr, r.stderr
    return r.stdout.splitlines()


def test_an_unsatisfiable_env_makes_eval_fail_and_hides_every_gpu(fake_nvml, cli_env):
    fake_nvml.write(make_gpus(2))
    assert _eval(cli_env, "-n 5") == ["status=1", "visible="]
    # nothing exported before either: still none visible, rather than all
    assert _eval(cli_env, "-n 5", before="unset CUDA_VISIBLE_DEVICES") == ["status=1", "visible="]


def test_bad_usage_of_env_fails_closed_too(fake_nvml, cli_env):
    fake_nvml.write(make_gpus(2))
    assert _eval(cli_env, "-n 1 --no-such-flag") == ["status=1", "visible="]
    assert _eval(cli_env, "-n 1 --timeout 5") == ["status=1", "visible="]  # --timeout without --wait


def test_env_that_succeeds_is_unchanged(fake_nvml, cli_env):
    fake_nvml.write(make_gpus(2))
    assert _eval(cli_env, "-n 1 --no-lease") == ["status=0", "visible=0"]
    r = subprocess.run([sys.executable, "-m", "gpusd", "env", "-n", "1", "--no-lease"], env=cli_env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "false" not in r.stdout.split()


def test_the_error_still_goes_to_stderr_with_the_exit_status(fake_nvml, cli_env):
    fake_nvml.write(make_gpus(2))
    r = subprocess.run([sys.executable, "-m", "gpusd", "env", "-n", "5"], env=cli_env, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 4 and r.stderr.startswith("gpusd: ") and "need 5" in r.stderr
    assert r.stdout.splitlines() == ["export CUDA_VISIBLE_DEVICES=''", "export CUDA_DEVICE_ORDER=PCI_BUS_ID",
                                     "export ROCR_VISIBLE_DEVICES=''", "export HIP_VISIBLE_DEVICES=-1",
                                     "export GPU_DEVICE_ORDINAL=-1", "export ZE_AFFINITY_MASK=-1",
                                     "export ONEAPI_DEVICE_SELECTOR='level_zero:*'", "unset GPUSD_LEASE", "false"]


def test_a_failing_env_hides_the_gpus_of_every_vendor_not_only_cuda(fake_nvml, cli_env):
    """A shell where AMD's and Intel's variables already named a GPU: a failing ``gpusd env`` left them
    naming it (only CUDA_VISIBLE_DEVICES was hidden), so the next command ran on a GPU no longer
    leased.  Each runtime's own hide-all value: empty is "no mask" to HIP and Level Zero."""
    fake_nvml.write(make_gpus(2))
    before = ("export ROCR_VISIBLE_DEVICES=GPU-4a1b2c3d4e5f6a7b HIP_VISIBLE_DEVICES=0 GPU_DEVICE_ORDINAL=0 "
              "ZE_AFFINITY_MASK=0 CUDA_VISIBLE_DEVICES=0")
    script = (f'{before}; eval "$({sys.executable} -m gpusd env -n 99)"; echo "status=$?"; '
              'for v in CUDA_VISIBLE_DEVICES ROCR_VISIBLE_DEVICES HIP_VISIBLE_DEVICES GPU_DEVICE_ORDINAL '
              'ZE_AFFINITY_MASK; do echo "$v=${!v-unset}"; done')
    r = subprocess.run(["bash", "-c", script], env=cli_env, capture_output=True, text=True, timeout=60)
    assert "Traceback" not in r.stderr, r.stderr
    assert r.stdout.splitlines() == ["status=1", "CUDA_VISIBLE_DEVICES=", "ROCR_VISIBLE_DEVICES=",
                                     "HIP_VISIBLE_DEVICES=-1", "GPU_DEVICE_ORDINAL=-1", "ZE_AFFINITY_MASK=-1"]


def test_env_stopped_by_sigterm_while_waiting_fails_closed(fake_nvml, cli_env):
    """``eval "$(timeout 60 gpusd env --wait -n 5)"``: timeout(1) ends gpusd env with SIGTERM, whose default
    action printed nothing, so eval succeeded with every GPU visible."""
    fake_nvml.write(make_gpus(2))
    script = (f'export CUDA_VISIBLE_DEVICES=0,1; eval "$(timeout -s TERM 8 {sys.executable} -m gpusd env --wait '
              '-n 5)"; echo "status=$?"; echo "visible=${CUDA_VISIBLE_DEVICES-unset}"')
    r = subprocess.run(["bash", "-c", script], env=cli_env, capture_output=True, text=True, timeout=60)
    assert "Traceback" not in r.stderr, r.stderr
    assert r.stdout.splitlines() == ["status=1", "visible="]
