"""inkling_fast: the optimized path (Triton kernels, position-addressed caches, CUDA graphs).

Conventions shared by every piece: docs/fast_path.md. The engine: `Engine` (engine.py)."""

from .engine import Engine

__all__ = ["Engine"]
