"""Tensor names: our readable module names <-> the released checkpoint layout.

Released names (`model.llm.*` for the trunk, `model.mtp.*` for the MTP head) live only here and in
the loader; modules use readable names (`q_proj`, `gate_up`). Every mapping is 1:1 with identical
shapes and element order (the interleaved w13 stays interleaved), so loading is a rename.
"""

from __future__ import annotations

import re

# suffix inside one block (trunk layer or MTP depth's transformer_block): ours -> released
BLOCK_SUFFIXES = {
    "attn_norm.weight": "attn_norm.weight",
    "mlp_norm.weight": "mlp_norm.weight",
    "attn.q_proj.weight": "attn.wq_du.weight",
    "attn.k_proj.weight": "attn.wk_dv.weight",
    "attn.v_proj.weight": "attn.wv_dv.weight",
    "attn.r_proj.weight": "attn.wr_du.weight",
    "attn.o_proj.weight": "attn.wo_ud.weight",
    "attn.q_norm.weight": "attn.q_norm.weight",
    "attn.k_norm.weight": "attn.k_norm.weight",
    "attn.k_conv.weight": "attn.k_sconv.weight",
    "attn.v_conv.weight": "attn.v_sconv.weight",
    "attn.rel_proj": "attn.rel_logits_proj.proj",
    "attn_conv.weight": "attn_sconv.weight",
    "mlp_conv.weight": "mlp_sconv.weight",
    # dense MLP
    "mlp.gate_up.weight": "mlp.w13_dn.weight",
    "mlp.down.weight": "mlp.w2_md.weight",
    "mlp.global_scale": "mlp.global_scale",
    # MoE
    "mlp.router": "mlp.gate.weight",
    "mlp.router_bias": "mlp.gate.bias",
    "mlp.gate_global_scale": "mlp.gate.global_scale",
    "mlp.experts_gate_up": "mlp.experts.w13_weight",
    "mlp.experts_down": "mlp.experts.w2_weight",
    "mlp.shared_gate_up": "mlp.shared_experts.shared_w13_weight",
    "mlp.shared_down": "mlp.shared_experts.shared_w2_weight",
}
TOP_LEVEL = {
    "trunk.embed.weight": "model.llm.embed.weight",
    "trunk.embed_norm.weight": "model.llm.embed_norm.weight",
    "trunk.norm.weight": "model.llm.norm.weight",
    "trunk.unembed.weight": "model.llm.unembed.weight",
    "mtp.chain_norm.weight": "model.mtp.chain_norm.weight",
}
DEPTH_OWN = {  # MTP depth parameters outside its block
    "hidden_norm.weight": "hidden_norm.weight",
    "embed_norm.weight": "embed_norm.weight",
    "input_proj.weight": "input_proj.weight",
}
_RELEASED_BLOCK = {v: k for k, v in BLOCK_SUFFIXES.items()}
_RELEASED_TOP = {v: k for k, v in TOP_LEVEL.items()}
_RELEASED_DEPTH = {v: k for k, v in DEPTH_OWN.items()}

# Names inside numbered layers, tried in order: (pattern whose two groups are the layer index and the
# suffix, the name built from the index and the renamed suffix, the suffix table that renames it).
_LAYERS_TO_RELEASED = (
    (r"trunk\.layers\.(\d+)\.(.+)", "model.llm.layers.{}.{}", BLOCK_SUFFIXES),
    (r"mtp\.depths\.(\d+)\.block\.(.+)", "model.mtp.layers.{}.transformer_block.{}", BLOCK_SUFFIXES),
    (r"mtp\.depths\.(\d+)\.(.+)", "model.mtp.layers.{}.{}", DEPTH_OWN),
)
_LAYERS_FROM_RELEASED = (
    (r"model\.llm\.layers\.(\d+)\.(.+)", "trunk.layers.{}.{}", _RELEASED_BLOCK),
    (r"model\.mtp\.layers\.(\d+)\.transformer_block\.(.+)", "mtp.depths.{}.block.{}", _RELEASED_BLOCK),
    (r"model\.mtp\.layers\.(\d+)\.(.+)", "mtp.depths.{}.{}", _RELEASED_DEPTH),
)


def _rename(name: str, top_level: dict, layers: tuple) -> str | None:
    """`name` renamed by the table of top-level names or by the first layer pattern that matches it with a
    suffix its table knows; None when neither does."""
    if name in top_level:
        return top_level[name]
    for pattern, renamed, suffixes in layers:
        m = re.fullmatch(pattern, name)
        if m and m.group(2) in suffixes:
            return renamed.format(m.group(1), suffixes[m.group(2)])
    return None


def to_released(name: str) -> str:
    """Our parameter name -> the released checkpoint name."""
    released = _rename(name, TOP_LEVEL, _LAYERS_TO_RELEASED)
    if released is None:
        raise KeyError(f"no released name for parameter {name}")
    return released


def from_released(name: str) -> str | None:
    """Released checkpoint name -> our parameter name (None when the name is not part of the model)."""
    return _rename(name, _RELEASED_TOP, _LAYERS_FROM_RELEASED)


# Released tensors of the other towers of the multimodal checkpoint: not part of the text model.
OTHER_TOWERS = ("model.visual.", "model.audio.")
# Leaf names of the extra tensors a quantized checkpoint (e.g. NVFP4) stores next to its packed weights.
QUANT_SCALE_SUFFIXES = ("weight_scale", "weight_scale_2", "input_scale")


def is_mtp(released_name: str) -> bool:
    return released_name.startswith("model.mtp.")


def is_other_tower(released_name: str) -> bool:
    """A vision or audio tensor of the multimodal checkpoint (ignored by the text model)."""
    return released_name.startswith(OTHER_TOWERS)


def is_quant_scale(released_name: str) -> bool:
    """A quantization scale (`...wq_du.weight_scale`, `...experts.w13_weight_scale_2`, `...input_scale`)."""
    return released_name.rsplit(".", 1)[-1].endswith(QUANT_SCALE_SUFFIXES)


def mtp_depth_of(released_name: str) -> int | None:
    """The MTP depth a released tensor belongs to (None for the chain norm and trunk tensors)."""
    m = re.match(r"model\.mtp\.layers\.(\d+)\.", released_name)
    return int(m.group(1)) if m else None
