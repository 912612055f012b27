"""One sequence's prefill, eagerly: the reference path of the batched prefill passes (device_steps.py).

    prefill_one(steps, slot, prompt, dec, stop, chunk)

The trunk over the prompt x_0..x_{L-1} in chunks of `chunk` tokens, x_L picked from its last
logits, SlotState.hidden filled with H_0..H_{L-1}, and every depth over the prompt rows 0..L-2-k
(teacher-forced), so that the first cycle's window [L-1-k, L-1] continues them. Tests compare the
batched passes with it; it returns x_L with one host sync, so it is never captured.
"""

from __future__ import annotations

import torch

from . import forward
from .device_steps import DeviceSteps, probs
from .kernels.sampling import sample_tokens
from .kernels.uniforms import philox_uniforms
from .step_io import Decoding


def prefill_one(steps: DeviceSteps, slot: int, prompt: list[int], dec: Decoding, stop: int, chunk: int,
                first_uniform: float | None = None) -> int:
    """Start `prompt` in `slot` (stop = L + max_new_tokens); returns x_L. `first_uniform`: x_L's uniform
    (reference uniforms only; with device uniforms the slot's seed and counter are used). No EOS is set
    for the slot."""
    st, W, L, k = steps.state, steps.W, len(prompt), dec.k
    device = st.tokens.device
    st.tokens[slot, :L] = torch.tensor(prompt, dtype=torch.int64)
    slot_t = torch.tensor([slot], dtype=torch.int32, device=device)
    depth_rows = L - 1 - k                                                   # depth rows 0..L-2-k
    for c0 in range(0, L, chunk):
        c1 = min(L, c0 + chunk)
        pos = torch.arange(c0, c1, dtype=torch.int32, device=device)[None]
        hidden = forward.trunk_forward(W, steps.trunk_caches, st.tokens[slot, c0:c1][None], slot_t, pos,
                                       prefill=True)
        st.hidden[slot, c0:c1] = hidden[0]
        d1 = min(c1, depth_rows)
        if d1 > c0:                                                          # depth rows c0..d1-1
            h, d_pos = hidden[:, : d1 - c0], pos[:, : d1 - c0].contiguous()
            for m in range(k):
                ids = st.tokens[slot, c0 + m + 1: d1 + m + 1][None]          # x_{p+m+1}
                h = steps.depth(m, h, ids, slot_t, d_pos, prefill=True)
    last = hidden[0, -1:]                                                    # H_{L-1}
    if dec.greedy:
        first = forward.greedy_tokens(W, last)
    else:
        if steps.uniforms == "device":
            u = philox_uniforms(st.seeds[slot: slot + 1], st.counters[slot: slot + 1], 1)[:, 0]
        else:
            u = torch.tensor([first_uniform], dtype=torch.float64, device=device)
        first = sample_tokens(probs(forward.logits(W, last), dec.params), u)
    st.tokens[slot, L] = first[0]
    st.n[slot] = L + 1
    st.stop[slot] = stop
    st.eos[slot] = -1
    st.done[slot] = L + 1 >= stop
    return int(first[0])
