"""A dump written by the reference cycle (inkling_ref.decoding.speculative), recorded the way a port
records its own: every call of a depth, with the rows it ran, the tokens it consumed, the hidden it
read and the output it produced. The cycle module is a parameter, so that a copy of the reference with
a mistake built in (tests/mutants.py) writes the dump that mistake makes.
"""

from __future__ import annotations

import torch

from ..decoding import speculative as reference_cycle
from .dump import DumpRecorder, probe_of


@torch.no_grad()
def capture_reference(model, prompt: list[int], k: int, cycles: int, path, *, cycle=reference_cycle,
                      window: str = "full", logits: bool = False, metadata: dict | None = None):
    """Run `cycles` greedy cycles of `cycle` (prefill, draft, verify, accept_greedy, commit) on `prompt` and
    write their dump to `path`. The recording wraps `model.mtp_depth` for the duration: each call ran
    the rows ending at n-2 (the rows of `cycle.draft`'s window). Returns the final DecodeState."""
    rec = DumpRecorder()
    state = cycle.prefill(model, prompt)
    depth_call = model.mtp_depth

    def recording(m, h_prev, tokens, cache=None):
        out, row_logits = depth_call(m, h_prev, tokens, cache)
        T = tokens.shape[1]
        rec.depth_rows(m, range(state.n - 1 - T, state.n - 1), out[0], tokens=tokens[0], hidden_in=h_prev[0],
                       logits=row_logits[0] if logits else None)
        return out, row_logits

    model.mtp_depth = recording
    try:
        for _ in range(cycles):
            rec.step(state.n, k)
            d = cycle.draft(model, state, k, window=window)
            rec.drafts(d.tokens)
            v = cycle.verify(model, state, d.tokens)
            a, b = cycle.accept_greedy(d.tokens, v.logits)
            cycle.commit(state, d.tokens, a, b, v)
    finally:
        del model.mtp_depth                     # the class's method again
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    rec.write(path, state.tokens, {"engine": f"inkling_ref ({window} window)", "dtype": dtype, **(metadata or {})},
              checkpoint_probe=probe_of(model.mtp.depths[0].input_proj.weight))
    return state
