"""Review (issue 13): what a daemon's lease answer carries reaches a remote shell (``export NAME=...``
in the ssh command) and the command's environment: only the variables a daemon sets get through."""
from __future__ import annotations

from gpusd.cli.pool import remote_script
from gpusd.pool.client import _remote_env


def test_a_lease_answer_cannot_add_shell_code_or_loader_variables():
    env = _remote_env({"CUDA_VISIBLE_DEVICES": "0", "X=1; id >/tmp/pwned; Y": "v", "LD_PRELOAD": "/tmp/evil.so",
                       "GPUSD_LEASE": "abc", "CUDA_DEVICE_ORDER": 5})
    assert env == {"CUDA_VISIBLE_DEVICES": "0", "GPUSD_LEASE": "abc"}
    assert "id >/tmp/pwned" not in remote_script(env, ["echo", "hi"], ["gpusd", "fleet-job", "--job", "a" * 12, "--"])
