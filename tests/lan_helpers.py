"""Helpers for tests on namespace LANs (tests/netns.py) with a fleet secret: a secret file, the
stranger script (tests/stranger.py), Python run inside a namespace, a signed fleet-view read."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

from netns import Lan, Node, read_lines
from tests_paths import TESTS


def secret_file(path: Path, value: str) -> Path:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(value + "\n")
    return path


def start_script(lan: Lan, node: Node, args: list[str]) -> subprocess.Popen[bytes]:
    """tests/stranger.py in ``node``, once it says ``ready``."""
    p = lan.popen(node, [sys.executable, str(TESTS / "stranger.py"), *args],
                  env=lan.base_env(node, GPUSD_MDNS_FAST="1"), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert p.stdout is not None
    lines = read_lines(p.stdout.fileno(), 1, 30)
    assert lines and lines[0] == "ready", (lines, p.poll())
    return p


def python_in(lan: Lan, node: Node, code: str, env: dict[str, str] | None = None) -> Any:
    """Run ``code`` in ``node``; its standard output, as JSON."""
    r = lan.run(node, [sys.executable, "-c", textwrap.dedent(code)], env=env, timeout=60)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def signed_fleet(lan: Lan, node: Node, url: str, key_file: Path) -> dict[str, Any]:
    """GET the fleet view from ``node``, signed with the secret in ``key_file``; with the proof's verdict."""
    return python_in(lan, node, f"""
        import json
        from gpusd.views.sources import FleetSource
        from gpusd.wire.http import fetch_json
        from gpusd.wire.signing import FleetKey, load_secret
        key = FleetKey(load_secret({str(key_file)!r}))
        base, path = {url!r}.split("/api/v1/")
        secure, pin = FleetSource(base, key)._secure_url()   # the daemon's HTTPS port, as gpusd top --url does
        a = fetch_json(secure + "/api/v1/" + path, key, pin=pin)
        print(json.dumps({{"verified": a.verified, "data": a.data, "url": secure}}))
    """)
