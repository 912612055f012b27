"""A port dump written by the fast engine (inkling_fast.Engine), the way a port records its own depths.

`capture_fast` starts one sequence in a slot and runs greedy cycles of the engine's device steps
(`Engine.prefill`, `engine.steps.cycle`, both eager), recording every call of a depth for that slot:
the rows it ran (positions >= 0), the tokens it consumed, the hidden it read and its output. The
recording is the device steps' `on_depth` observer for the duration of the capture (a replayed CUDA
graph would not call Python, so the capture runs the steps eagerly whatever the engine was built with).
"""

from __future__ import annotations

import torch

from inkling_ref.port_check import DumpRecorder
from inkling_ref.port_check.dump import probe_of


@torch.no_grad()
def capture_fast(engine, prompt: list[int], k: int, cycles: int, path, slot: int = 0,
                 metadata: dict | None = None) -> list[int]:
    """Prefill `prompt` into `slot`, run `cycles` greedy cycles with k drafts, write the dump to `path`.
    The first step holds the prefill's depth rows and the first window's. Returns the committed tokens."""
    from inkling_fast.step_io import CycleColumns, Decoding

    stop = len(prompt) + 1 + cycles * (k + 1)
    if stop > engine.max_seq_len:
        raise ValueError(f"{len(prompt)} prompt tokens and {cycles} cycles of k = {k} need max_seq_len >= {stop}, "
                         f"the engine has {engine.max_seq_len}")
    rec = DumpRecorder()

    def recording(m, h_prev, ids, slots, pos, out):
        for b in torch.nonzero(slots == slot)[:, 0].tolist():
            live = pos[b] >= 0
            rec.depth_rows(m, pos[b][live].cpu(), out[b][live], tokens=ids[b][live].cpu(), hidden_in=h_prev[b][live])

    dec, cols = Decoding(k), CycleColumns(k)
    engine.steps.on_depth = recording
    try:
        rec.step(len(prompt) + 1, k)
        tokens = list(prompt) + [engine.prefill(slot, list(prompt), dec, stop)]
        batch = engine.make_batch([slot], k)
        for c in range(cycles):
            if c:
                rec.step(len(tokens), k)
            row = engine.steps.cycle(batch, dec)[0].tolist()
            drafts, a = row[cols.drafts: cols.drafts + k], row[cols.a]
            rec.drafts(drafts)
            tokens += drafts[:a] + [row[cols.b]]
    finally:
        engine.steps.on_depth = None
    dtype = str(engine.dtype).removeprefix("torch.")
    rec.write(path, tokens, {"engine": "inkling_fast.Engine", "dtype": dtype, **(metadata or {})},
              checkpoint_probe=probe_of(engine.W.depths[0].input_proj))
    return tokens
