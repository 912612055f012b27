"""Paying the engine's setup up front, and saying what it cost.

A request's first call on an `Engine` does work that later calls of the same shapes skip:

    kernel specializations   each Triton kernel is compiled once per set of compile-time constants the
                             call needs (block sizes, flags, head sizes) and per class of its other
                             arguments; from source when Triton's on-disk cache (TRITON_CACHE_DIR,
                             ~/.triton/cache) does not have it yet, loaded from that cache otherwise
    CUDA graphs              one per cycle shape (batch size, k, decode mode) and per prefill pass
                             shape (batch size, chunk length, k, mode), captured on first use after two
                             eager runs of the step

`warmup(engine, prompt_ids, **generate_kwargs)` runs the request once, discards its result, and
returns a `SetupReport`: the seconds it took, how many kernel specializations were compiled or loaded,
and how many graphs were captured. A second `generate` with the same shapes then runs at steady
speed. Kernels compile one after the other, as the steps first launch them: Triton's public API
builds a kernel for given arguments (`JITFunction.warmup`), but the arguments of a step's launches
exist only when the step runs, and collecting them without running would need hooks inside the
kernels or inside Triton. Counting uses Triton's public post-compile hook
(`triton.knobs.runtime.jit_post_compile_hook`); under the interpreter, or on a Triton without that
hook, the count is None.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass

import torch

from .kernels.common import interpreting


@dataclass(frozen=True)
class SetupReport:
    seconds: float                   # wall time of the warm-up call (compiles, captures and one decode)
    kernels_built: int | None        # kernel specializations compiled or loaded from Triton's cache (None: not countable)
    graphs_captured: int             # CUDA graphs captured by the call

    def __str__(self) -> str:
        built = "" if self.kernels_built is None else f"kernels compiled: {self.kernels_built}, "
        return f"setup {self.seconds:.1f} s ({built}graphs captured: {self.graphs_captured})"


@contextlib.contextmanager
def count_kernel_builds():
    """Yields a one-element list that holds the number of Triton kernel specializations built inside the
    block ([None] when the running Triton has no post-compile hook, or kernels are interpreted)."""
    count: list[int | None] = [None]
    try:
        from triton import knobs
        runtime = knobs.runtime
        previous = runtime.jit_post_compile_hook
    except (ImportError, AttributeError):
        yield count
        return
    count[0] = 0

    def hook(*args, **kwargs):
        count[0] += 1
        return previous(*args, **kwargs) if previous is not None else None

    runtime.jit_post_compile_hook = hook
    try:
        yield count
    finally:
        runtime.jit_post_compile_hook = previous


def warmup(engine, prompt_ids, **generate_kwargs) -> SetupReport:
    """Run engine.generate(prompt_ids, **generate_kwargs) once, discarding its tokens, so that every
    kernel specialization and CUDA graph the request needs exists; return what that cost."""
    graphs_before = len(engine.graphs)
    start = time.perf_counter()
    with count_kernel_builds() as built:
        engine.generate(prompt_ids, **generate_kwargs)
    if engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)
    return SetupReport(seconds=time.perf_counter() - start, kernels_built=None if interpreting() else built[0],
                       graphs_captured=len(engine.graphs) - graphs_before)
