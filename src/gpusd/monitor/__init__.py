"""Watching GPUs: Prometheus metrics, threshold alerts, privacy of process fields, ``gpusd top``.

Each module imports its heavy dependencies (prometheus_client, rich, aiohttp) itself, so importing
this package costs nothing.  :func:`gpusd.monitor.integrate.install` wires everything into a daemon's
aiohttp application.
"""
