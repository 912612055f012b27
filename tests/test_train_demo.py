"""scripts/train_demo.py at toy size on CPU: the chained loss is the inference semantics, a resumed run
repeats an uninterrupted one exactly, and the export loads back by name with identical logits."""

import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open

REPO = Path(__file__).resolve().parents[1]


def _load_script():
    spec = importlib.util.spec_from_file_location("train_demo", REPO / "scripts" / "train_demo.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["train_demo"] = mod
    spec.loader.exec_module(mod)
    return mod


td = _load_script()


@pytest.fixture
def one_thread():
    """Two shared CPU cores: one thread is faster and keeps the runs reproducible."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def tiny_model(seed=0):
    model = td.InklingModel(td.tiny_config())
    td.init_for_training(model, seed)
    with torch.no_grad():  # trained-looking weights: convs, relative profiles and biases away from their init
        g = torch.Generator().manual_seed(seed + 1)
        for name, p in model.named_parameters():
            if name.endswith(("conv.weight", "rel_proj", "router_bias")):
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return model


def test_chained_forward_is_the_inference_semantics(one_thread):
    """forward_all == model.logits + model.mtp_logits (depth m: rows 0..T-2-m), and each depth's loss is
    the CE of row p against x_{p+m+2}, recomputed here row by row."""
    model = tiny_model().eval()
    T, D = 21, 8
    ids = torch.randint(3, 4000, (2, T), generator=torch.Generator().manual_seed(5))
    trunk_logits, depth_logits = td.forward_all(model, ids)
    assert torch.equal(trunk_logits, model.logits(ids))
    reference = model.mtp_logits(ids)
    assert len(depth_logits) == D
    for m in range(D):
        assert depth_logits[m].shape == (2, T - 1 - m, 4000)
        assert torch.equal(depth_logits[m], reference[m])

    losses = td.chained_losses(ids, trunk_logits, depth_logits)
    assert losses.shape == (1 + D,)
    logp = F.log_softmax(trunk_logits, -1)
    expected = -torch.stack([logp[b, p, ids[b, p + 1]] for b in range(2) for p in range(T - 1)]).mean()
    torch.testing.assert_close(losses[0], expected)
    for m in range(D):
        logp = F.log_softmax(reference[m], -1)
        expected = -torch.stack([logp[b, p, ids[b, p + m + 2]] for b in range(2) for p in range(T - 2 - m)]).mean()
        torch.testing.assert_close(losses[1 + m], expected)


def test_training_init():
    model = td.InklingModel(td.tiny_config())
    td.init_for_training(model, 0)
    cfg = model.config
    params = dict(model.named_parameters())
    assert torch.all(params["trunk.layers.0.attn.q_norm.weight"] == cfg.swa_head_dim ** 0.25)
    assert torch.all(params["mtp.depths.3.block.attn.k_norm.weight"] == cfg.head_dim ** 0.25)
    assert torch.all(params["trunk.norm.weight"] == 1) and torch.all(params["mtp.depths.0.hidden_norm.weight"] == 1)
    assert all(torch.all(p == 0) for n, p in params.items() if n.endswith(("conv.weight", "rel_proj", "router_bias")))
    assert torch.all(params["trunk.unembed.weight"][cfg.vocab_out:] == 0)
    assert params["trunk.unembed.weight"][: cfg.vocab_out].std() > 0
    assert params["mtp.depths.7.input_proj.weight"].std().item() == pytest.approx((2 * cfg.hidden_size) ** -0.5, rel=0.1)


def test_load_balancer_moves_bias_towards_balance(one_thread):
    model = tiny_model()
    bal = td.LoadBalancer(model, rate=0.01)
    moe = bal.layers[0]
    before = moe.router_bias.detach().clone()
    bal.active = True
    model.hidden(torch.randint(3, 4000, (2, 16), generator=torch.Generator().manual_seed(1)))
    load = bal.counts[0].float()
    assert load.sum() == 2 * 16 * moe.top_k
    bal.update()
    step = moe.router_bias.detach() - before
    torch.testing.assert_close(step, 0.01 * torch.sign(load.mean() - load))
    assert not moe.router_bias.requires_grad


def test_batches_are_deterministic_and_resumable():
    stream = torch.arange(1000, dtype=torch.int32)
    a = td.Batches(stream, seq_len=10, batch_size=7, seed=3)
    first = [a.next() for _ in range(20)]  # 140 windows: crosses into the second epoch (< 100 per epoch)
    assert a.epoch == 1
    windows = torch.cat(first[:15])[:99]  # the first epoch (offset 8: 99 windows): distinct, aligned
    assert len({int(w[0]) for w in windows}) == 99
    assert len({int(w[0]) % 10 for w in windows}) == 1
    assert all(torch.equal(w, torch.arange(int(w[0]), int(w[0]) + 10)) for w in windows)
    b = td.Batches(stream, seq_len=10, batch_size=7, seed=3)
    for _ in range(9):
        b.next()
    c = td.Batches(stream, seq_len=10, batch_size=7, seed=3)
    c.epoch, c.cursor = b.epoch, b.cursor
    assert all(torch.equal(c.next(), x) for x in first[9:])


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A small token stream with structure (repeated phrases), so a few steps move the losses."""
    d = tmp_path_factory.mktemp("corpus")
    rng = np.random.default_rng(0)
    phrases = [rng.integers(3, 4000, size=rng.integers(3, 9)) for _ in range(40)]
    tokens = np.concatenate([phrases[i] for i in rng.integers(0, 40, size=1500)]).astype(np.uint16)
    np.save(d / "train.npy", tokens[:-600])
    np.save(d / "heldout.npy", tokens[-600:])
    return d


def run(corpus, out, *extra):
    args = ["--corpus", str(corpus), "--out", str(out), "--size", "tiny", "--device", "cpu", "--seq-len", "24",
            "--batch-size", "3", "--warmup", "2", "--steps", "4", "--eval-every", "0", "--eval-windows", "4",
            "--lr", "1e-2", *extra]
    return td.main(args)


def test_resume_repeats_the_uninterrupted_run(corpus, tmp_path, one_thread):
    full = run(corpus, tmp_path / "full")
    run(corpus, tmp_path / "split", "--stop-at-step", "2")
    part = json.loads((tmp_path / "split" / "state.json").read_text())
    assert part["step"] == 2
    resumed = run(corpus, tmp_path / "split", "--resume")

    losses = [s["loss"] for s in full["log"]["steps"]]
    assert [s["step"] for s in resumed["log"]["steps"]] == [0, 1, 2, 3]
    assert [s["loss"] for s in resumed["log"]["steps"]] == losses
    assert [s["lr"] for s in resumed["log"]["steps"]] == [s["lr"] for s in full["log"]["steps"]]
    assert losses[3][0] < losses[0][0] and losses[3][1] < losses[0][1], "training moved the losses"
    with safe_open(tmp_path / "full" / "state.safetensors", "pt") as a, \
            safe_open(tmp_path / "split" / "state.safetensors", "pt") as b:
        assert set(a.keys()) == set(b.keys())
        for k in a.keys():
            if k.startswith(("model.", "adam.")):
                assert torch.equal(a.get_tensor(k), b.get_tensor(k)), k
    assert resumed["info"]["data_epoch"] == full["info"]["data_epoch"]
    assert resumed["info"]["data_cursor"] == full["info"]["data_cursor"]
    assert resumed["final"] == full["final"]

    with pytest.raises(SystemExit, match="batch-size"):
        run(corpus, tmp_path / "split", "--resume", "--batch-size", "5")
    with pytest.raises(SystemExit, match="already holds a training state"):
        run(corpus, tmp_path / "split")


def test_export_loads_back_by_name(corpus, tmp_path, one_thread):
    result = run(corpus, tmp_path / "run", "--export", str(tmp_path / "ckpt"), "--steps", "2")
    ckpt = tmp_path / "ckpt"
    assert sorted(p.name for p in ckpt.iterdir()) == ["README.md", "config.json", "model.safetensors",
                                                      "mtp.safetensors", "tokenizer.json", "train_log.json"]
    config = json.loads((ckpt / "config.json").read_text())
    assert config["mtp_config"] == {"num_nextn_predict_layers": 8, "local_layer_ids": [0, 2, 4, 5, 6, 7],
                                    "chain_hidden_post_norm": False, "apply_log_scaling": False}
    assert td.InklingConfig.from_dict(config) == td.tiny_config()
    with safe_open(ckpt / "model.safetensors", "pt") as f:
        trunk_names = set(f.keys())
        assert f.get_tensor("model.llm.layers.1.mlp.gate.bias").dtype == torch.float32
        assert f.get_tensor("model.llm.layers.1.mlp.experts.w13_weight").dtype == torch.bfloat16
    with safe_open(ckpt / "mtp.safetensors", "pt") as f:
        mtp_names = set(f.keys())
        assert f.get_tensor("model.mtp.layers.7.input_proj.weight").dtype == torch.bfloat16
    assert all(n.startswith("model.llm.") for n in trunk_names)
    assert all(n.startswith("model.mtp.") for n in mtp_names)
    assert "model.mtp.layers.0.transformer_block.attn.wq_du.weight" in mtp_names

    # the state holds the fp32 weights; the export must equal them rounded to bf16, and compute the same
    with safe_open(tmp_path / "run" / "state.safetensors", "pt") as f:
        trained = {k[len("model."):]: f.get_tensor(k) for k in f.keys() if k.startswith("model.")}
    loaded = td.load_released(ckpt)
    rounded = td.InklingModel(td.tiny_config()).eval()
    with torch.no_grad():
        for n, p in rounded.named_parameters():
            p.copy_(trained[n] if n.endswith("router_bias") else trained[n].to(torch.bfloat16).float())
    ids = torch.randint(3, 4000, (2, 30), generator=torch.Generator().manual_seed(2))
    a, b = td.forward_all(loaded, ids), td.forward_all(rounded, ids)
    assert torch.equal(a[0], b[0]) and all(torch.equal(x, y) for x, y in zip(a[1], b[1]))
    card = (ckpt / "README.md").read_text()
    assert f"{result['info']['step']} steps of 2" in card and "Python Software Foundation" in card


def test_lr_schedule_is_warmup_stable_decay():
    """Before the cooldown the rate does not depend on the step count (so re-estimating it changes nothing
    already done); the cooldown falls linearly to min_lr_ratio * lr."""
    hp = td.Hyper(lr=1.0, warmup=10, cooldown=0.2, min_lr_ratio=0.0)
    assert [td.lr_at(s, None, hp) for s in (0, 4, 9, 10, 500)] == [0.1, 0.5, 1.0, 1.0, 1.0]
    assert td.cooldown_start(100, hp) == 80 and td.cooldown_start(130, hp) == 104
    assert all(td.lr_at(s, 100, hp) == td.lr_at(s, 130, hp) == td.lr_at(s, None, hp) for s in range(80))
    cool = [td.lr_at(s, 100, hp) for s in range(80, 100)]
    assert cool[0] == 1.0 and cool[-1] == pytest.approx(1 / 20)
    assert all(a - b == pytest.approx(1 / 20) for a, b in zip(cool, cool[1:]))
