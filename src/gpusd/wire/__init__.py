"""What the daemon and its clients share on the wire (see docs/wire-format.md):

* :mod:`.txt` — the DNS-SD TXT schema (gpusd's own and GPU-SD/hwsd's): encoding and validated decoding;
* :mod:`.sse` — server-sent event framing and a bounded parser;
* :mod:`.mdns` — interface choice and the one ``AsyncZeroconf`` per process.

Nothing here imports the daemon or the clients; both import from here.
"""
