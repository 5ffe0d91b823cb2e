"""aiohttp in gpusd's own processes, imported without the system's CA store (gpusd.wire.aio):
in a process that is gpusd's (the command line), aiohttp's two default SSL contexts trust no certificate
authority, and every context made after the import loads the store as before; in anyone else's process
(``import gpusd`` in a program of their own) aiohttp is imported untouched.  Each case runs in a fresh
interpreter: whoever imports aiohttp first decides."""

from __future__ import annotations

import json
import ssl
import subprocess
import sys

import pytest

PROBE = """
import json, ssl, sys
from gpusd.wire import aio
if sys.argv[1] == "own":
    aio.own_process()
aiohttp = aio.load()
from aiohttp import connector  # its two default contexts, built when it was imported
print(json.dumps({
    "verified": connector._SSL_CONTEXT_VERIFIED.cert_store_stats()["x509_ca"],
    "unverified": connector._SSL_CONTEXT_UNVERIFIED.cert_store_stats()["x509_ca"],
    "after": ssl.create_default_context().cert_store_stats()["x509_ca"],
    "patched": ssl.SSLContext.set_default_verify_paths is not ssl._ssl._SSLContext.set_default_verify_paths,
    "other_thread": other,
}))
"""

# Before the probe: while aiohttp is being imported (found by this finder, in the middle of aio.load),
# another thread makes a default context and counts its certificate authorities.
OTHER_THREAD = """
import ssl, sys, threading
other = []
class _During:
    def find_spec(self, name, path=None, target=None):
        if name == "aiohttp" and not other:
            count = lambda: other.append(ssl.create_default_context().cert_store_stats()["x509_ca"])
            t = threading.Thread(target=count)
            t.start()
            t.join()
        return None
sys.meta_path.insert(0, _During())
"""


def _probe(mode: str) -> dict[str, object]:
    r = subprocess.run([sys.executable, "-c", OTHER_THREAD + PROBE, mode], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def _system_cas() -> int:
    return ssl.create_default_context().cert_store_stats()["x509_ca"]


@pytest.mark.skipif(_system_cas() == 0, reason="this machine's default SSL context loads no CA certificate")
def test_a_gpusd_process_imports_aiohttp_without_the_ca_store_and_puts_ssl_back():
    got = _probe("own")
    assert got["verified"] == 0 and got["unverified"] == 0  # aiohttp's defaults trust nobody: fail closed
    assert got["after"] == _system_cas()  # a context made afterwards loads the store as before
    assert got["patched"] is False  # ssl is as it was
    # a context another thread made while aiohttp was being imported loaded the store: the patch is the
    # importing thread's alone
    assert got["other_thread"] == [_system_cas()]


@pytest.mark.skipif(_system_cas() == 0, reason="this machine's default SSL context loads no CA certificate")
def test_someone_elses_process_gets_aiohttp_as_it_is():
    got = _probe("library")
    assert got["verified"] == _system_cas()  # their HTTPS verifies against the system's store, as always
    assert got["patched"] is False


def test_the_command_line_is_a_gpusd_process():
    """``gpusd.cli.main`` says so before it runs a command (the daemon and the clients it starts follow)."""
    code = ("from gpusd.wire import aio\nfrom gpusd.cli import main\n"
            "try:\n    main(['--version'])\nexcept SystemExit:\n    pass\nprint(aio._own)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().splitlines()[-1] == "True"
