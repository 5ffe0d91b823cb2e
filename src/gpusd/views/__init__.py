"""What clients show of the fleet.

* :mod:`.top` — ``gpusd top``; :mod:`.live` — the live table and its keys;
* :mod:`.sources` — where their data comes from (this machine, one daemon's fleet view, the LAN);
* :mod:`.sd` — the Prometheus service-discovery export;
* :mod:`.report` — usage reports as table, CSV, JSON or one HTML file;
* :mod:`.spark` — terminal sparklines;
* :mod:`.tables` — the one plain-text table renderer (rich).

Each module imports its heavy dependencies (rich) itself, so importing this package costs nothing.
Server-side monitoring (metrics, access control, threshold evaluation) lives in :mod:`gpusd.daemon`;
the threshold rule language, shared by both, in :mod:`gpusd.thresholds`.  Internal (docs/api.md).
"""
