"""The usage history: an embedded SQLite database per daemon (docs/history.md; not the daemon's recent
samples, :mod:`gpusd.daemon.recent`).

* :mod:`.db` — the schema, the two tiers (fine and coarse), retention and the size bound;
* :mod:`.recorder` — turns samples into per-GPU series, per-user usage and per-job records, on a
  writer thread (the sampling loop only hands a snapshot over);
* :mod:`.query` — what the daemon serves: usage over a time range, one GPU's series;
* :mod:`.idle` — idle leases and reservations: the event, the mark, the opt-in release policy;
* :mod:`.report` — merging the answers of one or many daemons into a report (``gpusd report``).

Pure storage and arithmetic: imports only the core (docs/architecture.md).  Internal (docs/api.md).
"""
