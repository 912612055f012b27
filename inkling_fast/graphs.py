"""Running the engine's device steps: as CUDA graphs, captured once per step key, or eagerly.

A step (device_steps.py) is a fixed sequence of kernel launches for its key (step_io.py), with one
input tensor and one result tensor, so it is captured once and replayed:

    static input    cycle: int32 [B], the slot of each batch row (-1: padding row)
                    prefill pass: int64 [B, PASS_COLUMNS + T + k], the pass's rows
    replay          every kernel of the step; the device state (caches, tokens, n, done) changes in place
    static output   cycle: int64 [B, k+8]; prefill pass: int64 [B, 3]

The host copies a step's input in (asynchronously, from pinned memory) before the replay and its
result out (one asynchronous copy into pinned memory, with an event to wait on) right after it, on
the same stream, so the next replay may overwrite the static output at once.

Capture needs the kernels compiled first (compiling synchronizes): the step runs twice on a side
stream on an all-padding input, which writes nothing but the scratch slot, so capturing is safe at
any time, also while other sequences are running. All graphs of an engine share one memory pool:
they run one after the other on one stream, never concurrently.
"""

from __future__ import annotations

import time
from typing import Callable, NamedTuple

import torch

from .device_steps import DeviceSteps
from .step_io import StepKey


class StepGraph:
    def __init__(self, pool, step: Callable[[torch.Tensor], torch.Tensor], padding_input: torch.Tensor):
        """step(input) -> output, captured on the all-padding `padding_input` (kept as the static input)."""
        self.input = padding_input
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):                                  # compile, then a clean run
                step(self.input)
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            self.out = step(self.input)
        self.replays = 0
        self.uploaded: torch.Tensor | None = None               # the host tensor last copied into `input`
        self.captured_s = time.perf_counter()                   # when (time.perf_counter seconds)

    def run(self, host_input: torch.Tensor, upload: Callable[[torch.Tensor, torch.Tensor], None]) -> torch.Tensor:
        """upload(host_input, self.input) unless the same values are already there, replay, and return
        the static output (valid until the next replay of any graph of the engine)."""
        if self.uploaded is None or not torch.equal(self.uploaded, host_input):
            upload(host_input, self.input)
            self.uploaded = host_input
        self.graph.replay()
        self.replays += 1
        return self.out


class Launched(NamedTuple):
    """A launched step: its result on its way to the host, the event to wait on before reading it (None
    on the CPU, where the result is ready), and, when timed, what brackets the step: two device events
    (CUDA), or two host clock readings (the CPU runs a step before `launch` returns)."""
    host: torch.Tensor
    ready: object
    timer: tuple | None

    def device_ms(self) -> float | None:
        """The step's run time in ms (after `ready` was waited on), or None when not timed."""
        if self.timer is None:
            return None
        start, end = self.timer
        return start.elapsed_time(end) if isinstance(start, torch.cuda.Event) else (end - start) * 1e3


class StepRunner:
    """Launches the steps of `steps` from host inputs and starts copying their results back: a graph
    per key (captured on first use) with `use_cuda_graphs`, else eagerly."""

    def __init__(self, steps: DeviceSteps, device: torch.device, use_cuda_graphs: bool):
        self.steps, self.device, self.use_cuda_graphs = steps, device, use_cuda_graphs
        self.graphs: dict[StepKey, StepGraph] = {}
        self.pool = torch.cuda.graph_pool_handle() if use_cuda_graphs else None

    def capture(self, key: StepKey) -> None:
        """Capture the graph of step `key` unless it exists (nothing when steps run eagerly)."""
        if self.use_cuda_graphs and key not in self.graphs:
            self.graphs[key] = StepGraph(self.pool, lambda rows: self.steps.run(key, rows),
                                         self.steps.padding_input(key, self.device))

    def launch(self, key: StepKey, host_input: torch.Tensor, timed: bool = False) -> Launched:
        """Run the step `key` on `host_input` (timed: between two device events, CUDA only)."""
        self.capture(key)
        cuda = self.device.type == "cuda"
        events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) if timed and cuda \
            else None
        if events:
            events[0].record()
        start = time.perf_counter()
        if self.use_cuda_graphs:
            out = self.graphs[key].run(host_input, self.upload)
        else:
            out = self.steps.run(key, self.upload(host_input))
        if events:
            events[1].record()
        timer = events if cuda else ((start, time.perf_counter()) if timed else None)
        return Launched(*self.fetch(out), timer)

    def time_padding(self, key: StepKey, replays: int = 5) -> float:
        """Median device ms of the step `key` on its all-padding input (it writes nothing but the scratch
        slot, so it may run at any time): what a cost table starts from before real steps are timed."""
        pad = self.steps.padding_input(key, torch.device("cpu"))
        times = []
        for _ in range(replays + 1):
            step = self.launch(key, pad, timed=True)
            if step.ready is not None:
                step.ready.synchronize()
            times.append(step.device_ms())
        times = sorted(t for t in times[1:] if t is not None)
        return times[len(times) // 2] if times else float("nan")

    def upload(self, host: torch.Tensor, dst: torch.Tensor | None = None) -> torch.Tensor:
        """host -> device without a host sync (through pinned memory on CUDA), into `dst` when given."""
        if self.device.type == "cuda":
            host = host.pin_memory()                  # the caching host allocator keeps it until the copy ran
            if dst is None:
                return host.to(self.device, non_blocking=True)
        elif dst is None:
            return host
        return dst.copy_(host, non_blocking=True)

    def fetch(self, out: torch.Tensor) -> tuple[torch.Tensor, object]:
        """The one device -> host copy of a step: into pinned memory, asynchronously, with an event."""
        if self.device.type != "cuda":
            return out.clone(), None
        host = torch.empty(out.shape, dtype=out.dtype, pin_memory=True)
        host.copy_(out, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return host, event
