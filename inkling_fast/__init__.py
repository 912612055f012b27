"""inkling_fast: the optimized path (Triton kernels, position-addressed caches, CUDA graphs).

Conventions shared by every piece: docs/fast_path.md."""
