"""Bad inputs across the command line, the API, configs and checkpoints, each with the error it must get.

One list, `CASES`, is both what `tests/test_bad_inputs.py` runs and what `scripts/bad_inputs_table.py`
writes into `docs/bad_inputs.md`, so the table shows the messages the code gives now.

A case is (area, what is given, run, expected outcome, pattern). `run(env)` makes the bad call; the
runner records the outcome: `exit N` for the command line (with its stderr), or the exception's class
for the API (with its message). `env` holds a tiny random checkpoint written once per session, a model
built from it, and a scratch directory for broken copies. Paths in messages are shown relative to
placeholders (<tmp>/, <repo>/) so that the table does not depend on where it was made.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import re
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable
from unittest import mock

import numpy as np
import torch
from safetensors.torch import load_file, save_file

import inkling_ref
from inkling_ref import InklingConfig, generate, load_checkpoint, random_model, save_checkpoint
from inkling_mtp.cli import main
from inkling_ref.io.checkpoint import convert_transformers_checkpoint
from inkling_ref.decoding.sampling import SamplingParams

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))
from make_random_checkpoint import tiny_random_config  # noqa: E402

DEFAULT = REPO / "inkling_ref" / "default_checkpoint"


# ---------------------------------------------------------------------- the environment
class Env:
    """A tiny random checkpoint (vocab 500, 8 MTP depths, 1024 positions) at `ckpt`, its model, and
    `copy(name, edit)`: a copy of the checkpoint in a fresh directory, changed by `edit(directory)`."""

    def __init__(self, root: Path):
        self.root = root
        self.ckpt = root / "ckpt"
        self.model = random_model(tiny_random_config(), seed=0)
        save_checkpoint(self.model, self.ckpt, overwrite=True)
        self._hf = None

    def hf_source(self) -> Path:
        """The tiny model's trunk in the transformers layout (what `convert` reads), written once."""
        if self._hf is None:
            from inkling_ref.io import names, transformers_layout
            self._hf = self.root / "hf"
            self._hf.mkdir()
            released = {names.to_released(n): p.detach().clone() for n, p in self.model.named_parameters()
                        if not n.startswith("mtp.")}
            save_file(transformers_layout.from_released(released), self._hf / "model.safetensors")
            cfg = dict(self.model.config.to_transformers_dict(), model_type="inkling_text")
            (self._hf / "config.json").write_text(json.dumps(cfg))
        return self._hf

    def copy(self, name: str, edit: Callable[[Path], None] | None = None) -> Path:
        d = self.root / name
        if d.exists():
            shutil.rmtree(d)
        shutil.copytree(self.ckpt, d)
        if edit is not None:
            edit(d)
        return d


@dataclass
class Outcome:
    kind: str      # "exit 2", "exit 1", "exit 0" or an exception class name
    message: str   # the stderr of the command line, or the exception's message


def run_main(env: Env, argv) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of the command line; `{ckpt}` in an argument is the tiny checkpoint,
    `{tmp}` the scratch directory, a function of env an argument made at run time."""
    args = [a.format(ckpt=env.ckpt, tmp=env.root) if isinstance(a, str) else a(env) for a in argv]
    err, out = io.StringIO(), io.StringIO()
    # as on a machine without a GPU, so that the outcome is the same everywhere
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out), \
            mock.patch.object(torch.cuda, "is_available", lambda: False):
        try:
            code = main(args)
        except SystemExit as e:
            code = e.code
    return code, out.getvalue(), err.getvalue()


def cli(*argv) -> Callable[[Env], Outcome]:
    """A command line: its exit status and stderr."""
    def run(env: Env) -> Outcome:
        code, _, err = run_main(env, argv)
        return Outcome(f"exit {code}", err)
    return run


def cli_like(argv, same_as, says: str) -> Callable[[Env], Outcome]:
    """A command line that must run and print what `same_as` prints: exit 0 and `says` (with {out}, the
    continuation), or the difference."""
    def run(env: Env) -> Outcome:
        code, out, err = run_main(env, argv)
        code_b, out_b, _ = run_main(env, same_as)
        if code != 0 or out != out_b:
            return Outcome(f"exit {code}", f"{err}\nprinted {out!r}, not {out_b!r}")
        return Outcome("exit 0", says.format(out=out.strip()))
    return run


def leaves_dst(run_fn: Callable[[Env], Outcome], dst: str, prepare: Callable[[Env, Path], None]):
    """`run_fn` over the directory env.root / dst prepared by prepare(env, path): its outcome, with
    ", DST CHANGED" added to the kind unless the directory is byte-identical afterwards."""
    def run(env: Env) -> Outcome:
        d = env.root / dst
        if d.exists():
            shutil.rmtree(d)
        prepare(env, d)
        before = {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}
        out = run_fn(env)
        after = {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}
        return out if after == before else Outcome(out.kind + ", DST CHANGED", out.message)
    return run


def runs(fn: Callable[[Env], str]) -> Callable[[Env], Outcome]:
    """An API call that must work: fn(env) returns what it gave, in words (the outcome "runs")."""
    def run(env: Env) -> Outcome:
        try:
            return Outcome("runs", fn(env))
        except Exception as e:  # noqa: BLE001
            return Outcome(type(e).__name__, str(e))
    return run


def api(fn: Callable[[Env], object]) -> Callable[[Env], Outcome]:
    def run(env: Env) -> Outcome:
        try:
            fn(env)
        except Exception as e:  # noqa: BLE001 - the class is part of the outcome
            return Outcome(type(e).__name__, str(e))
        return Outcome("no error", "")
    return run


def config(edit: Callable[[dict], None], flat: bool = False) -> Callable[[Env], Outcome]:
    """InklingConfig.from_dict of the tiny checkpoint's released config (or its flat transformers
    spelling), after `edit`."""
    def fn(env: Env):
        cfg = tiny_random_config()
        d = json.loads(json.dumps(cfg.to_transformers_dict() if flat else cfg.to_released_dict()))
        edit(d)
        InklingConfig.from_dict(d)
    return api(fn)


def checkpoint(edit: Callable[[Path], None], **load_kwargs) -> Callable[[Env], Outcome]:
    """load_checkpoint of a copy of the tiny checkpoint changed by `edit`."""
    def fn(env: Env):
        load_checkpoint(env.copy("broken", edit), **load_kwargs)
    return api(fn)


# ---------------------------------------------------------------------- ways to break a checkpoint
def set_values(name: str, value: float, file: str = "model.safetensors", dtype=None):
    """Rewrite tensor `name` with a few entries set to `value` (and the whole file in `dtype`)."""
    def edit(d: Path):
        tensors = load_file(d / file)
        if dtype is not None:
            tensors = {n: t.to(dtype) for n, t in tensors.items()}
        t = tensors[name]
        t.view(-1)[::97] = value
        save_file(tensors, d / file)
    return edit


def corrupt_bytes(name: str, file: str = "model.safetensors"):
    """Overwrite the stored bytes of tensor `name` with random bytes (seeded), leaving the header intact."""
    def edit(d: Path):
        path = d / file
        raw = bytearray(path.read_bytes())
        header_len = int.from_bytes(raw[:8], "little")
        header = json.loads(raw[8: 8 + header_len])
        start, end = (8 + header_len + o for o in header[name]["data_offsets"])
        raw[start:end] = np.random.default_rng(0).integers(0, 256, end - start, dtype=np.uint8).tobytes()
        path.write_bytes(bytes(raw))
    return edit


def truncate(file: str, keep: float):
    def edit(d: Path):
        raw = (d / file).read_bytes()
        (d / file).write_bytes(raw[: int(len(raw) * keep)])
    return edit


def write(file: str, text: str):
    def edit(d: Path):
        (d / file).write_text(text)
    return edit


def drop(*files: str):
    def edit(d: Path):
        for f in files:
            (d / f).unlink()
    return edit


def edit_config(fn: Callable[[dict], None]):
    def edit(d: Path):
        cfg = json.loads((d / "config.json").read_text())
        fn(cfg)
        (d / "config.json").write_text(json.dumps(cfg))
    return edit


def both(*edits):
    def edit(d: Path):
        for e in edits:
            e(d)
    return edit


def text(**kv):
    return lambda d: d["text_config"].update(kv)


def rename(section: str | None, old: str, new: str):
    def edit(d: dict):
        part = d if section is None else d[section]
        part[new] = part.pop(old)
    return edit


# ---------------------------------------------------------------------- the cases
@dataclass
class Case:
    area: str
    given: str                         # the bad input, as a user would describe it
    run: Callable[[Env], Outcome]
    expect: str                        # the outcome's kind
    pattern: str                       # a substring the message must contain


def checkpoint_dir(name: str, edit=None):
    """A command-line argument: the path of a broken copy of the tiny checkpoint."""
    return lambda env: str(env.copy(name, edit))


GEN = ("generate", "--checkpoint", "{ckpt}")
UNREADABLE_TOKENIZER = write("tokenizer.json", '{"version": "1.0", "model": ')
NAN_WEIGHT = set_values("model.llm.layers.1.attn.wq_du.weight", math.nan)

def bad_flag(flag: str, value: str, pattern: str, sampling: bool = False) -> Case:
    """A command-line case that must exit with 2: `generate` on a fine prompt given `flag value`, after
    `--temperature 1` when `sampling` (flags that apply only when sampling)."""
    sample = ("--temperature", "1") if sampling else ()
    return Case("CLI", f"`{flag} {value}`", cli(*GEN, "--prompt-ids", "1 2", *sample, flag, value), "exit 2", pattern)


CASES = [
    # --- the command line: flags that no checkpoint makes valid (exit 2)
    bad_flag("--temperature", "nan", "argument --temperature: must be a finite number >= 0, got 'nan'"),
    bad_flag("--temperature", "inf", "must be a finite number >= 0, got 'inf'"),
    bad_flag("--temperature", "-0.5", "must be a finite number >= 0"),
    bad_flag("--top-p", "0", "argument --top-p: must be a finite number in (0, 1], got '0'", sampling=True),
    bad_flag("--top-p", "1.5", "in (0, 1], got '1.5'", sampling=True),
    bad_flag("--top-k", "0", "argument --top-k: must be an integer >= 1, got '0'", sampling=True),
    bad_flag("--threads", "0", "argument --threads: must be an integer from 1 to"),
    bad_flag("--threads", "two", "argument --threads: must be an integer from 1 to"),
    bad_flag("--k", "-1", "argument --k: must be an integer >= 0 or auto, got '-1'"),
    bad_flag("--max-new-tokens", "0", "argument --max-new-tokens: must be an integer >= 1, got '0'"),
    Case("CLI", '`--prompt-ids "1 x"`', cli(*GEN, "--prompt-ids", "1 x"),
         "exit 2", "argument --prompt-ids: must be integers separated by spaces"),
    Case("CLI", '`--prompt-ids ""`', cli(*GEN, "--prompt-ids", ""), "exit 2", "--prompt-ids is empty"),
    Case("CLI", '`--prompt ""`', cli(*GEN, "--prompt", ""), "exit 2", "--prompt is empty"),
    Case("CLI", "`--top-k 5` without `--temperature` (greedy: silently ignored before)",
         cli(*GEN, "--prompt-ids", "1 2", "--top-k", "5"),
         "exit 2", "--top-k only applies when sampling, and --temperature 0 (the default) decodes greedily"),
    Case("CLI", "`--seed 1 --top-p 0.9` with `--temperature 0`",
         cli(*GEN, "--prompt-ids", "1 2", "--seed", "1", "--top-p", "0.9", "--temperature", "0"),
         "exit 2", "--top-p and --seed only apply when sampling"),
    Case("CLI", "`--engine fast --dtype float64`", cli(*GEN, "--prompt-ids", "1 2", "--engine", "fast",
                                                       "--dtype", "float64"),
         "exit 2", "--engine fast runs --dtype float32 or bfloat16, not float64"),
    bad_flag("--dtype", "float16", "argument --dtype: invalid choice: 'float16'"),
    Case("CLI", "neither `--prompt` nor `--prompt-ids`", cli(*GEN), "exit 2",
         "one of the arguments --prompt --prompt-ids is required"),
    Case("CLI", "`convert SRC DST --max-shard-size 5XB`",
         cli("convert", "{ckpt}", "{tmp}/out", "--max-shard-size", "5XB"),
         "exit 2", "argument --max-shard-size: not a size: '5XB'"),
    # --- the command line: fine flags that these files cannot serve (exit 1)
    Case("CLI", "`--checkpoint` that does not exist", cli("generate", "--checkpoint", "{tmp}/nowhere",
                                                          "--prompt-ids", "1 2"),
         "exit 1", "checkpoint directory <tmp>/nowhere does not exist"),
    Case("CLI", "`--checkpoint` naming a file", cli("generate", "--checkpoint", "{ckpt}/config.json",
                                                    "--prompt-ids", "1 2"),
         "exit 1", "is a file; pass the checkpoint directory"),
    Case("CLI", "`--k 9` on a checkpoint with 8 MTP depths", cli(*GEN, "--prompt-ids", "1 2", "--k", "9"),
         "exit 1", "--k 9: the checkpoint <tmp>/ckpt has 8 MTP depths, so --k can be 0 to 8"),
    Case("CLI", "a checkpoint without an MTP head, at the default `--k 4`",
         cli("generate", "--checkpoint", checkpoint_dir("trunk", drop("mtp.safetensors")), "--prompt-ids", "1 2"),
         "exit 1", "has no MTP head (no complete model.mtp.* depth), so it cannot draft: use --k 0"),
    Case("CLI", '`--prompt-ids "1 999"` (vocabulary of 500)', cli(*GEN, "--prompt-ids", "1 999"),
         "exit 1", "the prompt (--prompt-ids) has token ids out of range 0..499: [999]"),
    Case("CLI", "`--max-new-tokens 1023` after a 2-token prompt (1024 positions)",
         cli(*GEN, "--prompt-ids", "1 2", "--max-new-tokens", "1023"),
         "exit 1", "with --max-new-tokens 1023 the sequence would reach 1025 tokens, beyond the model's maximum "
                   "length 1024: at most 1022 new tokens fit"),
    Case("CLI", "`--prompt TEXT` on a checkpoint without tokenizer.json", cli(*GEN, "--prompt", "def f():"),
         "exit 1", "--prompt needs a tokenizer, and <tmp>/ckpt has no tokenizer.json: pass token ids with "
                   "--prompt-ids"),
    Case("CLI", "`--prompt TEXT` with an unreadable tokenizer.json",
         cli("generate", "--checkpoint", checkpoint_dir("badtok", UNREADABLE_TOKENIZER), "--prompt", "def f():"),
         "exit 1", "<tmp>/badtok/tokenizer.json is not a readable tokenizer file"),
    Case("CLI", "`--prompt-ids` with an unreadable tokenizer.json (only needed to print text)",
         cli("generate", "--checkpoint", checkpoint_dir("badtok", UNREADABLE_TOKENIZER), "--prompt-ids", "1 2",
             "--k", "2", "--max-new-tokens", "4"),
         "exit 0", "warning: <tmp>/badtok/tokenizer.json is not a readable tokenizer file"),
    Case("CLI", "`--prompt TEXT` with a tokenizer whose vocabulary is larger than the model's",
         cli("generate", "--checkpoint",
             checkpoint_dir("bigtok", lambda d: shutil.copy(DEFAULT / "tokenizer.json", d)), "--prompt",
             "def fibonacci(n):"),
         "exit 1", "the prompt (--prompt, tokenized by <tmp>/bigtok/tokenizer.json) has token ids out of range 0..499"),
    Case("CLI", "`--engine fast` on a machine without a GPU", cli(*GEN, "--prompt-ids", "1 2", "--engine", "fast"),
         "exit 1", "--engine fast needs a CUDA GPU and none is available; use --engine ref"),
    Case("CLI", "a checkpoint whose weights hold NaN",
         cli("generate", "--checkpoint", checkpoint_dir("nan", NAN_WEIGHT), "--prompt-ids", "1 2"),
         "exit 1", "holds weights that are NaN or infinite"),
    Case("CLI", "`convert` of a directory that does not exist", cli("convert", "{tmp}/nowhere", "{tmp}/out"),
         "exit 1", "checkpoint directory <tmp>/nowhere does not exist"),

    # --- the API
    Case("API", "`generate(model, torch.tensor([[[1, 2]]]))`: rank 3",
         api(lambda env: generate(env.model, torch.tensor([[[1, 2]]]), max_new_tokens=2)),
         "ValueError", "prompt_ids has shape [1, 1, 2]: token ids come as [T] (one prompt) or [B, T] (a batch)"),
    Case("API", "`generate(model, torch.tensor([1.0, 2.0]))`: float ids",
         api(lambda env: generate(env.model, torch.tensor([1.0, 2.0]), max_new_tokens=2)),
         "ValueError", "prompt_ids has dtype torch.float32: token ids must be integers"),
    Case("API", "`generate(model, [1, 2.0])`", api(lambda env: generate(env.model, [1, 2.0], max_new_tokens=2)),
         "ValueError", "prompt_ids, position 1: 2.0 (float) is not a token id: token ids are integers"),
    Case("API", "`generate(model, [True, 2])`", api(lambda env: generate(env.model, [True, 2], max_new_tokens=2)),
         "ValueError", "prompt_ids, position 0: True (bool) is not a token id"),
    Case("API", "`generate(model, [[[1, 2]]])`: lists nested too deep",
         api(lambda env: generate(env.model, [[[1, 2]]], max_new_tokens=2)),
         "ValueError", "prompt 0, position 0: [1, 2] (list) is not a token id: token ids are integers (prompt_ids "
                       "is nested one level too deep)"),
    Case("API", "`generate(model, [1, [2]])`: ids and lists mixed",
         api(lambda env: generate(env.model, [1, [2]], max_new_tokens=2)),
         "ValueError", "prompt_ids mixes token ids and lists: prompt 0 is 1 (int)"),
    Case("API", "`generate(..., max_new_tokens=2.5)`",
         api(lambda env: generate(env.model, [1, 2], max_new_tokens=2.5)),
         "ValueError", "max_new_tokens must be an integer, got 2.5 (float)"),
    Case("API", "`generate(..., temperature=float('nan'))`",
         api(lambda env: generate(env.model, [1, 2], max_new_tokens=2, temperature=math.nan)),
         "ValueError", "temperature must be a finite number >= 0 (0 = greedy), got nan"),
    Case("API", "`SamplingParams(temperature=float('inf'))`", api(lambda env: SamplingParams(math.inf)),
         "ValueError", "temperature must be a finite number >= 0 (0 = greedy), got inf"),
    Case("API", "`generate(..., top_k=2.5)`",
         api(lambda env: generate(env.model, [1, 2], max_new_tokens=2, temperature=1.0, top_k=2.5)),
         "ValueError", "top_k must be an integer >= 1 (or None), got 2.5"),
    Case("API", "`generate(..., top_p=float('nan'))`",
         api(lambda env: generate(env.model, [1, 2], max_new_tokens=2, temperature=1.0, top_p=math.nan)),
         "ValueError", "top_p must be a number in (0, 1] (or None), got nan"),
    Case("API", "`generate(..., seed='1')`",
         api(lambda env: generate(env.model, [1, 2], max_new_tokens=2, temperature=1.0, seed="1")),
         "ValueError", "seed must be an integer or None, got '1' (str)"),
    Case("API", "`generate(..., eos_token_id=4000)` (vocabulary of 500)",
         api(lambda env: generate(env.model, [1, 2], max_new_tokens=2, eos_token_id=4000)),
         "ValueError", "eos_token_id must be a token id in 0..499 or None, got 4000 (int)"),
    Case("API", "`generate(model, ..., num_speculative_tokens=9)` on 8 loaded depths",
         api(lambda env: generate(env.model, [1, 2], max_new_tokens=2, num_speculative_tokens=9)),
         "ValueError", "num_speculative_tokens=9 needs 9 MTP depths; the model has 8 loaded"),
    Case("API", "`generate('path/to/checkpoint', ...)`: a path instead of a model",
         api(lambda env: generate(str(env.ckpt), [1, 2], max_new_tokens=2)),
         "ValueError", "model must be an InklingModel (e.g. load_checkpoint(path)), got str"),
    Case("API", "`model.logits(torch.tensor([1, 2]))`: one sequence without its batch axis",
         api(lambda env: env.model.logits(torch.tensor([1, 2]))),
         "ValueError", "input_ids must be a [B, T] tensor of token ids, got shape [2] (one sequence: ids[None])"),
    Case("API", "`model.logits(torch.tensor([[1.0, 2.0]]))`",
         api(lambda env: env.model.logits(torch.tensor([[1.0, 2.0]]))),
         "TypeError", "input_ids must be an integer tensor, got torch.float32"),
    Case("API", "`load_checkpoint(path, num_mtp_depths=-1)`",
         api(lambda env: load_checkpoint(env.ckpt, num_mtp_depths=-1)),
         "CheckpointError", "num_mtp_depths must be an integer >= 0 or None, got -1"),
    Case("API", "`load_checkpoint(path, dtype=torch.int8)`",
         api(lambda env: load_checkpoint(env.ckpt, dtype=torch.int8)),
         "CheckpointError", "dtype=torch.int8 cannot be loaded"),

    # --- configs (InklingConfig.from_dict; load_checkpoint and the command line add the file's path)
    Case("config", "`sconv_kernal_size` (a typo of sconv_kernel_size)",
         config(rename("text_config", "sconv_kernel_size", "sconv_kernal_size")),
         "ConfigError", "unknown config field 'text_config.sconv_kernal_size' (did you mean "
                        "'text_config.sconv_kernel_size'?)"),
    Case("config", "`mtp_confg` (a typo that would drop the MTP head)", config(rename(None, "mtp_config", "mtp_confg")),
         "ConfigError", "unknown config field 'mtp_confg' (did you mean 'mtp_config'?)"),
    Case("config", "`mtp_config.num_nextn_predict_layer`",
         config(rename("mtp_config", "num_nextn_predict_layers", "num_nextn_predict_layer")),
         "ConfigError", "(did you mean 'mtp_config.num_nextn_predict_layers'?)"),
    Case("config", "flat transformers config with `rms_norm_esp`", config(rename(None, "rms_norm_eps", "rms_norm_esp"),
                                                                         flat=True),
         "ConfigError", "unknown config field 'rms_norm_esp' (did you mean 'rms_norm_eps'?)"),
    Case("config", '`"use_embed_norm": "false"` (a string)', config(text(use_embed_norm="false")),
         "ConfigError", "config field 'use_embed_norm': must be true or false, got 'false'"),
    Case("config", '`"tie_word_embeddings": 1`', config(text(tie_word_embeddings=1)),
         "ConfigError", "config field 'tie_word_embeddings': must be true or false, got 1"),
    Case("config", '`"chain_hidden_post_norm": "false"`',
         config(lambda d: d["mtp_config"].update(chain_hidden_post_norm="false")),
         "ConfigError", "must be true or false, got 'false'"),
    Case("config", '`"hidden_size": true`', config(text(hidden_size=True)),
         "ConfigError", "config field 'hidden_size': must be a positive integer, got True"),
    Case("config", '`"num_hidden_layers": 4.0`', config(text(num_hidden_layers=4.0)),
         "ConfigError", "must be a positive integer, got 4.0"),
    Case("config", '`"rms_norm_eps": "1e-6"`', config(text(rms_norm_eps="1e-6")),
         "ConfigError", "config field 'rms_norm_eps': must be a positive number, got '1e-6'"),
    Case("config", '`"log_scaling_alpha": NaN`', config(text(log_scaling_alpha=math.nan)),
         "ConfigError", "config field 'log_scaling_alpha': must be a number >= 0, got nan"),
    Case("config", '`"mtp_config": false`', config(lambda d: d.update(mtp_config=False)),
         "ConfigError", "config field 'mtp_config': must be an object, got False"),
    Case("config", '`"local_layer_ids": [0, 0, 2]`', config(text(local_layer_ids=[0, 0, 2])),
         "ConfigError", "config field 'local_layer_ids': ids [0] are listed more than once"),
    Case("config", "`sliding_window_size` and `sliding_window` disagree",
         config(text(sliding_window=32)),
         "ConfigError", "sliding_window_size, sliding_window spell the same field 'sliding_window' with different"),

    # --- checkpoints (load_checkpoint; the command line prints the same message)
    Case("checkpoint", "a weight holding NaN", checkpoint(NAN_WEIGHT),
         "CheckpointError", "model.llm.layers.1.attn.wq_du.weight in model.safetensors: 43 of 4096 values"),
    Case("checkpoint", "a weight holding infinity (MTP head)",
         checkpoint(set_values("model.mtp.layers.3.input_proj.weight", math.inf, file="mtp.safetensors")),
         "CheckpointError", "model.mtp.layers.3.input_proj.weight in mtp.safetensors"),
    Case("checkpoint", "random bytes over a weight's data behind an intact header",
         checkpoint(corrupt_bytes("model.llm.layers.2.mlp.experts.w13_weight")),
         "CheckpointError", "model.llm.layers.2.mlp.experts.w13_weight in model.safetensors"),
    Case("checkpoint", "float64 weights beyond float32's range, loaded in float32",
         checkpoint(set_values("model.llm.embed.weight", 1e300, dtype=torch.float64)),
         "CheckpointError", "weights overflow dtype=float32 (load in a wider dtype"),
    Case("checkpoint", "a truncated model.safetensors", checkpoint(truncate("model.safetensors", 0.5)),
         "CheckpointError", "<tmp>/broken/model.safetensors: not a readable safetensors file"),
    Case("checkpoint", "model.safetensors that is not a safetensors file",
         checkpoint(write("model.safetensors", "not a tensor file")),
         "CheckpointError", "model.safetensors: not a readable safetensors file"),
    Case("checkpoint", "no config.json", checkpoint(drop("config.json")),
         "CheckpointError", "<tmp>/broken: missing config.json"),
    Case("checkpoint", "config.json that is not JSON", checkpoint(write("config.json", '{"text_config": {')),
         "CheckpointError", "config.json: malformed JSON"),
    Case("checkpoint", "a typo in config.json (`num_attention_head`)",
         checkpoint(edit_config(rename("text_config", "num_attention_heads", "num_attention_head"))),
         "ConfigError", "<tmp>/broken/config.json: unknown config field 'text_config.num_attention_head'"),
    Case("checkpoint", "only a pickled pytorch_model.bin",
         checkpoint(both(drop("model.safetensors", "mtp.safetensors"), write("pytorch_model.bin", "pickle"))),
         "CheckpointError",
         "found ['pytorch_model.bin'], which would need unpickling: only safetensors files are read"),
    Case("checkpoint", "a missing tensor",
         checkpoint(lambda d: save_file({n: t for n, t in load_file(d / "model.safetensors").items()
                                         if n != "model.llm.norm.weight"}, d / "model.safetensors")),
         "CheckpointError", "missing tensors (1):\n    model.llm.norm.weight"),
    Case("checkpoint", "`num_mtp_depths=4` of a checkpoint whose depth 3 lacks a tensor",
         checkpoint(lambda d: save_file({n: t for n, t in load_file(d / "mtp.safetensors").items()
                                         if n != "model.mtp.layers.3.input_proj.weight"}, d / "mtp.safetensors"),
                    num_mtp_depths=4),
         "CheckpointError", "num_mtp_depths=4 requested, but checkpoint <tmp>/broken has 3 complete MTP depth(s) "
                            "(its config.json declares 8); depth 3 lacks: model.mtp.layers.3.input_proj.weight"),
]

# ---------------------------------------------------------------------- check-port: dumps it cannot check
# (one block, spliced into the command line's cases below; docs/port_checker.md is the format)
from safetensors import safe_open  # noqa: E402

from inkling_ref.port_check import capture_reference  # noqa: E402


def port_dump(env: Env) -> Path:
    """A good dump of the tiny checkpoint (reference cycle, k = 2, 3 cycles), written once per session."""
    path = env.root / "port_dump.safetensors"
    if not path.exists():
        capture_reference(env.model, list(range(3, 20)), 2, 3, path)
    return path


def dump_arg(name: str, edit: Callable[[dict, dict], None] | None = None):
    """A command-line argument: the path of a copy of the good dump changed by edit(tensors, metadata)."""
    def arg(env: Env) -> str:
        with safe_open(port_dump(env), framework="pt") as f:
            meta, tensors = dict(f.metadata()), {n: f.get_tensor(n) for n in f.keys()}
        if edit is not None:
            edit(tensors, meta)
        path = env.root / f"{name}.safetensors"
        save_file(tensors, path, metadata=meta)
        return str(path)
    return arg


def other_seed_checkpoint(env: Env) -> str:
    """The tiny checkpoint's shapes with other weights (seed 1)."""
    path = env.root / "other_seed"
    if not path.exists():
        save_checkpoint(random_model(tiny_random_config(), seed=1), path)
    return str(path)


def set_field(name: str, fn):
    return lambda tensors, meta: tensors.update({name: fn(tensors[name])})


def drop_field(name: str, rename_to: str | None = None):
    def edit(tensors, meta):
        t = tensors.pop(name)
        if rename_to:
            tensors[rename_to] = t
    return edit


def one_wrong_draft(tensors, meta):
    """Step 0's first draft changed: if it was accepted, the committed token no longer follows from it."""
    n0 = int(tensors["step_n"][0])
    tensors["step_drafts"][0, 0] = (int(tensors["tokens"][n0]) + 1) % 500
    tensors["step_n"][1] = max(int(tensors["step_n"][1]), n0 + 2)


def port_check(dump, checkpoint="{ckpt}", *flags):
    return cli("check-port", dump, "--checkpoint", checkpoint, *flags)


PORT_DUMP_CASES = [
    Case("CLI", "`check-port` of a dump that does not exist", port_check("{tmp}/nowhere.safetensors"),
         "exit 1", "<tmp>/nowhere.safetensors: no such file"),
    Case("CLI", "`check-port` without `--checkpoint`", cli("check-port", dump_arg("good")),
         "exit 2", "the following arguments are required: --checkpoint"),
    Case("CLI", "`check-port` of a checkpoint's safetensors file instead of a dump",
         port_check("{ckpt}/mtp.safetensors"),
         "exit 1", "<tmp>/ckpt/mtp.safetensors: not a port dump (its safetensors metadata lacks "
                   "format=inkling-mtp-port-dump)"),
    Case("CLI", "`check-port` of a file that is not safetensors", port_check("{ckpt}/config.json"),
         "exit 1", "<tmp>/ckpt/config.json: not a readable safetensors file"),
    Case("CLI", "a dump of another format version",
         port_check(dump_arg("version", lambda t, m: m.update(version="2"))),
         "exit 1", "dump format version '2'; this checker reads version 1"),
    Case("CLI", "a dump without `row_hidden` (a required field)", port_check(dump_arg("no_rows", drop_field("row_hidden"))),
         "exit 1", "missing required field(s) 'row_hidden'; a dump holds tokens, hidden, step_n, step_k"),
    Case("CLI", "a dump whose field is misspelled `row_hiden`",
         port_check(dump_arg("typo", drop_field("row_hidden", "row_hiden"))),
         "exit 1", "missing required field(s) 'row_hidden' (the file has 'row_hiden')"),
    Case("CLI", "a dump whose `tokens` are float32",
         port_check(dump_arg("float_tokens", set_field("tokens", lambda t: t.float()))),
         "exit 1", "field 'tokens' must hold integers (int32 or int64), got torch.float32"),
    Case("CLI", "a dump whose `row_hidden` are int64",
         port_check(dump_arg("int_hidden", set_field("row_hidden", lambda t: t.long()))),
         "exit 1", "field 'row_hidden' must be float16, bfloat16, float32 or float64, got torch.int64"),
    Case("CLI", "a dump whose `hidden` is one-dimensional",
         port_check(dump_arg("flat_hidden", set_field("hidden", lambda t: t.flatten()))),
         "exit 1", "field 'hidden' must have 2 dimension(s), got shape"),
    Case("CLI", "a dump with fewer `row_hidden` rows than `row_step` lists",
         port_check(dump_arg("short_rows", set_field("row_hidden", lambda t: t[:-3]))),
         "exit 1", "field 'row_hidden' has 43 rows; row_step lists 46"),
    Case("CLI", "a dump whose depth skipped a row of its window",
         port_check(dump_arg("gap", set_field("row_position", lambda t: t.where(t != 5, 4)))),
         "exit 1", "step 0, depth 0: rows 0..16 with 1 repeated, 1 missing (first 5); a depth's rows in a step must "
                   "be contiguous, once each, ending at n-2 = 16"),
    Case("CLI", "a dump whose accepted draft is not the committed token", port_check(dump_arg("wrong_draft",
                                                                                                one_wrong_draft)),
         "exit 1", "step 0 accepted 1 draft(s) (n goes 18 -> 20) but tokens[18:19] = [490] are not its drafts [491]"),
    Case("CLI", "a dump holding NaN in `hidden`",
         port_check(dump_arg("nan", set_field("hidden", lambda t: t.index_fill(0, torch.tensor([2]), math.nan)))),
         "exit 1", "field 'hidden' holds NaN or infinite values"),
    Case("CLI", "a dump with token id 999 (vocabulary of 500)",
         port_check(dump_arg("big_id", set_field("tokens", lambda t: t.index_fill(0, torch.tensor([0]), 999)))),
         "exit 1", "field 'tokens' holds token id 999; the checkpoint's vocabulary is 0..499"),
    Case("CLI", "a dump checked against another model (the demo checkpoint)",
         port_check(dump_arg("good"), str(DEFAULT)),
         "exit 1", "its hidden states are 64 wide and the checkpoint's hidden_size is 256: the dump comes from "
                   "another model"),
    Case("CLI", "a dump checked against a checkpoint of the same shapes and other weights",
         port_check(dump_arg("good"), other_seed_checkpoint),
         "exit 1", "written with another checkpoint: its checkpoint_probe (MTP depth 0 input_proj.weight[0, :16]) "
                   "differs"),
    Case("CLI", "a dump checked against a checkpoint without an MTP head",
         port_check(dump_arg("good"), checkpoint_dir("trunk", drop("mtp.safetensors"))),
         "exit 1", "its steps ran 2 MTP depths and the checkpoint <tmp>/trunk has 0: the dump comes from another "
                   "checkpoint"),
]
_AT = next(i for i, c in enumerate(CASES) if c.area != "CLI")   # after the command line's other cases
CASES[_AT:_AT] = PORT_DUMP_CASES


def tensor_as(name: str, dtype, file: str = "model.safetensors"):
    """Store tensor `name` in `dtype`."""
    def edit(d: Path):
        tensors = load_file(d / file)
        tensors[name] = tensors[name].to(dtype)
        save_file(tensors, d / file)
    return edit


def without(section: str, key: str):
    return edit_config(lambda c: c[section].pop(key))


def set_key(section: str, key: str, value):
    return edit_config(lambda c: c[section].update({key: value}))


def drop_key(section: str | None, key: str):
    def edit(d: dict):
        (d if section is None else d[section]).pop(key)
    return edit


def earlier_checkpoint(env: Env, d: Path) -> None:
    """An earlier conversion in d, and a file of the user's beside it."""
    convert_transformers_checkpoint(env.hf_source(), d)
    (d / "tokenizer.json").write_text("{}")


def user_files(env: Env, d: Path) -> None:
    d.mkdir(parents=True)
    (d / "thesis.tex").write_text("years of work")


def meta_ids(env: Env):
    return torch.tensor([[1, 2]], device="meta")


def same_tokens(env: Env, **kwargs) -> str:
    want = generate(env.model, [1, 2, 3], max_new_tokens=6, num_speculative_tokens=2)
    got = generate(env.model, [1, 2, 3], max_new_tokens=6, num_speculative_tokens=2, seed=1, **kwargs)
    if got.token_ids != want.token_ids:
        raise AssertionError(f"{got.token_ids} differ from greedy {want.token_ids}")
    return f"the greedy tokens {got.token_ids[0]}, acceptance length {got.stats.acceptance_length:.2f} as greedy"


def absurd_route_scale(env: Env):
    cfg = tiny_random_config().replace(route_scale=1e300)
    model = random_model(cfg, seed=0)
    generate(model, [1, 2, 3], max_new_tokens=4, num_speculative_tokens=2)


def load_on_cuda_without_cuda(env: Env):
    with mock.patch.object(torch.cuda, "is_available", lambda: False):   # as on a machine without a GPU
        load_checkpoint(env.ckpt, device="cuda")


TINY_T = ("--temperature", "1e-310")
HUGE = "99999999999"

CASES += [
    # --- the command line: flags without bounds before (exit 2)
    bad_flag("--threads", "5000", "argument --threads: must be an integer from 1 to"),
    bad_flag("--threads", HUGE, "argument --threads: must be an integer from 1 to"),
    Case("CLI", '`--checkpoint ""` (silently the bundled demo before)',
         cli("generate", "--checkpoint", "", "--prompt-ids", "1 2"),
         "exit 2", "argument --checkpoint: an empty path ('')"),
    Case("CLI", "`--prompt` whose bytes are not UTF-8 (`caf\\xe9`, a tokenizer traceback before)",
         cli(*GEN, "--prompt", "caf\udce9"),
         "exit 2", "argument --prompt: not valid UTF-8 text (byte 0xe9 at character 3)"),
    Case("CLI", '`convert SRC ""`', cli("convert", "{ckpt}", ""), "exit 2", "argument DST: an empty path ('')"),
    Case("CLI", '`convert "" DST`', cli("convert", "", "{tmp}/out"), "exit 2", "argument SRC: an empty path ('')"),
    Case("CLI", "`convert SRC DST --max-shard-size 0.5` (0 bytes)",
         cli("convert", "{ckpt}", "{tmp}/out", "--max-shard-size", "0.5"),
         "exit 2", "argument --max-shard-size: '0.5' is less than one byte"),
    Case("CLI", "`convert SRC DST --overwrite --max-shard-size 0.5` over an earlier checkpoint (emptied DST before; "
                "DST is left byte-identical)",
         leaves_dst(cli("convert", lambda env: str(env.hf_source()), "{tmp}/earlier", "--overwrite",
                        "--max-shard-size", "0.5"), "earlier", earlier_checkpoint),
         "exit 2", "'0.5' is less than one byte"),
    # --- the command line: these files cannot serve it (exit 1)
    Case("CLI", "`convert SRC DST --overwrite` into a directory of other files (DST is left byte-identical)",
         leaves_dst(cli("convert", lambda env: str(env.hf_source()), "{tmp}/home", "--overwrite"), "home",
                    user_files),
         "exit 1", "<tmp>/home is not empty and holds no checkpoint (thesis.tex): refusing to write a checkpoint "
                   "into it, even with overwrite"),
    Case("CLI", f"`--k {HUGE}`", cli(*GEN, "--prompt-ids", "1 2", "--k", HUGE),
         "exit 1", f"--k {HUGE}: the checkpoint <tmp>/ckpt has 8 MTP depths, so --k can be 0 to 8"),
    Case("CLI", f"`--max-new-tokens {HUGE}`", cli(*GEN, "--prompt-ids", "1 2", "--max-new-tokens", HUGE),
         "exit 1", "at most 1022 new tokens fit"),
    Case("CLI", '`--prompt-ids "-1 2"`', cli(*GEN, "--prompt-ids", "-1 2"),
         "exit 1", "the prompt (--prompt-ids) has token ids out of range 0..499: [-1]"),
    Case("CLI", "a config.json with `route_scale` 1e300 (every logit NaN: one repeated token and 100 % acceptance "
                "before)",
         cli("generate", "--checkpoint", checkpoint_dir("route", set_key("text_config", "route_scale", 1e300)),
             "--prompt-ids", "1 2", "--max-new-tokens", "4"),
         "exit 1", "the prefill pass produced NaN or infinite values, so no token can be chosen from it"),
    Case("CLI", "a config.json with `logits_mup_width_multiplier` 1e-300 (0 in float32)",
         cli("generate", "--checkpoint", checkpoint_dir("mup", set_key("text_config", "logits_mup_width_multiplier",
                                                                       1e-300)),
             "--prompt-ids", "1 2", "--max-new-tokens", "4"),
         "exit 1", "the prefill pass produced NaN or infinite values"),
    *[Case("CLI", f"a config.json without `{key}` (silently the full-size model's value before)",
           cli("generate", "--checkpoint", checkpoint_dir("nokey", without("text_config", key)), "--prompt-ids", "1 2"),
           "exit 1", f"<tmp>/nokey/config.json: config field '{field}'")
      for key, field in (("route_scale", "route_scale"), ("num_experts_per_tok", "num_experts_per_tok"),
                         ("logits_mup_width_multiplier", "mup"), ("log_scaling_n_floor", "log_scaling_n_floor"))],
    Case("CLI", "a config.json declaring 200,000 layers (a hang before)",
         cli("generate", "--checkpoint", checkpoint_dir("layers", set_key("text_config", "num_hidden_layers", 200000)),
             "--prompt-ids", "1 2"),
         "exit 1", "(num_hidden_layers in config.json): 200000 layers is beyond any model (at most 10000)"),
    Case("CLI", "a config.json declaring 5,000 layers (4 in the files)",
         cli("generate", "--checkpoint", checkpoint_dir("layers", set_key("text_config", "num_hidden_layers", 5000)),
             "--prompt-ids", "1 2"),
         "exit 1", "= 5000, but its files hold 4 trunk layers (model.llm.layers.0 .. 3): config.json does not "
                   "describe these weights"),
    Case("CLI", "a config.json declaring 5,000 MTP depths (a hang before)",
         cli("generate", "--checkpoint", checkpoint_dir("depths", both(
             set_key("mtp_config", "num_nextn_predict_layers", 5000), set_key("mtp_config", "local_layer_ids", []))),
             "--prompt-ids", "1 2"),
         "exit 1", "= 5000, but its files hold 8 MTP depth(s) (model.mtp.layers.0 .. 7)"),
    Case("CLI", "`--temperature 1e-310` (the last id every time before)",
         cli_like((*GEN, "--prompt-ids", "1 2 3", "--k", "2", "--max-new-tokens", "6", *TINY_T),
                  (*GEN, "--prompt-ids", "1 2 3", "--k", "2", "--max-new-tokens", "6"),
                  "exit 0: prints what --temperature 0 prints ({out}), the greedy limit"),
         "exit 0", "the greedy limit"),

    # --- the API
    Case("API", "`generate(..., max_new_tokens=[5])` (a list deep inside before)",
         api(lambda env: generate(env.model, [1, 2], max_new_tokens=[5])),
         "ValueError", "max_new_tokens must be an integer, got [5] (list): this generate takes one limit for every "
                       "prompt"),
    Case("API", "`generate(..., num_speculative_tokens=[2])`",
         api(lambda env: generate(env.model, [1, 2], max_new_tokens=2, num_speculative_tokens=[2])),
         "ValueError", "num_speculative_tokens must be an integer or \"auto\", got [2] (list)"),
    Case("API", "`generate(..., top_k=[5])`",
         api(lambda env: generate(env.model, [1, 2], max_new_tokens=2, temperature=1.0, top_k=[5])),
         "ValueError", "top_k must be an integer >= 1 (or None), got [5]"),
    Case("API", "`generate(model, ids)` with ids on the meta device",
         api(lambda env: generate(env.model, meta_ids(env), max_new_tokens=2)),
         "ValueError", "prompt_ids is on the meta device, which holds no values"),
    Case("API", "`model.logits(ids)` with ids on the meta device", api(lambda env: env.model.logits(meta_ids(env))),
         "ValueError", "input_ids is on the meta device, which holds no values"),
    Case("API", "`model.logits(torch.zeros(1, 0, dtype=torch.long))`: no tokens",
         api(lambda env: env.model.logits(torch.zeros(1, 0, dtype=torch.long))),
         "ValueError", "input_ids has no tokens (shape [1, 0])"),
    Case("API", "`model.mtp_logits(torch.zeros(0, 3, dtype=torch.long))`: no sequences",
         api(lambda env: env.model.mtp_logits(torch.zeros(0, 3, dtype=torch.long))),
         "ValueError", "input_ids has no tokens (shape [0, 3])"),
    Case("API", "`model.hidden(ids)` with int64 ids as int16", api(lambda env: env.model.hidden(
        torch.tensor([[1, 2]], dtype=torch.int16))),
         "TypeError", "input_ids must be an integer tensor, got torch.int16"),
    Case("API", "`generate(..., temperature=1e-310)` (the last id every time before)",
         runs(lambda env: same_tokens(env, temperature=1e-310)), "runs", "the greedy tokens"),
    Case("API", "`generate(..., temperature=5e-324)`: the smallest positive double",
         runs(lambda env: same_tokens(env, temperature=5e-324, top_p=0.5)), "runs", "the greedy tokens"),
    Case("API", "`generate(model)` of a model whose `route_scale` is 1e300",
         api(absurd_route_scale), "NonFiniteError", "the prefill pass produced NaN or infinite values"),
    Case("API", '`load_checkpoint(path, device="cuda")` on a machine without CUDA',
         api(load_on_cuda_without_cuda),
         "CheckpointError", "device='cuda', but this machine has no CUDA GPU"),
    Case("API", '`load_checkpoint(path, device="meta")`', api(lambda env: load_checkpoint(env.ckpt, device="meta")),
         "CheckpointError", "device='meta' holds no values"),
    Case("API", '`load_checkpoint("")`', api(lambda env: load_checkpoint("")),
         "CheckpointError", "a checkpoint path must be a non-empty str or Path, got ''"),
    Case("API", "`load_checkpoint(None)`", api(lambda env: load_checkpoint(None)),
         "CheckpointError", "a checkpoint path must be a non-empty str or Path, got None"),
    Case("API", "`save_checkpoint(model, dir, overwrite=True)` into a directory of other files",
         leaves_dst(api(lambda env: save_checkpoint(env.model, env.root / "home", overwrite=True)), "home", user_files),
         "CheckpointError", "is not empty and holds no checkpoint (thesis.tex)"),
    Case("API", "`save_checkpoint(model, dir, max_shard_bytes=0)`",
         api(lambda env: save_checkpoint(env.model, env.root / "out0", max_shard_bytes=0)),
         "CheckpointError", "max_shard_bytes must be a positive integer or None, got 0"),
    Case("API", "`convert_transformers_checkpoint(src, dst, max_shard_bytes=0, overwrite=True)` over an earlier "
                "checkpoint (DST is left byte-identical)",
         leaves_dst(api(lambda env: convert_transformers_checkpoint(env.hf_source(), env.root / "earlier",
                                                                    max_shard_bytes=0, overwrite=True)),
                    "earlier", earlier_checkpoint),
         "CheckpointError", "max_shard_bytes must be a positive integer or None, got 0"),

    # --- configs
    *[Case("config", f"no `{key}` (the full-size model's {default} before)", config(drop_key("text_config", key)),
           "ConfigError", f"is missing{why}: it changes what the model computes and has no safe default")
      for key, default, why in (("route_scale", "8.0", " and the model has MoE layers"),
                                ("num_experts_per_tok", "6", " and the model has MoE layers"),
                                ("logits_mup_width_multiplier", "24", ""), ("log_scaling_n_floor", "128000", ""),
                                ("rms_norm_eps", "1e-6", ""), ("head_dim", "128", ""),
                                ("local_layer_ids", "every sixth layer global", ""),
                                ("model_max_length", "131072", ""))],
    Case("config", "no `mtp_config.chain_hidden_post_norm` with 8 MTP depths",
         config(drop_key("mtp_config", "chain_hidden_post_norm")),
         "ConfigError", "is missing and the model has MTP depths"),
    Case("config", "no `mtp_config.local_layer_ids` with 8 MTP depths (all global before)",
         config(drop_key("mtp_config", "local_layer_ids")),
         "ConfigError", "'mtp_layer_types' (released config.json: mtp_config.local_layer_ids; transformers: "
                        "mtp_local_layer_ids) is missing and the model has MTP depths"),
    Case("config", '`"num_hidden_layers": 1e12` (as an integer)', config(text(num_hidden_layers=10**12)),
         "ConfigError", "1000000000000 layers is beyond any model (at most 10000)"),
    Case("config", '`"hidden_size": 10**15`', config(text(hidden_size=10**15)),
         "ConfigError", "config field 'hidden_size': 1000000000000000 is beyond any model (at most 2147483647)"),
    Case("config", '`"num_nextn_predict_layers": 10**9`',
         config(lambda d: d["mtp_config"].update(num_nextn_predict_layers=10**9, local_layer_ids=[])),
         "ConfigError", "1000000000 MTP depths is beyond any model (at most 10000)"),

    # --- checkpoints
    Case("checkpoint", "an int32 weight (called quantized before)",
         checkpoint(tensor_as("model.llm.norm.weight", torch.int32)),
         "CheckpointError", "holds tensors of dtype I32, which no weight of this model has"),
    Case("checkpoint", "a config declaring 5,000 MTP depths, loaded with `num_mtp_depths=4`",
         checkpoint(both(set_key("mtp_config", "num_nextn_predict_layers", 5000),
                         set_key("mtp_config", "local_layer_ids", [])), num_mtp_depths=4),
         "CheckpointError", "= 5000, but its files hold 8 MTP depth(s)"),
    Case("checkpoint", "a config whose `n_routed_experts` is 2**31 - 1",
         checkpoint(set_key("text_config", "n_routed_experts", 2**31 - 1)),
         "CheckpointError", "config field 'n_routed_experts' = 2147483647 is larger than any dimension of any tensor "
                            "in its files (the largest is 512)"),
    Case("checkpoint", "a config whose `hidden_size` is 10**7",
         checkpoint(set_key("text_config", "hidden_size", 10**7)),
         "CheckpointError", "config field 'hidden_size' = 10000000 is larger than any dimension"),
]

def run_case(case: Case, env: Env) -> Outcome:
    """Run one case; paths in its message are shown as <tmp>/ and <repo>/."""
    out = case.run(env)
    message = out.message.replace(str(env.root), "<tmp>").replace(str(REPO), "<repo>")
    return Outcome(out.kind, message)


assert inkling_ref  # the package under test, imported from the working tree


# ---------------------------------------------------------------------- the table
def shown(out: Outcome) -> str:
    """What a user reads: for the command line, its `inkling-mtp ...: error:` (or warning) line and the
    lines listed under it, without argparse's usage lines or the statistics; otherwise the message."""
    if not out.kind.startswith("exit"):
        return out.message.rstrip("\n")
    lines = out.message.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith("inkling-mtp ")), None)
    if start is None:   # a run that works: the case's own words for what it printed
        return out.message.strip()
    end = next((i for i in range(start + 1, len(lines)) if not lines[i].startswith(" ")), len(lines))
    return "\n".join(lines[start:end])


def _cell(text: str) -> str:
    spans = []
    for line in text.splitlines():
        line = line.strip().replace("|", "\\|")
        spans.append(f"`` {line} ``" if "`" in line else f"`{line}`")
    return "<br>".join(spans)


HEADER = """\
# Bad inputs and the errors they get

Every row is a case of `tests/bad_inputs.py`, run by `tests/test_bad_inputs.py`; this file is written
from their outcomes by `python scripts/bad_inputs_table.py`, and a test fails when it differs from
what the code gives now. Paths are shown as `<tmp>/` (a scratch directory) and `<repo>/`. Words that
Python, safetensors or tokenizers put inside a message (in parentheses after "not a readable ... file",
after "malformed JSON:") are those of the versions that wrote this file and may differ with others, and
the largest `--threads` is the number of CPUs of the machine that wrote it.

The rules:

- **Command line** (`inkling-mtp`): one line `inkling-mtp COMMAND: error: ...` that names the flag or
  file and what would be valid, in the command line's words (`--k 9`, never `num_speculative_tokens=9`),
  and never a traceback. Exit status **2** when the command line is invalid whatever the checkpoint
  (a flag's value, flags that contradict each other; argparse prints the usage above the error line),
  **1** when it cannot run with these files (checkpoint, config, tokenizer, or a prompt, `--k` or
  `--max-new-tokens` beyond what the checkpoint holds, or a model that computes NaN or infinity). A case
  whose outcome is `exit 0` or `runs` is one that failed silently before and now does what a user expects.
- **API**: a `ValueError` (or its subclasses `ConfigError` and `CheckpointError`) whose message names the
  argument, field or tensor and what is valid; a tensor of the wrong dtype given to the model is a
  `TypeError`. Checkpoint errors list every offending tensor, one per line, under one summary line.

Decisions:

- `--top-k`, `--top-p` or `--seed` with `--temperature 0` (greedy, the default) is an error rather than
  silently ignored: the user asked for sampling and would otherwise not get it.
- `--prompt-ids` does not need the tokenizer: an unreadable `tokenizer.json` is then a warning and the
  continuation is printed as token ids. `--prompt TEXT` needs it, so there it is an error.
- A config key that is not an Inkling field is an error only where it looks like a misspelling of a field
  the file leaves out (closest spelling by `difflib`, ratio >= 0.8); other keys belong to transformers or
  to the other towers and are ignored.
- Every config key that changes what the model computes must be in config.json (docs/checkpoint.md lists
  every key, required or optional with its default); the config's layer and depth counts and its sizes
  are checked against the safetensors headers before anything is built from them.
- Every pass of generate checks that what it chooses tokens from is finite (the reference: hidden
  states and logits; the fast engine, on the device: the largest logit of each row inside the greedy
  accept kernel, the sums of the probabilities when sampling): a model that overflows stops with the
  step it overflowed in.
- A temperature down to the smallest positive double samples the greedy limit.
- `convert` and `save_checkpoint` check every argument before they touch the destination, write beside
  it and swap the result in when complete, and never write into a non-empty directory that holds no
  checkpoint: a failure leaves the destination as it was.
- Every weight is checked to be finite as it loads, and again after the cast to the requested dtype.
  Corrupted bytes are caught where they decode to NaN or infinity (random bytes do within a few hundred
  values); a corruption that decodes only to finite numbers cannot be told from a weight by its value.

Beyond these rows, `tests/test_fuzz.py` fuzzes `inkling-mtp generate`: random edits of a copy of the
demo checkpoint (config keys deleted, scaled, negated or retyped; tensor files truncated, bit-flipped
or reshaped; the tokenizer corrupted) with random flag values. Every case must exit 0 with finite
statistics, or exit 1 or 2 with one error line and no traceback, within a time limit. CI runs a fixed,
derandomized set of 25 examples. A longer run:
`INKLING_FUZZ_EXAMPLES=2000 INKLING_FUZZ_RANDOM=1 python -m pytest tests/test_fuzz.py`.

"""


# Text that comes from Python, safetensors or tokenizers inside our messages, and may change with their
# versions: the table test compares the table with these parts masked.
LIBRARY_TEXT = [re.compile(p) for p in (
    r"(not a readable safetensors file) \([^`]*\)",
    r"(is not a readable tokenizer file) \([^`]*?\);",
    r"(malformed JSON): [^`]*",
    r"(invalid choice: 'float16') \([^`]*\)",
    r"(must be an integer from 1 to) \d+",       # the CPUs of the machine that wrote the table
)]


def masked(table: str) -> str:
    for p in LIBRARY_TEXT:
        table = p.sub(r"\1 ...", table)
    return table


def render(results: list[tuple[Case, Outcome]]) -> str:
    rows = ["| # | area | bad input | outcome | what the user reads |", "|---|---|---|---|---|"]
    for i, (case, out) in enumerate(results, 1):
        rows.append(f"| {i} | {case.area} | {case.given.replace('|', chr(92) + '|')} | {out.kind} | "
                    f"{_cell(shown(out))} |")
    return HEADER + "\n".join(rows) + "\n"
