"""The seed name of gpusd, kept working: ``import gpisd; client = gpisd.Client()``.

Everything in :mod:`gpusd` is available here under the same name."""

from __future__ import annotations

from typing import Any

import gpusd
from gpusd import __version__


def __getattr__(name: str) -> Any:
    return getattr(gpusd, name)


__all__ = ["__version__", *gpusd.__all__]
