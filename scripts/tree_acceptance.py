"""Acceptance of chain and tree drafts on the demo checkpoint's held-out prompts (greedy).

    python scripts/tree_acceptance.py --device cuda --out docs/benchmarks/tree_acceptance.json
    python scripts/tree_acceptance.py --device cpu --prompts 6 --validate-prompts 2 --out /tmp/t.json
    python scripts/tree_acceptance.py --report --out docs/benchmarks/tree_acceptance.json   # .md + .png only

Writes OUT (JSON), OUT with .md (tables) and .png (accepted tokens per cycle against verified tokens
per cycle). Method:
  1. the greedy continuation of every prompt (batched plain greedy decoding with the trunk cache);
  2. teacher-forced draft ranks of every depth along prompt + continuation (`tree_ranks.draft_ranks`);
  3. every chain k = 1..8 and every tree shape replayed from those ranks (`tree_ranks.replay`: the
     cycles generate_tree runs, without running them);
  4. checks, on the first --validate-prompts prompts: `generate` (plain, and the chain cycle with
     k = 8) equals the continuation, the chain's accept counts equal the replay's, and generate_tree
     (the real tree cycle) equals the continuation and gives the replay's cycles, accepted path by
     accepted path, for a few shapes;
  5. trees grown on the replay (`tree_ranks.grow_trees`) of a search set: the greedy continuations
     of each prompt's first --search-len tokens (other contexts than the scored ones); and, as an
     optimistic bound, grown on the scored continuations themselves ("in-sample").
Statistics follow docs/spec/mtp-cycle.md §6: cycles cut short by the length limit are not counted;
acceptance length = mean(a + 1); verified tokens per cycle = nodes + 1 (the pending token and the
drafts); tokens per verified token = acceptance length / verified tokens per cycle.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from inkling_ref import TrunkCache, generate, load_checkpoint  # noqa: E402
from inkling_ref.tree import drafts as TR  # noqa: E402
from inkling_ref.tree import ranks as RK  # noqa: E402
from provenance import git_commit  # noqa: E402

FULL_SHAPES = [[2, 1], [2, 1, 1, 1], [2, 1, 1, 1, 1, 1], [3, 1, 1, 1], [2, 2, 1, 1], [2, 2, 2], [4, 1, 1, 1],
               [2, 1, 1, 1, 1, 1, 1, 1], [2, 2, 2, 1], [3, 1, 1, 1, 1, 1, 1, 1], [2, 2, 1, 1, 1, 1, 1, 1],
               [4, 1, 1, 1, 1, 1, 1, 1]]
GROWN_NODES = [4, 6, 8, 12, 16, 24, 32]
IN_SAMPLE_NODES = [4, 8, 16, 32]
VALIDATE = ["chain k=4", "tree [2, 2, 1, 1]", "tree [4, 1, 1, 1, 1, 1, 1, 1]", "grown 16"]
MAX_K = 8
BATCH = 8    # sequences per batched forward


@torch.no_grad()
def greedy_continuations(model, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """Plain greedy decoding of equally long prompts in batches: the trunk over each batch with its cache,
    one token per step."""
    device = next(model.parameters()).device
    out = []
    for i in range(0, len(prompts), BATCH):
        ids = torch.tensor(prompts[i: i + BATCH], dtype=torch.long, device=device)   # [B, L]
        cache = TrunkCache(len(model.trunk.layers))
        nxt = model.trunk.readout(model.trunk(ids, cache)[:, -1]).argmax(-1)          # [B]
        new = [nxt]
        for _ in range(new_tokens - 1):
            nxt = model.trunk.readout(model.trunk(nxt[:, None], cache)[:, -1]).argmax(-1)
            new.append(nxt)
        out += torch.stack(new, dim=1).tolist()
    return out


def best_grown(sequences, new_tokens: int, max_len: int, sizes: list[int]) -> dict[int, TR.TreeSpec]:
    """Per size, the better (on `sequences`) of two greedy growths: from the root alone, and from the
    chain of all MAX_K depths (greedy growth alone can stop short of the long chain)."""
    from_root = RK.grow_trees(sequences, new_tokens, max_len, max(sizes), MAX_K)
    from_chain = RK.grow_trees(sequences, new_tokens, max_len, max(sizes), MAX_K, start=TR.TreeSpec.chain(MAX_K))
    from_chain[MAX_K] = TR.TreeSpec.chain(MAX_K)
    out = {}
    for N in sizes:
        options = [t for t in (from_root.get(N), from_chain.get(N)) if t is not None]
        out[N] = max(options, key=lambda t: RK.acceptance_length(sequences, new_tokens, t, max_len))
    return out


def ranks_of(model, sequences: list[list[int]]) -> list[list[list[int]]]:
    out = []
    for i in range(0, len(sequences), BATCH):
        out += RK.draft_ranks(model, sequences[i: i + BATCH])
    return out


def stats(spec: TR.TreeSpec, cycles) -> dict:
    """Acceptance statistics of counted cycles (objects with .accepted, .ranks, .counted)."""
    counted = [c for c in cycles if c.counted]
    n = len(counted)
    if n == 0:
        raise SystemExit(f"{spec.describe()}: no cycle used the whole tree (--new-tokens too small)")
    tau = sum(c.accepted + 1 for c in counted) / n
    D = spec.depth
    return {"cycles": n, "acceptance_length": tau, "verified_per_cycle": spec.num_nodes + 1,
            "tokens_per_verified": tau / (spec.num_nodes + 1),
            "per_level": [sum(1 for c in counted if c.accepted >= j) / n for j in range(1, D + 1)],
            "off_top1": sum(1 for c in counted if any(r for r in c.ranks)) / n}


def describe(spec: TR.TreeSpec) -> dict:
    """What the cost model needs of a shape: per depth m, the tree rows it computes and the nodes it
    expands (their candidates are read from the LM head)."""
    return {"paths": [list(p) for p in spec.paths], "branching": spec.branching(), "nodes": spec.num_nodes,
            "depth": spec.depth, "level_sizes": spec.level_sizes(),
            "draft_tree_rows": [len(spec.depth_rows(m)) for m in range(spec.depth)],
            "draft_heads": [len(spec.expanding(m)) for m in range(spec.depth)]}


def demo_acceptance_check(r: dict) -> str:
    """The chains beside docs/benchmarks/demo_acceptance.json's greedy runs (reference `generate`), when
    that evaluation used the same prompts and lengths."""
    path = ROOT / "docs" / "benchmarks" / "demo_acceptance.json"
    if not path.exists():
        return "docs/benchmarks/demo_acceptance.json is absent: no cross-check."
    demo = json.loads(path.read_text())
    if (demo.get("num_prompts"), demo.get("new_tokens"), demo.get("prompt_len")) != \
            (r["num_prompts"], r["new_tokens"], r["prompt_len"]):
        return ("Chains not compared with docs/benchmarks/demo_acceptance.json: it used "
                f"{demo.get('num_prompts')} prompts x {demo.get('new_tokens')} tokens.")
    ours = {x["nodes"]: x for x in r["runs"] if x["kind"] == "chain"}
    pairs = [(int(k), v) for k, v in demo["runs"]["greedy"].items() if int(k) in ours]
    same = all(abs(ours[k]["acceptance_length"] - v["acceptance_length"]) < 1e-9 and ours[k]["cycles"] == v["cycles"]
               for k, v in pairs)
    return (f"Chains beside docs/benchmarks/demo_acceptance.json (the same prompts decoded by `generate`, "
            f"{demo.get('commit')}): k = " + ", ".join(str(k) for k, _ in pairs) + ": acceptance length "
            + " / ".join(f"{v['acceptance_length']:.3f}" for _, v in pairs)
            + (" there, identical here (same cycle counts)." if same else
               " there, here " + " / ".join(f"{ours[k]['acceptance_length']:.3f}" for k, _ in pairs) + "."))


def write_markdown(path: Path, r: dict) -> None:
    runs = r["runs"]
    chains = [x for x in runs if x["kind"] == "chain"]
    L = ["# Tree drafts on the demo checkpoint: acceptance per verified token", "",
         f"Command: `{r['command']}` ({r['device']}, {r['dtype']}, wall time {r['wall_s']:.0f} s, {r['date']}, "
         f"commit {r['commit']}).", "",
         f"Prompts: the first {r['num_prompts']} of `data/heldout_prompts.json` ({r['prompt_len']} tokens each, "
         f"held-out code), {r['new_tokens']} new tokens each, greedy. Checkpoint `{r['checkpoint']}`.",
         "", "Method (scripts/tree_acceptance.py): the greedy continuation of each prompt; the teacher-forced "
         "rank of the right token in every depth's logits along it; every shape's cycles replayed from "
         "those ranks (`inkling_ref.tree.ranks.replay`). Checked here: " + r["validation"]["summary"], "",
         r["demo_acceptance_check"], "",
         "Acceptance length = mean accepted tokens per cycle (a + 1, the trunk's own token included); "
         "verified = tokens through the trunk per cycle (pending token + draft nodes); the last column "
         "is the share of cycles whose accepted path left the top-1 chain.", "",
         "| shape | nodes | verified / cycle | acceptance length | tokens / verified token | cycles | "
         "P(a >= j), j = 1..depth (%) | off top-1 |", "|---|---:|---:|---:|---:|---:|---|---:|"]
    for x in runs:
        per = " / ".join(f"{100 * v:.0f}" for v in x["per_level"])
        L.append(f"| {x['name']} | {x['nodes']} | {x['verified_per_cycle']} | {x['acceptance_length']:.3f} | "
                 f"{x['tokens_per_verified']:.3f} | {x['cycles']} | {per} | {100 * x['off_top1']:.0f} % |")
    L += ["", "## Best shape per verified budget", "",
          "For each number of tokens verified per cycle: the best chain and the best tree (branching or grown, "
          "not in-sample; growth may return a chain) that verify at most that many. "
          f"Chains stop at k = {MAX_K} ({MAX_K + 1} verified): the "
          "checkpoint has no more depths; past that only trees can spend more.", "",
          "| verified / cycle <= | best chain | acceptance length | best tree | acceptance length | tree vs chain |",
          "|---:|---|---:|---|---:|---:|"]
    for budget in sorted({x["verified_per_cycle"] for x in runs if x["kind"] != "in-sample"}):
        fit = [x for x in runs if x["verified_per_cycle"] <= budget]
        chain = max((x for x in fit if x["kind"] == "chain"), key=lambda x: x["acceptance_length"])
        trees = [x for x in fit if x["kind"] in ("tree", "grown")]
        if not trees:
            continue
        tree = max(trees, key=lambda x: x["acceptance_length"])
        shape = tree["name"] + (" (a chain)" if tree["branching"] == [1] * tree["depth"] else "")
        L.append(f"| {budget} | {chain['name']} | {chain['acceptance_length']:.3f} | {shape} | "
                 f"{tree['acceptance_length']:.3f} | "
                 f"{100 * (tree['acceptance_length'] / chain['acceptance_length'] - 1):+.1f} % |")
    L += ["", "![accepted against verified tokens per cycle](" + path.with_suffix(".png").name + ")", "",
          "Grown trees (`inkling_ref.tree.ranks.grow_trees`, up to depth "
          f"{MAX_K}): node by node, the next-ranked child that most raises the replayed acceptance length of "
          f"the search set: the greedy continuations ({r['new_tokens']} tokens) of the first {r['search_len']} tokens "
          "of the same prompts, contexts other than the scored ones. 'In-sample' trees are grown on the scored "
          "continuations themselves: an optimistic bound, not a result.", "",
          "Their shapes (rank paths, level by level):", ""]
    for x in runs:
        if x["kind"] in ("grown", "in-sample"):
            L.append(f"- {x['name']}: nodes per level {x['level_sizes']}: "
                     + " ".join("(" + ",".join(map(str, p)) + ")" for p in x["paths"]))
    path.write_text("\n".join(L) + "\n")


def plot(path: Path, r: dict) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    runs = r["runs"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, key, ylabel in ((axes[0], "acceptance_length", "accepted tokens per cycle"),
                            (axes[1], "tokens_per_verified", "accepted tokens per verified token")):
        for kind, style, label in (("chain", "o-", "chains k = 1..8"), ("tree", "s", "trees, branching per level"),
                                   ("grown", "^-", "trees grown on the search set"),
                                   ("in-sample", "v:", "trees grown on the scored set (optimistic)")):
            xs = [x for x in runs if x["kind"] == kind]
            ax.plot([x["verified_per_cycle"] for x in xs], [x[key] for x in xs], style, label=label, ms=5)
        ax.set(xlabel="verified tokens per cycle (nodes + 1)", ylabel=ylabel, xscale="log")
        ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
        ax.set_xticks([2, 3, 5, 9, 17, 33], labels=["2", "3", "5", "9", "17", "33"])
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"demo checkpoint, {r['num_prompts']} held-out prompts x {r['new_tokens']} tokens, greedy",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    ap.add_argument("--out", default=str(ROOT / "docs" / "benchmarks" / "tree_acceptance.json"))
    ap.add_argument("--checkpoint", default=str(ROOT / "inkling_ref" / "default_checkpoint"))
    ap.add_argument("--prompts", type=int, default=24, help="the first N prompts of data/heldout_prompts.json")
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--search-len", type=int, default=128,
                    help="the search set continues each prompt's first N tokens (default 128)")
    ap.add_argument("--validate-prompts", type=int, default=4,
                    help="prompts on which plain greedy and generate_tree are run against the replay")
    ap.add_argument("--dtype", default="float64", choices=["float64", "float32"])
    ap.add_argument("--report", action="store_true", help="rewrite OUT's .md and .png from OUT, measure nothing")
    args = ap.parse_args(argv)
    if args.report:
        out = Path(args.out)
        if not out.exists():
            raise SystemExit(f"--report: {out} does not exist")
        r = json.loads(out.read_text())
        write_markdown(out.with_suffix(".md"), r)
        plot(out.with_suffix(".png"), r)
        print(f"rewrote {out.with_suffix('.md')} and {out.with_suffix('.png')}")
        return
    if args.device not in ("cpu", "cuda"):
        raise SystemExit(f"--device {args.device!r}: expected cpu or cuda")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no CUDA GPU here")
    prompts_file = json.loads((ROOT / "data" / "heldout_prompts.json").read_text())
    prompts = [p["ids"] for p in prompts_file["prompts"]]
    if not 1 <= args.prompts <= len(prompts):
        raise SystemExit(f"--prompts {args.prompts}: data/heldout_prompts.json has {len(prompts)} prompts")
    if not 0 <= args.validate_prompts <= args.prompts:
        raise SystemExit(f"--validate-prompts {args.validate_prompts}: expected 0..--prompts ({args.prompts})")
    if not MAX_K + 2 <= args.search_len <= len(prompts[0]):
        raise SystemExit(f"--search-len {args.search_len}: expected {MAX_K + 2}..{len(prompts[0])}")
    if len({len(p) for p in prompts}) != 1:
        raise SystemExit("data/heldout_prompts.json: the prompts must have one length (batched decoding)")
    if args.new_tokens < 2:
        raise SystemExit(f"--new-tokens {args.new_tokens}: at least 2 are needed for one draft cycle")
    if args.device == "cpu":
        torch.set_num_threads(1)   # tiny tensors: one thread is fastest, and immune to a busy machine
    t0 = time.time()
    prompts = prompts[: args.prompts]
    model = load_checkpoint(args.checkpoint, dtype=getattr(torch, args.dtype), device=args.device)
    max_len = model.config.max_position_embeddings
    log = lambda *a: print(f"[{time.time() - t0:6.1f} s]", *a, flush=True)  # noqa: E731

    # 1 + 2: continuations and ranks, for the scored set and the search set
    continuations = greedy_continuations(model, prompts, args.new_tokens)
    ranks = ranks_of(model, [p + c for p, c in zip(prompts, continuations)])
    search_prompts = [p[: args.search_len] for p in prompts]
    search_ranks = ranks_of(model, [p + c for p, c in zip(search_prompts, greedy_continuations(
        model, search_prompts, args.new_tokens))])
    log(f"greedy continuations and teacher-forced draft ranks of {len(prompts)} prompts and their search set")

    # 5: trees grown on the replay
    scored = [(rk, len(p)) for rk, p in zip(ranks, prompts)]
    search = [(rk, args.search_len) for rk in search_ranks]
    grown = best_grown(search, args.new_tokens, max_len, GROWN_NODES)
    in_sample = best_grown(scored, args.new_tokens, max_len, IN_SAMPLE_NODES)
    log("trees grown")

    shapes = [("chain", f"chain k={k}", TR.TreeSpec.chain(k)) for k in range(1, MAX_K + 1)]
    shapes += [("tree", f"tree {b}", TR.TreeSpec.from_branching(b)) for b in FULL_SHAPES]
    shapes += [("grown", f"grown {N}", grown[N]) for N in GROWN_NODES]
    shapes += [("in-sample", f"in-sample {N}", in_sample[N]) for N in IN_SAMPLE_NODES]

    # 3: replay
    runs, replays = [], {}
    for kind, name, spec in shapes:
        replays[name] = [RK.replay(rk, L, args.new_tokens, spec, max_len) for rk, L in scored]
        runs.append({"kind": kind, "name": name, **describe(spec),
                     **stats(spec, [c for seq in replays[name] for c in seq])})
    log(f"replayed {len(shapes)} shapes")

    # 4: checks against real decoding
    V = args.validate_prompts
    mismatches = {}
    if V:
        plain = generate(model, prompts[:V], max_new_tokens=args.new_tokens, num_speculative_tokens=0).token_ids
        if plain != continuations[:V]:
            raise SystemExit("generate (plain greedy) differs from the batched greedy continuation")
        chain = generate(model, prompts[:V], max_new_tokens=args.new_tokens, num_speculative_tokens=MAX_K)
        if chain.token_ids != continuations[:V]:
            raise SystemExit(f"generate (chain k = {MAX_K}) differs from the greedy continuation")
        mismatches[f"chain k={MAX_K} (generate)"] = sum(
            [c.accepted for c in real] != [c.accepted for c in rep]
            for real, rep in zip(chain.cycles, replays[f"chain k={MAX_K}"]))
        spec_of = {name: spec for _, name, spec in shapes}
        for name in VALIDATE:
            bad = 0
            for i in range(V):
                out, cycles = TR.generate_tree(model, prompts[i], args.new_tokens, spec_of[name])
                if out != continuations[i]:
                    raise SystemExit(f"{name}: tree decoding of prompt {i} differs from greedy decoding")
                real = [(c.accepted, c.ranks, c.counted) for c in cycles]
                bad += real != [(c.accepted, c.ranks, c.counted) for c in replays[name][i]]
            mismatches[f"{name} (generate_tree)"] = bad
            log(f"{name}: generate_tree == greedy; replay mismatches on {bad} of {V} prompts")
    ok = all(v == 0 for v in mismatches.values())
    summary = (f"on the first {V} prompts, plain and chain (k = {MAX_K}) `generate` and `generate_tree` "
               "equal the greedy continuation, and the replay equals real decoding cycle for cycle "
               "(accepted count and path) for: " + "; ".join(mismatches) if ok and V else
               "not checked against real decoding (--validate-prompts 0)" if ok else
               "REPLAY MISMATCHES (prompts whose cycles differ): "
               + "; ".join(f"{k}: {v}" for k, v in mismatches.items()))

    r = {"command": "python scripts/tree_acceptance.py " + " ".join(argv if argv is not None else sys.argv[1:]),
         "device": torch.cuda.get_device_name() if args.device == "cuda" else "CPU (1 thread)",
         "dtype": args.dtype, "date": time.strftime("%Y-%m-%d"), "commit": git_commit(),
         "checkpoint": Path(args.checkpoint).name, "num_prompts": len(prompts), "prompt_len": len(prompts[0]),
         "new_tokens": args.new_tokens, "max_k": MAX_K, "search_len": args.search_len,
         "validation": {"prompts": V, "mismatched_prompts": mismatches, "ok": ok, "summary": summary},
         "runs": runs}
    r["demo_acceptance_check"] = demo_acceptance_check(r)
    r["wall_s"] = time.time() - t0
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(r, indent=1) + "\n")
    write_markdown(out.with_suffix(".md"), r)
    try:
        plot(out.with_suffix(".png"), r)
    except ImportError as e:
        log(f"no plot ({e}): `--report --out {out}` draws it where matplotlib is installed")
    log(f"wrote {out} (+ .md, .png)")
    if not ok:
        raise SystemExit("the replay disagrees with real decoding: " + summary)


if __name__ == "__main__":
    main()
