"""Shared utilities of the fast-path kernel tests."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from inkling_fast.kernels.common import interpreting

# The dtypes every kernel test runs in, and the tolerances of docs/fast_path.md: relative L2 error
# (inkling_ref.testing.rel_l2) of the kernel against its twin / the reference.
DTYPES = [torch.float32, torch.bfloat16]
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


@pytest.fixture
def device() -> str:
    """'cuda' when a GPU is present (the real kernels), else 'cpu' (TRITON_INTERPRET=1, see conftest)."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def poison(t: torch.Tensor) -> torch.Tensor:
    """Fill t in place with a value no kernel writes (NaN for floats, -7 for integers), so an element
    the kernel fails to write is caught."""
    return t.fill_(float("nan") if t.is_floating_point() else -7)


def randn(*shape, dtype=torch.float32, device="cpu", gen: torch.Generator, scale: float = 1.0) -> torch.Tensor:
    """Standard normal draws, made where the generator lives (a CPU generator: reproducible on any
    device; a CUDA one for tensors of gigabytes), moved to `device`."""
    x = torch.randn(*shape, generator=gen, dtype=torch.float32, device=gen.device)
    return (x * scale).to(device=device, dtype=dtype)


def randint(low: int, high: int, *shape, dtype=torch.float32, device="cpu", gen: torch.Generator) -> torch.Tensor:
    """Integers in [low, high) as `dtype` (exact in bf16 for small ranges): sums of their products are
    exact in float32, so equal dot products are true ties whatever the summation order."""
    return torch.randint(low, high, shape, generator=gen, device=gen.device).to(device=device, dtype=dtype)


def run_without_sync_then_capture(step) -> "torch.cuda.CUDAGraph":
    """GPU only. Run `step()` (compiled already) once under
    torch.cuda.set_sync_debug_mode("error"), where any host synchronization inside raises, then capture
    it in a CUDA graph (capturing fails on a synchronization too) and return the graph to replay."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph


def norm_weight(H: int, device, gen: torch.Generator) -> torch.Tensor:
    """An RMSNorm weight drawn away from 1 (1 +- U(0.15, 0.45)), float32."""
    sign = torch.randint(0, 2, (H,), generator=gen).float() * 2 - 1
    return (1 + sign * (0.15 + 0.3 * torch.rand(H, generator=gen))).to(device)


# Triton's CPU interpreter converts float32 -> bfloat16 by truncation (triton/runtime/interpreter.py,
# cast_impl), the GPU rounds to nearest even; so a rounded bf16 result can differ by one unit in the
# last place under the interpreter.
INTERPRETED = interpreting()


def assert_rounded_equal(a: torch.Tensor, b: torch.Tensor) -> None:
    """a == b exactly (a value computed in fp32 and rounded once to the model dtype, on both sides);
    under the interpreter, bf16 values may differ by one ulp (see above)."""
    assert a.shape == b.shape and a.dtype == b.dtype
    if not (INTERPRETED and a.dtype == torch.bfloat16):
        assert torch.equal(a, b)
        return
    ulp = b.float().abs() * 2.0**-7  # bf16 keeps 8 significant bits
    assert torch.isfinite(a).all() and ((a.float() - b.float()).abs() <= ulp).all()


def load_benchmark(name: str):
    """benchmarks/<name>.py imported by path (benchmarks/ is not a package). The script puts benchmarks/
    on sys.path to import its sibling scripts; that entry and those modules are taken back afterwards,
    so that a later import elsewhere (e.g. transformers' `import kernels`) never finds a benchmark
    script by its plain name."""
    folder = Path(__file__).resolve().parents[2] / "benchmarks"
    spec = importlib.util.spec_from_file_location(name, folder / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    path, modules = list(sys.path), set(sys.modules)
    sys.modules[spec.name] = mod          # dataclasses look their module up there
    try:
        spec.loader.exec_module(mod)
    finally:
        sys.path[:] = path
        for added in set(sys.modules) - modules:
            if getattr(sys.modules[added], "__file__", None) and Path(sys.modules[added].__file__).parent == folder:
                del sys.modules[added]
        sys.modules.pop(spec.name, None)
    return mod
