"""Paying the engine's setup up front, and saying what it cost.

A request's first call on an `Engine` does work that later calls of the same shapes skip:

    kernel specializations   each Triton kernel is built once per set of compile-time constants the
                             call needs (block sizes, flags, head sizes) and per class of its other
                             arguments; from source when Triton's on-disk cache (TRITON_CACHE_DIR,
                             ~/.triton/cache) does not have it yet, loaded from that cache otherwise
    CUDA graphs              one per cycle shape (batch size, k, decode mode) and per prefill pass
                             shape (batch size, chunk length, k, mode), captured on first use after two
                             eager runs of the step

Built one after the other, as the steps first launch them, the specializations of a request take
most of a cold first call: each build is a compiler pipeline of about a second. They are independent,
so `build_concurrently` builds them on a pool of threads before the first step runs:

    twin        the engine's weights, caches and state as meta tensors (shapes, strides and offsets,
                no memory): a step run on them computes nothing and touches no device memory
    trace       every step the request will run (Engine.request_steps), on the twin and on its padding
                input, with each kernel launch turned into a build-only launch (Triton's `warmup`):
                the launch computes the kernel's specialization from its arguments as a real launch
                would (a meta tensor's address is its offset, so alignment classes carry over) and
                submits the build instead of running anything
    builds      submitted to Triton's asynchronous compile mode (`triton.runtime._async_compile`) on a
                thread pool; they run concurrently where Triton's compiler releases the GIL (its MLIR
                and LLVM passes, ptxas), and the mode's exit waits for all of them and installs them
                in the kernels' caches. The thread that builds a kernel then builds its launcher too
                (the host-side stub that Triton generates per kernel signature, with a C compiler on
                some Triton versions), which would otherwise be built one by one at first launch

The request's steps then find every kernel built. A specialization the trace missed is still built
when a step first launches it, so a trace can only save time, never change a result.

    record      once the builds are done, a file in Triton's cache folder records them (`build_record`:
                named by a digest of everything the specializations depend on); a later process that
                finds it skips the trace and loads the kernels from that cache at first launch, since
                the trace's first use of meta tensors imports parts of torch that cost more than those
                loads

`warmup(engine, prompt_ids, **generate_kwargs)` builds the request's kernels that way, runs the
request once, discards its result, and returns a `SetupReport`: the seconds it took, how many kernel
specializations were built and how many graphs were captured. A second `generate` with the same
shapes then runs at steady speed. Counting uses Triton's public post-compile hook
(`triton.knobs.runtime.jit_post_compile_hook`); under the interpreter, or on a Triton without that hook,
the count is None.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import hashlib
import inspect
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass(frozen=True)
class SetupReport:
    seconds: float                   # wall time of the warm-up call (builds, captures and one decode)
    kernels_built: int | None        # kernel specializations built or loaded from Triton's cache (None: not countable)
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


# ----------------------------------------------------------------------------------------------- the trace
def map_tensors(fn, x):
    """x with fn applied to every tensor inside (dataclass fields, lists, tuples); anything else as it is."""
    if isinstance(x, torch.Tensor):
        return fn(x)
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return dataclasses.replace(x, **{f.name: map_tensors(fn, getattr(x, f.name))
                                         for f in dataclasses.fields(x) if f.init})
    if isinstance(x, (list, tuple)):
        return type(x)(map_tensors(fn, v) for v in x)
    return x


def to_meta(x):
    """x with every tensor inside replaced by a meta tensor of the same shape, strides, dtype and storage
    offset (map_tensors)."""
    def meta(t):
        storage = torch.empty(t.untyped_storage().nbytes() // t.element_size(), dtype=t.dtype, device="meta")
        return storage.as_strided(t.shape, t.stride(), t.storage_offset())
    return map_tensors(meta, x)


ENGINE_TENSORS = ("W", "trunk_caches", "depth_caches", "state", "reference_uniforms")   # what the steps read


def meta_twin(engine):
    """A shallow copy of `engine` whose weights, caches and slot state are meta tensors (to_meta)."""
    twin = copy.copy(engine)
    twin.device = torch.device("meta")
    for name in ENGINE_TENSORS:
        setattr(twin, name, to_meta(getattr(engine, name)))
    return twin


def constexpr_args(kernel, args: tuple, kwargs: dict) -> tuple:
    """(name, value) of every compile-time constant of a launch, in order: the `tl.constexpr` parameters,
    then the launch options (num_warps, num_stages, ...)."""
    signature = inspect.signature(kernel.fn)
    params = signature.parameters
    bound = signature.bind(*args, **{n: v for n, v in kwargs.items() if n in params})
    bound.apply_defaults()
    return tuple((name, value) for name, value in bound.arguments.items()
                 if "constexpr" in str(params[name].annotation)) + \
        tuple(sorted((n, v) for n, v in kwargs.items() if n not in params))


@contextlib.contextmanager
def launches_build_only(record: list | None = None, run: bool = False):
    """Inside the block, a Triton launch `kernel[grid](*args, **kwargs)` only builds the kernel for those
    arguments (Triton's warmup: compiled, or found in a cache, and not run; under the interpreter
    nothing), or, with run=True, runs as usual. Each launch appends (kernel name, constexpr_args) to
    `record` when given. Patches `triton.runtime.jit.KernelInterface.__getitem__` (the launch syntax of
    JIT and interpreted kernels alike) for the duration of the block and, when nothing runs, lets the
    kernel wrappers take meta tensors (kernels.common.build_only)."""
    from triton.runtime.jit import JITFunction, KernelInterface

    from .kernels import common

    launch = KernelInterface.__getitem__

    def patched(kernel, grid):
        def go(*args, **kwargs):
            if record is not None:
                record.append((kernel.fn.__name__, constexpr_args(kernel, args, kwargs)))
            if run:
                return launch(kernel, grid)(*args, **kwargs)
            if isinstance(kernel, JITFunction):
                return kernel.run(*args, grid=grid, warmup=True, **kwargs)
        return go

    KernelInterface.__getitem__ = patched
    common._BUILD_ONLY[0] = not run
    try:
        yield
    finally:
        KernelInterface.__getitem__ = launch
        common._BUILD_ONLY[0] = False


def trace_steps(engine, keys: list[tuple], record: list | None = None) -> None:
    """Run the steps `keys` (Engine.step on Engine.padding_input) on the engine's meta twin with every
    launch build-only."""
    twin = meta_twin(engine)
    with torch.no_grad(), launches_build_only(record):
        for key in keys:
            twin.step(key, twin.padding_input(key))


class BuildPool(ThreadPoolExecutor):
    """A thread pool for Triton's asynchronous compile mode whose task, once the kernel is compiled, also
    builds the kernel's launcher (`triton.runtime.driver.active.launcher_cls`, which Triton keeps in its
    on-disk cache), so that the kernel's first launch finds both."""

    def submit(self, fn, /, *args, **kwargs):
        from triton.runtime import driver

        def build():
            kernel = fn(*args, **kwargs)
            driver.active.launcher_cls(kernel.src, kernel.metadata)
            return kernel

        return super().submit(build)


def build_record(engine, keys: list[tuple]) -> Path | None:
    """The file by which `build_concurrently` notes that Triton's on-disk cache holds the kernel
    specializations of the steps `keys` on this engine, or None when the cache folder is unknown. It
    lies in that cache folder (emptying the cache drops it) and is named by a digest of what a launch's
    specialization depends on: the Triton and torch versions, the device, the source of this package,
    the engine's configuration, the shape, strides, dtype, offset and 16-byte alignment of every tensor
    the steps read, and the keys. A record that outlived its kernels (a cache emptied in part, other
    compiler settings) only means they are built one by one at first launch, as without a record."""
    try:
        from triton import knobs
        folder = Path(knobs.cache.dir)
    except (ImportError, AttributeError, TypeError):
        return None
    import triton

    digest = hashlib.sha256()
    for path in sorted(Path(__file__).resolve().parent.rglob("*.py")):
        digest.update(path.name.encode() + path.read_bytes())
    layouts = []
    for name in ENGINE_TENSORS:
        map_tensors(lambda t: layouts.append((name, tuple(t.shape), t.stride(), t.dtype, t.storage_offset(),
                                              t.data_ptr() % 16)), getattr(engine, name))
    device = (torch.cuda.get_device_name(engine.device), torch.cuda.get_device_capability(engine.device)) \
        if engine.device.type == "cuda" else str(engine.device)
    digest.update(repr((triton.__version__, torch.__version__, torch.version.cuda, device, engine.config,
                        engine.dtype, engine.max_batch_size, engine.max_seq_len, engine.batch_sizes,
                        engine.prefill_tokens, engine.prefill_lengths, engine.uniforms, layouts,
                        keys)).encode())
    return folder / "inkling_mtp" / f"{digest.hexdigest()}.built"


def build_concurrently(engine, keys: list[tuple], threads: int | None = None) -> None:
    """Build the kernel specializations of the steps `keys` on `threads` threads (default: one per CPU
    core this process may use): trace_steps under Triton's asynchronous compile mode, whose exit
    waits for every build. Without that mode (older Triton) the trace builds them one by one. Skipped
    when a `build_record` says an earlier process built them into Triton's on-disk cache: the trace's
    first use of meta tensors imports parts of torch (torch._dynamo, sympy) that cost more than loading
    those kernels at first launch. A no-op under the interpreter, which builds nothing."""
    from .kernels.common import interpreting

    if interpreting() or engine.device.type != "cuda":
        return
    record = build_record(engine, keys)
    if record is not None and record.exists():
        return
    try:
        from triton.runtime._async_compile import AsyncCompileMode
    except ImportError:
        trace_steps(engine, keys)
    else:
        threads = threads or (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count())
        with BuildPool(max_workers=threads, thread_name_prefix="triton-build") as pool:
            with AsyncCompileMode(pool):
                trace_steps(engine, keys)
    if record is not None:
        with contextlib.suppress(OSError):                   # a read-only cache: no record, no harm
            record.parent.mkdir(parents=True, exist_ok=True)
            record.touch()


def warmup(engine, prompt_ids, **generate_kwargs) -> SetupReport:
    """Build the kernels of engine.generate(prompt_ids, **generate_kwargs) concurrently, then run that
    call once, discarding its tokens, so that every kernel specialization and CUDA graph the request
    needs exists; return what that cost."""
    from .kernels.common import interpreting

    graphs_before = len(engine.graphs)
    start = time.perf_counter()
    with count_kernel_builds() as built:
        engine.build_kernels(prompt_ids, **generate_kwargs)
        engine.generate(prompt_ids, **generate_kwargs)
    if engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)
    return SetupReport(seconds=time.perf_counter() - start, kernels_built=None if interpreting() else built[0],
                       graphs_captured=len(engine.graphs) - graphs_before)
