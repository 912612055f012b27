"""The Inkling configuration: one flat dataclass, read from either spelling of the config file.

Two spellings exist in the wild (see `shared/spec/inkling-architecture.md`, "Config keys"):

* the released `config.json`: top level `text_config` + `mtp_config` (+ vision/audio, ignored here),
  with `sconv_kernel_size`, `dense_mlp_idx`, `dense_intermediate_size`, `local_layer_ids`,
  `model_max_length`, and `intermediate_size` meaning the *MoE expert* width;
* a transformers `InklingTextConfig`: `conv_kernel_size`, `layer_types`, `mlp_layer_types`,
  `max_position_embeddings`, `intermediate_size` meaning the *dense MLP* width,
  `moe_intermediate_size`, `num_mtp_layers`, `mtp_local_layer_ids`.

`InklingConfig.from_dict` accepts both and says, in every error, which field is wrong.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path


class ConfigError(ValueError):
    """A config that cannot describe a runnable Inkling model. The message names the field."""


SLIDING, GLOBAL = "sliding", "global"
DENSE, MOE = "dense", "moe"


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
        if not self.layer_types:
            # default pattern: every sixth layer is global
            self.layer_types = [GLOBAL if (i + 1) % 6 == 0 else SLIDING for i in range(self.num_layers)]
        if not self.mlp_types:
            self.mlp_types = [MOE] * self.num_layers
        if not self.mtp_layer_types and self.num_mtp_depths:
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
        def need(ok: bool, name: str, why: str):
            if not ok:
                raise ConfigError(f"config field '{name}': {why}")

        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                     "swa_num_heads", "swa_num_kv_heads", "swa_head_dim", "sliding_window", "rel_extent",
                     "d_rel", "conv_kernel_size", "max_position_embeddings"):
            v = getattr(self, name)
            need(isinstance(v, int) and not isinstance(v, bool) and v > 0, name,
                 f"must be a positive integer, got {v!r}")
        need(self.num_mtp_depths >= 0, "num_mtp_depths", f"must be >= 0, got {self.num_mtp_depths}")
        need(self.num_heads % self.num_kv_heads == 0, "num_heads",
             f"{self.num_heads} query heads is not a multiple of num_kv_heads={self.num_kv_heads}")
        need(self.swa_num_heads % self.swa_num_kv_heads == 0, "swa_num_heads",
             f"{self.swa_num_heads} query heads is not a multiple of swa_num_kv_heads={self.swa_num_kv_heads}")
        if self.unpadded_vocab_size is not None:
            need(0 < self.unpadded_vocab_size <= self.vocab_size, "unpadded_vocab_size",
                 f"{self.unpadded_vocab_size} must be in 1..vocab_size={self.vocab_size}")
        need(len(self.layer_types) == self.num_layers, "layer_types",
             f"has {len(self.layer_types)} entries for num_layers={self.num_layers}")
        need(all(t in (SLIDING, GLOBAL) for t in self.layer_types), "layer_types",
             f"entries must be '{SLIDING}' or '{GLOBAL}', got {sorted(set(self.layer_types))}")
        need(len(self.mlp_types) == self.num_layers, "mlp_types",
             f"has {len(self.mlp_types)} entries for num_layers={self.num_layers}")
        need(all(t in (DENSE, MOE) for t in self.mlp_types), "mlp_types",
             f"entries must be '{DENSE}' or '{MOE}', got {sorted(set(self.mlp_types))}")
        if DENSE in self.mlp_types or self.num_mtp_depths:
            need(self.dense_intermediate_size > 0, "dense_intermediate_size", "must be positive")
        if MOE in self.mlp_types:
            need(self.moe_intermediate_size > 0, "moe_intermediate_size", "must be positive")
            need(self.n_routed_experts > 0, "n_routed_experts", "must be positive")
            need(self.n_shared_experts >= 0, "n_shared_experts", "must be >= 0")
            need(0 < self.num_experts_per_tok <= self.n_routed_experts, "num_experts_per_tok",
                 f"{self.num_experts_per_tok} must be in 1..n_routed_experts={self.n_routed_experts}")
        if self.log_scaling_n_floor is not None:
            need(self.log_scaling_n_floor > 0, "log_scaling_n_floor", "must be positive (or null to disable)")
        need(self.mup > 0, "mup", f"logits_mup_width_multiplier must be positive, got {self.mup}")
        need(self.rms_norm_eps > 0, "rms_norm_eps", "must be positive")
        need(len(self.mtp_layer_types) == self.num_mtp_depths, "mtp_layer_types",
             f"has {len(self.mtp_layer_types)} entries for {self.num_mtp_depths} MTP depths")
        need(all(t in (SLIDING, GLOBAL) for t in self.mtp_layer_types), "mtp_layer_types",
             f"entries must be '{SLIDING}' or '{GLOBAL}'")

    # ------------------------------------------------------------------ reading
    @classmethod
    def from_dict(cls, d: dict) -> "InklingConfig":
        """Build from a released `config.json` (with `text_config`) or a transformers text config."""
        if not isinstance(d, dict):
            raise ConfigError(f"config must be a JSON object, got {type(d).__name__}")
        if "text_config" in d:
            text = d["text_config"]
            if not isinstance(text, dict):
                raise ConfigError("config field 'text_config' must be an object")
            mtp = d.get("mtp_config") or {}
            if not isinstance(mtp, dict):
                raise ConfigError("config field 'mtp_config' must be an object")
        else:
            text, mtp = d, {}
        return cls(**_text_fields(text), **_mtp_fields(text, mtp))

    @classmethod
    def from_file(cls, path: str | Path) -> "InklingConfig":
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        if not path.exists():
            raise FileNotFoundError(f"no config.json at {path}")
        try:
            d = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path} is not valid JSON: {e}") from None
        return cls.from_dict(d)

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
def _first(d: dict, *names, default=None):
    """The value of the first key present among `names` (the spellings of one field)."""
    for n in names:
        if n in d and d[n] is not None:
            return d[n]
    return default


def _dense_prefix(mlp_types: list[str]) -> int:
    n = 0
    while n < len(mlp_types) and mlp_types[n] == DENSE:
        n += 1
    return n


def _text_fields(t: dict) -> dict:
    num_layers = _first(t, "num_hidden_layers", "num_layers")
    if num_layers is None:
        raise ConfigError("config field 'num_hidden_layers' is missing")
    if not isinstance(num_layers, int) or num_layers <= 0:
        raise ConfigError(f"config field 'num_hidden_layers': must be a positive integer, got {num_layers!r}")

    # sliding layers: released `local_layer_ids` or transformers `layer_types`
    if t.get("layer_types") is not None:
        names = {"hybrid_sliding": SLIDING, "sliding_attention": SLIDING, "hybrid": GLOBAL,
                 "full_attention": GLOBAL, SLIDING: SLIDING, GLOBAL: GLOBAL}
        bad = [x for x in t["layer_types"] if x not in names]
        if bad:
            raise ConfigError(f"config field 'layer_types': unknown entries {bad} "
                              "(expected 'hybrid_sliding' or 'hybrid')")
        layer_types = [names[x] for x in t["layer_types"]]
    elif t.get("local_layer_ids") is not None:
        ids = t["local_layer_ids"]
        bad = [i for i in ids if not isinstance(i, int) or not 0 <= i < num_layers]
        if bad:
            raise ConfigError(f"config field 'local_layer_ids': ids {bad} out of range 0..{num_layers - 1}")
        layer_types = [SLIDING if i in set(ids) else GLOBAL for i in range(num_layers)]
    else:
        layer_types = []  # default pattern

    # intermediate sizes: the ambiguous `intermediate_size`
    released_reading = "dense_intermediate_size" in t or (
        "dense_mlp_idx" in t and "moe_intermediate_size" not in t)
    if released_reading:
        dense_f = _first(t, "dense_intermediate_size")
        moe_f = _first(t, "moe_intermediate_size", "intermediate_size")
    else:
        dense_f = _first(t, "intermediate_size")
        moe_f = _first(t, "moe_intermediate_size")

    # MoE layers: transformers `mlp_layer_types` or released `dense_mlp_idx`
    if t.get("mlp_layer_types") is not None:
        names = {"dense": DENSE, "sparse": MOE, "moe": MOE}
        bad = [x for x in t["mlp_layer_types"] if x not in names]
        if bad:
            raise ConfigError(f"config field 'mlp_layer_types': unknown entries {bad} (expected 'dense' or 'sparse')")
        mlp_types = [names[x] for x in t["mlp_layer_types"]]
    else:
        n_dense = _first(t, "dense_mlp_idx", default=0)
        if not isinstance(n_dense, int) or not 0 <= n_dense <= num_layers:
            raise ConfigError(f"config field 'dense_mlp_idx': {n_dense!r} must be in 0..{num_layers}")
        mlp_types = [DENSE if i < n_dense else MOE for i in range(num_layers)]
    if DENSE in mlp_types and dense_f is None:
        raise ConfigError("config field 'dense_intermediate_size' is missing but the config has dense MLP layers "
                          f"(reading taken: {'released' if released_reading else 'transformers'} spelling)")

    if t.get("use_embed_norm") is False:
        raise ConfigError("config field 'use_embed_norm': false is not supported (every Inkling checkpoint "
                          "normalizes its embedding)")

    out = dict(
        vocab_size=_first(t, "vocab_size", default=201024),
        unpadded_vocab_size=_first(t, "unpadded_vocab_size"),
        hidden_size=_first(t, "hidden_size"),
        num_layers=num_layers,
        num_heads=_first(t, "num_attention_heads", "num_heads"),
        num_kv_heads=_first(t, "num_key_value_heads", "num_kv_heads"),
        head_dim=_first(t, "head_dim", default=128),
        rel_extent=_first(t, "rel_extent", default=1024),
        swa_num_heads=_first(t, "swa_num_attention_heads", "swa_num_heads"),
        swa_num_kv_heads=_first(t, "swa_num_key_value_heads", "swa_num_kv_heads"),
        swa_head_dim=_first(t, "swa_head_dim", default=128),
        sliding_window=_first(t, "sliding_window_size", "sliding_window", default=512),
        d_rel=_first(t, "d_rel", default=16),
        log_scaling_n_floor=_first(t, "log_scaling_n_floor"),
        log_scaling_alpha=_first(t, "log_scaling_alpha", default=0.1),
        layer_types=layer_types,
        mlp_types=mlp_types,
        dense_intermediate_size=dense_f if dense_f is not None else 0,
        moe_intermediate_size=moe_f if moe_f is not None else 0,
        n_routed_experts=_first(t, "n_routed_experts", "num_local_experts", default=256),
        num_experts_per_tok=_first(t, "num_experts_per_tok", default=6),
        n_shared_experts=_first(t, "n_shared_experts", default=2),
        route_scale=float(_first(t, "route_scale", default=8.0)),
        mup=float(_first(t, "logits_mup_width_multiplier", "embedding_multiplier", default=24.0)),
        rms_norm_eps=float(_first(t, "rms_norm_eps", default=1e-6)),
        conv_kernel_size=_first(t, "sconv_kernel_size", "conv_kernel_size", default=4),
        max_position_embeddings=_first(t, "model_max_length", "max_position_embeddings", default=131072),
        bos_token_id=_first(t, "bos_token_id"),
        eos_token_id=_first(t, "eos_token_id"),
    )
    for name in ("hidden_size", "num_heads", "num_kv_heads"):
        if out[name] is None:
            raise ConfigError(f"config field '{ {'num_heads': 'num_attention_heads', 'num_kv_heads': 'num_key_value_heads'}.get(name, name)}' is missing")
    out["swa_num_heads"] = out["swa_num_heads"] or out["num_heads"]
    out["swa_num_kv_heads"] = out["swa_num_kv_heads"] or out["num_kv_heads"]
    if isinstance(out["eos_token_id"], list):
        out["eos_token_id"] = out["eos_token_id"][0] if out["eos_token_id"] else None
    return out


def _mtp_fields(text: dict, mtp: dict) -> dict:
    n = _first(mtp, "num_nextn_predict_layers", default=None)
    if n is None:
        n = _first(text, "num_mtp_layers", "num_nextn_predict_layers", default=0)
    if not isinstance(n, int) or n < 0:
        raise ConfigError(f"config field 'mtp_config.num_nextn_predict_layers': must be an integer >= 0, got {n!r}")
    ids = _first(mtp, "local_layer_ids")
    if ids is None:
        ids = _first(text, "mtp_local_layer_ids", default=[])
    bad = [i for i in ids if not isinstance(i, int) or not 0 <= i < n]
    if bad:
        raise ConfigError(f"config field 'mtp_config.local_layer_ids': ids {bad} out of range 0..{n - 1} "
                          f"for {n} MTP depths")
    return dict(
        num_mtp_depths=n,
        mtp_layer_types=[SLIDING if i in set(ids) else GLOBAL for i in range(n)],
        chain_hidden_post_norm=bool(_first(mtp, "chain_hidden_post_norm",
                                           default=_first(text, "chain_hidden_post_norm", default=False))),
        mtp_apply_log_scaling=bool(_first(mtp, "apply_log_scaling", default=False)),
    )
