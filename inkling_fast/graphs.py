"""One speculative cycle captured as a CUDA graph, per (batch size, k, decode mode).

The cycle (Engine.cycle: draft, verify, accept, commit) is a fixed sequence of kernel launches
whose shapes depend only on the batch size B and k; every data-dependent value (slots, lengths,
positions, tokens, uniforms) lives on the device. So it is captured once and replayed:

    static inputs   batch.slot [B], batch.live [B], batch.uniforms [B, 2k+1]   (copied in before replay)
    replay          every kernel of the cycle; the device state (caches, tokens, n) is updated in place
    static output   [B, k+2]: a, b, d_1..d_k per row                           (copied out after replay)

Capture needs the kernels compiled and autotuned first (autotuning synchronizes): the cycle is run
twice on a side stream with every row padding, which writes nothing but the scratch slot, so
capturing is safe at any time, also while other sequences are running. All graphs of an engine
share one memory pool: they never run concurrently.
"""

from __future__ import annotations

import torch


class CycleGraph:
    def __init__(self, engine, batch_size: int, k: int, mode):
        self.batch = engine.padding_batch(batch_size, k)       # the static inputs
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):                                  # compile + autotune, then a clean run
                engine.cycle(self.batch, k, mode)
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=engine.graph_pool):
            self.out = engine.cycle(self.batch, k, mode)
        self.replays = 0

    def run(self, batch) -> torch.Tensor:
        """Copy `batch` (same shapes) into the static inputs, replay, return the static output."""
        self.batch.slot.copy_(batch.slot)
        self.batch.live.copy_(batch.live)
        self.batch.uniforms.copy_(batch.uniforms)
        self.graph.replay()
        self.replays += 1
        return self.out

