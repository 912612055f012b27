"""The fast engine at Inkling-Small's true widths against inkling_ref, both on the same device.

At the demo's width (H 256, 8 experts, a 4,000-entry vocabulary) several parts of the fast path run
in a shape they never take in a real model: tile loops that run once, a vocabulary whose last tile
is whole, an expert tensor far below 2^31 elements, no prompt longer than the sliding window. Here
the whole engine (batched prefill passes, draft, verify, accept, commit and the rollback of every
ring; CUDA graphs on a GPU) runs a random model with Inkling-Small's real widths and is checked
against the reference, token for token and draft for draft.

The model (`TRUE`): H 4096, 32 query / 8 KV heads of 128, window 512, a vocabulary of 201,024 rows
truncated to 200,058 ids; two trunk layers, sliding attention + the dense MLP (16384) and global
attention + the MoE (256 experts of 2048, top-6, 2 shared): the fewest layers that hold both
attention kinds and both MLP kinds, with every routed expert (256 x 4096 x 4096 elements: past 2^31,
so the experts' offsets need 64 bits). Two MTP depths, sliding and global, as depths 0 and 1 of the
released head. Log-tau starts at position 256 (the released 128,000 would leave it at 1 in any
prompt a test can afford), so that the global layer's scaling runs. In float32 that is 36 GB of
parameters: the model is built on meta tensors and drawn in place on the device
(`randomize_on_device`, inkling_ref.randomize_'s distributions).

Prompts: three, ragged, two longer than the window: 600 random tokens, 513 copies of one token t*,
37 random tokens. Prefill passes hold at most 1024 tokens, so the long prompts are split and their
later chunks read their history from the caches.

What random weights leave to chance is planted (`plant`), so that each check is certain:
  * Acceptance. Random depths almost never guess the trunk's next token: the random prompts' cycles
    reject their drafts and roll back. For full acceptance the second prompt repeats t*. Past the
    first positions (the convolutions reach back K-1 = 3 inputs) every position of such a sequence
    sees the same inputs, so the trunk's hidden and each depth's output there barely move from row
    to row. The unembedding row u of t* is set from their mean directions so that t*'s logit is
    A = 10 standard deviations of a random row's logit above zero at those rows (the largest of the
    200,057 other rows' logits is about 4.6 of them): the trunk and every depth predict t*, every cycle
    of that sequence accepts all k drafts, and the sequence stays on t*. u has about 3^(1/2) A the
    entry scale of a random row, so at a random hidden of H = 4096 dimensions t*'s logit stays within
    a fraction of one standard deviation: the random prompts never meet t*.
  * The LM head's last partial tile. t* is the last unpadded id (200,057). 200,058 = 3125 x 64 + 58:
    whatever the tile width (a multiple of 64 ids in both greedy LM-head kernels), the last tile is
    partial and holds t*. The padded rows (200,058 .. 201,023) are scaled by 100: a head that let
    them compete would pick one of them at every position.
  * The last experts. Every MoE router's selection bias of the last routed expert is 10 (the sigmoid
    scores lie in (0, 1), the other biases near 0): every token selects it, in the prompts' prefill
    passes (the grouped MoE) and in every cycle (the few-token MoE). The last shared expert, the last
    group of the grouped MoE's order, takes every token anyway. A witness token t_e = 200,056 has its
    unembedding row set so that the first prompt's x_L is t_e with both experts' contributions and
    cannot be without either of them (`plant`).

float32 (`test_fp32_equals_reference`), k = 0, 1 and the loaded depths, the engine's caches poisoned
(NaN) before each run: `Engine.generate` == `inkling_ref.generate`: token ids, every CycleRecord
(drafts, accepted count, emitted tokens) and the statistics; and what the plants promise holds in the
reference's own output. Then mutants, each of which must fail the token comparison over the first
new tokens (they begin with x_L, where every plant bites already):
  * the LM head drops its last partial tile (its argmax sees ids below 200,000 only): kernel-ready
    weights whose greedy head reads fewer rows (`HeadRows`), every tensor shared;
  * the LM head lets the padded rows compete (the argmax over all 201,024 rows);
  * the MoE drops the last routed expert's group, or the last group of its order (the last shared
    expert): that expert's down projection zeroed in place, which removes exactly the group's
    contribution, in the very memory the captured graphs read; restored after.

bf16 (`test_bf16_against_reference`): the near-tie rule of the demo checkpoint's bf16 test, at true
width. bf16 rounds every activation to 8 significant bits, which moves a logit of this random head
(spread about 4) by a few hundredths to a tenth; the top two of 200,058 logits are often closer than
that. It also moves the routers' selection scores, and those of the top experts crowd near 1 (a
sigmoid of logits of spread 2), so the k-th and (k+1)-th choices are often closer than the rounding:
a token then selects another expert. So greedy bf16 output parts from float32 output after some
tokens, legitimately. The rule: wherever two outputs part (bf16 against the float32 reference, and
bf16 speculative against bf16 plain decoding), the float32 reference at that context is near a
tie: its top-2 logit margin is below TIE_LOGIT = 0.5, or a routing choice of the last row is within
TIE_ROUTE = 0.01 of changing (the MoE is the trunk's last layer, so no other row's routing reaches
that row's logits). Both bounds are several times the rounding they allow for. Exact in bf16 as in
float32: the forced sequence (t* only, every cycle accepting all k: its margins are far beyond any
rounding). And a statistic: 16 next-token picks after consecutive prefixes of the 600-token prompt
(one prefill each) each equal the float32 reference's argmax or fall on a near tie, and at most half
differ (a wrong kernel changes nearly all of them).

The same code runs at tiny widths (`TINY`, weights drawn on the CPU so that every machine gets the
same model) on any machine, the CPU through the Triton interpreter: it keeps the test itself working
in CI. In 32 dimensions a random hidden can point close to u, so there A is smaller (4) and the seed
is one whose random prompts never meet t* (checked by the preconditions). The true widths need a GPU
(36 GB of float32 weights, 18 GB more in bf16).
"""

from __future__ import annotations

import dataclasses
import gc
import math
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from test_engine import assert_same_result, poison
from test_engine import exact_fp32, one_thread  # noqa: F401 (autouse: TF32 off, one CPU thread)

from inkling_fast import Engine, weights
from inkling_fast.cost_model import inkling_small_config
from inkling_ref import InklingConfig, InklingModel, generate

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

TIE_LOGIT = 0.5       # bf16: a top-2 logit margin below this is a near tie
TIE_ROUTE = 0.01      # bf16: a selection-score gap (k-th vs (k+1)-th expert) below this is a near tie
ROUTE_BIAS = 10.0     # selection bias of the last routed expert: every token selects it
EXPERT_SCALE = 4.0    # the last routed and shared experts' down projections: their part of H is large
PAD_SCALE = 100.0     # the padded unembedding rows, scaled: a head reading them picks them
TILE_IDS = 64         # both greedy LM heads tile the vocabulary in multiples of 64 ids


@dataclass(frozen=True)
class Widths:
    """One size of the test: the config (InklingConfig fields over Inkling-Small's), the prompts
    (random, all t*, random), new tokens, the prefill budget, and A (the forced token's head scale)."""
    name: str
    changes: dict
    prompt_lengths: tuple[int, int, int]
    new_tokens: int
    prefill_tokens: int
    prefill_lengths: list[int] | None
    head_scale: float
    prefix_picks: int
    mutant_tokens: int    # new tokens per prompt in the mutant runs (1: x_L alone)
    bf16_plain: bool      # bf16 also decodes plainly (k = 0), to compare speculative with plain decoding
    seed: int
    draw_on: str          # where the weights are drawn (and so which generator's stream they are)


TRUE = Widths(
    "inkling_small", dict(num_layers=2, layer_types=["sliding", "global"], mlp_types=["dense", "moe"], num_mtp_depths=2,
                 mtp_layer_types=["sliding", "global"], log_scaling_n_floor=256, max_position_embeddings=4096),
    prompt_lengths=(600, 513, 37), new_tokens=20, prefill_tokens=1024, prefill_lengths=None, head_scale=10.0,
    prefix_picks=16, mutant_tokens=3, bf16_plain=True, seed=11, draw_on=DEVICE)

TINY = Widths(
    "tiny", dict(vocab_size=200, unpadded_vocab_size=150, hidden_size=32, num_heads=2, num_kv_heads=1, head_dim=16,
                 swa_num_heads=2, swa_num_kv_heads=1, swa_head_dim=16, sliding_window=6, rel_extent=12, d_rel=4,
                 dense_intermediate_size=24, moe_intermediate_size=16, n_routed_experts=4, num_experts_per_tok=2,
                 n_shared_experts=1,
                 mup=2.0, num_layers=2, layer_types=["sliding", "global"], mlp_types=["dense", "moe"],
                 num_mtp_depths=2, mtp_layer_types=["sliding", "global"], log_scaling_n_floor=8,
                 max_position_embeddings=64),
    prompt_lengths=(8, 7, 3), new_tokens=4, prefill_tokens=12, prefill_lengths=[4], head_scale=4.0,
    prefix_picks=3, mutant_tokens=1, bf16_plain=False, seed=18, draw_on="cpu")


def config(w: Widths) -> InklingConfig:
    return InklingConfig(**{**inkling_small_config(), **w.changes})


# ----------------------------------------------------------------------------- the model
@torch.no_grad()
def randomize_on_device(model: InklingModel, seed: int) -> None:
    """Draw every parameter in place where it lives, with inkling_ref.randomize_'s distributions (norm
    weights and scales 1 +- U(0.15, 0.45), conv taps N(0, 0.3), relative profiles N(0, 1), router
    N(0, 2/sqrt(H)) with a selection bias N(0, 0.2), embedding and unembedding N(0, 1), projections
    N(0, 1/fan_in)) from a generator on the parameters' device: a host copy of the true-width model
    would not fit most hosts, and drawing it there would take minutes."""
    g = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    for name, p in model.named_parameters():
        leaf = name.rsplit(".", 1)[-1]
        if name.endswith("norm.weight") or leaf in ("global_scale", "gate_global_scale"):
            sign = torch.empty_like(p).bernoulli_(0.5, generator=g).mul_(2).sub_(1)
            p.uniform_(0.15, 0.45, generator=g).mul_(sign).add_(1)
        elif name.endswith("conv.weight"):
            p.normal_(0.0, 0.3, generator=g)
        elif leaf == "rel_proj":
            p.normal_(0.0, 1.0, generator=g)
        elif leaf == "router_bias":
            p.normal_(0.0, 0.2, generator=g)
        elif leaf == "router":
            p.normal_(0.0, 2.0 / math.sqrt(p.shape[-1]), generator=g)
        elif name.endswith("embed.weight") or name.endswith("unembed.weight"):
            p.normal_(0.0, 1.0, generator=g)
        elif p.dim() >= 2:
            p.normal_(0.0, 1.0 / math.sqrt(p.shape[-1]), generator=g)
        else:
            raise AssertionError(f"randomize_on_device has no rule for parameter {name} {tuple(p.shape)}")


def moe_modules(model: InklingModel) -> list[torch.nn.Module]:
    """The reference's MoE modules (those with a router and a selection bias), in layer order."""
    return [m for m in model.modules() if hasattr(m, "router") and hasattr(m, "router_bias")]


def chain_outputs(model: InklingModel, ids: list[int], rows: slice) -> list[torch.Tensor]:
    """Teacher-forced over `ids`: the trunk's hidden H_p and each depth's output at the rows p of
    `rows` (depth m at row p consumed x_{p+m+1}), as [rows, H] float64 tensors."""
    x = torch.tensor([ids], device=model.trunk.unembed.weight.device)
    hidden = model.hidden(x)
    outputs = [hidden[0, rows]]
    h = hidden[:, :-1]
    for m in range(model.num_mtp_depths):
        n = x.shape[1] - 1 - m
        h, _ = model.mtp_depth(m, h[:, :n], x[:, m + 1: m + 1 + n])
        outputs.append(h[0, rows])
    return [o.double() for o in outputs]


def mean_direction(rows: torch.Tensor) -> torch.Tensor:
    return F.normalize(F.normalize(rows, dim=-1).mean(0), dim=0)


class zeroed:
    """Context manager: the given tensors zeroed in place (the same memory the engine and its CUDA
    graphs read), restored on exit."""

    def __init__(self, *tensors: torch.Tensor):
        self.tensors = tensors

    def __enter__(self):
        self.saved = [t.clone() for t in self.tensors]
        for t in self.tensors:
            t.zero_()

    def __exit__(self, *exc):
        for t, v in zip(self.tensors, self.saved):
            t.copy_(v)


def least_norm_row(directions: list[torch.Tensor], targets: list[float]) -> torch.Tensor:
    """The least-norm u with u . d_i / |d_i| = targets[i] (float64)."""
    D = torch.stack([F.normalize(d.double(), dim=0) for d in directions])
    t = torch.tensor(targets, dtype=torch.float64, device=D.device)
    return D.T @ torch.linalg.solve(D @ D.T, t)


@torch.no_grad()
def plant(model: InklingModel, forced_len: int, new_tokens: int, head_scale: float,
          witness_prompt: list[int]) -> tuple[int, int]:
    """The plants of the module docstring; returns (t*, t_e). Unembedding rows are set last (the
    unembedding feeds neither the trunk's hiddens nor the depths' outputs). Against a hidden x, a random
    row of the unembedding (entries of standard deviation s) scores a logit of standard deviation
    s |x| (over mup, as every row), and a row u scores |x| (u . x / |x|).

    t* = V_out - 1: u is the least-norm vector with u . d_i / |d_i| = A s for the mean directions d_i
    of the trunk's hidden and of each depth's output over the rows that a generation of `new_tokens`
    after a `forced_len`-token prompt of t* reads (positions L-1 onwards): there t* beats the other
    rows by A of their standard deviations, whatever the angles between the d_i, and |u| is about
    sqrt(depths + 1) A s, so at a random hidden t* scores about sqrt(depths + 1) A s |x| / sqrt(H).

    t_e = V_out - 2, the witness of the last experts: with H the trunk's hidden at the last row of
    `witness_prompt`, H_r the same with the last routed expert's down projection zeroed in every MoE
    layer, H_s with the last shared expert's, u is the least-norm vector with u . H = A s |H| and
    u . H_r = u . H_s = 0. So the reference picks x_L = t_e after that prompt, and a model without
    either expert's contribution gives t_e a logit of 0 there, below the other rows' maximum: its x_L
    differs."""
    cfg = model.config
    V_out, depths = cfg.vocab_out, model.num_mtp_depths
    t_star, t_e = V_out - 1, V_out - 2
    moes = moe_modules(model)
    for moe in moes:
        moe.router_bias[-1] = ROUTE_BIAS
        moe.experts_down[-1] *= EXPERT_SCALE
        moe.shared_down[-1] *= EXPERT_SCALE
    unembed = model.trunk.unembed.weight
    unembed[V_out:] *= PAD_SCALE
    scale = head_scale * unembed[: min(t_e, 4096)].double().std().item()
    rows = slice(forced_len - 1, forced_len + new_tokens + depths)
    forced = chain_outputs(model, [t_star] * (rows.stop + 1 + depths), rows)
    unembed[t_star] = least_norm_row([mean_direction(o) for o in forced], [scale] * len(forced)).to(unembed.dtype)
    x = torch.tensor([witness_prompt], device=unembed.device)
    h = model.hidden(x)[0, -1]
    with zeroed(*[m.experts_down[-1] for m in moes]):
        h_routed = model.hidden(x)[0, -1]
    with zeroed(*[m.shared_down[-1] for m in moes]):
        h_shared = model.hidden(x)[0, -1]
    unembed[t_e] = least_norm_row([h, h_routed, h_shared], [scale, 0.0, 0.0]).to(unembed.dtype)
    return t_star, t_e


@dataclass
class Setup:
    widths: Widths
    model: InklingModel
    t_star: int
    t_e: int
    prompts: list[list[int]]
    reference: dict[int, object]        # k -> inkling_ref.generate's GenerationResult (float32)


@pytest.fixture(scope="module", params=[TINY, pytest.param(TRUE, marks=pytest.mark.gpu)], ids=lambda w: w.name)
def setup(request) -> Setup:
    w = request.param
    cfg = config(w)
    with torch.device("meta"):
        model = InklingModel(cfg)
    model = model.to_empty(device=w.draw_on).eval()
    randomize_on_device(model, w.seed)
    model = model.to(DEVICE)
    g = torch.Generator().manual_seed(5)
    random_ids = [torch.randint(0, cfg.vocab_out - 2, (n,), generator=g).tolist() for n in w.prompt_lengths]
    t_star, t_e = plant(model, w.prompt_lengths[1], w.new_tokens, w.head_scale, random_ids[0])
    prompts = [random_ids[0], [t_star] * w.prompt_lengths[1], random_ids[2]]
    with torch.no_grad():
        reference = {k: generate(model, prompts, max_new_tokens=w.new_tokens, num_speculative_tokens=k)
                     for k in range(cfg.num_mtp_depths + 1)}
    yield Setup(w, model, t_star, t_e, prompts, reference)
    del model, reference
    gc.collect()
    if DEVICE == "cuda":
        torch.cuda.empty_cache()


def check_preconditions(s: Setup) -> None:
    """What the plants promise, in the reference's own output: the forced prompt emits only t* and
    accepts every draft of every cycle; the first prompt's x_L is the witness t_e; the random prompts
    reject drafts (cycles roll back)."""
    for k, r in s.reference.items():
        assert r.token_ids[1] == [s.t_star] * s.widths.new_tokens, f"k={k}: the forced prompt left t*"
        assert r.token_ids[0][0] == s.t_e, f"k={k}: x_L of the first prompt is {r.token_ids[0][0]}, not t_e"
        if k == 0:
            continue
        forced = r.cycles[1]
        assert all(c.accepted == c.k for c in forced) and any(c.accepted == k for c in forced), \
            f"k={k}: the forced prompt rejected a draft: {[(c.accepted, c.k) for c in forced]}"
        others = [c for i in (0, 2) for c in r.cycles[i]]
        rejected = sum(c.accepted < c.k for c in others)
        assert rejected >= len(others) // 2, f"k={k}: only {rejected} of {len(others)} random cycles rejected"


# ----------------------------------------------------------------------------- mutants
@dataclass
class HeadRows(weights.ModelWeights):
    """Kernel-ready weights whose greedy LM head takes the argmax over the first `head_ids` rows of
    the unembedding instead of the unpadded vocabulary: fewer rows is a head that drops its last
    partial tile; all of them is a head that lets the padded rows compete. Everything else (and every
    tensor) is the wrapped weights'."""
    head_ids: int = 0

    @property
    def vocab_out(self) -> int:
        return self.head_ids

    @classmethod
    def of(cls, W: weights.ModelWeights, head_ids: int) -> "HeadRows":
        return cls(**{f.name: getattr(W, f.name) for f in dataclasses.fields(W)}, head_ids=head_ids)


def moe_weights(W: weights.ModelWeights) -> list[weights.MoEWeights]:
    return [b.mlp for b in W.blocks if isinstance(b.mlp, weights.MoEWeights)]


# ----------------------------------------------------------------------------- tests
def make_engine(s: Setup, model_or_weights, dtype, max_batch_size: int = 3, **kw) -> Engine:
    w = s.widths
    return Engine(model_or_weights, max_batch_size=max_batch_size,
                  max_seq_len=max(w.prompt_lengths) + w.new_tokens, num_speculative_tokens=s.model.num_mtp_depths,
                  dtype=dtype, device=DEVICE, prefill_tokens=w.prefill_tokens, prefill_lengths=w.prefill_lengths, **kw)


def test_fp32_equals_reference(setup):
    s = setup
    check_preconditions(s)
    depths, N = s.model.num_mtp_depths, s.widths.new_tokens
    W = weights.from_model(s.model, depths, torch.float32, torch.device(DEVICE))
    engine = make_engine(s, W, torch.float32)
    for k in range(depths + 1):
        poison(engine)
        got = engine.generate(s.prompts, max_new_tokens=N, num_speculative_tokens=k)
        assert_same_result(got, s.reference[k])

    # Mutants: each must fail the token comparison over the first `mutant_tokens` new tokens, which
    # begin with x_L, where every plant bites already: the forced prompt's x_L is t*, in the last tile;
    # the padded rows win everywhere; the last experts feed every token's last MoE layer.
    k, n = depths, s.widths.mutant_tokens
    want = [t[:n] for t in s.reference[k].token_ids]       # greedy output is a prefix of a longer run's

    def first_tokens(e: Engine) -> list[list[int]]:
        return e.generate(s.prompts, max_new_tokens=n, num_speculative_tokens=k).token_ids

    V_out, V = s.model.config.vocab_out, s.model.config.vocab_size
    heads = {"LM head drops its last partial tile": HeadRows.of(W, V_out // TILE_IDS * TILE_IDS),
             "LM head lets the padded rows compete": HeadRows.of(W, V)}
    for what, mutant in heads.items():
        broken = make_engine(s, mutant, torch.float32, use_cuda_graphs=False)
        with pytest.raises(AssertionError):
            assert first_tokens(broken) == want, what
        del broken
    moe = moe_weights(W)
    groups = {"MoE drops the last routed expert's group": [m.w2[-1] for m in moe],
              "MoE drops the last group (the last shared expert)": [m.shared_w2[-1] for m in moe]}
    for what, tensors in groups.items():
        with zeroed(*tensors), pytest.raises(AssertionError):
            assert first_tokens(engine) == want, what


# ----------------------------------------------------------------------------- bf16
@torch.no_grad()
def near_tie(model: InklingModel, context: list[int]) -> tuple[float, float]:
    """At the last row of `context`, the float32 reference's top-2 logit margin and its smallest
    routing gap over the MoE layers: the selection score of the k-th chosen expert minus that of the
    best expert not chosen (sigmoid(x W_r^T) + bias, as the reference selects)."""
    gaps = []

    def record(module, args):
        x = args[0].reshape(-1, args[0].shape[-1])[-1:].float()
        z = x @ module.router.float().T
        scores = torch.sigmoid(z[:, : module.num_routed]) + module.router_bias.float()
        top = scores.topk(module.top_k + 1, dim=-1).values[0]
        gaps.append(float(top[-2] - top[-1]))

    hooks = [m.register_forward_pre_hook(record) for m in moe_modules(model)]
    try:
        logits = model.logits(torch.tensor([context], device=DEVICE))[0, -1].float()
    finally:
        for h in hooks:
            h.remove()
    top2 = logits.topk(2).values
    return float(top2[0] - top2[1]), min(gaps, default=math.inf)


def assert_parted_at_near_ties(model: InklingModel, prompts, got: list[list[int]], want: list[list[int]],
                               what: str) -> int:
    """got and want (new tokens per prompt) are equal up to their first difference, which the float32
    reference sees as a near tie (TIE_LOGIT, TIE_ROUTE). Returns how many sequences parted."""
    parted = 0
    for i, (prompt, g, w) in enumerate(zip(prompts, got, want)):
        assert len(g) == len(w), f"{what}, prompt {i}: {len(g)} tokens against {len(w)}"
        j = next((t for t, (a, b) in enumerate(zip(g, w)) if a != b), None)
        if j is None:
            continue
        parted += 1
        margin, gap = near_tie(model, prompt + w[:j])
        print(f"{what}, prompt {i}: parted at token {j}: top-2 margin {margin:.3f}, routing gap {gap:.4f}")
        assert margin < TIE_LOGIT or gap < TIE_ROUTE, \
            f"{what}, prompt {i}: parted at token {j} where the float32 trunk is not near a tie " \
            f"(top-2 margin {margin:.3f} >= {TIE_LOGIT}, routing gap {gap:.4f} >= {TIE_ROUTE})"
    return parted


def test_bf16_against_reference(setup):
    s = setup
    gc.collect()
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
    depths, N, picks = s.model.num_mtp_depths, s.widths.new_tokens, s.widths.prefix_picks
    engine = make_engine(s, s.model, torch.bfloat16, max_batch_size=picks)
    want = s.reference[depths]
    runs = {}
    for k in ((0, depths) if s.widths.bf16_plain else (depths,)):
        poison(engine)
        runs[k] = engine.generate(s.prompts, max_new_tokens=N, num_speculative_tokens=k)
        assert_parted_at_near_ties(s.model, s.prompts, runs[k].token_ids, want.token_ids, f"bf16 k={k} vs float32")
    if 0 in runs:
        assert_parted_at_near_ties(s.model, s.prompts, runs[depths].token_ids, runs[0].token_ids,
                                   f"bf16 k={depths} vs bf16 k=0")
    assert runs[depths].token_ids[1] == want.token_ids[1] and runs[depths].cycles[1] == want.cycles[1], \
        "bf16: the forced sequence differs from the float32 reference's"

    long = s.prompts[0]
    prefixes = [long[: len(long) - picks + i] for i in range(picks)]
    firsts = [t[0] for t in engine.generate(prefixes, max_new_tokens=1, num_speculative_tokens=0).token_ids]
    with torch.no_grad():
        logits = s.model.logits(torch.tensor([long[:-1]], device=DEVICE))[0, -picks:]
    differ = []
    for i, (got, row) in enumerate(zip(firsts, logits)):
        if got != int(row.argmax()):
            margin, gap = near_tie(s.model, prefixes[i])
            differ.append((i, round(margin, 3), round(gap, 4)))
            assert margin < TIE_LOGIT or gap < TIE_ROUTE, \
                f"bf16 pick after prefix {len(prefixes[i])}: {got} against the float32 argmax {int(row.argmax())}, " \
                f"not a near tie (margin {margin:.3f}, routing gap {gap:.4f})"
    print(f"bf16 next-token picks at {picks} prefixes: {len(differ)} differ from float32 (index, margin, gap): {differ}")
    assert len(differ) <= picks // 2, f"bf16: {len(differ)} of {picks} picks differ from float32: {differ}"
