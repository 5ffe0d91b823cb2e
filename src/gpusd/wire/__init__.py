"""What the daemon and its clients share on the wire (see docs/wire-format.md):

* :mod:`.txt` — the DNS-SD TXT schema (gpusd's own and GPU-SD/hwsd's): encoding and validated decoding;
* :mod:`.sse` — server-sent event framing and a bounded parser;
* :mod:`.mdns` — interface choice and the one ``AsyncZeroconf`` per process;
* :mod:`.responder` — the RFC 6762 fixes python-zeroconf lets us make;
* :mod:`.fleet` — the typed fleet view of ``GET /api/v1/fleet``;
* :mod:`.http` — one bounded, signed HTTP GET for the command line;
* :mod:`.aio` — aiohttp for gpusd's own processes, imported without the CA store gpusd never uses;
* :mod:`.signing` — HTTP Message Signatures with the fleet secret, the daemon's proof;
* :mod:`.sigfast` — the fast path for gpusd's own signature shape (the library: fallback, reference);
* :mod:`.sshsig` — users' SSH signatures (SSHSIG, the agent's sign request);
* :mod:`.promsd` — the Prometheus target groups.

Nothing here imports the daemon or the clients; both import from here.  Internal (docs/api.md):
the formats are the interface, documented and versioned.
"""
