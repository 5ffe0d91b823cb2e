"""``gpusd notify`` on this machine (docs/notify.md): it fires once, after the holder's lease ended and
not before (told by the order of events: the holder writes ENDING just before its lease ends, the
command fired says whether it saw it), with --exec and --webhook, again at each transition with
--repeat, exit 5 on --timeout, and never takes a lease; bad input is one line that changes nothing."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest
from notify_helpers import Holder, notifier, when_said
from notify_receiver import serve

from conftest import gpusd_cli
from fakenvml import make_gpus

SIM = "2xA100-80GB"
SECRET = "0123456789abcdef0123456789abcdef"


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    return dict(os.environ, GPUSD_SIMULATE=SIM, TMPDIR=str(tmp_path))


def secret_file(path: Path, mode: int = 0o600) -> Path:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    with os.fdopen(fd, "w") as f:
        f.write(SECRET + "\n")
    os.chmod(path, mode)
    return path


def lines(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


@pytest.mark.timeout(120)
def test_exec_fires_once_after_the_holder_ends_and_not_before(tmp_path: Path, env: dict[str, str]) -> None:
    out = tmp_path / "fired"
    holder = Holder(tmp_path, 2, env)
    # the command fired also takes both GPUs: the notifier holds no lease of them
    cmd = when_said(out) + f"; {sys.executable} -m gpusd run -n 2 -- true && echo leased >> {out}"
    n = notifier(["-n", "2", "--exec", cmd], env)
    try:
        n.wait_for("watching until they are free")  # it has looked, and they were not free
        assert not out.exists()
        holder.end()
        assert n.finish() == 0, "".join(n.lines)
    finally:
        n.stop()
    got = lines(out)
    assert len(got) == 2 and got[1] == "leased", got
    when, count, gpus, uuids, seq = got[0].split()
    # both GPUs, least loaded first: the simulated loads drift, so either may lead
    assert (when, count, sorted(gpus.split(",")), seq) == ("after", "2", ["0", "1"], "1")
    assert all(u.startswith("GPU-") for u in uuids.split(",")) and len(uuids.split(",")) == 2
    assert any("2 GPU(s) free on this machine" in ln for ln in n.lines)


def test_free_already_fires_at_once_and_exits_0(tmp_path: Path, env: dict[str, str]) -> None:
    out = tmp_path / "fired"
    r = gpusd_cli(["notify", "-n", "1", "--exec", when_said(out)], env=env)
    assert r.returncode == 0, r.stderr
    # no holder at all: free before any end (the least loaded GPU, which the simulated loads' drift picks)
    [fired] = [ln.split()[:3] for ln in lines(out)]
    assert fired[:2] == ["before", "1"] and fired[2] in ("0", "1"), fired


@pytest.mark.timeout(120)
def test_webhook_fires_once_signed_with_the_documented_body(tmp_path: Path, env: dict[str, str]) -> None:
    from gpusd.notify.deliver import SCHEMA, verify

    got = tmp_path / "posts"
    srv = serve(got)
    key = secret_file(tmp_path / "hook.key")
    holder = Holder(tmp_path, 1, dict(env, GPUSD_SIMULATE="1xA100-80GB"))
    n = notifier(["-n", "1", "--webhook", f"http://127.0.0.1:{srv.server_address[1]}/hook?token=t",
                  "--webhook-secret-file", str(key)], dict(env, GPUSD_SIMULATE="1xA100-80GB"))
    try:
        n.wait_for("watching until they are free")
        assert not got.exists()
        holder.end()
        assert n.finish() == 0, "".join(n.lines)
    finally:
        n.stop()
        srv.shutdown()
    posts = [json.loads(ln) for ln in lines(got)]
    assert len(posts) == 1
    post = posts[0]
    body = json.loads(post["body"])
    assert body["schema"] == SCHEMA == "gpusd-notify/1" and body["event"] == "gpus_free"
    assert body["count"] == 1 and body["fleet"] is False and body["sequence"] == 1
    assert [g["index"] for g in body["gpus"]] == [0] and body["gpus"][0]["uuid"].startswith("GPU-")
    assert body["host"]["name"] and body["delivery"] == post["headers"]["X-Gpusd-Delivery"]
    assert post["path"] == "/hook?token=t"
    assert verify(SECRET.encode(), post["body"].encode(), post["headers"]["X-Gpusd-Signature"])
    assert not verify(b"another secret of sixteen+ bytes", post["body"].encode(), post["headers"]["X-Gpusd-Signature"])
    assert not any("token=t" in ln for ln in n.lines)  # the query may hold a token: never shown


@pytest.mark.timeout(120)
def test_repeat_fires_again_at_each_new_transition(tmp_path: Path, env: dict[str, str]) -> None:
    out = tmp_path / "fired"
    env1 = dict(env, GPUSD_SIMULATE="1xA100-80GB")
    holder = Holder(tmp_path, 1, env1)
    n = notifier(["-n", "1", "--repeat", "--exec", when_said(out)], env1)
    try:
        n.wait_for("not free now on this machine: watching")
        holder.end()
        n.wait_for("GPU(s) free on this machine")
        holder = Holder(tmp_path, 1, env1)
        n.wait_for("taken again on this machine: watching")
        assert len(lines(out)) == 1
        holder.end()
        n.wait_for("GPU(s) free on this machine", count=2)
        assert n.proc.poll() is None  # still watching
    finally:
        n.stop()
    got = [ln.split() for ln in lines(out)]
    assert [(g[0], g[-1]) for g in got] == [("after", "1"), ("after", "2")]


def test_timeout_exits_5_without_firing(tmp_path: Path, env: dict[str, str]) -> None:
    out = tmp_path / "fired"
    holder = Holder(tmp_path, 2, env)
    try:
        r = gpusd_cli(["notify", "-n", "1", "--timeout", "1", "--exec", when_said(out)], env=env)
    finally:
        holder.end()
    assert r.returncode == 5, r.stderr
    assert r.stderr.count("\n") == 1 and "gave up after 1s" in r.stderr, r.stderr
    assert not out.exists()


def test_a_count_that_can_never_qualify_is_said_at_once(tmp_path: Path, env: dict[str, str]) -> None:
    r = gpusd_cli(["notify", "-n", "3", "--exec", "true"], env=env)
    assert r.returncode == 4 and r.stderr.count("\n") == 1 and "can never qualify" in r.stderr, r.stderr


BAD = [
    (["--webhook", "ftp://127.0.0.1/x"], "only http:// and https://"),
    (["--webhook", "file:///etc/passwd"], "only http:// and https://"),
    (["--webhook", "http:///nohost"], "names no host"),
    (["--webhook", "http://user:pw@127.0.0.1/"], "user:password@"),
    (["--webhook", "http://127.0.0.1/a b"], "white space"),
    (["--exec", "true", "--timeout", "0"], "--timeout"),
    (["--exec", "true", "--timeout", "-5s"], "--timeout"),
    (["--exec", "true", "--webhook", "http://127.0.0.1/"], "one of --exec CMD"),
    ([], "one of --exec CMD"),
    (["--mail", "a@example.org, b@example.org", "--smtp", "127.0.0.1"], "not one plain mail address"),
    (["--mail", "a@example.org\nBcc: x@y", "--smtp", "127.0.0.1"], "not one plain mail address"),
    (["--mail", "a@example.org", "--smtp", "127.0.0.1:99999"], "port"),
    (["--exec", "true", "--webhook-secret-file", "/nonexistent"], "signs a --webhook"),
    (["--webhook", "http://127.0.0.1/", "--webhook-attempts", "0"], "--webhook-attempts"),
    (["--exec", "true", "--host", "node-*"], "with --fleet"),
]


@pytest.mark.parametrize("args, said", BAD, ids=[" ".join(a)[:40] for a, _ in BAD])
def test_bad_input_is_one_line_and_changes_nothing(tmp_path: Path, env: dict[str, str], args: list[str],
                                                    said: str) -> None:
    locks = Path(os.environ["GPUSD_LOCK_DIR"])
    r = gpusd_cli(["notify", "-n", "1", *args], env=env)
    assert r.returncode == 2, r.stderr
    assert r.stderr.count("\n") <= 2 and said in r.stderr, r.stderr  # argparse adds "see gpusd --help"
    assert "Traceback" not in r.stderr and r.stdout == ""
    assert not locks.exists()  # nothing watched, nothing written


def test_a_webhook_secret_file_others_can_read_is_refused(tmp_path: Path, env: dict[str, str]) -> None:
    key = secret_file(tmp_path / "hook.key", 0o644)
    got = tmp_path / "posts"
    srv = serve(got)
    try:
        r = gpusd_cli(["notify", "-n", "1", "--webhook", f"http://127.0.0.1:{srv.server_address[1]}/",
                       "--webhook-secret-file", str(key)], env=env)
    finally:
        srv.shutdown()
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert "webhook secret file" in r.stderr and "readable by other users" in r.stderr
    assert not got.exists() and not Path(str(got) + ".conns").exists()
    link = tmp_path / "link.key"
    link.symlink_to(secret_file(tmp_path / "real.key"))
    r = gpusd_cli(["notify", "-n", "1", "--webhook", "http://127.0.0.1:9/", "--webhook-secret-file", str(link)],
                  env=env)
    assert r.returncode == 2 and "cannot read the webhook secret file" in r.stderr, r.stderr


@pytest.mark.timeout(60)
def test_a_receiver_that_never_answers_costs_a_bounded_number_of_bounded_tries(tmp_path: Path,
                                                                                env: dict[str, str]) -> None:
    got = tmp_path / "posts"
    srv = serve(got, "silent")
    try:
        r = gpusd_cli(["notify", "-n", "1", "--webhook", f"http://127.0.0.1:{srv.server_address[1]}/",
                       "--webhook-timeout", "0.3", "--webhook-attempts", "3"], env=env, timeout=30)
    finally:
        srv.shutdown()
    assert r.returncode == 1, r.stderr
    assert r.stderr.count("\n") == 1 and "not delivered after 3 tries: no answer within 0.3s" in r.stderr, r.stderr
    assert lines(Path(str(got) + ".conns")) == ["conn"] * 3


def test_a_failing_receiver_gets_retries_and_a_refusing_one_none(tmp_path: Path, env: dict[str, str]) -> None:
    got = tmp_path / "posts"
    srv = serve(got, "fail:2")
    try:
        r = gpusd_cli(["notify", "-n", "1", "--webhook", f"http://127.0.0.1:{srv.server_address[1]}/"], env=env)
    finally:
        srv.shutdown()
    assert r.returncode == 0, r.stderr
    posts = [json.loads(ln) for ln in lines(got)]
    assert len(posts) == 3 and len({p["headers"]["X-Gpusd-Delivery"] for p in posts}) == 1  # one delivery id
    gone = tmp_path / "gone"
    srv = serve(gone, "gone")
    try:
        r = gpusd_cli(["notify", "-n", "1", "--webhook", f"http://127.0.0.1:{srv.server_address[1]}/"], env=env)
    finally:
        srv.shutdown()
    assert r.returncode == 1 and "not delivered after 1 try: HTTP 410" in r.stderr, r.stderr
    assert len(lines(gone)) == 1


def test_the_notifier_takes_no_lease_while_it_waits(tmp_path: Path, env: dict[str, str]) -> None:
    holder = Holder(tmp_path, 1, env)  # one of two GPUs held: -n 2 waits
    n = notifier(["-n", "2", "--exec", "true"], env)
    try:
        n.wait_for("watching until they are free")
        r = gpusd_cli(["leases", "--json"], env=env)
        assert r.returncode == 0, r.stderr
        held = json.loads(r.stdout)
        leases = held if isinstance(held, list) else held.get("leases", held)
        assert len(leases) == 1, leases  # the holder's only
        assert gpusd_cli(["run", "-n", "1", "--", "true"], env=env).returncode == 0  # the other GPU is free
    finally:
        n.stop()
        holder.end()


@pytest.mark.timeout(180)
def test_fires_once_after_a_lease_the_daemon_held_ends(tmp_path: Path, fake_nvml: Any, cli_env: dict[str, str]
                                                       ) -> None:
    """With a daemon as the lease authority (real GPUs: the fake NVML), the holder's lease is in the
    daemon's own directory: the notifier reads it there and is woken when it ends."""
    from authority_helpers import AuthorityDaemon

    fake_nvml.write(make_gpus(2))
    env = cli_env
    daemon = AuthorityDaemon(env, tmp_path / "daemon-state", tmp_path / "daemon.log").start()
    out = tmp_path / "fired"
    try:
        holder = Holder(tmp_path, 2, env)
        held = Path(os.environ["GPUSD_LOCK_DIR"]) / "authority"
        assert len(list(held.glob("lease-*.json"))) == 1  # the daemon holds the lease, in its own directory
        assert not list(held.parent.glob("lease-*.json"))
        n = notifier(["-n", "1", "--exec", when_said(out)], env)
        try:
            n.wait_for("watching until they are free")
            holder.end()
            assert n.finish() == 0, "".join(n.lines)
        finally:
            n.stop()
    finally:
        daemon.stop()
    assert [ln.split()[:2] for ln in lines(out)] == [["after", "1"]]
