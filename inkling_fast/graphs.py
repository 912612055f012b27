"""Engine steps captured as CUDA graphs: one per cycle shape (batch size, k, decode mode) and one per
prefill-pass shape (batch size, chunk length T, k, decode mode).

A step is a fixed sequence of kernel launches whose shapes depend only on its key; every
data-dependent value (slots, lengths, positions, tokens) is either device state or in one static
input tensor. So it is captured once and replayed:

    static input    cycle: int32 [B], the slot of each batch row (-1: padding row)
                    prefill pass: int64 [B, 8 + T + k], the pass's rows (Engine.prefill_rows)
    replay          every kernel of the step; the device state (caches, tokens, n, done) is updated in place
    static output   cycle: int64 [B, k+7] (Engine.cycle); prefill pass: int64 [B, 2] (x_L, done)

The host copies a step's input in (asynchronously, from pinned memory) before the replay and its output
out (one asynchronous copy into pinned memory) right after it, on the same stream, so the next replay
may overwrite the output at once.

Capture needs the kernels compiled and autotuned first (autotuning synchronizes): the step is run
twice on a side stream with every row padding, which writes nothing but the scratch slot, so
capturing is safe at any time, also while other sequences are running. All graphs of an engine
share one memory pool: they run one after the other on one stream, never concurrently.
"""

from __future__ import annotations

from typing import Callable

import torch


class StepGraph:
    def __init__(self, pool, step: Callable[[torch.Tensor], torch.Tensor], padding_input: torch.Tensor):
        """step(input) -> output, run on the all-padding `padding_input` (kept as the static input)."""
        self.input = padding_input
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):                                  # compile + autotune, then a clean run
                step(self.input)
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            self.out = step(self.input)
        self.replays = 0
        self.uploaded: torch.Tensor | None = None               # the host tensor last copied into `input`

    def run(self, host_input: torch.Tensor, upload: Callable[[torch.Tensor, torch.Tensor], None]) -> torch.Tensor:
        """upload(host_input, self.input) unless the same values are already there, replay, and return
        the static output (valid until the next replay of any graph of the engine)."""
        if self.uploaded is None or not torch.equal(self.uploaded, host_input):
            upload(host_input, self.input)
            self.uploaded = host_input
        self.graph.replay()
        self.replays += 1
        return self.out
