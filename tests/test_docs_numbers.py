"""The numbers the README, docs/real_checkpoints.md and the notebooks' prose quote agree with the data
they come from.

Each CLAIM is (where, pattern, source): `where` is a file, or a notebook (its markdown cells only: the
code cells compute their numbers from the data, and nbval compares their outputs); `pattern` is a
regular expression whose groups are the quoted numbers as written; `source` computes the same
strings from the data: docs/benchmarks/*.json (through inkling_fast.cost_model where the prose quotes
a prediction) or, for the model sizes, the tensor shapes `inkling_ref` builds. A claim whose pattern
no longer matches fails as well, so rewording the prose means updating its claim here.

`test_a_planted_number_fails` plants a wrong digit in each claim's text, one claim at a time, and
checks that the comparison catches it."""

from __future__ import annotations

import functools
import json
import math
import re
from pathlib import Path
from typing import Callable, NamedTuple

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "docs" / "benchmarks"


# ---------------------------------------------------------------------------------------------- data

@functools.cache
def engine() -> dict:
    return json.loads((BENCH / "engine.json").read_text())


@functools.cache
def acceptance() -> dict:
    return json.loads((BENCH / "demo_acceptance.json").read_text())


def section(name: str) -> dict:
    """The run that measured one section of engine.json (gpu, date, commit, command, copy_gbps)."""
    return engine().get("section_runs", {}).get(name, engine())


def demo_row(batch: int, k: int, name: str = "fast_graphs") -> dict:
    return next(r for r in engine()["demo"]["end_to_end"] if (r["engine"], r["batch"], r["k"]) == (name, batch, k))


def fixed_row(batch: int, k: int, loop: str = "overlap") -> dict:
    return next(r for r in engine()["requests"]["fixed"] if (r["loop"], r["batch"], r["k"]) == (loop, batch, k))


def serving_row(k: int, loop: str = "overlap") -> dict:
    return next(r for r in engine()["requests"]["serving"] if (r["loop"], r["k"]) == (loop, k))


def layer_ms(kind: str, batch: int, T: int) -> float:
    return next(r["ms"] for r in engine()["layers"]["rows"] if (r["kind"], r["batch"], r["T"]) == (kind, batch, T))


@functools.cache
def model():
    """(cost_model module, Costs, Inkling-Small config, greedy acceptance curves), as notebook 05 builds them."""
    from inkling_fast import cost_model as cm

    return cm, cm.Costs(engine()), cm.inkling_small_config(), cm.load_acceptance(acceptance(), run="greedy")


def predicted(batch: int) -> tuple[str, str, str, str]:
    """(best k, plain tokens/s, tokens/s with the best k, speedup) at one batch size, over the measured ks."""
    cm, costs, cfg, curves = model()
    ks = [0] + costs.measured_ks()
    best = cm.recommend_k(costs, cfg, batch, curves, ks)
    rows = {r["k"]: r for r in cm.predict(costs, cfg, [batch], ks, curves)}
    return (str(best), f"{rows[0]['tokens_per_s']:.1f}", f"{rows[best]['tokens_per_s']:.1f}",
            f"{rows[best]['speedup']:.2f}")


def validation() -> tuple[str, str, str]:
    """(usable points within 15 %, usable points, largest error) of the cost model on the demo (notebook 05 §5)."""
    cm, _, _, curves = model()
    host = cm.host_overhead_ms(engine())
    val = cm.demo_validation(engine(), curves, host_ms=host or 0.0)
    usable = [r for r in val if r["basis"] == "steady" or r["batch"] == 1]
    worst = max(usable, key=lambda r: abs(r["err"]))
    return (str(sum(abs(r["err"]) <= 0.15 for r in usable)), str(len(usable)), f"{100 * worst['err']:+.1f}")


def tree_comparison() -> list[dict]:
    """The cost model's best chain and best tree per batch for Inkling-Small (notebook 07)."""
    cm, costs, cfg, _ = model()
    runs = cm.load_tree_acceptance(json.loads((BENCH / "tree_acceptance.json").read_text()))
    return cm.compare_trees(costs, cfg, [1, 2, 4, 8, 16, 32, 64], runs)


def floor_ms(kind: str, batch: int, T: int) -> float:
    """A layer's byte floor in ms at the layers section's copy bandwidth (notebook 05 §2)."""
    cm, costs, cfg, _ = model()
    nbytes = cm.layer_floor_bytes(kind, cfg, batch, T, costs.layers_context)
    return nbytes / (section("layers")["copy_gbps"] * 1e9) * 1e3


def ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}"


def sizes() -> dict[str, dict[str, int]]:
    """Parameters by part of Inkling and Inkling-Small (text model, 8 MTP depths), from the shapes inkling_ref
    builds for the configs of docs/spec/inkling-architecture.md §4 (the method line of real_checkpoints.md)."""
    return _sizes()


@functools.cache
def _sizes() -> dict[str, dict[str, int]]:
    from inkling_fast.cost_model import inkling_small_config
    from inkling_ref import InklingConfig
    from inkling_ref.io.checkpoint import expected_shapes

    small = inkling_small_config()
    full = dict(small, hidden_size=6144, num_layers=66, num_heads=64, num_kv_heads=8, swa_num_heads=64,
                swa_num_kv_heads=16, dense_intermediate_size=24576, moe_intermediate_size=3072, mup=24.0,
                layer_types=["global" if (i + 1) % 6 == 0 else "sliding" for i in range(66)],
                mlp_types=["dense" if i < 2 else "moe" for i in range(66)])

    def part(name: str) -> str:
        if name.startswith("model.mtp."):
            return "mtp"
        if name in ("model.llm.embed.weight", "model.llm.unembed.weight"):
            return name.split(".")[2]
        if ".mlp.experts." in name:
            return "routed"
        return "shared" if "shared_experts" in name else "trunk"

    out = {}
    for label, cfg in (("Inkling", full), ("Inkling-Small", small)):
        parts: dict[str, int] = {}
        for name, shape in expected_shapes(InklingConfig(**cfg), 8).items():
            parts[part(name)] = parts.get(part(name), 0) + math.prod(shape)
        parts["total"] = sum(parts.values())
        out[label] = parts
    return out


def totals() -> tuple[str, str, str, str]:
    """(Inkling B params, Inkling-Small B params, Inkling TB, Inkling-Small GB) in bf16, as the prose rounds them."""
    big, small = sizes()["Inkling"]["total"], sizes()["Inkling-Small"]["total"]
    return str(round(big / 1e9)), str(round(small / 1e9)), f"{2 * big / 1e12:.1f}", str(round(2 * small / 1e9))


def size_row(part: str) -> tuple[str, str, str, str]:
    big, small = sizes()["Inkling"][part], sizes()["Inkling-Small"][part]
    return f"{big / 1e9:.2f}", f"{2 * big / 1e9:.1f}", f"{small / 1e9:.2f}", f"{2 * small / 1e9:.2f}"


def note_number(pattern: str) -> float:
    """A number engine.json's notes state (e.g. the many-row LM head's time, measured by another benchmark)."""
    return float(next(m.group(1) for n in engine()["notes"] for m in [re.search(pattern, n)] if m))


# ---------------------------------------------------------------------------------------------- claims

class Claim(NamedTuple):
    where: str                       # a path relative to the repository root; a notebook means its markdown
    pattern: str                     # a regular expression over the prose, white space as single spaces;
                                     # its groups are the quoted numbers
    source: Callable[[], tuple]      # the same numbers, formatted as written, from the data


def _t(*xs):
    return tuple(str(x) for x in xs)


README = "README.md"
NB05 = "notebooks/05_when_mtp_pays.ipynb"
NB07 = "notebooks/07_tree_drafts.ipynb"
REAL = "docs/real_checkpoints.md"

CLAIMS = [
    # README, quick start
    Claim(README, r"accepted often: ([\d.]+) tokens per verify pass at k = 4",
          lambda: _t(f"{acceptance()['runs']['greedy']['4']['acceptance_length']:.2f}")),
    # README, speed table (engine.json; the GPU and the date of every section)
    Claim(README, r"\*\*(NVIDIA [^*]+)\*\*, (\d{4}-\d\d-\d\d)\. Regenerate",
          lambda: _t(section("demo")["gpu"], section("demo")["date"])),
    Claim(README, r"\| demo checkpoint, batch 1, k = 4: tokens/s over whole `generate` calls \| (\d+) \| (\d+) \| "
                  r"([\d.]+)x \| demo, (\w+) \|",
          lambda: _t(round(demo_row(1, 0)["tokens_per_s"]), round(demo_row(1, 4)["tokens_per_s"]),
                     ratio(demo_row(1, 4)["tokens_per_s"], demo_row(1, 0)["tokens_per_s"]), section("demo")["commit"])),
    Claim(README, r"\| demo checkpoint, one request at batch 1, k = 4: ms \| ([\d.]+) \| ([\d.]+) \| ([\d.]+)x \| "
                  r"requests, (\w+) \|",
          lambda: _t(f"{fixed_row(1, 0)['whole_ms']:.2f}", f"{fixed_row(1, 4)['whole_ms']:.2f}",
                     ratio(fixed_row(1, 0)["whole_ms"], fixed_row(1, 4)["whole_ms"]), section("requests")["commit"])),
    Claim(README, r"\| demo checkpoint, 32 requests at batch 32, k = 4: ms \| ([\d.]+) \| ([\d.]+) \| ([\d.]+)x \| "
                  r"requests, (\w+) \|",
          lambda: _t(f"{fixed_row(32, 0)['whole_ms']:.2f}", f"{fixed_row(32, 4)['whole_ms']:.2f}",
                     ratio(fixed_row(32, 0)["whole_ms"], fixed_row(32, 4)["whole_ms"]), section("requests")["commit"])),
    Claim(README, r"\| demo checkpoint, 128 mixed requests on 32 slots, k = 4: output tokens/s \| (\d+) \| (\d+) \| "
                  r"([\d.]+)x \| requests, (\w+) \|",
          lambda: _t(round(serving_row(0)["output_tokens_per_s"]), round(serving_row(4)["output_tokens_per_s"]),
                     ratio(serving_row(4)["output_tokens_per_s"], serving_row(0)["output_tokens_per_s"]),
                     section("requests")["commit"])),
    Claim(README, r"\| Inkling-Small predicted, batch 1, best k = (\d+): tokens/s \| ([\d.]+) \| ([\d.]+) \| ([\d.]+)x \|",
          lambda: predicted(1)),
    Claim(README, r"\| Inkling-Small predicted, batch 64, best k = (\d+): tokens/s \| ([\d.]+) \| ([\d.]+) \| ([\d.]+)x \|",
          lambda: predicted(64)),
    Claim(README, r"\| Inkling-Small predicted, batch 64, [^|]+\|[^|]+\|[^|]+\|[^|]+\| layers and head, (\w+) \|",
          lambda: _t(section("layers")["commit"])),
    Claim(README, r"within 15 % at (\d+) of (\d+) \(batch, k\) points, largest error ([+-][\d.]+) %",
          validation),
    Claim(README, r"One MTP depth step at Inkling-Small width takes ([\d.]+)x its HBM floor at batch 1",
          lambda: _t(next(f"{r['ms'] / r['floor_ms']:.2f}" for r in engine()["mtp_head"]["depth_step"]
                          if (r["batch"], r["rows"]) == (1, 1)))),
    # README and docs/real_checkpoints.md: the models' sizes
    Claim(README, r"about (\d+) B and (\d+) B parameters \(text model; ([\d.]+) TB and (\d+) GB in bf16\)",
          lambda: totals()),
    Claim(REAL, r"about (\d+) B and (\d+) B parameters in their text models, ([\d.]+) TB and (\d+) GB in bf16",
          lambda: totals()),
    *[Claim(REAL, rf"\| {label} \| ([\d.]+) B \| ([\d.]+) GB \| ([\d.]+) B \| ([\d.]+) GB \|",
            (lambda part=part: size_row(part)))
      for label, part in (("trunk without experts \\(attention, short convs, norms, routers, 2 dense MLPs\\)", "trunk"),
                          ("MoE routed experts", "routed"), ("MoE shared experts", "shared"),
                          ("MTP head, 8 depths \\(`mtp.safetensors`\\)", "mtp"), ("embedding table", "embed"),
                          ("LM head \\(`unembed`\\)", "unembed"))],
    Claim(REAL, r"\| \*\*text model, total\*\* \| \*\*([\d.]+) B\*\* \| \*\*([\d.]+) GB\*\* \| \*\*([\d.]+) B\*\* \| "
                r"\*\*([\d.]+) GB\*\* \|",
          lambda: size_row("total")),
    Claim(REAL, r"40 layers x 256 x 3 x 2048 x 4096 = ([\d.]+) B",
          lambda: _t(f"{sizes()['Inkling-Small']['routed'] / 1e9:.2f}")),
    # notebook 05's prose (its code cells print the rest from the same files)
    Claim(NB05, r"at batch 64 with T = 9 \(576 tokens per layer\) the sliding MoE layer takes ([\d.]+) ms against a "
                r"byte floor of ([\d.]+) ms",
          lambda: _t(f"{layer_ms('sliding_moe', 64, 9):.1f}", f"{floor_ms('sliding_moe', 64, 9):.1f}")),
    Claim(NB05, r"At N = 576 that overstates the LM head by about (\d+) ms of a (\d+) ms verify",
          lambda: _t(round(layer_ms("lm_head_argmax", 576, 1) - note_number(r"at 576 rows ([\d.]+) ms")),
                     round(model()[0].t_verify(model()[1], model()[2], 64, 8)))),
    Claim(NB05, r"a verify pass of 9 tokens reads about (\d+)",
          lambda: _t(round(model()[0].expected_distinct_experts(9)))),
    # notebook 07's prose: the best tree against the best chain at batch 16 and 32
    Claim(NB07, r"the extra verified tokens of a grown tree are cheap: it comes out about (\d+) % ahead",
          lambda: _t(round(100 * max(r["tree_gain"] for r in tree_comparison() if r["batch"] in (16, 32))))),
]


# ---------------------------------------------------------------------------------------------- checks

def text_of(where: str) -> str:
    """The prose of a file (a notebook: its markdown cells), with every run of white space made one space, so
    that a claim does not depend on where a line breaks."""
    path = ROOT / where
    if path.suffix == ".ipynb":
        cells = json.loads(path.read_text())["cells"]
        text = "\n\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "markdown")
    else:
        text = path.read_text()
    return re.sub(r"\s+", " ", text)


def mismatches(claim: Claim, text: str) -> list[str]:
    """What disagrees between `text` and the data for one claim (empty: they agree)."""
    m = re.search(claim.pattern, text)
    if m is None:
        return [f"{claim.where}: no text matches {claim.pattern!r} (reworded? update its claim in {Path(__file__).name})"]
    want = tuple(claim.source())
    got = m.groups()
    return [f"{claim.where}: {m.group(0)!r} states {g}, the data gives {w}" for g, w in zip(got, want) if g != w]


@pytest.mark.parametrize("claim", CLAIMS, ids=[f"{c.where}:{i}" for i, c in enumerate(CLAIMS)])
def test_the_quoted_numbers_agree_with_the_data(claim):
    assert not mismatches(claim, text_of(claim.where))


def plant(text: str, claim: Claim) -> str:
    """`text` with the last digit of the claim's first numeric group changed."""
    m = re.search(claim.pattern, text)
    for i in range(1, len(m.groups()) + 1):
        s, e = m.span(i)
        digits = [j for j in range(s, e) if text[j].isdigit()]
        if digits:
            j = digits[-1]
            return text[:j] + str((int(text[j]) + 1) % 10) + text[j + 1:]
    raise AssertionError(f"claim {claim.pattern!r} quotes no digit")


def test_a_planted_number_fails():
    for claim in CLAIMS:
        planted = plant(text_of(claim.where), claim)
        assert mismatches(claim, planted), f"a wrong digit in {claim.where} ({claim.pattern!r}) went unnoticed"


def test_a_reworded_claim_fails():
    claim = CLAIMS[0]
    assert mismatches(claim, text_of(claim.where).replace("accepted often", "accepted quite often"))
