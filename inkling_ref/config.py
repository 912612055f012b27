"""The Inkling configuration: one flat dataclass, read from either spelling of the config file.

Two spellings exist in the wild (see `docs/spec/inkling-architecture.md`, "Config keys"):

* the released `config.json`: top level `text_config` + `mtp_config` (+ vision/audio, ignored here),
  with `sconv_kernel_size`, `dense_mlp_idx`, `dense_intermediate_size`, `local_layer_ids`,
  `model_max_length`, and `intermediate_size` meaning the *MoE expert* width;
* a transformers `InklingTextConfig`: `conv_kernel_size`, `layer_types`, `mlp_layer_types`,
  `max_position_embeddings`, `intermediate_size` meaning the *dense MLP* width,
  `moe_intermediate_size`, `num_mtp_layers`, `mtp_local_layer_ids`.

`InklingConfig.from_dict` accepts both (and the multimodal transformers config, whose
`text_config` is in the transformers spelling). Every error names the field, as the file spells it.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path


class ConfigError(ValueError):
    """A config that cannot describe a runnable Inkling model. The message names the field."""


SLIDING, GLOBAL = "sliding", "global"
DENSE, MOE = "dense", "moe"
KNOWN_MODEL_TYPES = ("inkling_mm_model", "inkling_text", "inkling")


@dataclass
class InklingConfig:
    # vocabulary and widths
    vocab_size: int = 201024
    unpadded_vocab_size: int | None = 200058
    hidden_size: int = 6144
    num_layers: int = 66
    # global ("hybrid") attention layers
    num_heads: int = 64
    num_kv_heads: int = 8
    head_dim: int = 128
    rel_extent: int = 1024
    # sliding ("hybrid_sliding") attention layers
    swa_num_heads: int = 64
    swa_num_kv_heads: int = 16
    swa_head_dim: int = 128
    sliding_window: int = 512
    # relative-logit bias and log-tau
    d_rel: int = 16
    log_scaling_n_floor: int | None = 128000
    log_scaling_alpha: float = 0.1
    # per-layer kinds: "sliding" | "global", and "dense" | "moe"
    layer_types: list[str] = field(default_factory=list)
    mlp_types: list[str] = field(default_factory=list)
    # MLPs
    dense_intermediate_size: int = 24576
    moe_intermediate_size: int = 3072
    n_routed_experts: int = 256
    num_experts_per_tok: int = 6
    n_shared_experts: int = 2
    route_scale: float = 8.0
    # misc
    mup: float = 24.0  # logits_mup_width_multiplier
    rms_norm_eps: float = 1e-6
    conv_kernel_size: int = 4
    max_position_embeddings: int = 131072
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    # MTP head (mtp_config)
    num_mtp_depths: int = 0
    mtp_layer_types: list[str] = field(default_factory=list)
    chain_hidden_post_norm: bool = False
    mtp_apply_log_scaling: bool = False  # [ours] vLLM applies none inside MTP depths

    def __post_init__(self):
        if not self.layer_types and _is_int(self.num_layers):
            # default pattern: every sixth layer is global
            self.layer_types = [GLOBAL if (i + 1) % 6 == 0 else SLIDING for i in range(self.num_layers)]
        if not self.mlp_types and _is_int(self.num_layers):
            self.mlp_types = [MOE] * self.num_layers
        if not self.mtp_layer_types and _is_int(self.num_mtp_depths) and self.num_mtp_depths > 0:
            self.mtp_layer_types = [GLOBAL] * self.num_mtp_depths
        self.validate()

    # ------------------------------------------------------------------ derived sizes
    @property
    def vocab_out(self) -> int:
        """Number of logits the model returns (the unpadded vocabulary)."""
        return self.unpadded_vocab_size if self.unpadded_vocab_size is not None else self.vocab_size

    def attention_shape(self, kind: str) -> tuple[int, int, int, int]:
        """(num_heads, num_kv_heads, head_dim, rel_extent) of a "sliding" or "global" layer."""
        if kind == SLIDING:
            return self.swa_num_heads, self.swa_num_kv_heads, self.swa_head_dim, self.sliding_window
        return self.num_heads, self.num_kv_heads, self.head_dim, self.rel_extent

    @property
    def local_layer_ids(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == SLIDING]

    @property
    def mtp_local_layer_ids(self) -> list[int]:
        return [i for i, t in enumerate(self.mtp_layer_types) if t == SLIDING]

    # ------------------------------------------------------------------ validation
    def validate(self) -> None:
        """Raise ConfigError naming the first field that cannot describe a runnable model."""
        def need(ok: bool, name: str, why: str):
            if not ok:
                raise ConfigError(f"{field_label(name)}: {why}")

        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                     "swa_num_heads", "swa_num_kv_heads", "swa_head_dim", "sliding_window", "rel_extent",
                     "d_rel", "conv_kernel_size", "max_position_embeddings"):
            v = getattr(self, name)
            need(_is_int(v) and v > 0, name, f"must be a positive integer, got {v!r}")
        need(_is_int(self.num_mtp_depths) and self.num_mtp_depths >= 0, "num_mtp_depths",
             f"must be an integer >= 0, got {self.num_mtp_depths!r}")
        need(self.num_heads % self.num_kv_heads == 0, "num_heads",
             f"{self.num_heads} query heads is not a multiple of num_key_value_heads={self.num_kv_heads}")
        need(self.swa_num_heads % self.swa_num_kv_heads == 0, "swa_num_heads",
             f"{self.swa_num_heads} query heads is not a multiple of "
             f"swa_num_key_value_heads={self.swa_num_kv_heads}")
        if self.unpadded_vocab_size is not None:
            need(_is_int(self.unpadded_vocab_size) and 0 < self.unpadded_vocab_size <= self.vocab_size,
                 "unpadded_vocab_size", f"{self.unpadded_vocab_size!r} must be in 1..vocab_size={self.vocab_size}")
        for name in ("bos_token_id", "eos_token_id"):
            v = getattr(self, name)
            if v is not None:
                need(_is_int(v) and 0 <= v < self.vocab_size, name,
                     f"{v!r} must be a token id in 0..{self.vocab_size - 1}")
        need(self.sliding_window <= self.max_position_embeddings, "sliding_window",
             f"window {self.sliding_window} is longer than the context "
             f"(max_position_embeddings={self.max_position_embeddings}): such a layer would not slide")

        need(isinstance(self.layer_types, list) and len(self.layer_types) == self.num_layers, "layer_types",
             f"has {_len(self.layer_types)} entries for num_hidden_layers={self.num_layers}")
        need(all(t in (SLIDING, GLOBAL) for t in self.layer_types), "layer_types",
             f"entries must be '{SLIDING}' or '{GLOBAL}', got {sorted(set(map(str, self.layer_types)))}")
        need(isinstance(self.mlp_types, list) and len(self.mlp_types) == self.num_layers, "mlp_types",
             f"has {_len(self.mlp_types)} entries for num_hidden_layers={self.num_layers}")
        need(all(t in (DENSE, MOE) for t in self.mlp_types), "mlp_types",
             f"entries must be '{DENSE}' or '{MOE}', got {sorted(set(map(str, self.mlp_types)))}")

        if DENSE in self.mlp_types or self.num_mtp_depths:  # MTP depths always have a dense MLP
            need(_is_int(self.dense_intermediate_size) and self.dense_intermediate_size > 0,
                 "dense_intermediate_size",
                 f"must be a positive integer (the model has dense MLPs), got {self.dense_intermediate_size!r}")
        if MOE in self.mlp_types:
            need(_is_int(self.moe_intermediate_size) and self.moe_intermediate_size > 0, "moe_intermediate_size",
                 f"must be a positive integer (the model has MoE layers), got {self.moe_intermediate_size!r}")
            need(_is_int(self.n_routed_experts) and self.n_routed_experts > 0, "n_routed_experts",
                 f"must be a positive integer, got {self.n_routed_experts!r}")
            need(_is_int(self.n_shared_experts) and self.n_shared_experts >= 0, "n_shared_experts",
                 f"must be an integer >= 0, got {self.n_shared_experts!r}")
            need(_is_int(self.num_experts_per_tok) and 0 < self.num_experts_per_tok <= self.n_routed_experts,
                 "num_experts_per_tok",
                 f"{self.num_experts_per_tok!r} must be in 1..n_routed_experts={self.n_routed_experts}")
            need(_is_real(self.route_scale) and self.route_scale > 0, "route_scale",
                 f"must be a positive number, got {self.route_scale!r}")

        if self.log_scaling_n_floor is not None:
            need(_is_int(self.log_scaling_n_floor) and self.log_scaling_n_floor > 0, "log_scaling_n_floor",
                 f"must be a positive integer (or null to disable), got {self.log_scaling_n_floor!r}")
        need(_is_real(self.log_scaling_alpha) and self.log_scaling_alpha >= 0, "log_scaling_alpha",
             f"must be a number >= 0, got {self.log_scaling_alpha!r}")
        need(_is_real(self.mup) and self.mup > 0, "mup", f"must be a positive number, got {self.mup!r}")
        need(_is_real(self.rms_norm_eps) and self.rms_norm_eps > 0, "rms_norm_eps",
             f"must be a positive number, got {self.rms_norm_eps!r}")

        need(isinstance(self.mtp_layer_types, list) and len(self.mtp_layer_types) == self.num_mtp_depths,
             "mtp_layer_types", f"has {_len(self.mtp_layer_types)} entries for {self.num_mtp_depths} MTP depths")
        need(all(t in (SLIDING, GLOBAL) for t in self.mtp_layer_types), "mtp_layer_types",
             f"entries must be '{SLIDING}' or '{GLOBAL}', got {sorted(set(map(str, self.mtp_layer_types)))}")
        for name in ("chain_hidden_post_norm", "mtp_apply_log_scaling"):
            need(isinstance(getattr(self, name), bool), name, f"must be true or false, got {getattr(self, name)!r}")

    # ------------------------------------------------------------------ reading
    @classmethod
    def from_dict(cls, d: dict) -> "InklingConfig":
        """Build from a released `config.json` (with `text_config` + `mtp_config`), a transformers
        multimodal config (with `text_config`) or a flat transformers `InklingTextConfig` dict."""
        if not isinstance(d, dict):
            raise ConfigError(f"config must be a JSON object, got {type(d).__name__}")
        model_type = d.get("model_type")
        if model_type is not None and model_type not in KNOWN_MODEL_TYPES:
            raise ConfigError(f"config field 'model_type': {model_type!r} is not an Inkling model "
                              f"(expected one of {list(KNOWN_MODEL_TYPES)})")
        if "text_config" in d:
            text = d["text_config"]
            if not isinstance(text, dict):
                raise ConfigError("config field 'text_config': must be an object")
            mtp = d.get("mtp_config") or {}
            if not isinstance(mtp, dict):
                raise ConfigError("config field 'mtp_config': must be an object")
        else:
            text, mtp = d, {}
        return cls(**_text_fields(text), **_mtp_fields(text, mtp))

    @classmethod
    def from_file(cls, path: str | Path) -> "InklingConfig":
        """Read `path` (a config.json, or a directory holding one). Errors start with the file's path."""
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        if not path.exists():
            raise FileNotFoundError(f"no config.json at {path}")
        try:
            d = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ConfigError(f"{path} is not valid JSON: {e}") from None
        try:
            return cls.from_dict(d)
        except ConfigError as e:
            raise ConfigError(f"{path}: {e}") from None

    # ------------------------------------------------------------------ writing
    def to_released_dict(self) -> dict:
        """The released `config.json` layout (`text_config` + `mtp_config`)."""
        n_dense = _dense_prefix(self.mlp_types)
        text = {
            "vocab_size": self.vocab_size,
            "unpadded_vocab_size": self.unpadded_vocab_size,
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "swa_num_attention_heads": self.swa_num_heads,
            "swa_num_key_value_heads": self.swa_num_kv_heads,
            "swa_head_dim": self.swa_head_dim,
            "sliding_window_size": self.sliding_window,
            "d_rel": self.d_rel,
            "rel_extent": self.rel_extent,
            "log_scaling_n_floor": self.log_scaling_n_floor,
            "log_scaling_alpha": self.log_scaling_alpha,
            "local_layer_ids": self.local_layer_ids,
            "dense_mlp_idx": n_dense,
            "dense_intermediate_size": self.dense_intermediate_size,
            "intermediate_size": self.moe_intermediate_size,  # released spelling: the expert width
            "n_routed_experts": self.n_routed_experts,
            "num_experts_per_tok": self.num_experts_per_tok,
            "n_shared_experts": self.n_shared_experts,
            "route_scale": self.route_scale,
            "logits_mup_width_multiplier": self.mup,
            "rms_norm_eps": self.rms_norm_eps,
            "sconv_kernel_size": self.conv_kernel_size,
            "model_max_length": self.max_position_embeddings,
            "use_embed_norm": True,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
        }
        if self.mlp_types != [DENSE] * n_dense + [MOE] * (self.num_layers - n_dense):
            text["mlp_layer_types"] = ["dense" if t == DENSE else "sparse" for t in self.mlp_types]
        out = {"model_type": "inkling_mm_model", "text_config": text}
        if self.num_mtp_depths:
            out["mtp_config"] = {
                "num_nextn_predict_layers": self.num_mtp_depths,
                "local_layer_ids": self.mtp_local_layer_ids,
                "chain_hidden_post_norm": self.chain_hidden_post_norm,
                "apply_log_scaling": self.mtp_apply_log_scaling,
            }
        return out

    def to_transformers_dict(self) -> dict:
        """Keyword arguments of transformers' `InklingTextConfig` for the same trunk."""
        return {
            "vocab_size": self.vocab_size,
            "unpadded_vocab_size": self.unpadded_vocab_size,
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "swa_num_attention_heads": self.swa_num_heads,
            "swa_num_key_value_heads": self.swa_num_kv_heads,
            "swa_head_dim": self.swa_head_dim,
            "sliding_window_size": self.sliding_window,
            "d_rel": self.d_rel,
            "rel_extent": self.rel_extent,
            "log_scaling_n_floor": self.log_scaling_n_floor,
            "log_scaling_alpha": self.log_scaling_alpha,
            "layer_types": ["hybrid_sliding" if t == SLIDING else "hybrid" for t in self.layer_types],
            "mlp_layer_types": ["dense" if t == DENSE else "sparse" for t in self.mlp_types],
            "intermediate_size": self.dense_intermediate_size,
            "moe_intermediate_size": self.moe_intermediate_size,
            "n_routed_experts": self.n_routed_experts,
            "num_experts_per_tok": self.num_experts_per_tok,
            "n_shared_experts": self.n_shared_experts,
            "route_scale": self.route_scale,
            "logits_mup_width_multiplier": self.mup,
            "rms_norm_eps": self.rms_norm_eps,
            "conv_kernel_size": self.conv_kernel_size,
            "max_position_embeddings": self.max_position_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
        }

    def replace(self, **changes) -> "InklingConfig":
        """A copy with some fields changed (validated again)."""
        d = asdict(self)
        d.update(changes)
        return InklingConfig(**d)


# ---------------------------------------------------------------------- spelling tables
# Our field -> its spellings in config files, first one preferred. Two spellings of one field that
# are both present must agree. (The ambiguous `intermediate_size` and the per-layer lists are read
# separately below.)
TEXT_KEYS = {
    "vocab_size": ("vocab_size",),
    "unpadded_vocab_size": ("unpadded_vocab_size",),
    "hidden_size": ("hidden_size",),
    "num_layers": ("num_hidden_layers", "num_layers"),
    "num_heads": ("num_attention_heads", "num_heads"),
    "num_kv_heads": ("num_key_value_heads", "num_kv_heads"),
    "head_dim": ("head_dim",),
    "rel_extent": ("rel_extent",),
    "swa_num_heads": ("swa_num_attention_heads", "swa_num_heads"),
    "swa_num_kv_heads": ("swa_num_key_value_heads", "swa_num_kv_heads"),
    "swa_head_dim": ("swa_head_dim",),
    "sliding_window": ("sliding_window_size", "sliding_window"),
    "d_rel": ("d_rel",),
    "log_scaling_n_floor": ("log_scaling_n_floor",),
    "log_scaling_alpha": ("log_scaling_alpha",),
    "n_routed_experts": ("n_routed_experts", "num_local_experts"),
    "num_experts_per_tok": ("num_experts_per_tok",),
    "n_shared_experts": ("n_shared_experts",),
    "route_scale": ("route_scale",),
    "mup": ("logits_mup_width_multiplier", "embedding_multiplier"),
    "rms_norm_eps": ("rms_norm_eps",),
    "conv_kernel_size": ("sconv_kernel_size", "conv_kernel_size"),
    "max_position_embeddings": ("model_max_length", "max_position_embeddings"),
    "bos_token_id": ("bos_token_id",),
    "eos_token_id": ("eos_token_id",),
}
# Defaults where a file leaves a field out: the real model's values, as transformers' InklingTextConfig
# has them. Fields that fix tensor shapes and have no safe default are required instead.
TEXT_DEFAULTS = {
    "vocab_size": 201024, "unpadded_vocab_size": None, "head_dim": 128, "rel_extent": 1024, "swa_head_dim": 128,
    "sliding_window": 512, "d_rel": 16, "log_scaling_n_floor": None, "log_scaling_alpha": 0.1,
    "n_routed_experts": 256, "num_experts_per_tok": 6, "n_shared_experts": 2, "route_scale": 8.0, "mup": 24.0,
    "rms_norm_eps": 1e-6, "conv_kernel_size": 4, "max_position_embeddings": 131072, "bos_token_id": None,
    "eos_token_id": None,
}
REQUIRED = ("hidden_size", "num_layers", "num_heads", "num_kv_heads")

# How files spell the fields whose name differs from ours (for error messages).
FILE_SPELLING = {
    "num_layers": "num_hidden_layers",
    "num_heads": "num_attention_heads",
    "num_kv_heads": "num_key_value_heads",
    "swa_num_heads": "swa_num_attention_heads",
    "swa_num_kv_heads": "swa_num_key_value_heads",
    "sliding_window": "sliding_window_size / sliding_window",
    "mup": "logits_mup_width_multiplier",
    "conv_kernel_size": "sconv_kernel_size / conv_kernel_size",
    "max_position_embeddings": "model_max_length / max_position_embeddings",
    "layer_types": "local_layer_ids / layer_types",
    "mlp_types": "dense_mlp_idx / mlp_layer_types",
    "dense_intermediate_size": "dense_intermediate_size (released) / intermediate_size (transformers)",
    "moe_intermediate_size": "intermediate_size (released) / moe_intermediate_size (transformers)",
    "num_mtp_depths": "mtp_config.num_nextn_predict_layers / num_mtp_layers",
    "mtp_layer_types": "mtp_config.local_layer_ids / mtp_local_layer_ids",
    "chain_hidden_post_norm": "mtp_config.chain_hidden_post_norm",
    "mtp_apply_log_scaling": "mtp_config.apply_log_scaling",
    "n_routed_experts": "n_routed_experts / num_local_experts",
}


def field_label(name: str) -> str:
    """`config field 'x'`, plus how config files spell x when that differs."""
    spelled = FILE_SPELLING.get(name)
    return f"config field '{name}'" + (f" ({spelled} in config.json)" if spelled else "")


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_real(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _len(v) -> str:
    return str(len(v)) if isinstance(v, list) else f"a {type(v).__name__}, not a list, with"


def _lookup(d: dict, name: str, spellings: tuple[str, ...], prefix: str = ""):
    """The value of one field given its spellings; None if absent. Conflicting spellings are an error."""
    found = {s: d[s] for s in spellings if d.get(s) is not None}
    if len(set(map(repr, found.values()))) > 1:
        raise ConfigError(f"config fields {', '.join(prefix + s for s in found)} spell the same field "
                          f"'{name}' with different values {list(found.values())}")
    return next(iter(found.values()), None)


def _dense_prefix(mlp_types: list[str]) -> int:
    n = 0
    while n < len(mlp_types) and mlp_types[n] == DENSE:
        n += 1
    return n


def _id_list(v, name: str, n: int, what: str) -> list[int]:
    """A list of distinct ids in 0..n-1 (the field `name`), or ConfigError."""
    if not isinstance(v, list):
        raise ConfigError(f"config field '{name}': must be a list of {what} ids, got {v!r}")
    bad = [i for i in v if not _is_int(i) or not 0 <= i < n]
    if bad:
        raise ConfigError(f"config field '{name}': ids {bad} out of range 0..{n - 1} (there are {n} {what}s)")
    return v


def intermediate_size_reading(text: dict) -> str:
    """Which meaning of the ambiguous `intermediate_size` a text config gets (for error messages)."""
    if _released_widths(text):
        return ("released reading: intermediate_size = MoE expert width, dense_intermediate_size = dense "
                "MLP width (the config has dense_intermediate_size or dense_mlp_idx)")
    return ("transformers reading: intermediate_size = dense MLP width, moe_intermediate_size = MoE expert "
            "width (the config has neither dense_intermediate_size nor dense_mlp_idx)")


def _released_widths(t: dict) -> bool:
    return "dense_intermediate_size" in t or ("dense_mlp_idx" in t and "moe_intermediate_size" not in t)


def _text_fields(t: dict) -> dict:
    out = {name: _lookup(t, name, spellings) for name, spellings in TEXT_KEYS.items()}
    for name in REQUIRED:
        if out[name] is None:
            raise ConfigError(f"{field_label(name)} is missing")
    num_layers = out["num_layers"]
    if not _is_int(num_layers) or num_layers <= 0:
        raise ConfigError(f"{field_label('num_layers')}: must be a positive integer, got {num_layers!r}")

    # sliding layers: released `local_layer_ids` or transformers `layer_types` (both: they must agree)
    layer_types = []  # empty: the default pattern
    if t.get("layer_types") is not None:
        kinds = {"hybrid_sliding": SLIDING, "sliding_attention": SLIDING, "hybrid": GLOBAL,
                 "full_attention": GLOBAL, SLIDING: SLIDING, GLOBAL: GLOBAL}
        lt = t["layer_types"]
        if not isinstance(lt, list) or len(lt) != num_layers:
            raise ConfigError(f"config field 'layer_types': has {_len(lt)} entries for "
                              f"num_hidden_layers={num_layers}")
        bad = sorted({str(x) for x in lt if x not in kinds})
        if bad:
            raise ConfigError(f"config field 'layer_types': unknown entries {bad} "
                              "(expected 'hybrid_sliding' or 'hybrid')")
        layer_types = [kinds[x] for x in lt]
    if t.get("local_layer_ids") is not None:
        ids = set(_id_list(t["local_layer_ids"], "local_layer_ids", num_layers, "layer"))
        from_ids = [SLIDING if i in ids else GLOBAL for i in range(num_layers)]
        if layer_types and layer_types != from_ids:
            raise ConfigError("config fields 'local_layer_ids' and 'layer_types' disagree: sliding layers "
                              f"{sorted(ids)} vs {[i for i, k in enumerate(layer_types) if k == SLIDING]}")
        layer_types = from_ids

    # MoE layers: transformers `mlp_layer_types` or released `dense_mlp_idx` (both: they must agree)
    n_dense = t.get("dense_mlp_idx")
    if n_dense is not None and (not _is_int(n_dense) or not 0 <= n_dense <= num_layers):
        raise ConfigError(f"config field 'dense_mlp_idx': {n_dense!r} must be an integer in 0..{num_layers}")
    if t.get("mlp_layer_types") is not None:
        kinds = {"dense": DENSE, "sparse": MOE, "moe": MOE}
        mt = t["mlp_layer_types"]
        if not isinstance(mt, list) or len(mt) != num_layers:
            raise ConfigError(f"config field 'mlp_layer_types': has {_len(mt)} entries for "
                              f"num_hidden_layers={num_layers}")
        bad = sorted({str(x) for x in mt if x not in kinds})
        if bad:
            raise ConfigError(f"config field 'mlp_layer_types': unknown entries {bad} (expected 'dense' or 'sparse')")
        mlp_types = [kinds[x] for x in mt]
        if n_dense is not None and n_dense != _dense_prefix(mlp_types):
            raise ConfigError(f"config fields 'dense_mlp_idx' ({n_dense}) and 'mlp_layer_types' disagree: the "
                              f"list starts with {_dense_prefix(mlp_types)} dense layers")
    else:
        n_dense = n_dense or 0
        mlp_types = [DENSE if i < n_dense else MOE for i in range(num_layers)]

    # intermediate sizes: the ambiguous `intermediate_size`
    if _released_widths(t):
        dense_f = _lookup(t, "dense_intermediate_size", ("dense_intermediate_size",))
        moe_f = _lookup(t, "moe_intermediate_size", ("moe_intermediate_size", "intermediate_size"))
    else:
        dense_f = _lookup(t, "dense_intermediate_size", ("intermediate_size",))
        moe_f = _lookup(t, "moe_intermediate_size", ("moe_intermediate_size",))
    if DENSE in mlp_types and dense_f is None:
        raise ConfigError(f"{field_label('dense_intermediate_size')} is missing but the config has dense MLP "
                          f"layers ({intermediate_size_reading(t)})")
    if MOE in mlp_types and moe_f is None:
        raise ConfigError(f"{field_label('moe_intermediate_size')} is missing but the config has MoE layers "
                          f"({intermediate_size_reading(t)})")

    # features of other Inkling variants that this reference does not implement
    unsupported = {"use_embed_norm": (False, "every Inkling checkpoint normalizes its embedding"),
                   "mtp_hidden_states_first": (False, "MTP depths concatenate the hidden state first"),
                   "tie_word_embeddings": (True, "the embedding and the unembedding are separate tensors")}
    for key, (bad_value, why) in unsupported.items():
        if t.get(key) is bad_value:
            raise ConfigError(f"config field '{key}': {str(bad_value).lower()} is not supported ({why})")
    if t.get("hidden_act") not in (None, "silu"):
        raise ConfigError(f"config field 'hidden_act': {t['hidden_act']!r} is not supported (Inkling uses silu)")

    for name, default in TEXT_DEFAULTS.items():
        if out[name] is None:
            out[name] = default
    if isinstance(out["eos_token_id"], list):  # several stop ids: the first is the model's own
        out["eos_token_id"] = out["eos_token_id"][0] if out["eos_token_id"] else None

    # sliding layers have their own head counts; copy the global ones only when nothing slides
    any_sliding = SLIDING in layer_types or (not layer_types and num_layers >= 1)
    for name in ("swa_num_heads", "swa_num_kv_heads"):
        if out[name] is None:
            if any_sliding:
                raise ConfigError(f"{field_label(name)} is missing and the model has sliding-window layers")
            out[name] = out[name.replace("swa_", "")]
    for name in ("route_scale", "mup", "rms_norm_eps", "log_scaling_alpha"):
        if _is_int(out[name]):
            out[name] = float(out[name])
    return dict(out, layer_types=layer_types, mlp_types=mlp_types,
                dense_intermediate_size=dense_f if dense_f is not None else 0,
                moe_intermediate_size=moe_f if moe_f is not None else 0)


def _mtp_fields(text: dict, mtp: dict) -> dict:
    """MTP fields from `mtp_config` (released) and/or the text config (transformers spelling)."""
    def one(name, mtp_key, text_keys, default):
        a = _lookup(mtp, name, (mtp_key,), prefix="mtp_config.")
        b = _lookup(text, name, text_keys)
        if a is not None and b is not None and a != b:
            raise ConfigError(f"config fields 'mtp_config.{mtp_key}' ({a!r}) and '{text_keys[0]}' ({b!r}) "
                              "disagree")
        return a if a is not None else b if b is not None else default

    n = one("num_mtp_depths", "num_nextn_predict_layers", ("num_mtp_layers", "num_nextn_predict_layers"), 0)
    if not _is_int(n) or n < 0:
        raise ConfigError(f"{field_label('num_mtp_depths')}: must be an integer >= 0, got {n!r}")
    ids = one("mtp_layer_types", "local_layer_ids", ("mtp_local_layer_ids",), [])
    ids = set(_id_list(ids, "mtp_config.local_layer_ids", n, "MTP depth"))
    chain = one("chain_hidden_post_norm", "chain_hidden_post_norm", ("chain_hidden_post_norm",), False)
    log_scaling = one("mtp_apply_log_scaling", "apply_log_scaling", ("mtp_apply_log_scaling",), False)
    return dict(num_mtp_depths=n, mtp_layer_types=[SLIDING if i in ids else GLOBAL for i in range(n)],
                chain_hidden_post_norm=chain, mtp_apply_log_scaling=log_scaling)
