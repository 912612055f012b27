"""The Hugging Face transformers layout of an Inkling trunk <-> the released layout.

transformers' `InklingForCausalLM` renames every tensor, de-interleaves the w13 projections into
gate/up halves, splits the shared experts' w13 into separate gate and up tensors, and drops the
MTP head. `to_released` is the inverse of transformers' own conversion (what
`inkling-mtp convert` runs); `from_released` is its forward direction (used by tests to build a
transformers model from our weights). Both are pure renames and row permutations: no arithmetic.

transformers prefixes: `model.` for `InklingForCausalLM`, `model.language_model.` for the
multimodal `InklingForConditionalGeneration`; both are accepted.
"""

from __future__ import annotations

import re

import torch
from einops import rearrange

_ATTN = {  # released suffix -> transformers suffix, inside one layer
    "attn_norm.weight": "input_layernorm.weight",
    "mlp_norm.weight": "post_attention_layernorm.weight",
    "attn.wq_du.weight": "self_attn.q_proj.weight",
    "attn.wk_dv.weight": "self_attn.k_proj.weight",
    "attn.wv_dv.weight": "self_attn.v_proj.weight",
    "attn.wr_du.weight": "self_attn.r_proj.weight",
    "attn.wo_ud.weight": "self_attn.o_proj.weight",
    "attn.q_norm.weight": "self_attn.q_norm.weight",
    "attn.k_norm.weight": "self_attn.k_norm.weight",
    "attn.k_sconv.weight": "self_attn.k_sconv.conv1d.weight",
    "attn.v_sconv.weight": "self_attn.v_sconv.conv1d.weight",
    "attn.rel_logits_proj.proj": "self_attn.rel_logits_proj.proj",
    "attn_sconv.weight": "attn_sconv.conv1d.weight",
    "mlp_sconv.weight": "mlp_sconv.conv1d.weight",
    "mlp.w2_md.weight": "mlp.down_proj.weight",
    "mlp.global_scale": "mlp.global_scale",
    "mlp.gate.weight": "mlp.gate.weight",
    "mlp.gate.bias": "mlp.gate.e_score_correction_bias",
    "mlp.gate.global_scale": "mlp.gate.global_scale",
    "mlp.experts.w2_weight": "mlp.experts.down_proj",
    "mlp.shared_experts.shared_w2_weight": "mlp.shared_experts.down_proj",
}
_ATTN_BACK = {v: k for k, v in _ATTN.items()}
# vision / audio tensors of a multimodal checkpoint, in the transformers and in the released spelling
TOWERS = ("model.vision_tower.", "model.audio_tower.", "model.multi_modal_projector.", "model.visual.",
          "model.audio.")
_TOP = {
    "model.llm.embed.weight": "embed_tokens.weight",
    "model.llm.embed_norm.weight": "embed_tokens.embed_norm.weight",
    "model.llm.norm.weight": "norm.weight",
}
# older transformers releases (seen in 5.17) name the embedding norm `model.embed_norm.weight`
_TOP_OLD = {"embed_norm.weight": "model.llm.embed_norm.weight"}


def deinterleave(w: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows g0, u0, g1, u1, ... along `dim` -> (g, u)."""
    w = w.movedim(dim, 0)
    w = rearrange(w, "(f two) ... -> two f ...", two=2)
    return w[0].movedim(0, dim).contiguous(), w[1].movedim(0, dim).contiguous()


def interleave(g: torch.Tensor, u: torch.Tensor, dim: int) -> torch.Tensor:
    """(g, u) -> rows g0, u0, g1, u1, ... along `dim`."""
    w = torch.stack([g.movedim(dim, 0), u.movedim(dim, 0)])  # [2, F, ...]
    return rearrange(w, "two f ... -> (f two) ...").movedim(0, dim).contiguous()


def from_released(sd: dict[str, torch.Tensor], prefix: str = "model.") -> dict[str, torch.Tensor]:
    """Released trunk tensors -> transformers `InklingForCausalLM` names (the MTP head is dropped)."""
    out = {}
    for name, w in sd.items():
        if name.startswith("model.mtp."):
            continue
        if name == "model.llm.unembed.weight":
            out["lm_head.weight"] = w
        elif name in _TOP:
            out[prefix + _TOP[name]] = w
        else:
            m = re.fullmatch(r"model\.llm\.layers\.(\d+)\.(.+)", name)
            if not m:
                raise KeyError(f"unexpected released tensor {name}")
            layer, suffix = f"{prefix}layers.{m.group(1)}.", m.group(2)
            if suffix == "mlp.w13_dn.weight":
                g, u = deinterleave(w, 0)
                out[layer + "mlp.gate_proj.weight"], out[layer + "mlp.up_proj.weight"] = g, u
            elif suffix == "mlp.experts.w13_weight":
                g, u = deinterleave(w, 1)
                out[layer + "mlp.experts.gate_up_proj"] = torch.cat([g, u], dim=1)
            elif suffix == "mlp.shared_experts.shared_w13_weight":
                g, u = deinterleave(w, 1)
                out[layer + "mlp.shared_experts.gate_proj"], out[layer + "mlp.shared_experts.up_proj"] = g, u
            elif suffix in _ATTN:
                out[layer + _ATTN[suffix]] = w
            else:
                raise KeyError(f"unexpected released tensor {name}")
    return out


def match_model_names(sd: dict[str, torch.Tensor], model_keys) -> dict[str, torch.Tensor]:
    """`from_released` output renamed to the spelling of the installed transformers where it differs
    (the embedding norm: `model.embed_tokens.embed_norm.weight`, or `model.embed_norm.weight` in older
    releases). model_keys: the keys of the `InklingForCausalLM` state dict to load into."""
    keys = set(model_keys)
    old, new = "model.embed_tokens.embed_norm.weight", "model.embed_norm.weight"
    if old in sd and old not in keys and new in keys:
        sd = {(new if n == old else n): w for n, w in sd.items()}
    return sd


def to_released(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers `InklingForCausalLM` / `InklingForConditionalGeneration` text tensors -> released
    names. Vision and audio towers are dropped; tensors that already carry released text names
    (`model.llm.*`, `model.mtp.*`) pass through unchanged. Raises KeyError naming every tensor it
    cannot place. Works on meta tensors too (a dry run that only checks names and shapes)."""
    out, unknown = {}, []
    pending: dict[str, dict[str, torch.Tensor]] = {}  # split tensors waiting for their other half
    top_back = {v: k for k, v in _TOP.items()}
    for name, w in sd.items():
        if name.startswith(TOWERS):
            continue
        if name.startswith(("model.llm.", "model.mtp.")):
            out[name] = w
            continue
        if name == "lm_head.weight":
            out["model.llm.unembed.weight"] = w
            continue
        m = re.fullmatch(r"model\.(?:language_model\.)?(.+)", name)
        rest = m.group(1) if m else name
        if rest in top_back:
            out[top_back[rest]] = w
            continue
        if rest in _TOP_OLD:
            out[_TOP_OLD[rest]] = w
            continue
        m = re.fullmatch(r"layers\.(\d+)\.(.+)", rest)
        if not m:
            unknown.append(name)
            continue
        layer, suffix = f"model.llm.layers.{m.group(1)}.", m.group(2)
        if suffix == "mlp.experts.gate_up_proj":
            g, u = w.chunk(2, dim=1)
            out[layer + "mlp.experts.w13_weight"] = interleave(g, u, 1)
        elif suffix in ("mlp.gate_proj.weight", "mlp.up_proj.weight",
                        "mlp.shared_experts.gate_proj", "mlp.shared_experts.up_proj"):
            shared = "shared_experts" in suffix
            target = layer + ("mlp.shared_experts.shared_w13_weight" if shared else "mlp.w13_dn.weight")
            part = pending.setdefault(target, {})
            part["gate" if "gate_proj" in suffix else "up"] = w
            if len(part) == 2:
                out[target] = interleave(part["gate"], part["up"], 1 if shared else 0)
                del pending[target]
        elif suffix in _ATTN_BACK:
            out[layer + _ATTN_BACK[suffix]] = w
        else:
            unknown.append(name)
    unknown += [f"{t} (one of gate/up missing)" for t in pending]
    if unknown:
        raise KeyError("tensors with no place in the released layout: " + ", ".join(sorted(unknown)))
    return out
