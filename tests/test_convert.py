"""`inkling-mtp convert`: a checkpoint written by transformers' `save_pretrained` -> the released layout.

The oracle is transformers itself: an `InklingForCausalLM` whose every parameter is randomized by its own
transformers name (nothing of ours builds it), saved with `save_pretrained`, converted, loaded with
`load_checkpoint`; our logits must equal transformers' (float64; transformers computes norms, convs,
router and softmax in float32, hence a relative L2 bound of 1e-6)."""

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

transformers = pytest.importorskip("transformers", reason="transformers is a test dependency")
from transformers import InklingForCausalLM, InklingTextConfig  # noqa: E402

import inkling_ref  # noqa: E402
from configs import tiny_config  # noqa: E402
from inkling_ref import CheckpointError, load_checkpoint, save_checkpoint  # noqa: E402
from inkling_mtp.cli import main  # noqa: E402
from inkling_ref.testing import rel_l2  # noqa: E402
from mutants import load_mutant  # noqa: E402

BOUND = 1e-6
CFG = tiny_config()  # 2 MTP depths in the config; the transformers layout carries none of their tensors
SEQ_LEN = 45  # longer than the window (8) and the relative extent (16); log-tau from position 7
REPO = Path(__file__).resolve().parents[1]


@torch.no_grad()
def randomize_hf_(model, seed):
    """Every parameter (and the router's selection-bias buffer) of a transformers Inkling, non-trivial."""
    g = torch.Generator().manual_seed(seed)
    tensors = dict(model.named_parameters())
    tensors.update((n, b) for n, b in model.named_buffers() if n.endswith("e_score_correction_bias"))
    for name, p in tensors.items():
        if name.endswith(("norm.weight", "layernorm.weight", "global_scale")):
            sign = torch.randint(0, 2, p.shape, generator=g) * 2 - 1
            v = 1 + sign * (0.15 + 0.3 * torch.rand(p.shape, generator=g, dtype=torch.float64))
        elif name.endswith("conv1d.weight"):
            v = torch.randn(p.shape, generator=g, dtype=torch.float64) * 0.3
        elif name.endswith(("rel_logits_proj.proj", "embed_tokens.weight", "lm_head.weight")):
            v = torch.randn(p.shape, generator=g, dtype=torch.float64)
        elif name.endswith("e_score_correction_bias"):
            v = torch.randn(p.shape, generator=g, dtype=torch.float64) * 0.2
        elif name.endswith("mlp.gate.weight"):
            v = torch.randn(p.shape, generator=g, dtype=torch.float64) * 2 / math.sqrt(p.shape[-1])
        elif p.dim() >= 2:
            v = torch.randn(p.shape, generator=g, dtype=torch.float64) / math.sqrt(p.shape[-1])
        else:
            raise AssertionError(f"no rule for {name} {tuple(p.shape)}")
        p.copy_(v.to(p.dtype))


def hf_model(seed=7):
    hc = InklingTextConfig(**CFG.to_transformers_dict(), num_mtp_layers=CFG.num_mtp_depths,
                           mtp_local_layer_ids=CFG.mtp_local_layer_ids)
    hc._experts_implementation = "eager"
    hc._attn_implementation = "eager"
    hf = InklingForCausalLM(hc).to(torch.float64).eval()
    randomize_hf_(hf, seed)
    return hf


@pytest.fixture(scope="module")
def hf():
    return hf_model()


@pytest.fixture(scope="module")
def ids():
    return torch.randint(0, CFG.vocab_out, (2, SEQ_LEN), generator=torch.Generator().manual_seed(5))


@pytest.fixture(scope="module")
def hf_logits(hf, ids):
    with torch.no_grad():
        return hf(ids).logits


@pytest.fixture(scope="module")
def src(hf, tmp_path_factory):
    d = tmp_path_factory.mktemp("hf")
    hf.save_pretrained(d)
    return d


def logits_error(dst, ids, hf_logits, package=inkling_ref):
    m = package.load_checkpoint(dst, dtype=torch.float64)
    with torch.no_grad():
        return rel_l2(m.logits(ids), hf_logits)


def test_what_save_pretrained_writes(src):
    """The input convert expects: a flat transformers config and transformers tensor names."""
    cfg = json.loads((src / "config.json").read_text())
    assert cfg["model_type"] == "inkling_text" and cfg["architectures"] == ["InklingForCausalLM"]
    assert cfg["intermediate_size"] == CFG.dense_intermediate_size and "dense_intermediate_size" not in cfg
    names = load_file(src / "model.safetensors").keys()
    assert "model.layers.2.mlp.experts.gate_up_proj" in names and "lm_head.weight" in names
    assert not any(n.startswith(("model.llm.", "model.mtp.")) for n in names)


@pytest.mark.parametrize("shards", ["single", "sharded input", "sharded output"])
def test_converted_checkpoint_gives_the_transformers_logits(hf, src, ids, hf_logits, tmp_path, shards):
    if shards == "sharded input":
        hf.save_pretrained(tmp_path / "src", max_shard_size="100KB")
        assert (tmp_path / "src" / "model.safetensors.index.json").exists()
        source = tmp_path / "src"
    else:
        source = src
    args = ["--max-shard-size", "40kB"] if shards == "sharded output" else []
    assert main(["convert", str(source), str(tmp_path / "dst"), *args]) == 0
    files = sorted(p.name for p in (tmp_path / "dst").iterdir())
    if shards == "sharded output":
        assert "model.safetensors.index.json" in files and len(files) > 3
    else:
        assert files == ["config.json", "model.safetensors"]
        stored = load_file(tmp_path / "dst" / "model.safetensors")
        assert all(n.startswith("model.llm.") and t.dtype == torch.float64 for n, t in stored.items())
    err = logits_error(tmp_path / "dst", ids, hf_logits)
    print(f"{shards}: relative L2 error vs transformers = {err:.2e}")
    assert err < BOUND


def test_a_released_mtp_shard_completes_a_converted_checkpoint(src, tmp_path):
    """The converted config keeps the MTP fields, so the release's mtp.safetensors can be dropped in."""
    inkling_ref.io.checkpoint.convert_transformers_checkpoint(src, tmp_path / "dst")
    trunk = load_checkpoint(tmp_path / "dst", dtype=torch.float64)
    assert trunk.mtp is None and trunk.config == CFG
    head = inkling_ref.random_model(CFG, seed=3, dtype=torch.float64)
    save_checkpoint(head, tmp_path / "release")
    shutil.copy(tmp_path / "release" / "mtp.safetensors", tmp_path / "dst")
    full = load_checkpoint(tmp_path / "dst", dtype=torch.float64)
    assert full.num_mtp_depths == 2
    for n, p in full.named_parameters():
        source = head if n.startswith("mtp.") else trunk
        assert torch.equal(p, source.get_parameter(n)), n


def test_multimodal_prefix_and_config(src, ids, hf_logits, tmp_path):
    """InklingForConditionalGeneration's text tensors (`model.language_model.`), its towers (dropped) and its
    nested config with `text_config` in the transformers spelling."""
    d = tmp_path / "mm"
    d.mkdir()
    tensors = {n.replace("model.", "model.language_model.", 1) if n.startswith("model.") else n: t
               for n, t in load_file(src / "model.safetensors").items()}
    tensors["model.vision_tower.encoder_layers.0.projection.weight"] = torch.ones(4, 3)
    tensors["model.audio_tower.norm.weight"] = torch.ones(5)
    save_file(tensors, d / "model.safetensors")
    text = json.loads((src / "config.json").read_text())
    mm = {"model_type": "inkling_mm_model", "architectures": ["InklingForConditionalGeneration"],
          "text_config": text, "vision_config": {"hidden_size": 16}, "audio_config": {"n_mel_bins": 4}}
    (d / "config.json").write_text(json.dumps(mm))
    assert main(["convert", str(d), str(tmp_path / "dst")]) == 0
    err = logits_error(tmp_path / "dst", ids, hf_logits)
    print(f"multimodal: relative L2 error vs transformers = {err:.2e}")
    assert err < BOUND


def test_console_entry_in_a_subprocess(src, ids, hf_logits, tmp_path):
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    run = subprocess.run([sys.executable, "-m", "inkling_mtp.cli", "convert", str(src), str(tmp_path / "dst")],
                         capture_output=True, text=True, env=env, timeout=120)
    assert run.returncode == 0, run.stderr
    assert "converted 80 tensors" in run.stdout and "no MTP head" in run.stdout
    assert logits_error(tmp_path / "dst", ids, hf_logits) < BOUND


# ---------------------------------------------------------------------- bad input
def broken_copy(src, tmp_path, fn):
    d = tmp_path / "broken"
    shutil.copytree(src, d)
    tensors = load_file(d / "model.safetensors")
    fn(tensors)
    save_file(tensors, d / "model.safetensors")
    return d


def test_unplaceable_tensors_are_all_listed_and_nothing_is_written(src, tmp_path, capsys):
    def spoil(t):
        t["model.layers.0.self_attn.foo.weight"] = torch.zeros(2)
        t["model.extra_head.weight"] = torch.zeros(2)
        del t["model.layers.1.mlp.up_proj.weight"]
        del t["model.layers.3.mlp.shared_experts.gate_proj"]
    d = broken_copy(src, tmp_path, spoil)
    assert main(["convert", str(d), str(tmp_path / "dst")]) == 1
    err = capsys.readouterr().err
    print(err)
    assert ("tensors with no place in the released layout: model.extra_head.weight, "
            "model.layers.0.self_attn.foo.weight, "
            "model.llm.layers.1.mlp.w13_dn.weight (one of gate/up missing), "
            "model.llm.layers.3.mlp.shared_experts.shared_w13_weight (one of gate/up missing)") in err
    assert not (tmp_path / "dst").exists()


def test_misshapen_and_missing_source_tensors(src, tmp_path):
    def spoil(t):
        t["model.layers.1.self_attn.q_proj.weight"] = torch.zeros(47, 48, dtype=torch.float64)
        del t["model.norm.weight"]
    d = broken_copy(src, tmp_path, spoil)
    with pytest.raises(CheckpointError) as e:
        inkling_ref.io.checkpoint.convert_transformers_checkpoint(d, tmp_path / "dst")
    print(e.value)
    assert "(after renaming) does not match its config.json" in str(e.value)
    assert "missing tensors (1):\n    model.llm.norm.weight" in str(e.value)
    assert ("misshapen tensors (1):\n"
            "    model.llm.layers.1.attn.wq_du.weight expected [48, 48] got [47, 48]") in str(e.value)
    assert not (tmp_path / "dst").exists()


def test_quantized_source_is_refused(src, tmp_path):
    def quantize(t):
        t["model.layers.0.self_attn.q_proj.weight"] = torch.zeros(32, 24, dtype=torch.uint8)
        t["model.layers.0.self_attn.q_proj.weight_scale"] = torch.ones(32, 3)
    d = broken_copy(src, tmp_path, quantize)
    with pytest.raises(CheckpointError, match=r"quantized(.|\n)*"
                                              r"model.layers.0.self_attn.q_proj.weight \[U8 \[32, 24\]\]\n"
                                              r"    model.layers.0.self_attn.q_proj.weight_scale \[F32"):
        inkling_ref.io.checkpoint.convert_transformers_checkpoint(d, tmp_path / "dst")


def test_convert_argument_errors(src, tmp_path, capsys):
    assert main(["convert", str(tmp_path / "nowhere"), str(tmp_path / "dst")]) == 1
    assert "inkling-mtp convert: error: checkpoint directory" in capsys.readouterr().err
    (tmp_path / "noconfig").mkdir()
    shutil.copy(src / "model.safetensors", tmp_path / "noconfig")
    assert main(["convert", str(tmp_path / "noconfig"), str(tmp_path / "dst")]) == 1
    assert "noconfig: missing config.json" in capsys.readouterr().err
    assert main(["convert", str(src), str(src)]) == 1
    assert "SRC and DST are the same directory" in capsys.readouterr().err
    assert main(["convert", str(src), str(tmp_path / "dst")]) == 0
    assert main(["convert", str(src), str(tmp_path / "dst")]) == 1
    assert "already holds a checkpoint" in capsys.readouterr().err
    assert main(["convert", str(src), str(tmp_path / "dst"), "--overwrite"]) == 0
    with pytest.raises(SystemExit) as e:
        main(["convert", str(src), str(tmp_path / "dst2"), "--max-shard-size", "lots"])
    assert e.value.code == 2 and "not a size: 'lots'" in capsys.readouterr().err


MUTANTS = {
    "dense and shared w13 concatenated, not interleaved": [
        ("io/transformers_layout.py", 'out[target] = interleave(part["gate"], part["up"], 1 if shared else 0)',
         'out[target] = torch.cat([part["gate"], part["up"]], 1 if shared else 0)')],
    "routed experts' gate and up swapped": [
        ("io/transformers_layout.py", "g, u = w.chunk(2, dim=1)", "u, g = w.chunk(2, dim=1)")],
    "router bias not carried over": [
        ("io/checkpoint.py", "converted = transformers_layout.to_released(part)",
         "converted = {n: (t.zero_() if n.endswith('gate.bias') else t) "
         "for n, t in transformers_layout.to_released(part).items()}")],
}


@pytest.mark.parametrize("mutant", list(MUTANTS))
def test_convert_test_catches_mutant(mutant, src, ids, hf_logits, tmp_path):
    pkg = load_mutant(tmp_path, MUTANTS[mutant])
    pkg.io.checkpoint.convert_transformers_checkpoint(src, tmp_path / "dst")
    err = logits_error(tmp_path / "dst", ids, hf_logits, package=pkg)
    print(f"{mutant}: relative L2 error {err:.1e}")
    assert err > 1e3 * BOUND, f"the convert test does not notice '{mutant}'"


def test_older_transformers_embed_norm_spelling():
    """transformers 5.17 (the GPU image's) names the embedding norm `model.embed_norm.weight`; newer ones
    `model.embed_tokens.embed_norm.weight`. Both convert; match_model_names picks the installed spelling."""
    from inkling_ref.io import transformers_layout as tl
    w = torch.arange(4.0)
    for name in ("model.embed_norm.weight", "model.embed_tokens.embed_norm.weight"):
        assert list(tl.to_released({name: w})) == ["model.llm.embed_norm.weight"]
    sd = tl.from_released({"model.llm.embed_norm.weight": w})
    assert list(sd) == ["model.embed_tokens.embed_norm.weight"]
    assert list(tl.match_model_names(sd, ["model.embed_norm.weight"])) == ["model.embed_norm.weight"]
    assert tl.match_model_names(sd, ["model.embed_tokens.embed_norm.weight"]) == sd
