"""Review: what a daemon's lease answer carries reaches a remote shell (``export NAME=...``
in the ssh command) and the command's environment: only the variables a daemon sets get through."""
from __future__ import annotations

import pytest

from gpusd.cli.pool import remote_script
from gpusd.pool.client import _remote_env


def test_a_lease_answer_cannot_add_shell_code_or_loader_variables():
    env = _remote_env({"CUDA_VISIBLE_DEVICES": "0", "X=1; id >/tmp/pwned; Y": "v", "LD_PRELOAD": "/tmp/evil.so",
                       "GPUSD_LEASE": "abc", "CUDA_DEVICE_ORDER": 5})
    assert env == {"CUDA_VISIBLE_DEVICES": "0", "GPUSD_LEASE": "abc"}
    assert "id >/tmp/pwned" not in remote_script(env, ["echo", "hi"], ["gpusd", "fleet-job", "--job", "a" * 12, "--"])


@pytest.mark.parametrize("answer, why", [
    ({"devices": []}, "without a usable id"),
    ({"lease_id": "-rf; reboot", "devices": []}, "without a usable id"),
    ({"lease_id": ["x"], "devices": []}, "without a usable id"),
    ({"lease_id": "0123456789ab", "devices": [], "ttl": "soon"}, "cannot be read"),
])
def test_a_verified_daemons_unusable_lease_answer_is_a_clear_error(monkeypatch, answer, why) -> None:
    """Even a daemon that proved it holds the fleet secret answers bytes from the network: a lease id
    goes into URLs and the remote `gpusd fleet-job --lease` argument, so it must be a lease id."""
    from types import SimpleNamespace

    from gpusd.alloc.select import Constraints
    from gpusd.errors import GpusdError
    from gpusd.pool import client
    from gpusd.wire import http

    monkeypatch.setattr(client, "api_url", lambda h: ("http://198.18.0.9:1/api/v1", None))
    monkeypatch.setattr(http, "request_json", lambda *a, **k: SimpleNamespace(status=201, data=answer, verified=True))
    host = SimpleNamespace(hostname="node-9", node_id="n9", url="http://198.18.0.9:1", addresses=["198.18.0.9"])
    with pytest.raises(GpusdError, match=why):
        client._ask(host, [], Constraints(count=1), None, "me@here", None, 30.0)  # type: ignore[arg-type]
