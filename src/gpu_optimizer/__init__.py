"""Compatibility with scripts written for ``gpu_optimizer``::

    from gpu_optimizer import GpuOptimizer
    gpu = GpuOptimizer().get_min_load_gpu()     # index of the least-loaded GPU (nvidia-smi numbering)

A thin alias over :func:`gpusd.select`; new code should use gpusd directly.
"""

from __future__ import annotations

from typing import Any


class GpuOptimizer:
    def __init__(self, simulate: str | None = None, by: str = "load") -> None:
        self.simulate = simulate
        self.by = by

    def get_min_load_gpu(self, min_free: str | int | float | None = None, **constraints: Any) -> int:
        """The index of the least-loaded GPU (no lease taken; see ``gpusd.select`` for one)."""
        import gpusd

        sel = gpusd.select(1, min_free=min_free, by=self.by, lease=False, simulate=self.simulate, **constraints)
        return int(sel.gpus[0].index)

    def get_min_load_gpus(self, count: int, **constraints: Any) -> list[int]:
        import gpusd

        sel = gpusd.select(count, by=self.by, lease=False, simulate=self.simulate, **constraints)
        return [int(g.index) for g in sel.gpus]

    def set_visible(self, count: int = 1, **constraints: Any) -> list[int]:
        """Pick ``count`` GPUs and make them this process's devices (``CUDA_VISIBLE_DEVICES`` for
        NVIDIA GPUs, the vendor's variable for AMD and Intel ones: gpusd.inventory.vendors)."""
        import gpusd

        sel = gpusd.select(count, by=self.by, lease=False, simulate=self.simulate, **constraints)
        sel.apply()
        return [int(g.index) for g in sel.gpus]


__all__ = ["GpuOptimizer"]
