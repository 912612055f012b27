"""Released-layout checkpoints: save -> load is bit-exact in every layout (single file, shards + index,
MTP shard listed in the index or not), MTP depths are loaded by presence, and every bad input gets an
error naming every offending file or tensor. Nothing is ever unpickled (torch.load is booby-trapped)."""

import json
import pickle
import re

import pytest
import torch
from safetensors.torch import load_file, save_file

import inkling_ref
from configs import tiny_config
from inkling_ref import CheckpointError, ConfigError, load_checkpoint, save_checkpoint
from inkling_ref.testing import rel_l2

CFG = tiny_config()  # 4 trunk layers (dense and MoE), 2 MTP depths


@pytest.fixture(autouse=True)
def no_unpickling(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a checkpoint was unpickled")
    monkeypatch.setattr(torch, "load", refuse)
    monkeypatch.setattr(pickle, "load", refuse)
    monkeypatch.setattr(pickle, "loads", refuse)


def model(dtype=torch.float32, seed=0, **kw):
    return inkling_ref.random_model(CFG, seed=seed, dtype=dtype, **kw)


def assert_same_params(a, b):
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    assert pa.keys() == pb.keys()
    for n in pa:
        assert pa[n].dtype == pb[n].dtype, n
        assert torch.equal(pa[n], pb[n]), n


def edit(path, fn):
    """Rewrite one safetensors file: fn(dict of tensors) edits it in place."""
    tensors = load_file(path)
    fn(tensors)
    save_file(tensors, path)


def message(excinfo) -> str:
    return str(excinfo.value)


# ---------------------------------------------------------------------- round trips
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_round_trip_is_bit_exact(tmp_path, dtype):
    m = model(dtype)
    save_checkpoint(m, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors", "mtp.safetensors"]
    assert all(n.startswith("model.llm.") for n in load_file(tmp_path / "model.safetensors"))
    assert all(n.startswith("model.mtp.") for n in load_file(tmp_path / "mtp.safetensors"))
    back = load_checkpoint(tmp_path, dtype=dtype)
    assert back.num_mtp_depths == 2
    assert_same_params(m, back)
    ids = torch.randint(0, CFG.vocab_out, (2, 19), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(m.logits(ids), back.logits(ids))
        assert all(torch.equal(a, b) for a, b in zip(m.mtp_logits(ids), back.mtp_logits(ids)))


def test_each_tensor_keeps_its_dtype_and_load_casts(tmp_path):
    m = model(torch.bfloat16)
    bias = m.trunk.layers[2].mlp.router_bias
    bias.data = torch.randn(bias.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float32) / 7
    save_checkpoint(m, tmp_path)
    stored = load_file(tmp_path / "model.safetensors")
    assert stored["model.llm.layers.2.mlp.gate.bias"].dtype == torch.float32
    assert stored["model.llm.layers.3.mlp.gate.bias"].dtype == torch.bfloat16
    assert stored["model.llm.embed.weight"].dtype == torch.bfloat16

    for dtype in (torch.bfloat16, torch.float16, torch.float32, torch.float64):
        back = load_checkpoint(tmp_path, dtype=dtype)
        for n, p in back.named_parameters():
            keeps_fp32 = n == "trunk.layers.2.mlp.router_bias" and dtype.itemsize < 4
            assert p.dtype == (torch.float32 if keeps_fp32 else dtype), n
    up = load_checkpoint(tmp_path, dtype=torch.float64)
    assert torch.equal(up.trunk.layers[2].mlp.router_bias, bias.double())  # an fp32 bias is not rounded
    assert torch.equal(up.trunk.embed.weight, m.trunk.embed.weight.double())
    assert load_checkpoint(tmp_path, dtype="bfloat16").trunk.embed.weight.dtype == torch.bfloat16


@pytest.mark.parametrize("index_lists_mtp", [False, True])
def test_sharded_round_trip(tmp_path, index_lists_mtp):
    m = model(torch.float64)
    save_checkpoint(m, tmp_path, max_shard_bytes=60_000)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) >= 4 and not (tmp_path / "model.safetensors").exists()
    assert shards == [f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)]
    assert "mtp.safetensors" not in shards  # as in the releases
    for s in shards:
        sizes = [t.numel() * t.element_size() for t in load_file(tmp_path / s).values()]
        assert sum(sizes) <= 60_000 or len(sizes) == 1
    if index_lists_mtp:
        index["weight_map"].update({n: "mtp.safetensors" for n in load_file(tmp_path / "mtp.safetensors")})
        (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    assert_same_params(m, load_checkpoint(tmp_path, dtype=torch.float64))


def test_overwrite_replaces_a_sharded_checkpoint(tmp_path):
    save_checkpoint(model(seed=1), tmp_path, max_shard_bytes=60_000)
    with pytest.raises(CheckpointError, match=r"already holds a checkpoint .*config.json.*overwrite=True"):
        save_checkpoint(model(seed=2), tmp_path)
    (tmp_path / "notes.txt").write_text("kept")
    m = model(seed=2)
    save_checkpoint(m, tmp_path, overwrite=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors", "mtp.safetensors",
                                                          "notes.txt"]
    assert_same_params(m, load_checkpoint(tmp_path))


# ---------------------------------------------------------------------- MTP depths
def test_mtp_depths_are_loaded_on_request(tmp_path):
    m = model(torch.float64)
    save_checkpoint(m, tmp_path)
    ids = torch.randint(0, CFG.vocab_out, (1, 15), generator=torch.Generator().manual_seed(3))
    one = load_checkpoint(tmp_path, dtype=torch.float64, num_mtp_depths=1)
    assert one.num_mtp_depths == 1
    with torch.no_grad():
        assert torch.equal(one.mtp_logits(ids)[0], m.mtp_logits(ids)[0])
    none = load_checkpoint(tmp_path, num_mtp_depths=0)
    assert none.mtp is None and not any(n.startswith("mtp.") for n, _ in none.named_parameters())
    with pytest.raises(CheckpointError, match=r"num_mtp_depths=3 requested, but checkpoint .* has 2 complete MTP "
                                              r"depth\(s\) \(its config.json declares 2\)"):
        load_checkpoint(tmp_path, num_mtp_depths=3)
    for bad in (-1, "2", 1.0):
        with pytest.raises(CheckpointError, match=re.escape(f"num_mtp_depths must be an integer >= 0 or None, "
                                                            f"got {bad!r}")):
            load_checkpoint(tmp_path, num_mtp_depths=bad)


def test_directory_without_mtp_tensors_is_a_trunk(tmp_path):
    m = model()
    save_checkpoint(m, tmp_path)
    (tmp_path / "mtp.safetensors").unlink()
    trunk = load_checkpoint(tmp_path)
    assert trunk.mtp is None and trunk.config.num_mtp_depths == 2
    assert_same_params(model(num_mtp_depths=0), trunk)
    with pytest.raises(CheckpointError, match=r"num_mtp_depths=1 requested, but .* has 0 complete MTP depth\(s\)"
                                              r".*depth 0 lacks: model.mtp.layers.0.embed_norm.weight, "):
        load_checkpoint(tmp_path, num_mtp_depths=1)


def test_fewer_depths_in_the_files_than_in_the_config(tmp_path):
    save_checkpoint(model(), tmp_path)
    depth1 = sorted(n for n in load_file(tmp_path / "mtp.safetensors") if n.startswith("model.mtp.layers.1."))
    edit(tmp_path / "mtp.safetensors", lambda t: [t.pop(n) for n in depth1])
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(tmp_path)
    said = ("mtp_config.num_nextn_predict_layers; transformers: num_mtp_layers) = 2, but its files hold 1 MTP "
            "depth(s) (model.mtp.layers.0 .. 0): config.json does not describe these weights")
    assert said in message(e)
    with pytest.raises(CheckpointError) as e:     # the config is wrong whatever is asked of it
        load_checkpoint(tmp_path, num_mtp_depths=1)
    assert said in message(e)
    # a depth the files hold only in part: its missing tensors are listed
    edit(tmp_path / "mtp.safetensors", lambda t: t.update({n: torch.zeros(1) for n in depth1[:1]}))
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(tmp_path)
    assert f"missing tensors ({len(depth1) - 1}):\n" + "".join(f"    {n}\n" for n in depth1[1:]) in message(e) + "\n"
    assert "the first 1 MTP depth(s) are complete: num_mtp_depths=1 loads only those" in message(e)
    assert load_checkpoint(tmp_path, num_mtp_depths=1).num_mtp_depths == 1
    with pytest.raises(CheckpointError, match=r"has 1 complete MTP depth\(s\) \(its config.json declares 2\); "
                                              r"depth 1 lacks: " + re.escape(", ".join(depth1[1:]))):
        load_checkpoint(tmp_path, num_mtp_depths=2)


def test_saving_a_model_built_with_fewer_depths(tmp_path):
    m = model(num_mtp_depths=1)
    save_checkpoint(m, tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["mtp_config"]["num_nextn_predict_layers"] == 1
    assert_same_params(m, load_checkpoint(tmp_path))


def test_mtp_tensors_with_a_config_without_mtp(tmp_path):
    save_checkpoint(model(), tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    del cfg["mtp_config"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"unexpected tensors \(\d+\):\n    model.mtp.layers.0.(.|\n)*"
                                              r"config.json declares no MTP depths"):
        load_checkpoint(tmp_path)


def test_vision_and_audio_tensors_are_ignored(tmp_path):
    m = model()
    save_checkpoint(m, tmp_path)
    edit(tmp_path / "model.safetensors", lambda t: t.update({"model.visual.layers.linear_0.weight": torch.ones(3, 2),
                                                             "model.audio.encoder.weight": torch.ones(4)}))
    assert_same_params(m, load_checkpoint(tmp_path))


# ---------------------------------------------------------------------- tensor errors
@pytest.fixture
def saved(tmp_path):
    save_checkpoint(model(), tmp_path)
    return tmp_path


def test_missing_tensors_are_all_listed(saved):
    gone = ["model.llm.layers.3.attn.wr_du.weight", "model.llm.embed_norm.weight",
            "model.mtp.layers.1.transformer_block.mlp.w13_dn.weight"]
    edit(saved / "model.safetensors", lambda t: [t.pop(n) for n in gone[:2]])
    edit(saved / "mtp.safetensors", lambda t: t.pop(gone[2]))
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(saved)
    print(message(e))
    assert "missing tensors (3):\n" + "".join(f"    {n}\n" for n in sorted(gone)) in message(e) + "\n"
    assert str(saved) in message(e)


def test_misshapen_tensors_are_all_listed_with_both_shapes(saved):
    def shrink(t):
        t["model.llm.layers.1.attn.wk_dv.weight"] = torch.zeros(23, 48)
        t["model.llm.layers.0.mlp.w13_dn.weight"] = torch.zeros(48, 48)
    edit(saved / "model.safetensors", shrink)
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(saved)
    print(message(e))
    assert ("misshapen tensors (2):\n"
            "    model.llm.layers.0.mlp.w13_dn.weight expected [80, 48] got [48, 48]\n"
            "    model.llm.layers.1.attn.wk_dv.weight expected [24, 48] got [23, 48]\n") in message(e)
    assert "MLP widths: released reading: intermediate_size = MoE expert width" in message(e)


def test_unexpected_tensors_are_all_listed(saved):
    extra = ["model.llm.layers.0.attn.wq_du.bias", "model.llm.layers.7.attn_norm.weight",
             "model.mtp.layers.2.hidden_norm.weight"]
    edit(saved / "model.safetensors", lambda t: t.update({n: torch.zeros(2) for n in extra[:2]}))
    edit(saved / "mtp.safetensors", lambda t: t.update({extra[2]: torch.zeros(2)}))
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(saved)
    print(message(e))
    assert "unexpected tensors (3):\n" + "".join(f"    {n}\n" for n in sorted(extra)) in message(e) + "\n"


def test_all_kinds_of_tensor_error_in_one_message(saved):
    def break_all(t):
        t.pop("model.llm.norm.weight")
        t["model.llm.unembed.weight"] = torch.zeros(91, 48)
        t["model.llm.head.weight"] = torch.zeros(1)
    edit(saved / "model.safetensors", break_all)
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(saved)
    assert re.search(r"missing tensors \(1\):\n    model.llm.norm.weight\n"
                     r"  misshapen tensors \(1\):\n    model.llm.unembed.weight expected \[97, 48\] got \[91, 48\]\n"
                     r"  unexpected tensors \(1\):\n    model.llm.head.weight$", message(e))


def test_quantized_tensors_are_refused_and_listed(saved):
    def quantize(t):
        for layer in (0, 3):  # NVFP4: two 4-bit values per uint8, an fp8 scale per 16 values, two fp32 scales
            name = f"model.llm.layers.{layer}.attn.wq_du.weight"
            rows, cols = t[name].shape
            t[name] = torch.zeros(rows, cols // 2, dtype=torch.uint8)
            t[name + "_scale"] = torch.zeros(rows, cols // 16).to(torch.float8_e4m3fn)
            t[name + "_scale_2"] = torch.ones(())
            t[name.replace(".weight", ".input_scale")] = torch.ones(())
    edit(saved / "model.safetensors", quantize)
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(saved)
    print(message(e))
    assert "needs bf16, fp16, fp32 or fp64 weights" in message(e)
    listed = re.findall(r"^    (\S+) \[", message(e), flags=re.M)
    leaves = ("wq_du.weight", "wq_du.weight_scale", "wq_du.weight_scale_2", "wq_du.input_scale")
    assert listed == sorted(f"model.llm.layers.{i}.attn.{n}" for i in (0, 3) for n in leaves)
    assert "model.llm.layers.0.attn.wq_du.weight [U8 [32, 24]]" in message(e)


def test_tensor_in_two_files(saved):
    edit(saved / "mtp.safetensors", lambda t: t.update({"model.llm.norm.weight": torch.ones(48)}))
    with pytest.raises(CheckpointError, match=r"tensors stored twice \(1\): model.llm.norm.weight "
                                              r"\(in model.safetensors and mtp.safetensors\)"):
        load_checkpoint(saved)


# ---------------------------------------------------------------------- file errors
def test_missing_config(saved):
    (saved / "config.json").unlink()
    with pytest.raises(CheckpointError, match=re.escape(f"{saved}: missing config.json")):
        load_checkpoint(saved)


def test_malformed_config(saved):
    (saved / "config.json").write_text('{"text_config": {"hidden_size": 48,')
    with pytest.raises(CheckpointError, match=re.escape(str(saved / "config.json")) + ": malformed JSON"):
        load_checkpoint(saved)


def test_inconsistent_config(saved):
    cfg = json.loads((saved / "config.json").read_text())
    cfg["text_config"]["num_key_value_heads"] = 3
    (saved / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match=re.escape(str(saved / "config.json")) +
                       r": config field 'num_heads' \(num_attention_heads in config.json\): 4 query heads is not "
                       r"a multiple of num_key_value_heads=3"):
        load_checkpoint(saved)


def test_index_pointing_to_missing_shards(tmp_path):
    save_checkpoint(model(), tmp_path, max_shard_bytes=60_000)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    for s in (shards[1], shards[3]):
        (tmp_path / s).unlink()
    counts = [sum(v == s for v in index["weight_map"].values()) for s in (shards[1], shards[3])]
    with pytest.raises(CheckpointError, match=r"model.safetensors.index.json points to 2 missing shard file\(s\): "
                       + re.escape(f"{shards[1]} ({counts[0]} tensors), {shards[3]} ({counts[1]} tensors)")):
        load_checkpoint(tmp_path)


def test_index_placing_tensors_in_the_wrong_shard(tmp_path):
    save_checkpoint(model(), tmp_path, max_shard_bytes=60_000)
    path = tmp_path / "model.safetensors.index.json"
    index = json.loads(path.read_text())
    first = index["weight_map"]["model.llm.embed.weight"]
    index["weight_map"]["model.llm.embed.weight"] = "model-00002-of-" + first[-17:]
    index["weight_map"]["model.llm.ghost.weight"] = first
    path.write_text(json.dumps(index))
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(tmp_path)
    assert "lists tensors that are not where it says (2): model.llm.embed.weight (index: model-00002-of-" in message(e)
    assert f"model.llm.ghost.weight (index: {first}, actually: in no file)" in message(e)


def test_malformed_index(tmp_path):
    save_checkpoint(model(), tmp_path, max_shard_bytes=60_000)
    path = tmp_path / "model.safetensors.index.json"
    path.write_text("{")
    with pytest.raises(CheckpointError, match=re.escape(str(path)) + ": malformed JSON"):
        load_checkpoint(tmp_path)
    path.write_text('{"weight_map": {"model.llm.norm.weight": "../elsewhere.safetensors"}}')
    with pytest.raises(CheckpointError, match=r"shard names must be plain file names .*\.\./elsewhere"):
        load_checkpoint(tmp_path)
    path.write_text('{"metadata": {}}')
    with pytest.raises(CheckpointError, match=r"needs a 'weight_map' object"):
        load_checkpoint(tmp_path)


def test_unreadable_safetensors_file(saved):
    (saved / "mtp.safetensors").write_bytes(b"\x00\x01 not safetensors")
    with pytest.raises(CheckpointError, match=re.escape(str(saved / "mtp.safetensors")) +
                       r": not a readable safetensors file"):
        load_checkpoint(saved)


def test_pickled_checkpoints_are_never_read(saved):
    (saved / "model.safetensors").rename(saved / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match=r"no model.safetensors and no model.safetensors.index.json; found "
                                              r"\['pytorch_model.bin'\], which would need unpickling"):
        load_checkpoint(saved)


def test_bad_paths(tmp_path):
    with pytest.raises(CheckpointError, match=r"checkpoint directory .*nowhere does not exist"):
        load_checkpoint(tmp_path / "nowhere")
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(CheckpointError, match=r"config.json is a file; pass the checkpoint directory"):
        load_checkpoint(tmp_path / "config.json")


@pytest.mark.parametrize("dtype", [torch.int8, torch.float8_e4m3fn, torch.complex64, "float8", "fp32", None])
def test_wrong_dtype_request(saved, dtype):
    with pytest.raises(CheckpointError, match=re.escape(f"dtype={dtype!r} cannot be loaded: the reference runs in "
                                                        "torch.float32, torch.float64, torch.bfloat16, torch.float16")):
        load_checkpoint(saved, dtype=dtype)


def test_wrong_device(saved):
    with pytest.raises(CheckpointError, match=r"device='gpu0' is not a torch device"):
        load_checkpoint(saved, device="gpu0")


@pytest.mark.gpu
def test_load_onto_the_gpu(saved):
    """device="cuda": every parameter lands on the GPU, with the CPU load's values; logits agree with the
    CPU model's (float32, different kernels: relative L2 below 1e-5)."""
    cpu = load_checkpoint(saved)
    gpu = load_checkpoint(saved, device="cuda")
    for n, p in gpu.named_parameters():
        assert p.device.type == "cuda" and torch.equal(p.cpu(), cpu.get_parameter(n)), n
    ids = torch.randint(0, CFG.vocab_out, (2, 33), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        a, b = cpu.logits(ids), gpu.logits(ids.cuda()).cpu()
    err = rel_l2(b, a)
    print(f"GPU vs CPU logits: relative L2 {err:.1e}")
    assert err < 1e-5


def test_loading_builds_no_initializers():
    """Loading (and checking the headers of) a checkpoint builds the model's modules on the meta device
    without running their random initializers: `nn.init.normal_` on a meta tensor imports torch._dynamo,
    seconds of every command's start-up. Checked in a fresh interpreter, where nothing imported it yet."""
    import subprocess
    import sys
    from pathlib import Path
    code = ("import sys; from inkling_ref.io.checkpoint import inspect_checkpoint, load_checkpoint; "
            "p = sys.argv[1]; inspect_checkpoint(p); m = load_checkpoint(p); "
            "assert m.trunk.embed.weight.device.type == 'cpu' and m.trunk.embed.weight.abs().sum() > 0; "
            "print('torch._dynamo' in sys.modules)")
    root = Path(inkling_ref.__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "-c", code, str(root / "inkling_ref" / "default_checkpoint")],
                         capture_output=True, text=True, cwd=root, check=True).stdout.strip()
    assert out == "False", "loading a checkpoint imported torch._dynamo (a random init ran on the meta device)"


# ---------------------------------------------------------------------- the config against the weights
@pytest.mark.parametrize("where,key,value,says", [
    ("text_config", "num_hidden_layers", 5000, "= 5000, but its files hold 4 trunk layers (model.llm.layers.0 .. 3)"),
    ("mtp_config", "num_nextn_predict_layers", 5000, "= 5000, but its files hold 2 MTP depth(s)"),
    ("text_config", "n_routed_experts", 2**31 - 1, "config field 'n_routed_experts' = 2147483647 is larger than "
                                                   "any dimension of any tensor in its files"),
    ("text_config", "hidden_size", 10**7, "config field 'hidden_size' = 10000000 is larger than any dimension"),
])
def test_sizes_are_checked_against_the_weights_first(saved, where, key, value, says):
    """A config that declares more than its weights hold fails at once (nothing proportional to the
    declared size is built), in one line naming the key."""
    import time
    from inkling_ref.io.checkpoint import inspect_checkpoint
    cfg = json.loads((saved / "config.json").read_text())
    cfg[where][key] = value
    (saved / "config.json").write_text(json.dumps(cfg))
    for load in (load_checkpoint, inspect_checkpoint):
        t0 = time.perf_counter()
        with pytest.raises(CheckpointError) as e:
            load(saved)
        assert time.perf_counter() - t0 < 1
        assert says in message(e) and "\n" not in message(e), message(e)


@pytest.mark.parametrize("key", ["route_scale", "num_experts_per_tok", "logits_mup_width_multiplier",
                                 "log_scaling_n_floor"])
def test_a_missing_key_names_the_key_and_the_file(saved, key):
    cfg = json.loads((saved / "config.json").read_text())
    del cfg["text_config"][key]
    (saved / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError) as e:
        load_checkpoint(saved)
    assert message(e).startswith(f"{saved / 'config.json'}: config field ") and key in message(e)
    assert "is missing" in message(e) and "\n" not in message(e)
