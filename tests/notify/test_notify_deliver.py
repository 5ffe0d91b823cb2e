"""The delivery side of notify in-process: what a hostile host's readings can put into a shell's
environment or a JSON body, the signature a receiver checks (replays too), and redirects."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from notify_receiver import serve

from gpusd.errors import ConfigError, GpusdError
from gpusd.notify.deliver import Gpu, Notice, Webhook, check_address, clean_gpu, clean_host, sign, variables, verify

KEY = b"0123456789abcdef0123456789abcdef"


@pytest.mark.parametrize("index, uuid", [(-1, "GPU-1"), (1 << 20, "GPU-1"), (True, "GPU-1"), ("0", "GPU-1"),
                                         (0, "GPU-1; rm -rf ~"), (0, "GPU-$(id)"), (0, "x" * 97), (0, ""),
                                         (0, "GPU-1\nGPUSD_NOTIFY_HOST=evil"), (0, None)])
def test_a_gpu_a_host_cannot_name_safely_is_never_announced(index: object, uuid: object) -> None:
    assert clean_gpu(index, uuid, "A100") is None


def test_names_are_bounded_and_printable() -> None:
    g = clean_gpu(3, "MIG-1c0a/7/0", "\x1b]0;owned\x07NVIDIA\nA100" + "x" * 500)
    assert g is not None and g.index == 3 and g.name.isprintable() and len(g.name) <= 96 and "\x1b" not in g.name
    host = clean_host("node\x1b[2J-1\n" + "h" * 400)
    assert host.isprintable() and len(host) <= 253
    n = Notice(host, "abc", (g,))
    assert all(v.isprintable() for v in variables(n).values())


def test_the_signature_is_checked_and_a_replay_out_of_tolerance_refused() -> None:
    body = b'{"schema":"gpusd-notify/1"}'
    now = int(time.time())
    header = sign(KEY, body, now)
    assert verify(KEY, body, header)
    assert not verify(KEY, body + b" ", header)
    assert not verify(b"another key of thirty-two bytes!", body, header)
    assert not verify(KEY, body, sign(KEY, body, now - 3600))  # an old capture, replayed
    assert not verify(KEY, body, "t=notanumber,v1=00")


@pytest.mark.parametrize("addr", ["a@b.example, c@d.example", "Alice <a@b.example>", "a@b.example\r\nBcc: c@d",
                                  "-oQ/tmp@x", "a b@c", "@x", "a@", "a" * 300 + "@x"])
def test_only_one_plain_mail_address_is_taken(addr: str) -> None:
    with pytest.raises(ConfigError):
        check_address(addr)


def test_a_redirect_is_the_receivers_answer_never_followed(tmp_path: Path) -> None:
    got = tmp_path / "posts"
    srv = serve(got, "redirect")
    try:
        hook = Webhook(f"http://127.0.0.1:{srv.server_address[1]}/hook", attempts=3, backoff=0.01)
        with pytest.raises(GpusdError, match="not delivered after 1 try: HTTP 307"):
            hook.deliver(Notice("h", None, (Gpu(0, "GPU-1"),)))
    finally:
        srv.shutdown()
    assert [json.loads(ln)["path"] for ln in got.read_text().splitlines()] == ["/hook"]
