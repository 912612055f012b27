"""Reading configs: every spelling of the architecture spec's key table, the real model's released
config.json, agreement with transformers' own config classes, and errors that name the field."""

import copy
import json
import re

import pytest

from configs import tiny_config
from inkling_ref import ConfigError, InklingConfig

transformers = pytest.importorskip("transformers", reason="transformers is a test dependency")

TINY = tiny_config()  # 2 MTP depths, sliding/global mix, dense then MoE layers


def released_text():
    """The tiny config as a released text_config dict (spelled by hand here, not by the code under test)."""
    return {
        "vocab_size": 97, "unpadded_vocab_size": 91, "hidden_size": 48, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 12, "rel_extent": 16,
        "swa_num_attention_heads": 4, "swa_num_key_value_heads": 1, "swa_head_dim": 8,
        "sliding_window_size": 8, "d_rel": 5, "log_scaling_n_floor": 7, "log_scaling_alpha": 0.3,
        "local_layer_ids": [0, 2], "dense_mlp_idx": 2, "dense_intermediate_size": 40, "intermediate_size": 24,
        "n_routed_experts": 7, "num_experts_per_tok": 3, "n_shared_experts": 2, "route_scale": 2.5,
        "logits_mup_width_multiplier": 3.0, "rms_norm_eps": 1e-6, "sconv_kernel_size": 4,
        "model_max_length": 256, "use_embed_norm": True,
    }


def released(text=None, mtp=None):
    return {"model_type": "inkling_mm_model", "text_config": text or released_text(),
            "mtp_config": mtp if mtp is not None else {"num_nextn_predict_layers": 2, "local_layer_ids": [0],
                                                       "chain_hidden_post_norm": False}}


def test_released_spelling_reads_the_tiny_config():
    assert InklingConfig.from_dict(released()) == TINY


def test_write_then_read_round_trips():
    for cfg in (TINY, tiny_config(chain_hidden_post_norm=True, mtp_apply_log_scaling=True,
                                  mlp_types=["moe", "dense", "moe", "dense"]), InklingConfig()):
        assert InklingConfig.from_dict(json.loads(json.dumps(cfg.to_released_dict()))) == cfg
        trunk = cfg.replace(num_mtp_depths=0, mtp_layer_types=[], chain_hidden_post_norm=False,
                            mtp_apply_log_scaling=False)
        assert InklingConfig.from_dict(cfg.to_transformers_dict()) == trunk


# (description, edit of the released text_config / mtp_config): each spells one field the other way
SPELLINGS = {
    "conv_kernel_size": lambda t, m: t.update(conv_kernel_size=t.pop("sconv_kernel_size")),
    "max_position_embeddings": lambda t, m: t.update(max_position_embeddings=t.pop("model_max_length")),
    "sliding_window": lambda t, m: t.update(sliding_window=t.pop("sliding_window_size")),
    "layer_types": lambda t, m: t.update(layer_types=["hybrid_sliding", "hybrid", "hybrid_sliding", "hybrid"])
    or t.pop("local_layer_ids"),
    "mlp_layer_types": lambda t, m: t.update(mlp_layer_types=["dense", "dense", "sparse", "sparse"])
    or t.pop("dense_mlp_idx"),
    "intermediate_size (transformers reading)": lambda t, m: t.update(
        intermediate_size=t.pop("dense_intermediate_size"), moe_intermediate_size=t["intermediate_size"],
        mlp_layer_types=["dense", "dense", "sparse", "sparse"]) or t.pop("dense_mlp_idx"),
    "num_mtp_layers": lambda t, m: t.update(num_mtp_layers=m.pop("num_nextn_predict_layers")),
    "mtp_local_layer_ids": lambda t, m: t.update(mtp_local_layer_ids=m.pop("local_layer_ids")),
    "chain_hidden_post_norm in the text config": lambda t, m: t.update(
        chain_hidden_post_norm=m.pop("chain_hidden_post_norm")),
    "both spellings, agreeing": lambda t, m: t.update(sliding_window=8, conv_kernel_size=4, num_mtp_layers=2,
                                                      max_position_embeddings=256),
    "aliases": lambda t, m: t.update(embedding_multiplier=t.pop("logits_mup_width_multiplier"),
                                     num_local_experts=t.pop("n_routed_experts")),
}


@pytest.mark.parametrize("spelling", list(SPELLINGS))
def test_every_spelling_of_the_key_table(spelling):
    d = released()
    SPELLINGS[spelling](d["text_config"], d["mtp_config"])
    assert InklingConfig.from_dict(d) == TINY


def test_flat_transformers_text_config_with_mtp_fields():
    t = {k: v for k, v in TINY.to_transformers_dict().items()}
    t.update(model_type="inkling_text", num_mtp_layers=2, mtp_local_layer_ids=[0], local_layer_ids=None,
             chain_hidden_post_norm=False)
    assert InklingConfig.from_dict(t) == TINY


def test_released_reading_of_intermediate_size_by_dense_mlp_idx_alone():
    """Without dense_intermediate_size, dense_mlp_idx still marks the released spelling: intermediate_size is
    the expert width; with dense layers the dense width is then missing, and the error says which reading."""
    t = released_text()
    del t["dense_intermediate_size"]
    t["dense_mlp_idx"] = 0
    cfg = InklingConfig.from_dict(released(t, mtp={}))
    assert cfg.moe_intermediate_size == 24 and cfg.mlp_types == ["moe"] * 4
    t["dense_mlp_idx"] = 2
    with pytest.raises(ConfigError, match=r"dense_intermediate_size.*missing.*released reading"):
        InklingConfig.from_dict(released(t, mtp={}))


@pytest.mark.skipif(tuple(int(x) for x in transformers.__version__.split(".")[:2]) < (5, 24),
                    reason="pins the reading of transformers >= 5.24 (the version the tests are checked with); "
                           "5.17 reads the released spellings of intermediate_size differently")
def test_transformers_reads_our_released_config_the_same_way():
    """transformers' own InklingConfig (multimodal, top-level mtp_config) reads the file we write; its text
    config, read back by us, is the same model. This pins the ambiguous intermediate_size to its reading."""
    for cfg in (TINY, tiny_config(mlp_types=["moe", "dense", "moe", "moe"], chain_hidden_post_norm=True)):
        theirs = transformers.InklingConfig(**copy.deepcopy(cfg.to_released_dict())).text_config
        assert theirs.intermediate_size == cfg.dense_intermediate_size
        assert theirs.moe_intermediate_size == cfg.moe_intermediate_size
        assert theirs.conv_kernel_size == cfg.conv_kernel_size
        assert theirs.num_mtp_layers == cfg.num_mtp_depths
        assert InklingConfig.from_dict(theirs.to_dict()) == cfg
        # and the flat InklingTextConfig that transformers' save_pretrained writes
        flat = transformers.InklingTextConfig(**cfg.to_transformers_dict()).to_dict()
        assert InklingConfig.from_dict(flat) == cfg.replace(num_mtp_depths=0, mtp_layer_types=[],
                                                            chain_hidden_post_norm=False)


def test_real_inkling_released_config():
    """The released config.json of Inkling, with the sizes of the architecture spec (section 4), plus the
    vision and audio configs that the text model ignores."""
    text = {
        "vocab_size": 201024, "unpadded_vocab_size": 200058, "hidden_size": 6144, "num_hidden_layers": 66,
        "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 128,
        "swa_num_attention_heads": 64, "swa_num_key_value_heads": 16, "swa_head_dim": 128,
        "sliding_window_size": 512, "d_rel": 16, "rel_extent": 1024, "log_scaling_n_floor": 128000,
        "log_scaling_alpha": 0.1, "local_layer_ids": [i for i in range(66) if (i + 1) % 6],
        "dense_mlp_idx": 2, "dense_intermediate_size": 24576, "intermediate_size": 3072,
        "n_routed_experts": 256, "num_experts_per_tok": 6, "n_shared_experts": 2, "route_scale": 8,
        "logits_mup_width_multiplier": 24, "rms_norm_eps": 1e-6, "sconv_kernel_size": 4,
        "model_max_length": 131072, "use_embed_norm": True, "eos_token_id": [200002, 200012],
    }
    d = {"model_type": "inkling_mm_model", "text_config": text,
         "mtp_config": {"num_nextn_predict_layers": 8, "local_layer_ids": [0, 2, 4, 5, 6, 7],
                        "chain_hidden_post_norm": False},
         "vision_config": {"hidden_size": 1024, "num_hidden_layers": 24}, "audio_config": {"n_mel_bins": 80}}
    cfg = InklingConfig.from_dict(d)
    assert [i for i, t in enumerate(cfg.layer_types) if t == "global"] == list(range(5, 66, 6))
    assert cfg.mlp_types[:3] == ["dense", "dense", "moe"] and cfg.mlp_types.count("dense") == 2
    assert (cfg.dense_intermediate_size, cfg.moe_intermediate_size) == (24576, 3072)
    assert cfg.attention_shape("sliding") == (64, 16, 128, 512)
    assert cfg.attention_shape("global") == (64, 8, 128, 1024)
    assert cfg.vocab_out == 200058 and cfg.mup == 24.0 and cfg.route_scale == 8.0
    assert cfg.mtp_local_layer_ids == [0, 2, 4, 5, 6, 7] and cfg.num_mtp_depths == 8
    assert cfg.eos_token_id == 200002


def _set(**kv):
    return lambda t, m: t.update(kv)


# (edit, pattern the message must contain): the field named as the file spells it
BAD = {
    "heads not divisible": (_set(num_attention_heads=6, num_key_value_heads=4), r"num_attention_heads.*6.*4"),
    "sliding heads not divisible": (_set(swa_num_attention_heads=3, swa_num_key_value_heads=2),
                                    r"swa_num_attention_heads"),
    "local id out of range": (_set(local_layer_ids=[0, 2, 4]), r"'local_layer_ids': ids \[4\] out of range 0..3"),
    "MTP local id out of range": (lambda t, m: m.update(local_layer_ids=[0, 2]),
                                  r"mtp_config.local_layer_ids': ids \[2\] out of range 0..1"),
    "hidden size zero": (_set(hidden_size=0), r"'hidden_size': must be a positive integer, got 0"),
    "hidden size missing": (lambda t, m: t.pop("hidden_size"), r"'hidden_size' is missing"),
    "heads missing": (lambda t, m: t.pop("num_attention_heads"), r"num_attention_heads in config.json\) is missing"),
    "head dim negative": (_set(head_dim=-12), r"'head_dim': must be a positive integer, got -12"),
    "window zero": (_set(sliding_window_size=0), r"sliding_window_size.*positive integer, got 0"),
    "window longer than the context": (_set(sliding_window_size=512), r"sliding_window_size.*longer than the context"),
    "extent zero": (_set(rel_extent=0), r"'rel_extent': must be a positive integer"),
    "d_rel float": (_set(d_rel=5.0), r"'d_rel': must be a positive integer, got 5.0"),
    "kernel as a string": (_set(sconv_kernel_size="4"), r"sconv_kernel_size.*got '4'"),
    "unpadded vocab too large": (_set(unpadded_vocab_size=98),
                                 r"'unpadded_vocab_size': 98 must be in 1..vocab_size=97"),
    "top-k above experts": (_set(num_experts_per_tok=8),
                            r"'num_experts_per_tok': 8 must be in 1..n_routed_experts=7"),
    "no routed experts": (_set(n_routed_experts=0), r"n_routed_experts"),
    "layer_types too short": (_set(layer_types=["hybrid"] * 3),
                              r"'layer_types': has 3 entries for num_hidden_layers=4"),
    "layer_types unknown": (_set(layer_types=["hybrid", "local", "hybrid", "hybrid"]),
                            r"'layer_types': unknown entries \['local'\]"),
    "local ids and layer_types disagree": (_set(layer_types=["hybrid"] * 4),
                                           r"'local_layer_ids' and 'layer_types' disagree"),
    "dense_mlp_idx out of range": (_set(dense_mlp_idx=5), r"'dense_mlp_idx': 5 must be an integer in 0..4"),
    "dense_mlp_idx and mlp_layer_types disagree": (_set(mlp_layer_types=["dense", "sparse", "sparse", "sparse"]),
                                                    r"'dense_mlp_idx' \(2\) and 'mlp_layer_types' disagree"),
    "mlp_layer_types unknown": (_set(mlp_layer_types=["dense", "dense", "expert", "sparse"]),
                                r"'mlp_layer_types': unknown entries \['expert'\]"),
    "two spellings disagree": (_set(sliding_window=16), r"sliding_window_size, sliding_window .*different values"),
    "MTP depth counts disagree": (_set(num_mtp_layers=3),
                                  r"'mtp_config.num_nextn_predict_layers' \(2\) and 'num_mtp_layers' \(3\) disagree"),
    "negative MTP depths": (lambda t, m: m.update(num_nextn_predict_layers=-1, local_layer_ids=[]),
                            r"num_nextn_predict_layers.*got -1"),
    "chain norm as a string": (lambda t, m: m.update(chain_hidden_post_norm="false"),
                               r"chain_hidden_post_norm.*true or false, got 'false'"),
    "mup zero": (_set(logits_mup_width_multiplier=0), r"logits_mup_width_multiplier.*positive number"),
    "eps negative": (_set(rms_norm_eps=-1e-6), r"'rms_norm_eps': must be a positive number"),
    "n_floor zero": (_set(log_scaling_n_floor=0), r"'log_scaling_n_floor': must be a positive integer"),
    "eos id out of range": (_set(eos_token_id=200), r"'eos_token_id': 200 must be a token id in 0..96"),
    "embed norm off": (_set(use_embed_norm=False), r"'use_embed_norm': false is not supported"),
    "embedding first in MTP": (_set(mtp_hidden_states_first=False), r"'mtp_hidden_states_first'"),
    "tied embeddings": (_set(tie_word_embeddings=True), r"'tie_word_embeddings'"),
    "other activation": (_set(hidden_act="gelu"), r"'hidden_act': 'gelu' is not supported"),
    "MoE width missing": (lambda t, m: t.pop("intermediate_size"),
                          r"moe_intermediate_size.*missing.*MoE layers.*released reading"),
    "sliding heads missing": (lambda t, m: t.pop("swa_num_attention_heads"),
                              r"swa_num_attention_heads in config.json\) is missing.*sliding-window layers"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_config_error_names_the_field(case):
    edit, pattern = BAD[case]
    d = released()
    edit(d["text_config"], d["mtp_config"])
    with pytest.raises(ConfigError, match=pattern) as e:
        InklingConfig.from_dict(d)
    print(f"{case}: {e.value}")


def test_bad_top_level():
    with pytest.raises(ConfigError, match=r"'model_type': 'llama' is not an Inkling model"):
        InklingConfig.from_dict({"model_type": "llama", "hidden_size": 48})
    with pytest.raises(ConfigError, match=r"'text_config': must be an object"):
        InklingConfig.from_dict({"text_config": [1, 2]})
    with pytest.raises(ConfigError, match=r"'mtp_config': must be an object"):
        InklingConfig.from_dict(released(mtp=[2]))
    with pytest.raises(ConfigError, match=r"config must be a JSON object, got list"):
        InklingConfig.from_dict([1])


def test_direct_construction_is_validated():
    with pytest.raises(ConfigError, match=r"'num_heads' \(num_attention_heads in config.json\).*5 query heads"):
        tiny_config(num_heads=5)
    with pytest.raises(ConfigError, match=r"'mtp_layer_types'.*has 1 entries for 2 MTP depths"):
        tiny_config(mtp_layer_types=["sliding"])


def test_from_file(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(released()))
    assert InklingConfig.from_file(tmp_path) == TINY == InklingConfig.from_file(path)
    path.write_text('{"text_config": {"hidden_size": 48,}')
    with pytest.raises(ConfigError, match=re.escape(str(path)) + " is not valid JSON"):
        InklingConfig.from_file(path)
    d = released()
    d["text_config"]["num_key_value_heads"] = 3
    path.write_text(json.dumps(d))
    with pytest.raises(ConfigError, match=re.escape(str(path)) + r": config field 'num_heads'"):
        InklingConfig.from_file(path)
    with pytest.raises(FileNotFoundError, match="no config.json"):
        InklingConfig.from_file(tmp_path / "nowhere")


# ----------------------------------------------------------------------------- the key table
def test_key_table_drives_reading_from_every_spelling():
    """Each scalar field of KEYS, spelled in turn by each of its spellings in the released text_config,
    reads back the same config; the MTP fields likewise from the text config."""
    from inkling_ref.io.config import KEYS, LISTS_AND_WIDTHS
    checked = 0
    for key in KEYS:
        if key.field in LISTS_AND_WIDTHS:
            continue
        d = released()
        if key.mtp:
            value = d["mtp_config"].pop(key.released.removeprefix("mtp_config."), None)
            if value is None:
                value = key.default
        else:
            value = d["text_config"].pop(key.released, None)
            if value is None:
                continue  # a field the tiny config leaves at its default (bos / eos ids)
        for spelling in key.text_spellings:
            e = copy.deepcopy(d)
            e["text_config"][spelling] = value
            assert InklingConfig.from_dict(e) == TINY, (key.field, spelling)
            checked += 1
    assert checked >= 35


def test_key_table_drives_both_writers():
    """Every field is written under its spelling of the table (released: every row; transformers: the
    trunk's rows), with nothing else but the released constant use_embed_norm."""
    from inkling_ref.io.config import KEYS
    cfg = tiny_config(mlp_types=["moe", "dense", "moe", "dense"])  # not a dense prefix: mlp_layer_types too
    rel = cfg.to_released_dict()
    want_text = {k.released for k in KEYS if not k.mtp} | {"use_embed_norm", "mlp_layer_types"}
    want_mtp = {k.released.removeprefix("mtp_config.") for k in KEYS if k.mtp}
    assert set(rel["text_config"]) == want_text and set(rel["mtp_config"]) == want_mtp
    assert set(cfg.to_transformers_dict()) == {k.transformers for k in KEYS if k.transformers and not k.mtp}
    assert rel["text_config"]["sconv_kernel_size"] == cfg.to_transformers_dict()["conv_kernel_size"] == 4


# (edit, message): a key that looks like a misspelling of a field the file leaves out is refused
TYPOS = {
    "text key": (lambda d: d["text_config"].update(sliding_window_sise=d["text_config"].pop("sliding_window_size")),
                 "unknown config field 'text_config.sliding_window_sise' (did you mean "
                 "'text_config.sliding_window_size'?)"),
    "two at once": (lambda d: d["text_config"].update(d_rell=d["text_config"].pop("d_rel"),
                                                      head_dims=d["text_config"].pop("head_dim")),
                    "unknown config fields 'text_config.d_rell' (did you mean 'text_config.d_rel'?), "
                    "'text_config.head_dims' (did you mean 'text_config.head_dim'?)"),
    "top level": (lambda d: d.update(mtp_confg=d.pop("mtp_config")), "(did you mean 'mtp_config'?)"),
    "mtp_config key": (lambda d: d["mtp_config"].update(chain_hidden_postnorm=False) or
                       d["mtp_config"].pop("chain_hidden_post_norm"),
                       "(did you mean 'mtp_config.chain_hidden_post_norm'?)"),
}


@pytest.mark.parametrize("case", list(TYPOS))
def test_misspelled_keys_are_refused(case):
    edit, message = TYPOS[case]
    d = released()
    edit(d)
    with pytest.raises(ConfigError) as e:
        InklingConfig.from_dict(d)
    assert message in str(e.value)


def test_unknown_keys_that_resemble_no_missing_field_are_ignored():
    """Keys of other configs are not typos: transformers' bookkeeping, the other towers, and a key close
    to a field the file does give (that field is read from its own key)."""
    d = released()
    d.update(architectures=["InklingForConditionalGeneration"], vision_config={"hidden_size": 8}, dtype="bf16")
    d["text_config"].update(rope_theta=1e6, pad_token_id=0, sliding_window_sizes=[8], initializer_range=0.02)
    assert InklingConfig.from_dict(d) == TINY


# ----------------------------------------------------------------------------- required keys
def _required_spellings():
    """(field, the released key to delete, where) for every field a config must give; the tiny config has
    MoE, sliding and MTP layers, so every conditionally required field is required here."""
    from inkling_ref.io.config import KEYS, REQUIRED
    out = []
    for key in KEYS:
        if key.default is REQUIRED or key.required_if is not None:
            if key.field in ("dense_intermediate_size", "moe_intermediate_size"):
                continue   # required by the MLP kinds, with their own message (test_bad_config_error_names_the_field)
            if key.field in ("layer_types", "mlp_types"):
                continue   # below: two spellings each
            out.append((key.field, key.released))
    return out


@pytest.mark.parametrize("field,released_key", _required_spellings())
def test_a_missing_required_key_is_one_line_naming_it(field, released_key):
    d = released()
    where = d["mtp_config"] if released_key.startswith("mtp_config.") else d["text_config"]
    del where[released_key.removeprefix("mtp_config.")]
    with pytest.raises(ConfigError) as e:
        InklingConfig.from_dict(d)
    msg = str(e.value)
    assert "\n" not in msg and "is missing" in msg and released_key in msg, msg


@pytest.mark.parametrize("given", [["local_layer_ids"], ["dense_mlp_idx"]])
def test_per_layer_kinds_are_required(given):
    d = released()
    for k in given:
        del d["text_config"][k]
    with pytest.raises(ConfigError, match=f"{given[0]}.* is missing"):
        InklingConfig.from_dict(d)


def test_optional_keys_take_their_documented_defaults():
    d = released()
    d["text_config"].pop("eos_token_id", None)
    d["mtp_config"].pop("apply_log_scaling", None)
    cfg = InklingConfig.from_dict(d)
    assert cfg.eos_token_id is None and cfg.bos_token_id is None and cfg.mtp_apply_log_scaling is False
    # without an MTP head, its fields compute nothing and may be left out
    cfg = InklingConfig.from_dict(released(mtp={}))
    assert cfg.num_mtp_depths == 0 and cfg.chain_hidden_post_norm is False
    # without sliding layers, the sliding layers' shapes may be left out (the global head counts are copied)
    t = released_text()
    for k in ("swa_num_attention_heads", "swa_num_key_value_heads", "swa_head_dim", "sliding_window_size"):
        del t[k]
    t["local_layer_ids"] = []
    cfg = InklingConfig.from_dict(released(t, mtp={"num_nextn_predict_layers": 2, "local_layer_ids": [],
                                                   "chain_hidden_post_norm": False}))
    assert (cfg.swa_num_heads, cfg.swa_num_kv_heads) == (cfg.num_heads, cfg.num_kv_heads)
    # a nullable key given as null is given: log-tau off
    t = released_text()
    t["log_scaling_n_floor"] = None
    assert InklingConfig.from_dict(released(t)).log_scaling_n_floor is None


def test_docs_list_every_key_the_loader_reads():
    """docs/checkpoint.md has one row per key of the table: its released spelling, and 'required' (or
    'required with ...') or its default, as the table says."""
    from pathlib import Path
    from inkling_ref.io.config import KEYS, REQUIRED
    text = (Path(__file__).resolve().parents[1] / "docs" / "checkpoint.md").read_text()
    rows = {line.split("|")[1].strip().strip("`"): line for line in text.splitlines()
            if line.startswith("| `")}
    for key in KEYS:
        row = rows.get(key.released)
        assert row is not None, f"docs/checkpoint.md lists no key {key.released}"
        cells = [c.strip() for c in row.split("|")]
        if key.field in ("dense_intermediate_size", "moe_intermediate_size"):   # required by the MLP kinds
            assert cells[3].startswith("required with"), row
        elif key.default is REQUIRED and key.required_if is None:
            assert cells[3] == "required", row
        elif key.required_if is not None:
            assert cells[3] == f"required with {key.required_if}", row
        else:
            assert cells[3] == "optional", row


def test_absurd_sizes_are_refused_at_once():
    import time
    from inkling_ref.io.config import MAX_LAYERS, MAX_SIZE
    for text, pattern in ((dict(num_hidden_layers=10**12), rf"num_hidden_layers.*at most {MAX_LAYERS}"),
                          (dict(hidden_size=10**15), rf"'hidden_size': 1000000000000000 is beyond any model "
                                                     rf"\(at most {MAX_SIZE}\)")):
        t = released_text()
        t.update(text)
        t0 = time.perf_counter()
        with pytest.raises(ConfigError, match=pattern):
            InklingConfig.from_dict(released(t))
        assert time.perf_counter() - t0 < 1
    with pytest.raises(ConfigError, match=rf"num_nextn_predict_layers.*at most {MAX_LAYERS}"):
        InklingConfig.from_dict(released(mtp={"num_nextn_predict_layers": 10**9, "local_layer_ids": [],
                                              "chain_hidden_post_norm": False}))
