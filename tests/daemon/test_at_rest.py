"""The daemon at rest (issue 24, memory): what it serves only on request is loaded on the first request,
and that first answer is complete; its threads allocate from one malloc arena."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from daemon_helpers import unique_session
from gpusd.daemon.config import DaemonConfig
from gpusd.errors import ConfigError

# Loaded on the first request, not at rest (a daemon without threshold rules, peers or DNS-SD domain)
ON_REQUEST = ("gpusd.daemon.metrics", "prometheus_client", "gpusd.thresholds", "gpusd.discovery.types",
              "gpusd.wire.fleet", "gpusd.discovery.beyond")

# `gpusd start --foreground` in this process; a thread waits for its ready line, notes what is loaded,
# makes the first requests, notes again, and stops the daemon (SIGTERM, as `gpusd stop` does)
AT_REST = r"""
import json, os, signal, sys, threading, time, urllib.request
watched, out = sys.argv[1].split(","), {}
r, w = os.pipe()
def client():
    info = json.loads(os.fdopen(r).readline())
    time.sleep(1.5)  # a few samples
    out["at_rest"] = [m for m in watched if m in sys.modules]
    base = f"http://127.0.0.1:{info['port']}"
    for path in ("/metrics", "/api/v1/alerts", "/api/v1/fleet"):
        with urllib.request.urlopen(base + path, timeout=30) as resp:
            out[path] = resp.read().decode()
    out["after"] = [m for m in watched if m in sys.modules]
    out["hostname"] = info["hostname"]
    os.kill(os.getpid(), signal.SIGTERM)
threading.Thread(target=client, daemon=True).start()
from gpusd.cli import main
code = main(["start", "--foreground", "--ready-fd", str(w), *sys.argv[2:]])
print(json.dumps(out))
sys.exit(code)
"""


def test_what_is_served_on_request_is_loaded_on_the_first_request_with_a_complete_answer(tmp_path: Path) -> None:
    env = dict(os.environ, GPUSD_MDNS_FAST="1", GPUSD_INTERFACES="127.0.0.1", GPUSD_STATE_DIR=str(tmp_path / "s"))
    for var in ("GPUSD_PEERS", "GPUSD_DNS_SD_DOMAIN"):
        env.pop(var, None)
    r = subprocess.run([sys.executable, "-c", AT_REST, ",".join(ON_REQUEST), "--simulate", "2xA100-80GB",
                        "--interface", "127.0.0.1", "--port", "0", "--session", unique_session("rest"),
                        "--hostname", "rest-host", "--interval", "0.2"],
                       env=env, capture_output=True, text=True, timeout=90)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["at_rest"] == [], out["at_rest"]  # a daemon at rest has none of them
    metrics = out["/metrics"]
    for name in ("gpusd_gpu_memory_total_bytes", "gpusd_gpu_utilization_ratio", "gpusd_gpu_used_seconds_total"):
        assert sum(line.startswith(name + "{") for line in metrics.splitlines()) == 2, (name, metrics[:2000])
    assert json.loads(out["/api/v1/alerts"]) == {"rules": [], "alerts": []}
    fleet = json.loads(out["/api/v1/fleet"])
    assert [h["hostname"] for h in fleet["hosts"]] == ["rest-host"], fleet  # the fleet view, started on request
    assert {"gpusd.daemon.metrics", "prometheus_client", "gpusd.discovery.types"} <= set(out["after"])


def test_validation_still_reads_rules_peers_and_domains_when_there_are_some(monkeypatch: pytest.MonkeyPatch) -> None:
    """A daemon without rules, peers or a DNS-SD domain skips their parsers; one with them still has
    every bad value refused before it starts."""
    monkeypatch.delenv("GPUSD_PEERS", raising=False)
    monkeypatch.delenv("GPUSD_DNS_SD_DOMAIN", raising=False)
    DaemonConfig().validate()
    for bad in (DaemonConfig(thresholds=["temperature>>85"]), DaemonConfig(peers=["bad host name:1:2"]),
                DaemonConfig(dns_sd_domain="not a domain!"), DaemonConfig(dns_server="dns.lab")):
        with pytest.raises(ConfigError):
            bad.validate()
    DaemonConfig(thresholds=["temperature>85"], peers=["198.18.0.1:4780"], dns_sd_domain="lab.example").validate()
    monkeypatch.setenv("GPUSD_PEERS", "bad host name:1:2")
    with pytest.raises(ConfigError):
        DaemonConfig().validate()  # a bad $GPUSD_PEERS fails the start, as it did
    monkeypatch.setenv("GPUSD_PEERS", "198.18.0.1")
    monkeypatch.setenv("GPUSD_DNS_SD_DOMAIN", "not a domain!")
    with pytest.raises(ConfigError):
        DaemonConfig().validate()


# threads that each allocate from glibc malloc (objects over pymalloc's 512 bytes), then malloc_stats()
ARENAS = r"""
import ctypes, sys, threading
from gpusd.daemon.process import limit_malloc_arenas
limited = limit_malloc_arenas() if sys.argv[1] == "limit" else False
keep = []
def work():
    keep.append([bytes(2000 + i) for i in range(200)])
threads = [threading.Thread(target=work) for _ in range(4)]
for t in threads:
    t.start()
for t in threads:
    t.join()
sys.stderr.flush()
ctypes.CDLL("libc.so.6").malloc_stats()  # "Arena N:" per arena, on stderr
print(limited)
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc arenas")
def test_the_daemons_threads_share_one_malloc_arena() -> None:
    env = {k: v for k, v in os.environ.items() if k != "MALLOC_ARENA_MAX"}

    def arenas(mode: str, **extra: str) -> tuple[int, str]:
        r = subprocess.run([sys.executable, "-c", ARENAS, mode], env=dict(env, **extra), capture_output=True,
                           text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        return sum(line.startswith("Arena ") for line in r.stderr.splitlines()), r.stdout.strip()

    assert arenas("limit") == (1, "True")
    assert arenas("none")[0] > 1  # what glibc does without the limit: an arena per thread
    assert arenas("limit", MALLOC_ARENA_MAX="2") == (2, "False")  # the operator's setting is kept
