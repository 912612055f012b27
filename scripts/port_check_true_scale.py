"""The port checker at true width: a random Inkling-Small MTP head (8 depths, H 4096, the 201k vocabulary).

    python scripts/port_check_true_scale.py --out docs/benchmarks/port_check_true_scale.json   # GPU
    python scripts/port_check_true_scale.py --tiny --out /tmp/port_check_tiny.json             # CPU, minutes

1. Writes a released-layout checkpoint of the head only (config.json; model.safetensors with the embedding,
   embed_norm, the final norm and the LM head; mtp.safetensors with the 8 depths), random bf16 weights,
   into a temporary directory (about 7.8 GB at true width: the MTP shard alone is 4.5 GB, as released).
2. Measures the head-only loader (inkling_ref.port_check.load_head, float32 on the device, as check-port
   loads it) in a fresh process: wall time, peak host memory (ru_maxrss) and peak GPU memory, against the
   bytes it reads.
3. Builds the fast engine on that head in bf16 (no trunk layer: H is rms(rms(E[x]); embed_norm); norm),
   runs a prompt past the sliding window and a few greedy cycles, writes their dump (inkling_mtp.fast_dump)
   and checks it with the float32 reference: it must pass. The same engine running depth 0's weights
   for every step must be diagnosed as that mistake.
Every number goes to --out (JSON) and stdout.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from inkling_ref.port_check.head_loader import head_shapes  # noqa: E402


def config(tiny: bool):
    import true_scale
    return true_scale.tiny_inkling_small() if tiny else true_scale.inkling_small()


def random_tensor(name: str, shape, g: torch.Generator, device) -> torch.Tensor:
    """Random values in the spirit of inkling_ref.random_init: norms near 1, variance-preserving projections."""
    leaf = name.rsplit(".", 1)[-1]
    if name.endswith("norm.weight") or leaf == "global_scale":
        t = 1 + 0.1 * torch.randn(shape, generator=g, device=device)
    elif "sconv" in name:
        t = 0.3 * torch.randn(shape, generator=g, device=device)
    elif leaf == "proj" or name.endswith("embed.weight") or name.endswith("unembed.weight"):
        t = torch.randn(shape, generator=g, device=device)
    else:
        t = torch.randn(shape, generator=g, device=device) / math.sqrt(shape[-1])
    return t.to(torch.bfloat16).cpu()


def write_head_checkpoint(cfg, directory: Path, device) -> dict:
    """config.json, model.safetensors (trunk ends) and mtp.safetensors (the depths), one file in memory at a time."""
    shapes = head_shapes(cfg, cfg.num_mtp_depths)
    g = torch.Generator(device=device).manual_seed(0)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(cfg.to_released_dict(), indent=2))
    sizes = {}
    for file, mtp in (("model.safetensors", False), ("mtp.safetensors", True)):
        tensors = {n: random_tensor(n, s, g, device) for n, s in shapes.items() if n.startswith("model.mtp.") == mtp}
        save_file(tensors, str(directory / file), metadata={"format": "pt"})
        sizes[file] = (directory / file).stat().st_size
        del tensors
    return {"files": sizes, "head_bytes": sum(math.prod(s) * 2 for s in shapes.values())}


def measure_load(directory: str, dtype: str, device: str) -> None:
    """(Child process) load the head, print one JSON line with the time and peak memories."""
    from inkling_ref.port_check import load_head
    if device == "cuda":
        torch.cuda.init()
        torch.zeros(1, device="cuda")
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    t0 = time.perf_counter()
    head = load_head(directory, dtype=getattr(torch, dtype), device=device)
    if device == "cuda":
        torch.cuda.synchronize()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    out = {"dtype": dtype, "device": device, "seconds": time.perf_counter() - t0, "rss_before_gb": before / 1e9,
           "rss_peak_gb": peak / 1e9, "head_gb": sum(p.numel() * p.element_size() for p in head.parameters()) / 1e9}
    if device == "cuda":
        out["gpu_peak_gb"] = torch.cuda.max_memory_allocated() / 1e9
    print(json.dumps(out))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--tiny", action="store_true", help="a tiny width on the CPU (Triton interpreter)")
    ap.add_argument("--prompt", type=int, default=None, help="prompt tokens (default 600 true width, 20 tiny)")
    ap.add_argument("--cycles", type=int, default=None, help="greedy cycles (default 6 true width, 3 tiny)")
    ap.add_argument("--workdir", default=None, help="where to write the checkpoint (default: a temporary directory)")
    ap.add_argument("--measure-load", nargs=3, metavar=("DIR", "DTYPE", "DEVICE"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.measure_load:
        return measure_load(*args.measure_load)
    device = "cpu" if args.tiny else "cuda"
    if device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
        torch.set_num_threads(1)
    torch.backends.cuda.matmul.allow_tf32 = False
    cfg, k = config(args.tiny), 8
    L = args.prompt or (20 if args.tiny else 600)
    args.cycles = args.cycles or (3 if args.tiny else 6)
    res = {"command": "python scripts/port_check_true_scale.py " + " ".join(argv if argv is not None else sys.argv[1:]),
           "machine": torch.cuda.get_device_name() if device == "cuda" else "CPU",
           "hidden_size": cfg.hidden_size, "vocab": cfg.vocab_size, "depths": k, "prompt": L, "cycles": args.cycles}
    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        ckpt = Path(tmp) / "head"
        t0 = time.perf_counter()
        res.update(write_head_checkpoint(cfg, ckpt, device))
        res["write_s"] = time.perf_counter() - t0
        print(f"wrote {ckpt}: {res['files']} in {res['write_s']:.1f} s")
        line = subprocess.run([sys.executable, __file__, "--out", "-", "--measure-load", str(ckpt), "float32", device],
                              check=True, capture_output=True, text=True, env=os.environ).stdout.splitlines()[-1]
        res["load"] = json.loads(line)
        print("head-only load:", res["load"])
        res["check"] = run_check(ckpt, cfg, k, L, args.cycles, device, Path(tmp))
    Path(args.out).write_text(json.dumps(res, indent=1) + "\n")
    print(f"wrote {args.out}")
    wrong = [f"{name}: passed={r['passed']}, diagnosis {r['diagnosis']}" for name, r in res["check"].items()
             if r["passed"] != (name == "correct") or (name != "correct" and r["diagnosis"][:1] != [DEPTH0])]
    if wrong:
        raise SystemExit("unexpected outcome: " + "; ".join(wrong))


DEPTH0 = "depth 0's module reused for every draft step"


def run_check(ckpt: Path, cfg, k: int, L: int, cycles: int, device: str, tmp: Path) -> dict:
    from inkling_fast import Engine
    from inkling_fast.weights import from_model
    from inkling_mtp.fast_dump import capture_fast
    from inkling_ref.port_check import check_dump, load_head, read_dump

    out = {}
    t0 = time.perf_counter()
    head = load_head(ckpt, dtype=torch.float32, device=device)            # the reference of the check
    load_s = time.perf_counter() - t0
    head.trunk.layers = torch.nn.ModuleList()                              # a trunk of no layer, for from_model
    W = from_model(head, k, torch.bfloat16, torch.device(device))
    prompt = torch.randint(0, cfg.vocab_out, (L,), generator=torch.Generator().manual_seed(1)).tolist()
    for name, broken in (("correct", False), ("depth 0's weights for every step", True)):
        engine = Engine(W, max_batch_size=1, max_seq_len=L + 1 + cycles * (k + 1), num_speculative_tokens=k,
                        dtype=torch.bfloat16, device=device, use_cuda_graphs=False)
        if broken:
            engine.W.depths[1:] = [engine.W.depths[0]] * (k - 1)
        t0 = time.perf_counter()
        capture_fast(engine, prompt, k, cycles, tmp / "dump.safetensors")
        t1 = time.perf_counter()
        dump = read_dump(tmp / "dump.safetensors")
        report = check_dump(head, dump)
        t2 = time.perf_counter()
        print(report.render())
        out[name] = {"load_s": load_s, "dump_mb": (tmp / "dump.safetensors").stat().st_size / 1e6,
                     "rows": dump.num_rows, "capture_s": t1 - t0, "check_s": t2 - t1, "passed": report.passed,
                     "diagnosis": [d.mistake for d in report.diagnosis],
                     "depths": [(d.depth, d.error, d.worst_row) for d in report.depths]}
        print(name, {kk: v for kk, v in out[name].items() if kk != "depths"})
        del engine
    return out


if __name__ == "__main__":
    main()
