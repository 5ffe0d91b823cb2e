"""What clients show of the fleet: ``gpusd top`` (:mod:`.top`, :mod:`.live`), where its data comes
from (:mod:`.sources`), and the Prometheus service-discovery export (:mod:`.sd`).

Each module imports its heavy dependencies (rich) itself, so importing this package costs nothing.
Server-side monitoring (metrics, access control, threshold evaluation) lives in :mod:`gpusd.daemon`;
the threshold rule language, shared by both, in :mod:`gpusd.thresholds`.
"""
