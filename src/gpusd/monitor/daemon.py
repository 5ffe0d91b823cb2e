"""The installer gpusd's daemon runs at start-up (``gpusd.daemon.service.EXTENSIONS``): metrics,
dashboard, access control and thresholds on the daemon's aiohttp application."""

from __future__ import annotations

from typing import Any


def install(daemon: Any) -> None:
    from .integrate import install as install_app

    install_app(daemon.app, daemon)
