"""Train the tiny demo Inkling: trunk and 8 MTP depths together, on Python standard-library source.

    python scripts/build_corpus.py tokens                       # once: runs/corpus/{train,heldout}.npy
    python scripts/train_demo.py --out runs/demo --time-limit-min 8 --export runs/demo/checkpoint

One forward per batch, with the chained teacher-forced semantics of inference
(`InklingModel.mtp_logits`, docs/spec/mtp-cycle.md §1): the trunk's post-final-norm hidden H
once, then depth m over rows p = 0..T-2-m with the token x_{p+m+1}, its output feeding depth m+1.

    loss = CE(trunk: x_{p+1} | x_{<=p})  +  sum_m w_m * CE(depth m, row p: x_{p+m+2})
    w_m  = mtp_weight * mtp_decay^m           (0.3 * 0.8^m: sum 1.25; early depths weigh most,
                                               since draft j is only accepted after drafts < j)

Every depth's loss reaches the trunk, the shared embedding and the LM head (joint training). The
last row of each depth (p = T-2-m) has no target inside the window and is left out of its loss.

Training init (not `random_model`, whose weights are for tests): norms 1 except q_norm/k_norm at
hd^(1/4) (so the 1/hd-scaled logit starts like 1/sqrt(hd) attention), global scales 1, short convs 0
(identity: they have an internal residual), relative-logit profiles 0, router bias 0, embedding
N(0, 1) (normed), other matrices N(0, 1/fan_in), residual-output projections further / sqrt(2 L),
padded vocabulary rows 0. The MoE router bias is selection-only and gets no gradient: after every
step it moves by +-bias_rate towards balance (DeepSeek-V3's auxiliary-loss-free rule:
b_e += rate * sign(mean load - load_e), load counted over the step's tokens).

AdamW (betas 0.9/0.95, no decay on norms, scales, convs, relative profiles and the embedding),
grad-norm clip, bf16 autocast on CUDA (fp32 on CPU). Learning rate: warmup-stable-decay (linear
warmup, constant, then a linear cooldown to min_lr_ratio over the last `cooldown` fraction of the
steps) rather than cosine, because with `--time-limit-min` and no `--steps` the step count is only
estimated: from the measured time per step, re-estimated every 10 steps while the rate is still
constant (so the estimate changes nothing already done) and fixed when the cooldown begins. The
count and whether it is fixed are in the state; `--steps N` reproduces a run exactly.

State (`--out DIR`): state.safetensors (fp32 weights + AdamW moments) + state.json (step, data
position, RNG, hyperparameters), written atomically every `--save-every-min` and at the end;
`--resume` continues bit for bit (on CPU in fp32). train_log.json: losses per step, held-out
evaluations, wall time, tokens seen. `--export DIR`: the released layout in bf16 (config.json,
model.safetensors = trunk, mtp.safetensors = MTP head, tokenizer.json, README.md model card).
"""

from __future__ import annotations

import time

_T0 = time.time()  # the time limit counts from here (before torch is imported)

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import shutil  # noqa: E402
import sys  # noqa: E402
from contextlib import nullcontext  # noqa: E402
from dataclasses import asdict, dataclass, fields  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402
from tqdm import tqdm  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from inkling_ref import InklingConfig, InklingModel  # noqa: E402
from inkling_ref.io.config import DENSE, GLOBAL, MOE, SLIDING  # noqa: E402
from inkling_ref.model.moe import MoE  # noqa: E402
from inkling_ref.io.names import from_released, is_mtp, to_released  # noqa: E402

TOKENIZER = REPO / "inkling_ref" / "default_checkpoint" / "tokenizer.json"
MTP_LOCAL_IDS = [0, 2, 4, 5, 6, 7]  # released-style: depths 1 and 3 are global


# ---------------------------------------------------------------------- model sizes
def demo_config() -> InklingConfig:
    """~12.7 M parameters, 25 MB in bf16: trunk 6 layers (sliding window 64, two global layers with
    relative extent 128, log-tau from position 128), 2 dense then 4 MoE layers; 8 MTP depths."""
    S, G = SLIDING, GLOBAL
    return InklingConfig(
        vocab_size=4032, unpadded_vocab_size=4000,  # the tokenizer's 4000 tokens, padded to 63 * 64
        hidden_size=256, num_layers=6,
        num_heads=4, num_kv_heads=2, head_dim=64, rel_extent=128,
        swa_num_heads=4, swa_num_kv_heads=2, swa_head_dim=64, sliding_window=64,
        d_rel=16, log_scaling_n_floor=128, log_scaling_alpha=0.1,
        layer_types=[S, S, G, S, S, G],
        mlp_types=[DENSE, DENSE, MOE, MOE, MOE, MOE],
        dense_intermediate_size=384,  # trunk dense layers and every MTP depth
        moe_intermediate_size=96, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
        route_scale=2.0,
        # mup 2, not 4: the trunk's logits are W_u H / mup with |H| = sqrt(hidden), so a large divisor
        # shrinks the logits and slows the trunk's early learning; 2 keeps the division exercised (a
        # forgotten / mup changes every logit)
        mup=2.0, rms_norm_eps=1e-6, conv_kernel_size=4,
        max_position_embeddings=512, bos_token_id=0, eos_token_id=1,
        num_mtp_depths=8, mtp_layer_types=[S if m in MTP_LOCAL_IDS else G for m in range(8)],
        chain_hidden_post_norm=False,
    )


def tiny_config() -> InklingConfig:
    """The same structure at toy widths (CPU smoke runs and tests); same vocabulary."""
    return demo_config().replace(
        hidden_size=32, num_layers=2, layer_types=[SLIDING, GLOBAL], mlp_types=[DENSE, MOE],
        num_heads=2, num_kv_heads=1, head_dim=16, swa_num_heads=2, swa_num_kv_heads=1, swa_head_dim=16,
        sliding_window=8, rel_extent=16, log_scaling_n_floor=16, dense_intermediate_size=48,
        moe_intermediate_size=16, n_routed_experts=4, max_position_embeddings=64)


CONFIGS = {"demo": demo_config, "tiny": tiny_config}


# ---------------------------------------------------------------------- hyperparameters
@dataclass
class Hyper:
    size: str = "demo"
    seq_len: int = 512
    batch_size: int = 64
    lr: float = 2e-3
    min_lr_ratio: float = 0.0
    warmup: int = 100
    cooldown: float = 0.2
    weight_decay: float = 0.1
    clip: float = 1.0
    mtp_weight: float = 0.3
    mtp_decay: float = 0.8
    bias_rate: float = 1e-3
    seed: int = 0


def depth_weights(hp: Hyper, n: int) -> list[float]:
    return [hp.mtp_weight * hp.mtp_decay ** m for m in range(n)]


def cooldown_start(total: int, hp: Hyper) -> int:
    return total - int(round(hp.cooldown * total))


def lr_at(step: int, total: int | None, hp: Hyper) -> float:
    """Warmup-stable-decay: linear warmup over `warmup` steps, constant lr, then linear from lr (at
    cooldown_start) towards min_lr_ratio * lr (reached at `total`). total None: not known yet (constant)."""
    if step < hp.warmup:
        return hp.lr * (step + 1) / hp.warmup
    if total is None or step < cooldown_start(total, hp):
        return hp.lr
    start = cooldown_start(total, hp)
    left = max(0.0, (total - step) / max(1, total - start))  # 1 at the start of the cooldown -> 0 at total
    return hp.lr * (hp.min_lr_ratio + (1 - hp.min_lr_ratio) * left)


# ---------------------------------------------------------------------- init
@torch.no_grad()
def init_for_training(model: InklingModel, seed: int) -> None:
    """The training init described in the module docstring, seeded, in place."""
    cfg = model.config
    g = torch.Generator().manual_seed(seed)

    def normal(p, std):
        p.copy_(torch.randn(p.shape, generator=g) * std)

    out_proj = ("attn.o_proj.weight", "mlp.down.weight", "mlp.experts_down", "mlp.shared_down")
    for name, p in model.named_parameters():
        leaf = name.rsplit(".", 1)[-1]
        blocks = cfg.num_layers if name.startswith("trunk.") else 1  # blocks on that residual stream
        if name.endswith(("q_norm.weight", "k_norm.weight")):
            p.fill_(p.shape[0] ** 0.25)
        elif name.endswith("norm.weight") or leaf in ("global_scale", "gate_global_scale"):
            p.fill_(1.0)
        elif name.endswith("conv.weight") or leaf in ("rel_proj", "router_bias"):
            p.zero_()
        elif name == "trunk.embed.weight":
            normal(p, 1.0)
        elif name.endswith(out_proj):
            normal(p, 1.0 / math.sqrt(p.shape[-1] * 2 * blocks))
        elif p.dim() >= 2:
            normal(p, 1.0 / math.sqrt(p.shape[-1]))
        else:
            raise AssertionError(f"init_for_training has no rule for {name} {tuple(p.shape)}")
    model.trunk.embed.weight[cfg.vocab_out:] = 0  # padded rows: never read, never trained
    model.trunk.unembed.weight[cfg.vocab_out:] = 0


# ---------------------------------------------------------------------- the chained forward and loss
def forward_all(model: InklingModel, ids: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """ids: [B, T] -> (trunk logits [B, T, V], per depth m logits [B, T-1-m, V]).

    One trunk pass; depth m reads rows p = 0..T-2-m: h_prev (H_p for m = 0, depth m-1's output at p
    after) and the token x_{p+m+1}; row p predicts x_{p+m+2}. Same as `model.logits` + `model.mtp_logits`."""
    T = ids.shape[1]
    hidden = model.hidden(ids)  # H: [B, T, H], post-final-norm, before / mup
    trunk_logits = model.trunk.readout(hidden)
    h_prev, depth_logits = hidden[:, : T - 1], []
    for m in range(model.num_mtp_depths):
        rows = T - 1 - m
        h_prev, logits = model.mtp_depth(m, h_prev[:, :rows], ids[:, m + 1: m + 1 + rows])
        depth_logits.append(logits)
    return trunk_logits, depth_logits


def chained_losses(ids: torch.Tensor, trunk_logits: torch.Tensor, depth_logits: list[torch.Tensor]) -> torch.Tensor:
    """Mean cross-entropies [1 + D]: the trunk's (position p -> x_{p+1}), then depth m's on its rows
    p = 0..T-3-m (-> x_{p+m+2}; the last row's target lies outside the window)."""
    T = ids.shape[1]

    def ce(logits, targets):
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())

    losses = [ce(trunk_logits[:, : T - 1], ids[:, 1:])]
    for m, logits in enumerate(depth_logits):
        losses.append(ce(logits[:, : T - 2 - m], ids[:, m + 2:]))
    return torch.stack(losses)


# ---------------------------------------------------------------------- data
class Batches:
    """Deterministic windows of `seq_len` tokens from one token stream.

    Epoch e: a random offset in [0, seq_len) and a random order of the windows starting at
    offset + i * seq_len, both drawn from numpy's generator seeded with (seed, e). The position in the
    data is (epoch, cursor): that is all a resumed run needs."""

    def __init__(self, stream: torch.Tensor, seq_len: int, batch_size: int, seed: int):
        if stream.numel() < seq_len + 1:
            raise ValueError(f"token stream of {stream.numel()} tokens is shorter than seq_len={seq_len} + 1")
        self.stream, self.seq_len, self.batch_size, self.seed = stream, seq_len, batch_size, seed
        self.epoch, self.cursor, self._starts = 0, 0, None

    def _epoch_starts(self) -> np.ndarray:
        if self._starts is None or self._starts[0] != self.epoch:
            rng = np.random.default_rng([self.seed, self.epoch])
            offset = int(rng.integers(self.seq_len))
            n = (self.stream.numel() - offset) // self.seq_len
            self._starts = (self.epoch, offset + rng.permutation(n) * self.seq_len)
        return self._starts[1]

    def next(self) -> torch.Tensor:
        starts = []
        while len(starts) < self.batch_size:
            epoch_starts = self._epoch_starts()
            take = epoch_starts[self.cursor: self.cursor + self.batch_size - len(starts)]
            starts.extend(take.tolist())
            self.cursor += len(take)
            if self.cursor >= len(epoch_starts):
                self.epoch, self.cursor = self.epoch + 1, 0
        s = torch.tensor(starts, device=self.stream.device)
        return self.stream[s[:, None] + torch.arange(self.seq_len, device=s.device)].long()


def load_stream(path: Path, vocab_out: int, device: str) -> torch.Tensor:
    if not path.exists():
        raise SystemExit(f"no token stream at {path}: run `python scripts/build_corpus.py tokens` first")
    a = np.load(path, allow_pickle=False)
    if a.dtype != np.uint16 or a.ndim != 1:
        raise SystemExit(f"{path}: expected a 1-D uint16 array, got {a.dtype} {a.shape}")
    if a.size and int(a.max()) >= vocab_out:
        raise SystemExit(f"{path}: token id {int(a.max())} >= the model's vocabulary ({vocab_out})")
    return torch.from_numpy(a.astype(np.int32)).to(device)


# ---------------------------------------------------------------------- MoE load balancing
class LoadBalancer:
    """Counts, per trunk MoE layer, how many tokens chose each routed expert during training
    forwards (a forward hook re-runs the router's selection on the layer's input), and after each
    step moves the selection-only bias: b_e += rate * sign(mean load - load_e)."""

    def __init__(self, model: InklingModel, rate: float):
        self.rate, self.active = rate, False
        self.layers = [m for m in model.trunk.modules() if isinstance(m, MoE)]
        self.counts = [None] * len(self.layers)
        self.last_imbalance: list[float] = []
        for i, moe in enumerate(self.layers):
            moe.router_bias.requires_grad_(False)
            moe.register_forward_hook(self._hook(i))

    def _hook(self, i):
        def hook(moe, args, out):
            if not self.active:
                return
            with torch.no_grad():
                chosen = moe.route(args[0].reshape(-1, args[0].shape[-1]))[0]
                c = torch.bincount(chosen.flatten(), minlength=moe.num_routed)
            self.counts[i] = c if self.counts[i] is None else self.counts[i] + c
        return hook

    @torch.no_grad()
    def update(self) -> None:
        imbalance = []
        for i, moe in enumerate(self.layers):
            load = self.counts[i].float()
            moe.router_bias += self.rate * torch.sign(load.mean() - load)
            imbalance.append(load.max() / load.mean())
            self.counts[i] = None
        self.last_imbalance = torch.stack(imbalance).tolist() if imbalance else []


# ---------------------------------------------------------------------- evaluation
@torch.no_grad()
def evaluate(model: InklingModel, stream: torch.Tensor, seq_len: int, n_windows: int, batch_size: int,
             autocast) -> dict:
    """Held-out metrics on `n_windows` evenly spaced windows: loss and top-1 accuracy of the trunk and of
    each depth, and each depth's agreement with the trunk's argmax for the same token (depth m row p vs
    trunk position p+m+1). `tf_accept_len_k{4,8}`: 1 + the mean leading run of agreeing depths at one
    row: a teacher-forced proxy, not the acceptance length of real speculative decoding."""
    was_training = model.training
    model.eval()
    T, D = seq_len, model.num_mtp_depths
    n = min(n_windows, stream.numel() // T)
    starts = torch.linspace(0, stream.numel() - T - 1, n, device=stream.device).long()
    loss_sum, correct, agree, count = torch.zeros(1 + D), torch.zeros(1 + D), torch.zeros(D), torch.zeros(1 + D)
    runs = {k: [] for k in (4, 8) if k <= D}
    for b in range(0, n, batch_size):
        s = starts[b: b + batch_size]
        ids = stream[s[:, None] + torch.arange(T, device=s.device)].long()
        with autocast():
            trunk_logits, depth_logits = forward_all(model, ids)
        loss_sum += chained_losses(ids, trunk_logits, depth_logits).cpu() * ids.shape[0]
        count += ids.shape[0]
        trunk_pred = trunk_logits.argmax(-1)  # [B, T]: prediction of x_{p+1}
        correct[0] += (trunk_pred[:, :-1] == ids[:, 1:]).float().mean().cpu() * ids.shape[0]
        rows = T - 1 - D  # rows where every depth has a target
        agree_rows = []
        for m, logits in enumerate(depth_logits):
            pred = logits[:, : T - 2 - m].argmax(-1)
            correct[1 + m] += (pred == ids[:, m + 2:]).float().mean().cpu() * ids.shape[0]
            same = pred == trunk_pred[:, m + 1: T - 1]
            agree[m] += same.float().mean().cpu() * ids.shape[0]
            agree_rows.append(same[:, :rows])
        lead = torch.cumprod(torch.stack(agree_rows, -1).long(), -1)  # [B, rows, D]
        for k in runs:
            runs[k].append(lead[..., :k].sum(-1).flatten().float().cpu())
    model.train(was_training)
    loss, acc = (loss_sum / count).tolist(), (correct / count).tolist()
    out = {"windows": n, "trunk": {"loss": loss[0], "acc": acc[0]},
           "depths": [{"loss": loss[1 + m], "acc": acc[1 + m], "agree": (agree[m] / count[0]).item()}
                      for m in range(D)]}
    for k, r in runs.items():
        out[f"tf_accept_len_k{k}"] = 1 + torch.cat(r).mean().item()
    return out


# ---------------------------------------------------------------------- optimizer
def make_optimizer(model: InklingModel, hp: Hyper, device: str) -> torch.optim.AdamW:
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        plain_matrix = p.dim() >= 2 and not name.endswith(("conv.weight", "rel_proj", "trunk.embed.weight"))
        (decay if plain_matrix else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": hp.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=hp.lr, betas=(0.9, 0.95), eps=1e-8, fused=device.startswith("cuda"))


# ---------------------------------------------------------------------- training state (safetensors + json)
def save_state(out: Path, model, opt, info: dict, log: dict) -> None:
    """Weights (fp32, our names), AdamW moments, and a JSON of everything else; atomic replace."""
    names = {p: n for n, p in model.named_parameters()}
    tensors = {f"model.{n}": p.detach().contiguous() for n, p in model.named_parameters()}
    steps = {}
    for p, st in opt.state.items():
        tensors[f"adam.exp_avg.{names[p]}"] = st["exp_avg"]
        tensors[f"adam.exp_avg_sq.{names[p]}"] = st["exp_avg_sq"]
        steps[names[p]] = float(st["step"])
    tensors["rng.torch"] = torch.get_rng_state()
    if torch.cuda.is_available():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"rng.cuda.{i}"] = s
    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().cpu().contiguous() for k, v in tensors.items()}
    save_file(tensors, out / "state.safetensors.tmp", metadata={"step": str(info["step"])})
    (out / "state.json.tmp").write_text(json.dumps({**info, "adam_steps": steps}, indent=1))
    (out / "train_log.json.tmp").write_text(json.dumps(log))
    for name in ("state.safetensors", "state.json", "train_log.json"):
        os.replace(out / f"{name}.tmp", out / name)


def load_state(out: Path, model, opt) -> tuple[dict, dict]:
    info = json.loads((out / "state.json").read_text())
    tensors = load_file(out / "state.safetensors")
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(tensors[f"model.{n}"])
    sd = opt.state_dict()
    index = {id(p): i for i, p in enumerate(q for g in opt.param_groups for q in g["params"])}
    sd["state"] = {}
    for n, p in model.named_parameters():
        if n in info["adam_steps"]:
            sd["state"][index[id(p)]] = {"step": torch.tensor(info["adam_steps"][n]),
                                         "exp_avg": tensors[f"adam.exp_avg.{n}"],
                                         "exp_avg_sq": tensors[f"adam.exp_avg_sq.{n}"]}
    opt.load_state_dict(sd)
    torch.set_rng_state(tensors["rng.torch"])
    cuda_states = [tensors[k] for k in sorted(k for k in tensors if k.startswith("rng.cuda."))]
    if cuda_states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(cuda_states[: torch.cuda.device_count()])
    log = json.loads((out / "train_log.json").read_text())
    log["steps"] = [s for s in log["steps"] if s["step"] < info["step"]]
    return info, log


# ---------------------------------------------------------------------- export (released layout, bf16)
def export_released(model: InklingModel, out: Path, tokenizer: Path, card: str) -> dict[str, int]:
    """config.json, model.safetensors (model.llm.*), mtp.safetensors (model.mtp.*), tokenizer.json,
    README.md. bf16, except the router's selection bias (fp32, as released). Returns file sizes."""
    out.mkdir(parents=True, exist_ok=True)
    trunk, mtp = {}, {}
    for name, p in model.named_parameters():
        released = to_released(name)
        t = p.detach().float() if name.endswith("router_bias") else p.detach().to(torch.bfloat16)
        (mtp if is_mtp(released) else trunk)[released] = t.cpu().contiguous()
    (out / "config.json").write_text(json.dumps(model.config.to_released_dict(), indent=2) + "\n")
    save_file(trunk, out / "model.safetensors", metadata={"format": "pt"})
    save_file(mtp, out / "mtp.safetensors", metadata={"format": "pt"})
    shutil.copyfile(tokenizer, out / "tokenizer.json")
    (out / "README.md").write_text(card)
    written = ("config.json", "model.safetensors", "mtp.safetensors", "tokenizer.json", "README.md")
    return {name: (out / name).stat().st_size for name in written}


def load_released(path: Path, dtype: torch.dtype = torch.float32) -> InklingModel:
    """A model from an exported folder (config.json + model.safetensors + mtp.safetensors), by name."""
    config = InklingConfig.from_file(path / "config.json")
    model = InklingModel(config)
    tensors = {}
    for shard in ("model.safetensors", "mtp.safetensors"):
        tensors.update(load_file(path / shard))
    ours = {}
    for name, t in tensors.items():
        own = from_released(name)
        if own is None:
            raise KeyError(f"{path}: tensor {name} is not part of the model")
        ours[own] = t
    params = dict(model.named_parameters())
    missing = sorted(set(params) - set(ours))
    if missing:
        raise KeyError(f"{path}: missing tensors for {[to_released(n) for n in missing][:8]}")
    with torch.no_grad():
        for n, p in params.items():
            if ours[n].shape != p.shape:
                raise ValueError(f"{path}: {to_released(n)} has shape {tuple(ours[n].shape)}, "
                                 f"the config needs {tuple(p.shape)}")
            p.copy_(ours[n])
    return model.to(dtype).eval()


def model_card(model: InklingModel, hp: Hyper, info: dict, final_eval: dict, device_name: str) -> str:
    """The README.md of an exported checkpoint: what it is, how it was made, its held-out numbers."""
    c, ev = model.config, final_eval
    n_trunk = sum(p.numel() for n, p in model.named_parameters() if n.startswith("trunk."))
    n_all = sum(p.numel() for p in model.parameters())
    n_dense = c.mlp_types.count(DENSE)
    depth_rows = "\n".join(
        f"| {m} | {'sliding' if t == SLIDING else 'global'} | {d['loss']:.3f} | {d['acc']:.3f} | {d['agree']:.3f} |"
        for m, (t, d) in enumerate(zip(c.mtp_layer_types, ev["depths"])))
    proxies = ", ".join(f"k = {k}: {ev[f'tf_accept_len_k{k}']:.2f}" for k in (4, 8) if f"tf_accept_len_k{k}" in ev)
    flags = " ".join(f"--{f.name.replace('_', '-')} {getattr(hp, f.name)}" for f in fields(Hyper)
                     if getattr(hp, f.name) != f.default)
    return f"""# inkling-mtp demo checkpoint: a tiny Inkling with an 8-depth MTP head

A small Inkling trained from scratch for this repository, so that acceptance lengths, speedups and
plots measure something real. It is not a useful code model: {n_all / 1e6:.1f} M parameters, of which
{n_trunk / 1e6:.1f} M in the trunk (incl. {2 * c.vocab_size * c.hidden_size / 1e6:.1f} M embedding and LM head) and
{(n_all - n_trunk) / 1e6:.1f} M in the MTP head; trained for {info['train_wall_s'] / 60:.1f} minutes.

## Architecture (`config.json`, released layout; `model.safetensors` trunk, `mtp.safetensors` MTP head, bf16)
- Trunk: hidden {c.hidden_size}, {c.num_layers} layers, `local_layer_ids` {c.local_layer_ids} (sliding window {c.sliding_window}); global layers with relative extent {c.rel_extent} and log-tau from position {c.log_scaling_n_floor} (alpha {c.log_scaling_alpha}).
- Layers 0..{n_dense - 1} dense (intermediate {c.dense_intermediate_size}), then MoE: {c.n_routed_experts} routed experts of width {c.moe_intermediate_size}, top-{c.num_experts_per_tok}, {c.n_shared_experts} shared, route_scale {c.route_scale}; router selection bias in fp32.
- Attention heads {c.num_heads} (KV {c.num_kv_heads}) x {c.head_dim}; mup {c.mup}; vocabulary {c.unpadded_vocab_size} (padded to {c.vocab_size}, padded rows zero); trained context {hp.seq_len}.
- MTP: {c.num_mtp_depths} depths, `local_layer_ids` {c.mtp_local_layer_ids}, dense MLP {c.dense_intermediate_size}, `chain_hidden_post_norm` false, no log-tau inside depths.

## Training
- Data: the Python standard library of CPython 3.11 (PSF License), split into train and held-out by file (`data/corpus/files.json` in the repository); byte-level BPE tokenizer of {c.unpadded_vocab_size} tokens trained on the train split (`tokenizer.json`).
- `scripts/train_demo.py`: trunk and MTP head trained jointly from scratch, one chained teacher-forced forward per batch; loss = CE(trunk) + sum_m {hp.mtp_weight} * {hp.mtp_decay}^m * CE(depth m).
- AdamW, lr {hp.lr}, warmup {hp.warmup} steps, constant, linear cooldown over the last {hp.cooldown:.0%} of the steps to {hp.min_lr_ratio} x lr; weight decay {hp.weight_decay}, grad clip {hp.clip}; batch {hp.batch_size} x {hp.seq_len} tokens; seed {hp.seed}; {'fp32' if device_name == 'CPU' else 'bf16 autocast'}. MoE selection bias balanced by the auxiliary-loss-free sign rule (rate {hp.bias_rate}).
- {info['step']} steps of {info['total_steps']}, {info['tokens_seen'] / 1e6:.1f} M tokens, on {device_name}.
- Reproduce: `python scripts/build_corpus.py tokens && python scripts/train_demo.py --out runs/demo --steps {info['total_steps']} {flags} --export DIR`.

## Held-out evaluation ({ev['windows']} windows of {hp.seq_len} tokens, teacher-forced)
Trunk: loss {ev['trunk']['loss']:.3f}, top-1 accuracy {ev['trunk']['acc']:.3f}.

| depth | attention | loss | top-1 accuracy | agrees with the trunk's argmax |
|---|---|---|---|---|
{depth_rows}

Teacher-forced proxy of the acceptance length ({proxies}): the mean leading run of depths that agree
with the trunk at one position. Real speculative decoding is measured separately.

## License
Trained on the CPython standard library (Python Software Foundation License).
"""


# ---------------------------------------------------------------------- main
def resolve_hyper(args, saved: dict | None) -> Hyper:
    """CLI values over defaults; on resume the saved values win and a differing CLI value is an error."""
    hp = Hyper(**saved) if saved else Hyper()
    for f in fields(Hyper):
        v = getattr(args, f.name)
        if v is None:
            continue
        if saved and v != saved[f.name]:
            raise SystemExit(f"--{f.name.replace('_', '-')}={v} differs from the resumed run's {saved[f.name]}")
        setattr(hp, f.name, v)
    return hp


def estimate_total_steps(info: dict, hp: Hyper, timing: tuple[float, int] | None, end_time: float,
                         cuda: bool) -> None:
    """Set info["total_steps"] so that training ends by `end_time`, from the mean time per step since
    `timing` = (time, step) (evaluations and saves included); fix it once the cooldown has begun."""
    if cuda:
        torch.cuda.synchronize()
    now, step = time.time(), info["step"]
    if timing is None or step == timing[1]:
        return
    per_step = (now - timing[0]) / (step - timing[1])
    info["total_steps"] = step + max(1, int(0.97 * (end_time - now) / per_step))
    if step >= cooldown_start(info["total_steps"], hp):
        info["total_fixed"] = True
        tqdm.write(f"step {step}: {per_step:.3f} s/step ({hp.batch_size * hp.seq_len / per_step:,.0f} tokens/s); "
                   f"cooldown begins, total steps fixed at {info['total_steps']}")


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--corpus", type=Path, default=REPO / "runs" / "corpus")
    ap.add_argument("--out", type=Path, required=True, help="state, log (and default export) folder")
    ap.add_argument("--resume", action="store_true", help="continue from --out/state.*")
    ap.add_argument("--steps", type=int, default=None, help="total steps (default: fit --time-limit-min)")
    ap.add_argument("--time-limit-min", type=float, default=None, help="stop cleanly (save, export) before this")
    ap.add_argument("--stop-at-step", type=int, default=None, help="stop this run at this step (as if out of time)")
    ap.add_argument("--reserve-s", type=float, default=None, help="seconds kept for the final eval, save, export")
    ap.add_argument("--save-every-min", type=float, default=2.0)
    ap.add_argument("--eval-every", type=int, default=500)
    ap.add_argument("--eval-windows", type=int, default=128)
    ap.add_argument("--export", type=Path, default=None, help="write the released-layout checkpoint here")
    ap.add_argument("--tokenizer", type=Path, default=TOKENIZER)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--threads", type=int, default=None, help="CPU threads (torch.set_num_threads)")
    for f in fields(Hyper):  # hyperparameters: None = default (fresh run) or the saved value (resume)
        ap.add_argument(f"--{f.name.replace('_', '-')}", type=type(f.default), default=None,
                        choices=list(CONFIGS) if f.name == "size" else None)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = args.device
    cuda = device.startswith("cuda")
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = True
    autocast = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if cuda else nullcontext
    deadline = _T0 + 60 * args.time_limit_min if args.time_limit_min else math.inf
    reserve = args.reserve_s if args.reserve_s is not None else (30.0 if cuda else 0.0)

    state_exists = (args.out / "state.json").exists()
    if args.resume and not state_exists:
        raise SystemExit(f"--resume: no training state in {args.out}")
    if not args.resume and state_exists:
        raise SystemExit(f"{args.out} already holds a training state: pass --resume, or another --out")
    saved_info = json.loads((args.out / "state.json").read_text()) if args.resume else None
    hp = resolve_hyper(args, saved_info["hyper"] if saved_info else None)
    config = CONFIGS[hp.size]()
    if hp.seq_len > config.max_position_embeddings:
        raise SystemExit(f"--seq-len {hp.seq_len} exceeds the config's context {config.max_position_embeddings}")

    torch.manual_seed(hp.seed)
    model = InklingModel(config)
    init_for_training(model, hp.seed)
    model.to(device).train()
    balancer = LoadBalancer(model, hp.bias_rate)
    opt = make_optimizer(model, hp, device)
    weights = torch.tensor(depth_weights(hp, config.num_mtp_depths), device=device)
    train = Batches(load_stream(args.corpus / "train.npy", config.vocab_out, device), hp.seq_len, hp.batch_size, hp.seed)
    heldout = load_stream(args.corpus / "heldout.npy", config.vocab_out, device)

    if args.resume:
        info, log = load_state(args.out, model, opt)
        train.epoch, train.cursor = info["data_epoch"], info["data_cursor"]
    else:
        info = {"step": 0, "total_steps": args.steps, "total_fixed": args.steps is not None,
                "tokens_seen": 0, "train_wall_s": 0.0,
                "hyper": asdict(hp), "data_epoch": 0, "data_cursor": 0}
        log = {"config": config.to_released_dict(), "hyper": asdict(hp),
               "depth_weights": depth_weights(hp, config.num_mtp_depths),
               "corpus_tokens": {"train": train.stream.numel(), "heldout": heldout.numel()},
               "steps": [], "evals": [], "runs": []}
    if args.steps is not None and args.steps != info["total_steps"]:
        if info["total_steps"] is not None and info["step"] > cooldown_start(info["total_steps"], hp):
            raise SystemExit(f"--steps {args.steps}: the resumed run is in its cooldown towards {info['total_steps']}")
        info["total_steps"] = args.steps
    info["total_fixed"] = info["total_fixed"] or args.steps is not None
    if info["total_steps"] is None and math.isinf(deadline):
        raise SystemExit("give --steps, or --time-limit-min to fit the step count to the time")

    def checkpoint():
        info.update(data_epoch=train.epoch, data_cursor=train.cursor)
        save_state(args.out, model, opt, info, log)

    device_name = torch.cuda.get_device_name(device) if cuda else "CPU"
    info["step_at_start"] = info["step"]
    run = {"device": device_name, "start_step": info["step"], "started_s_after_launch": round(time.time() - _T0, 1)}
    print(f"demo Inkling ({hp.size}): {sum(p.numel() for p in model.parameters()) / 1e6:.2f} M parameters, "
          f"train stream {train.stream.numel()} tokens, device {device_name}, step {info['step']}/"
          f"{info['total_steps'] or 'auto'}", flush=True)

    timing = None  # (time, step) where the measurement of the time per step began (automatic step count)
    stopped_by = "steps"
    pending = []  # (step, lr, loss tensor [1 + D], grad norm): fetched to the host every few steps
    t_run = time.time()
    t_last_save = time.time()
    pbar = tqdm(total=info["total_steps"], initial=info["step"], mininterval=10, desc="train")

    def flush_pending():
        if pending:
            values = torch.stack([torch.cat([p[2], p[3][None]]) for p in pending]).tolist()
            for (step, lr, _, _), v in zip(pending, values):
                log["steps"].append({"step": step, "lr": lr, "loss": [round(x, 5) for x in v[:-1]],
                                     "grad_norm": round(v[-1], 4)})
            pending.clear()

    while info["total_steps"] is None or info["step"] < info["total_steps"]:
        step = info["step"]
        if args.stop_at_step is not None and step >= args.stop_at_step:
            stopped_by = "stop-at-step"
            break
        if time.time() + reserve > deadline:
            stopped_by = "time limit"
            break
        if not info["total_fixed"] and step % 10 == 0 and step - info["step_at_start"] >= 10:
            estimate_total_steps(info, hp, timing, deadline - reserve, cuda)
            timing = timing or (time.time(), step)
            pbar.total = info["total_steps"]
        ids = train.next()
        lr = lr_at(step, info["total_steps"], hp)
        for g in opt.param_groups:
            g["lr"] = lr
        balancer.active = True
        with autocast():
            losses = chained_losses(ids, *forward_all(model, ids))
        balancer.active = False
        loss = losses[0] + (weights * losses[1:]).sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), hp.clip)
        opt.step()
        balancer.update()

        pending.append((step, lr, losses.detach().float(), grad_norm.detach().float()))
        info["step"] = step + 1
        info["tokens_seen"] += ids.numel()
        if len(pending) >= 20 or info["step"] == info["total_steps"]:
            flush_pending()
            last = log["steps"][-1]["loss"]
            pbar.set_postfix(trunk=f"{last[0]:.3f}", d0=f"{last[1]:.3f}", d7=f"{last[-1]:.3f}", refresh=False)
        pbar.update(1)
        if args.eval_every and info["step"] % args.eval_every == 0:
            ev = evaluate(model, heldout, hp.seq_len, args.eval_windows, hp.batch_size, autocast)
            log["evals"].append({"step": info["step"], **ev})
            tqdm.write(f"step {info['step']}: held-out trunk {ev['trunk']['loss']:.3f}, depths "
                       + " ".join(f"{d['loss']:.2f}" for d in ev["depths"])
                       + "; agree " + " ".join(f"{d['agree']:.2f}" for d in ev["depths"])
                       + f"; MoE max/mean load {max(balancer.last_imbalance or [0]):.2f}")
        if time.time() - t_last_save > 60 * args.save_every_min:
            flush_pending()
            info["train_wall_s"] += time.time() - t_run
            t_run = time.time()
            checkpoint()
            t_last_save = time.time()
    pbar.close()
    flush_pending()
    info["train_wall_s"] += time.time() - t_run

    final = evaluate(model, heldout, hp.seq_len, args.eval_windows, hp.batch_size, autocast)
    log["evals"].append({"step": info["step"], "final": True, **final})
    run.update(end_step=info["step"], stopped_by=stopped_by, wall_s=round(time.time() - _T0, 1))
    log["runs"].append(run)
    log.update(tokens_seen=info["tokens_seen"], train_wall_s=info["train_wall_s"], total_steps=info["total_steps"])
    checkpoint()

    tail = log["steps"][-50:]
    if tail:
        mean = np.mean([s["loss"] for s in tail], axis=0)
        print(f"\nstep {info['step']}/{info['total_steps']} ({stopped_by}); train loss (mean of last {len(tail)} "
              f"steps): trunk {mean[0]:.3f}, depths " + " ".join(f"{x:.3f}" for x in mean[1:]))
    print(f"held-out: trunk loss {final['trunk']['loss']:.3f} acc {final['trunk']['acc']:.3f}")
    for m, d in enumerate(final["depths"]):
        print(f"  depth {m}: loss {d['loss']:.3f} acc {d['acc']:.3f} agrees with trunk {d['agree']:.3f}")
    print("  teacher-forced acceptance-length proxy: "
          + ", ".join(f"k={k} {final[f'tf_accept_len_k{k}']:.2f}" for k in (4, 8) if f"tf_accept_len_k{k}" in final))
    print(f"{info['tokens_seen'] / 1e6:.1f} M tokens in {info['train_wall_s']:.0f} s of training "
          f"({info['tokens_seen'] / max(info['train_wall_s'], 1e-9):,.0f} tokens/s over all runs)")
    if info["step"] < (info["total_steps"] or 0):
        print(f"stopped early ({stopped_by}): resume with --resume --out {args.out}")

    if args.export is not None:
        card = model_card(model, hp, info, final, device_name)
        sizes = export_released(model, args.export, args.tokenizer, card)
        shutil.copyfile(args.out / "train_log.json", args.export / "train_log.json")
        weights_total = sum(sizes.values())
        print(f"exported to {args.export}: " + ", ".join(f"{k} {v / 2**20:.2f} MiB" for k, v in sizes.items())
              + f"; checkpoint total {weights_total / 1e6:.2f} MB")
        check_export(model, args.export, heldout, hp.seq_len)
        too_big = [k for k, v in sizes.items() if v >= 15 * 2**20]
        if too_big or weights_total > 25e6:
            raise SystemExit(f"export over budget: {too_big or 'total'} (each file < 15 MiB, total <= 25 MB)")
    return {"info": info, "log": log, "final": final}


@torch.no_grad()
def check_export(model: InklingModel, path: Path, stream: torch.Tensor, seq_len: int) -> None:
    """Reload the export by name and compare logits with the trained model rounded to bf16 (fp32 maths,
    on the CPU, where both forwards are deterministic)."""
    reloaded = load_released(path)
    rounded = InklingModel(model.config).eval()
    for (n, p), (_, q) in zip(rounded.named_parameters(), model.named_parameters()):
        p.copy_(q.float() if n.endswith("router_bias") else q.to(torch.bfloat16).float())
    ids = stream[: min(seq_len, 128)].long()[None].cpu()
    a, b = forward_all(reloaded, ids), forward_all(rounded, ids)
    same = torch.equal(a[0], b[0]) and all(torch.equal(x, y) for x, y in zip(a[1], b[1]))
    if not same:
        raise SystemExit(f"the export in {path} does not reproduce the trained model's logits")
    print(f"export check: reloaded by name, trunk and {len(a[1])} depth logits identical to the bf16-rounded model")


if __name__ == "__main__":
    main()
