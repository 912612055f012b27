"""The Inkling configuration: one flat dataclass, read from either spelling of the config file.

Two spellings exist in the wild (see `docs/spec/inkling-architecture.md`, "Config keys"):

* the released `config.json`: top level `text_config` + `mtp_config` (+ vision/audio, ignored here),
  with `sconv_kernel_size`, `dense_mlp_idx`, `dense_intermediate_size`, `local_layer_ids`,
  `model_max_length`, and `intermediate_size` meaning the *MoE expert* width;
* a transformers `InklingTextConfig`: `conv_kernel_size`, `layer_types`, `mlp_layer_types`,
  `max_position_embeddings`, `intermediate_size` meaning the *dense MLP* width,
  `moe_intermediate_size`, `num_mtp_layers`, `mtp_local_layer_ids`.

One table, `KEYS`, lists every field with its released and transformers spellings, the check its
value must pass and its default; it drives reading (`from_dict`), writing (`to_released_dict`,
`to_transformers_dict`) and the type checks of `validate`. The per-layer lists and the ambiguous
`intermediate_size` are spelled differently in structure, so their reading and writing are written
out below, still under the table's names.

`InklingConfig.from_dict` accepts both spellings (and the multimodal transformers config, whose
`text_config` is in the transformers spelling). Every error names the field, as the file spells it.
A key that is not an Inkling field but looks like a misspelling of one the file leaves out
(`sconv_kernal_size`) is an error, so that a typo never silently falls back to a default.
"""

from __future__ import annotations

import copy
import difflib
import json
import math
import numbers
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable


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
        for name in ("num_layers", "num_mtp_depths"):   # before any list of that length is built
            v = getattr(self, name)
            if is_int(v) and v > MAX_LAYERS:
                raise ConfigError(f"{field_label(name)}: {v} is beyond any model (at most {MAX_LAYERS})")
        if not self.layer_types and is_int(self.num_layers):
            # default pattern: every sixth layer is global
            self.layer_types = [GLOBAL if (i + 1) % 6 == 0 else SLIDING for i in range(self.num_layers)]
        if not self.mlp_types and is_int(self.num_layers):
            self.mlp_types = [MOE] * self.num_layers
        if not self.mtp_layer_types and is_int(self.num_mtp_depths) and self.num_mtp_depths > 0:
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
        """Raise ConfigError naming the first field that cannot describe a runnable model.

        Each field's type and range come from its row of `KEYS`; the relations between fields follow."""
        def need(ok: bool, name: str, why: str):
            if not ok:
                raise ConfigError(f"{field_label(name)}: {why}")

        dense = DENSE in self.mlp_types or self.num_mtp_depths  # MTP depths always have a dense MLP
        moe = MOE in self.mlp_types
        for key in KEYS:
            if key.check is None or (key.when == DENSE and not dense) or (key.when == MOE and not moe):
                continue
            v = getattr(self, key.field)
            need(key.check.ok(v), key.field, f"{key.check.says}{WHEN_NOTE.get(key.when, '')}, got {v!r}")
            need(not is_int(v) or v <= MAX_SIZE, key.field, f"{v} is beyond any model (at most {MAX_SIZE})")

        need(self.num_heads % self.num_kv_heads == 0, "num_heads",
             f"{self.num_heads} query heads is not a multiple of num_key_value_heads={self.num_kv_heads}")
        need(self.swa_num_heads % self.swa_num_kv_heads == 0, "swa_num_heads",
             f"{self.swa_num_heads} query heads is not a multiple of "
             f"swa_num_key_value_heads={self.swa_num_kv_heads}")
        if self.unpadded_vocab_size is not None:
            need(self.unpadded_vocab_size <= self.vocab_size, "unpadded_vocab_size",
                 f"{self.unpadded_vocab_size!r} must be in 1..vocab_size={self.vocab_size}")
        for name in ("bos_token_id", "eos_token_id"):
            v = getattr(self, name)
            if v is not None:
                need(0 <= v < self.vocab_size, name, f"{v!r} must be a token id in 0..{self.vocab_size - 1}")
        slides = isinstance(self.layer_types, list) and isinstance(self.mtp_layer_types, list) and \
            SLIDING in self.layer_types + self.mtp_layer_types
        need(not slides or self.sliding_window <= self.max_position_embeddings, "sliding_window",
             f"window {self.sliding_window} is longer than the context "
             f"(max_position_embeddings={self.max_position_embeddings}): such a layer would not slide")
        if moe:
            need(self.num_experts_per_tok <= self.n_routed_experts, "num_experts_per_tok",
                 f"{self.num_experts_per_tok!r} must be in 1..n_routed_experts={self.n_routed_experts}")

        for name, n, what, kinds in (("layer_types", self.num_layers, "num_hidden_layers={}", (SLIDING, GLOBAL)),
                                     ("mlp_types", self.num_layers, "num_hidden_layers={}", (DENSE, MOE)),
                                     ("mtp_layer_types", self.num_mtp_depths, "{} MTP depths", (SLIDING, GLOBAL))):
            v = getattr(self, name)
            need(isinstance(v, list) and len(v) == n, name, f"has {_len(v)} entries for {what.format(n)}")
            need(all(t in kinds for t in v), name,
                 f"entries must be '{kinds[0]}' or '{kinds[1]}', got {sorted(set(map(str, v)))}")

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
            _refuse_typos(d, [("text_config",), ("mtp_config",), ("model_type",)], "")
            text, mtp = d["text_config"], d.get("mtp_config")
            if not isinstance(text, dict):
                raise ConfigError("config field 'text_config': must be an object")
            if mtp is None:
                mtp = {}
            if not isinstance(mtp, dict):
                raise ConfigError(f"config field 'mtp_config': must be an object, got {mtp!r}")
            _refuse_typos(text, TEXT_SPELLINGS, "text_config.")
            _refuse_typos(mtp, MTP_SPELLINGS, "mtp_config.")
        else:
            _refuse_typos(d, TEXT_SPELLINGS + [("text_config",), ("mtp_config",)], "")
            text, mtp = d, {}
        fields = dict(_text_fields(text), **_mtp_fields(text, mtp))
        if fields["mtp_layer_types"] is None:
            if fields["num_mtp_depths"] > 0:
                raise _missing("mtp_layer_types", NEEDS_MTP)
            fields["mtp_layer_types"] = []
        return cls(**_complete(fields))

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
        text, mtp = {}, {}
        for key in KEYS:
            value = key.write_released(self) if key.write_released else getattr(self, key.field)
            if key.mtp:
                mtp[key.released.removeprefix("mtp_config.")] = value
            else:
                text[key.released] = value
        text["use_embed_norm"] = True
        n_dense = text["dense_mlp_idx"]
        if self.mlp_types != [DENSE] * n_dense + [MOE] * (self.num_layers - n_dense):
            text["mlp_layer_types"] = _mlp_layer_types(self)  # not a dense prefix: dense_mlp_idx cannot say it
        out = {"model_type": "inkling_mm_model", "text_config": text}
        if self.num_mtp_depths:
            out["mtp_config"] = mtp
        return out

    def to_transformers_dict(self) -> dict:
        """Keyword arguments of transformers' `InklingTextConfig` for the same trunk (no MTP fields)."""
        return {key.transformers: key.write_transformers(self) if key.write_transformers else getattr(self, key.field)
                for key in KEYS if key.transformers and not key.mtp}

    def replace(self, **changes) -> "InklingConfig":
        """A copy with some fields changed (validated again)."""
        d = asdict(self)
        d.update(changes)
        return InklingConfig(**d)


# ---------------------------------------------------------------------- the key table
def is_int(v) -> bool:
    """An integer (Python or NumPy), not a boolean: what every count, size and token id must be."""
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def is_real(v) -> bool:
    """A finite number (Python or NumPy), not a boolean."""
    return isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(v)


@dataclass(frozen=True)
class Check:
    """What a field's value must be: `ok(value)`, and the words an error uses for it."""
    ok: Callable[[object], bool]
    says: str


POSITIVE_INT = Check(lambda v: is_int(v) and v > 0, "must be a positive integer")
COUNT = Check(lambda v: is_int(v) and v >= 0, "must be an integer >= 0")
POSITIVE_INT_OR_NULL = Check(lambda v: v is None or (is_int(v) and v > 0),
                             "must be a positive integer (or null to disable)")
POSITIVE = Check(lambda v: is_real(v) and v > 0, "must be a positive number")
NON_NEGATIVE = Check(lambda v: is_real(v) and v >= 0, "must be a number >= 0")
TOKEN_ID_OR_NULL = Check(lambda v: v is None or is_int(v), "must be a token id (an integer) or null")
BOOL = Check(lambda v: isinstance(v, bool), "must be true or false")
WHEN_NOTE = {DENSE: " (the model has dense MLPs)", MOE: " (the model has MoE layers)"}
REQUIRED = object()  # the default of a field a config file must give: it changes what the model computes
# Bounds that keep a corrupted size from building millions of per-layer entries or tensor shapes beyond
# int64 before any weight is seen: far above any Inkling (66 layers, 8 depths, widths up to ~200k).
MAX_LAYERS = 10_000                 # num_hidden_layers, MTP depths
MAX_SIZE = 2**31 - 1                # every other size
# What a field needs to be required: the model has MoE layers, sliding-window layers (trunk or MTP
# depth), or an MTP head. Without it the field computes nothing and takes its default.
NEEDS_MOE, NEEDS_SLIDING, NEEDS_MTP = "MoE layers", "sliding-window layers", "MTP depths"


@dataclass(frozen=True)
class Key:
    """One row of the key table: an `InklingConfig` field and how config files spell it.

    released: the key in the released config.json (`mtp_config.<key>` for the MTP head's fields);
    transformers: the key of transformers' InklingTextConfig (None: it has none); aliases: other
    spellings that are read. check: what the value must be (None: the field is a per-layer list,
    checked in `validate`); when: checked only when the model has dense MLPs or MoE layers.
    default: the value when a file leaves the field out, or REQUIRED: a file must give the field (null
    counts as given for a field that may be null), since it changes what the model computes and no
    default is safe; required_if: required only when the model has that feature (NEEDS_*), else
    `default` (which then computes nothing). docs/checkpoint.md lists every key with its default.
    write_released / write_transformers: the value to write, where it is not the field itself."""
    field: str
    released: str
    transformers: str | None
    check: Check | None
    default: object = None
    aliases: tuple[str, ...] = ()
    when: str | None = None
    required_if: str | None = None
    write_released: Callable | None = None
    write_transformers: Callable | None = None

    @property
    def mtp(self) -> bool:
        return self.released.startswith("mtp_config.")

    @property
    def text_spellings(self) -> tuple[str, ...]:
        """Its spellings inside a text config (released first), without duplicates."""
        own = () if self.mtp else (self.released,)
        return tuple(dict.fromkeys(own + ((self.transformers,) if self.transformers else ()) + self.aliases))


def _local_ids(kinds: list[str]) -> list[int]:
    return [i for i, t in enumerate(kinds) if t == SLIDING]


def _mlp_layer_types(cfg) -> list[str]:
    return ["dense" if t == DENSE else "sparse" for t in cfg.mlp_types]


KEYS = [
    #   field                      released                    transformers               check
    Key("vocab_size",              "vocab_size",              "vocab_size",              POSITIVE_INT, REQUIRED),
    Key("unpadded_vocab_size",     "unpadded_vocab_size",     "unpadded_vocab_size",     POSITIVE_INT_OR_NULL,
        REQUIRED),
    Key("hidden_size",             "hidden_size",             "hidden_size",             POSITIVE_INT, REQUIRED),
    Key("num_layers",              "num_hidden_layers",       "num_hidden_layers",       POSITIVE_INT, REQUIRED,
        aliases=("num_layers",)),
    Key("num_heads",               "num_attention_heads",     "num_attention_heads",     POSITIVE_INT, REQUIRED,
        aliases=("num_heads",)),
    Key("num_kv_heads",            "num_key_value_heads",     "num_key_value_heads",     POSITIVE_INT, REQUIRED,
        aliases=("num_kv_heads",)),
    Key("head_dim",                "head_dim",                "head_dim",                POSITIVE_INT, REQUIRED),
    # the sliding layers' shapes: without sliding layers the global head counts are copied
    Key("swa_num_heads",           "swa_num_attention_heads", "swa_num_attention_heads", POSITIVE_INT, REQUIRED,
        aliases=("swa_num_heads",), required_if=NEEDS_SLIDING),
    Key("swa_num_kv_heads",        "swa_num_key_value_heads", "swa_num_key_value_heads", POSITIVE_INT, REQUIRED,
        aliases=("swa_num_kv_heads",), required_if=NEEDS_SLIDING),
    Key("swa_head_dim",            "swa_head_dim",            "swa_head_dim",            POSITIVE_INT, 128,
        required_if=NEEDS_SLIDING),
    Key("sliding_window",          "sliding_window_size",     "sliding_window_size",     POSITIVE_INT, 512,
        aliases=("sliding_window",), required_if=NEEDS_SLIDING),
    Key("d_rel",                   "d_rel",                   "d_rel",                   POSITIVE_INT, REQUIRED),
    Key("rel_extent",              "rel_extent",              "rel_extent",              POSITIVE_INT, REQUIRED),
    Key("log_scaling_n_floor",     "log_scaling_n_floor",     "log_scaling_n_floor",     POSITIVE_INT_OR_NULL,
        REQUIRED),
    Key("log_scaling_alpha",       "log_scaling_alpha",       "log_scaling_alpha",       NON_NEGATIVE, REQUIRED),
    # per-layer kinds: released as id lists / a dense prefix length, transformers as lists of names
    Key("layer_types",             "local_layer_ids",         "layer_types",             None, REQUIRED,
        write_released=lambda c: _local_ids(c.layer_types),
        write_transformers=lambda c: ["hybrid_sliding" if t == SLIDING else "hybrid" for t in c.layer_types]),
    Key("mlp_types",               "dense_mlp_idx",           "mlp_layer_types",         None, REQUIRED,
        write_released=lambda c: _dense_prefix(c.mlp_types), write_transformers=_mlp_layer_types),
    # MLP widths: `intermediate_size` means the dense width in one spelling, the expert width in the other
    Key("dense_intermediate_size", "dense_intermediate_size", "intermediate_size",       POSITIVE_INT, when=DENSE),
    Key("moe_intermediate_size",   "intermediate_size",       "moe_intermediate_size",   POSITIVE_INT, when=MOE),
    Key("n_routed_experts",        "n_routed_experts",        "n_routed_experts",        POSITIVE_INT, 256,
        aliases=("num_local_experts",), when=MOE, required_if=NEEDS_MOE),
    Key("num_experts_per_tok",     "num_experts_per_tok",     "num_experts_per_tok",     POSITIVE_INT, 6, when=MOE,
        required_if=NEEDS_MOE),
    Key("n_shared_experts",        "n_shared_experts",        "n_shared_experts",        COUNT, 2, when=MOE,
        required_if=NEEDS_MOE),
    Key("route_scale",             "route_scale",             "route_scale",             POSITIVE, 8.0, when=MOE,
        required_if=NEEDS_MOE),
    Key("mup",                     "logits_mup_width_multiplier", "logits_mup_width_multiplier", POSITIVE, REQUIRED,
        aliases=("embedding_multiplier",)),
    Key("rms_norm_eps",            "rms_norm_eps",            "rms_norm_eps",            POSITIVE, REQUIRED),
    Key("conv_kernel_size",        "sconv_kernel_size",       "conv_kernel_size",        POSITIVE_INT, REQUIRED),
    Key("max_position_embeddings", "model_max_length",        "max_position_embeddings", POSITIVE_INT, REQUIRED),
    Key("bos_token_id",            "bos_token_id",            "bos_token_id",            TOKEN_ID_OR_NULL),
    Key("eos_token_id",            "eos_token_id",            "eos_token_id",            TOKEN_ID_OR_NULL),
    # the MTP head: `mtp_config` in the released file, the text config in transformers' spelling
    Key("num_mtp_depths",          "mtp_config.num_nextn_predict_layers", "num_mtp_layers", COUNT, 0,
        aliases=("num_nextn_predict_layers",)),
    Key("mtp_layer_types",         "mtp_config.local_layer_ids", "mtp_local_layer_ids",  None, [],
        required_if=NEEDS_MTP, write_released=lambda c: _local_ids(c.mtp_layer_types)),
    Key("chain_hidden_post_norm",  "mtp_config.chain_hidden_post_norm", "chain_hidden_post_norm", BOOL, False,
        required_if=NEEDS_MTP),
    Key("mtp_apply_log_scaling",   "mtp_config.apply_log_scaling", None,                 BOOL, False,  # [ours]
        aliases=("mtp_apply_log_scaling",)),
]
KEY = {key.field: key for key in KEYS}
LISTS_AND_WIDTHS = ("layer_types", "mlp_types", "dense_intermediate_size", "moe_intermediate_size", "mtp_layer_types")

# Features of other Inkling variants that this reference does not implement: key -> (the value that
# asks for them, why). Each must be a boolean when present.
UNSUPPORTED = {"use_embed_norm": (False, "every Inkling checkpoint normalizes its embedding"),
               "mtp_hidden_states_first": (False, "MTP depths concatenate the hidden state first"),
               "tie_word_embeddings": (True, "the embedding and the unembedding are separate tensors")}

# What a typo may be mistaken for: per field, every spelling of it (see `_refuse_typos`).
TEXT_SPELLINGS = [key.text_spellings for key in KEYS] + [("mlp_layer_types",), ("hidden_act",)] + [
    (k,) for k in UNSUPPORTED]
MTP_SPELLINGS = [(key.released.removeprefix("mtp_config."),) for key in KEYS if key.mtp]


# Keys of transformers' configs (and of the other towers) that are read by no field here.
OTHER_KNOWN_KEYS = {
    "_name_or_path", "architectures", "attention_dropout", "chunk_size_feed_forward", "dtype", "torch_dtype",
    "id2label", "label2id", "initializer_range", "is_encoder_decoder", "output_attentions", "output_hidden_states",
    "pad_token_id", "problem_type", "return_dict", "transformers_version", "use_cache", "rms_norm_eps_moe_gate",
    "shared_expert_sink", "number_of_conv_states", "vision_config", "audio_config", "image_token_id",
    "audio_token_id", "image_bos_token_id", "audio_bos_token_id",
}


def field_label(name: str) -> str:
    """`config field 'x'`, plus how config files spell x when that differs."""
    key = KEY.get(name)
    if key is None or key.released == key.transformers == name:
        return f"config field '{name}'"
    if key.transformers is None or key.released == key.transformers:
        return f"config field '{name}' ({key.released} in config.json)"
    return f"config field '{name}' (released config.json: {key.released}; transformers: {key.transformers})"


def _refuse_typos(d: dict, fields: list[tuple[str, ...]], where: str) -> None:
    """Refuse keys that are not Inkling fields but look like a spelling of a field `d` leaves out.

    fields: per field, its spellings. Keys that resemble nothing are other models' or transformers'
    bookkeeping (`architectures`, `dtype`, ...) and are ignored."""
    known = {s for spellings in fields for s in spellings} | OTHER_KNOWN_KEYS
    absent = [s for spellings in fields if not any(s in d for s in spellings) for s in spellings]
    typos = []
    for key in d:
        if key not in known:
            close = difflib.get_close_matches(key, absent, n=1, cutoff=0.8)
            if close:
                typos.append(f"'{where}{key}' (did you mean '{where}{close[0]}'?)")
    if typos:
        raise ConfigError(f"unknown config field{'s' if len(typos) > 1 else ''} {', '.join(typos)}: check the "
                          "spelling (a misspelled key is not read, and its field would silently take its default)")


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
    bad = [i for i in v if not is_int(i) or not 0 <= i < n]
    if bad:
        raise ConfigError(f"config field '{name}': ids {bad} out of range 0..{n - 1} (there are {n} {what}s)")
    repeated = sorted({i for i in v if v.count(i) > 1})
    if repeated:
        raise ConfigError(f"config field '{name}': ids {repeated} are listed more than once")
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


def _per_layer(t: dict, name: str, kinds: dict, num_layers: int, expected: str) -> list[str]:
    """Config field `name`, a list with one entry per layer, each spelling mapped to its kind by `kinds`;
    ConfigError when the list has another length or an entry `kinds` does not know (`expected` names the
    usual spellings in that message)."""
    entries = t[name]
    if not isinstance(entries, list) or len(entries) != num_layers:
        raise ConfigError(f"config field '{name}': has {_len(entries)} entries for num_hidden_layers={num_layers}")
    bad = sorted({str(x) for x in entries if not isinstance(x, str) or x not in kinds})
    if bad:
        raise ConfigError(f"config field '{name}': unknown entries {bad} (expected {expected})")
    return [kinds[x] for x in entries]


def _given(d: dict, key: Key) -> bool:
    """Whether a text config gives the field: a value, or null for a field that may be null."""
    nullable = key.check is not None and key.check.ok(None)
    return any(s in d and (nullable or d[s] is not None) for s in key.text_spellings)


def _missing(name: str, feature: str | None = None) -> ConfigError:
    why = f" and the model has {feature}" if feature else ""
    return ConfigError(f"{field_label(name)} is missing{why}: it changes what the model computes and has no "
                       "safe default (docs/checkpoint.md lists the keys a config must give)")


def _text_fields(t: dict) -> dict:
    """The trunk's fields from a text config; a scalar field the file leaves out is None here (its
    default, or the error of a required field, comes in `_complete`)."""
    out = {key.field: _lookup(t, key.field, key.text_spellings) for key in KEYS
           if not key.mtp and key.field not in LISTS_AND_WIDTHS}
    for name in ("hidden_size", "num_layers", "num_heads", "num_kv_heads"):
        if out[name] is None:
            raise ConfigError(f"{field_label(name)} is missing")
    num_layers = out["num_layers"]
    if not is_int(num_layers) or num_layers <= 0:
        raise ConfigError(f"{field_label('num_layers')}: must be a positive integer, got {num_layers!r}")
    if num_layers > MAX_LAYERS:
        raise ConfigError(f"{field_label('num_layers')}: {num_layers} layers is beyond any model (at most "
                          f"{MAX_LAYERS})")
    if t.get("layer_types") is None and t.get("local_layer_ids") is None:
        raise _missing("layer_types")
    if t.get("mlp_layer_types") is None and t.get("dense_mlp_idx") is None:
        raise _missing("mlp_types")
    given = {key.field for key in KEYS if not key.mtp and key.field not in LISTS_AND_WIDTHS and _given(t, key)}

    # sliding layers: released `local_layer_ids` or transformers `layer_types` (both: they must agree)
    layer_types = []  # empty: the default pattern
    if t.get("layer_types") is not None:
        kinds = {"hybrid_sliding": SLIDING, "sliding_attention": SLIDING, "hybrid": GLOBAL,
                 "full_attention": GLOBAL, SLIDING: SLIDING, GLOBAL: GLOBAL}
        layer_types = _per_layer(t, "layer_types", kinds, num_layers, "'hybrid_sliding' or 'hybrid'")
    if t.get("local_layer_ids") is not None:
        ids = set(_id_list(t["local_layer_ids"], "local_layer_ids", num_layers, "layer"))
        from_ids = [SLIDING if i in ids else GLOBAL for i in range(num_layers)]
        if layer_types and layer_types != from_ids:
            raise ConfigError("config fields 'local_layer_ids' and 'layer_types' disagree: sliding layers "
                              f"{sorted(ids)} vs {[i for i, k in enumerate(layer_types) if k == SLIDING]}")
        layer_types = from_ids

    # MoE layers: transformers `mlp_layer_types` or released `dense_mlp_idx` (both: they must agree)
    n_dense = t.get("dense_mlp_idx")
    if n_dense is not None and (not is_int(n_dense) or not 0 <= n_dense <= num_layers):
        raise ConfigError(f"config field 'dense_mlp_idx': {n_dense!r} must be an integer in 0..{num_layers}")
    if t.get("mlp_layer_types") is not None:
        kinds = {"dense": DENSE, "sparse": MOE, "moe": MOE}
        mlp_types = _per_layer(t, "mlp_layer_types", kinds, num_layers, "'dense' or 'sparse'")
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

    for key, (bad_value, why) in UNSUPPORTED.items():
        if t.get(key) is not None and not isinstance(t[key], bool):
            raise ConfigError(f"config field '{key}': must be true or false, got {t[key]!r}")
        if t.get(key) is bad_value:
            raise ConfigError(f"config field '{key}': {str(bad_value).lower()} is not supported ({why})")
    if t.get("hidden_act") not in (None, "silu"):
        raise ConfigError(f"config field 'hidden_act': {t['hidden_act']!r} is not supported (Inkling uses silu)")

    if isinstance(out["eos_token_id"], list):  # several stop ids: the first is the model's own
        out["eos_token_id"] = out["eos_token_id"][0] if out["eos_token_id"] else None
    return dict(out, layer_types=layer_types, mlp_types=mlp_types,
                dense_intermediate_size=dense_f if dense_f is not None else 0,
                moe_intermediate_size=moe_f if moe_f is not None else 0, _given=given)


def _complete(fields: dict) -> dict:
    """Fill in the defaults of the fields a file left out, or refuse a missing required one (one line
    naming the key). Which fields are required depends on the model: see Key.required_if."""
    given = fields.pop("_given")
    has = {NEEDS_MOE: MOE in fields["mlp_types"],
           NEEDS_SLIDING: SLIDING in fields["layer_types"] + fields["mtp_layer_types"],
           NEEDS_MTP: fields["num_mtp_depths"] > 0}
    for key in KEYS:
        if key.field in given or key.field in LISTS_AND_WIDTHS or key.mtp:   # the MTP fields: `_mtp_fields`
            continue
        if key.default is REQUIRED and key.required_if is None:
            raise _missing(key.field)
        if key.required_if is not None and has[key.required_if]:
            raise _missing(key.field, key.required_if)
        if key.field in ("swa_num_heads", "swa_num_kv_heads"):   # nothing slides: the global counts
            fields[key.field] = fields[key.field.replace("swa_", "")]
        else:
            fields[key.field] = copy.deepcopy(key.default)
    for name in ("route_scale", "mup", "rms_norm_eps", "log_scaling_alpha"):
        if is_int(fields[name]):
            fields[name] = float(fields[name])
    return fields


def _mtp_fields(text: dict, mtp: dict) -> dict:
    """MTP fields from `mtp_config` (released) and/or the text config (transformers spelling)."""
    def one(name):
        key = KEY[name]
        mtp_key = key.released.removeprefix("mtp_config.")
        a = _lookup(mtp, name, (mtp_key,), prefix="mtp_config.")
        b = _lookup(text, name, key.text_spellings)
        if a is not None and b is not None and a != b:
            spelled = next(s for s in key.text_spellings if text.get(s) is not None)
            raise ConfigError(f"config fields 'mtp_config.{mtp_key}' ({a!r}) and '{spelled}' ({b!r}) disagree")
        return a if a is not None else b           # None: the file leaves the field out

    n = one("num_mtp_depths")
    n = 0 if n is None else n
    if not is_int(n) or n < 0:
        raise ConfigError(f"{field_label('num_mtp_depths')}: must be an integer >= 0, got {n!r}")
    if n > MAX_LAYERS:
        raise ConfigError(f"{field_label('num_mtp_depths')}: {n} MTP depths is beyond any model (at most "
                          f"{MAX_LAYERS})")
    ids = one("mtp_layer_types")
    kinds = None
    if ids is not None:
        ids = set(_id_list(ids, "mtp_config.local_layer_ids", n, "MTP depth"))
        kinds = [SLIDING if i in ids else GLOBAL for i in range(n)]
    log_tau = one("mtp_apply_log_scaling")
    out = dict(num_mtp_depths=n, mtp_layer_types=kinds, mtp_apply_log_scaling=False if log_tau is None else log_tau)
    chain = one("chain_hidden_post_norm")
    if chain is not None or n == 0:
        out["chain_hidden_post_norm"] = chain if chain is not None else False
    else:
        raise _missing("chain_hidden_post_norm", NEEDS_MTP)
    return out
