"""Checkpoints in the released layout: `load_checkpoint`, `save_checkpoint`, and the conversion
from the transformers layout (`convert_transformers_checkpoint`, run by `inkling-mtp convert`).

A checkpoint is a directory:

    config.json                          released spelling: text_config + mtp_config
    model.safetensors                    the trunk, `model.llm.*`            (one file), or
    model-00001-of-0000N.safetensors ... the trunk in shards, with
    model.safetensors.index.json         {"weight_map": {tensor name: shard file}}
    mtp.safetensors                      the MTP head, `model.mtp.*`; the index may not list it

Which tensors exist decides what is loaded: the MTP head is detected by the presence of
`model.mtp.*` tensors (in any file), never by the index. Vision and audio tensors
(`model.visual.*`, `model.audio.*`) are ignored. Safetensors only: nothing is ever unpickled.

Every check of names, shapes and dtypes reads only the safetensors headers and reports every
offending tensor at once; the values are checked as they load (every weight must be finite).
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from . import names, transformers_layout
from .config import DENSE, MOE, SLIDING, ConfigError, InklingConfig, field_label, intermediate_size_reading
from ..model.model import InklingModel

DEFAULT_CHECKPOINT = Path(__file__).resolve().parents[1] / "default_checkpoint"   # the bundled demo

CONFIG = "config.json"
SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
MTP_FILE = "mtp.safetensors"
TOKENIZER = "tokenizer.json"
LOADABLE_DTYPES = {torch.float32: "float32", torch.float64: "float64", torch.bfloat16: "bfloat16",
                   torch.float16: "float16"}
FLOAT_FILE_DTYPES = {"F32", "F64", "BF16", "F16"}  # safetensors dtype codes the reference can run
QUANTIZED_FILE_DTYPES = {"U8", "I8"}                 # packed quantized weights (e.g. NVFP4: two values a byte)
# tensors never rounded below the precision they are stored in (the router bias only picks experts,
# and a bf16 copy of an fp32 bias changes which ones)
KEEP_STORED_PRECISION = ("mlp.router_bias",)


class CheckpointError(ValueError):
    """A checkpoint directory that cannot be loaded as asked. The message names the file or tensors."""


@dataclass(frozen=True)
class TensorInfo:
    """What a safetensors header says about one tensor."""
    file: str               # file name inside the checkpoint directory
    dtype: str              # safetensors dtype code: "BF16", "F32", "U8", "F8_E4M3", ...
    shape: tuple[int, ...]


# ---------------------------------------------------------------------- reading a directory
def _directory(path) -> Path:
    if not isinstance(path, (str, os.PathLike)) or str(path) == "":
        raise CheckpointError(f"a checkpoint path must be a non-empty str or Path, got {path!r}")
    d = Path(path)
    if not d.exists():
        raise CheckpointError(f"checkpoint directory {d} does not exist")
    if not d.is_dir():
        raise CheckpointError(f"{d} is a file; pass the checkpoint directory (the one holding {CONFIG})")
    return d


def read_config(directory: Path) -> tuple[InklingConfig, dict]:
    """(config, raw JSON) of a checkpoint directory."""
    path = directory / CONFIG
    if not path.is_file():
        raise CheckpointError(f"{directory}: missing {CONFIG} (a checkpoint directory holds {CONFIG}, "
                              f"{SINGLE} or {INDEX} with its shards, and {MTP_FILE} for the MTP head)")
    try:
        raw = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: malformed JSON: {e}") from None
    try:
        return InklingConfig.from_dict(raw), raw
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from None


def tensor_files(directory: Path) -> tuple[list[str], dict[str, str] | None]:
    """The safetensors files to read, and the index's weight map (None without an index)."""
    index_path = directory / INDEX
    if index_path.is_file():
        try:
            index = json.loads(index_path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{index_path}: malformed JSON: {e}") from None
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise CheckpointError(f"{index_path}: needs a 'weight_map' object mapping tensor names to shard files")
        files = sorted(set(weight_map.values()))
        outside = [f for f in files if Path(f).name != f]
        if outside:
            raise CheckpointError(f"{index_path}: shard names must be plain file names in the checkpoint "
                                  f"directory, got {outside}")
        missing = [f for f in files if not (directory / f).is_file()]
        if missing:
            counts = {f: sum(v == f for v in weight_map.values()) for f in missing}
            raise CheckpointError(f"{index_path} points to {len(missing)} missing shard file(s): "
                                  + ", ".join(f"{f} ({counts[f]} tensors)" for f in missing))
    elif (directory / SINGLE).is_file():
        files, weight_map = [SINGLE], None
    else:
        pickled = sorted(p.name for p in directory.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".ckpt"))
        hint = (f"; found {pickled}, which would need unpickling: only safetensors files are read, "
                "convert them to safetensors first") if pickled else ""
        raise CheckpointError(f"{directory}: no {SINGLE} and no {INDEX}{hint}")
    if (directory / MTP_FILE).is_file() and MTP_FILE not in files:
        files.append(MTP_FILE)  # releases keep the MTP head in a shard the index does not list
    return files, weight_map


def read_headers(directory: Path, files: list[str], weight_map: dict[str, str] | None) -> dict[str, TensorInfo]:
    """Name -> TensorInfo for every tensor of every file (headers only: no tensor data is read)."""
    infos: dict[str, TensorInfo] = {}
    duplicates = []
    for f in files:
        try:
            with safe_open(directory / f, framework="pt") as s:
                for name in s.keys():
                    piece = s.get_slice(name)
                    info = TensorInfo(f, piece.get_dtype(), tuple(piece.get_shape()))
                    if name in infos:
                        duplicates.append(f"{name} (in {infos[name].file} and {f})")
                    else:
                        infos[name] = info
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f"{directory / f}: not a readable safetensors file ({e})") from None
    if duplicates:
        raise CheckpointError(f"{directory}: tensors stored twice ({len(duplicates)}): "
                              + ", ".join(sorted(duplicates)))
    if weight_map is not None:
        wrong = [f"{n} (index: {f}, actually: {infos[n].file if n in infos else 'in no file'})"
                 for n, f in sorted(weight_map.items()) if n not in infos or infos[n].file != f]
        if wrong:
            raise CheckpointError(f"{directory / INDEX} lists tensors that are not where it says "
                                  f"({len(wrong)}): " + ", ".join(wrong))
    return infos


# ---------------------------------------------------------------------- checking against the config
def _listing(title: str, items: list[str]) -> str:
    return f"  {title} ({len(items)}):\n" + "".join(f"    {x}\n" for x in items)


def meta_model(config: InklingConfig, num_mtp_depths: int) -> InklingModel:
    """The model's modules with parameters on the meta device (shapes, no storage): the loader assigns
    every parameter afterwards."""
    with torch.device("meta"):
        return InklingModel(config, num_mtp_depths=num_mtp_depths)


def expected_shapes(config: InklingConfig, num_mtp_depths: int) -> dict[str, tuple[int, ...]]:
    """Released name -> shape of every tensor a model with `num_mtp_depths` depths needs."""
    model = meta_model(config, num_mtp_depths)
    return {names.to_released(n): tuple(p.shape) for n, p in model.named_parameters()}


def check_quantized(where, infos: dict[str, TensorInfo]) -> None:
    """Refuse quantized tensors (packed integer / float8 weights and their scale tensors), and tensors of
    any other dtype that is not a float the reference runs (named with the dtype found)."""
    text = {n: i for n, i in infos.items() if not names.is_other_tower(n)}
    quantized = {n for n, i in text.items() if names.is_quant_scale(n) or i.dtype in QUANTIZED_FILE_DTYPES
                 or i.dtype.startswith(("F8_", "F6_", "F4"))}
    other = sorted(f"{n} [{i.dtype} {list(i.shape)}]" for n, i in text.items()
                   if n not in quantized and i.dtype not in FLOAT_FILE_DTYPES)
    if other:
        dtypes = sorted({i.dtype for n, i in text.items() if n not in quantized and i.dtype not in FLOAT_FILE_DTYPES})
        raise CheckpointError(
            f"{where} holds tensors of dtype {', '.join(dtypes)}, which no weight of this model has: weights are "
            "BF16, F16, F32 or F64 (a file written by another tool, or tensors that are not weights)\n"
            + _listing("tensors of another dtype", other))
    bad = sorted(f"{n} [{i.dtype} {list(i.shape)}]" for n, i in text.items() if n in quantized)
    if bad:
        raise CheckpointError(
            f"{where} holds quantized tensors (e.g. NVFP4 packed uint8 weights with their scales), which the "
            "reference cannot run: it needs bf16, fp16, fp32 or fp64 weights. Use the unquantized "
            "(bf16) checkpoint.\n" + _listing("quantized or scale tensors", bad))


_TRUNK_LAYER = re.compile(r"model\.llm\.layers\.(\d+)\.")
_MTP_DEPTH = re.compile(r"model\.mtp\.layers\.(\d+)\.")
# Config fields that are tensor dimensions (or a factor of one): none can exceed the largest dimension of
# the files. (field, what the model must have for the field to be used)
_DIMENSIONS = (("vocab_size", None), ("hidden_size", None), ("num_heads", None), ("num_kv_heads", None),
               ("head_dim", None), ("d_rel", None), ("rel_extent", None), ("conv_kernel_size", None),
               ("swa_num_heads", SLIDING), ("swa_num_kv_heads", SLIDING), ("swa_head_dim", SLIDING),
               ("dense_intermediate_size", DENSE), ("moe_intermediate_size", MOE), ("n_routed_experts", MOE),
               ("n_shared_experts", MOE))


def _indices_held(pattern: re.Pattern, infos: dict[str, TensorInfo]) -> int:
    """1 + the largest layer index among the tensor names `pattern` matches (0: none)."""
    found = [int(m.group(1)) for n in infos for m in [pattern.match(n)] if m]
    return 1 + max(found) if found else 0


def check_sizes(where, config: InklingConfig, infos: dict[str, TensorInfo], trunk: bool = True) -> int:
    """Check the config's counts and sizes against the safetensors headers before anything proportional to
    them is built: a config that declares more trunk layers than the files hold, or a size larger than
    every dimension of every tensor, does not describe these weights (one line naming the key); so does
    one that declares more MTP depths than the files hold tensors of, unless they hold none at all (a
    trunk saved without its head). trunk=False leaves the trunk layers out of the count (files that hold
    only what the MTP head reads). Returns how many MTP depths the files hold tensors of (1 + the largest
    depth index)."""
    held = _indices_held(_TRUNK_LAYER, infos)
    if trunk and config.num_layers > held:
        hold = f"{held} trunk layers (model.llm.layers.0 .. {held - 1})" if held else "no trunk layer"
        raise CheckpointError(f"{where}: {field_label('num_layers')} = {config.num_layers}, but its files hold "
                              f"{hold}: config.json does not describe these weights")
    depths = _indices_held(_MTP_DEPTH, infos)
    if 0 < depths < config.num_mtp_depths:
        raise CheckpointError(f"{where}: {field_label('num_mtp_depths')} = {config.num_mtp_depths}, but its files "
                              f"hold {depths} MTP depth(s) (model.mtp.layers.0 .. {depths - 1}): config.json does "
                              "not describe these weights")
    largest = max((max(i.shape, default=0) for i in infos.values()), default=0)
    uses = {None: True, SLIDING: SLIDING in config.layer_types + config.mtp_layer_types,
            DENSE: DENSE in config.mlp_types or config.num_mtp_depths > 0, MOE: MOE in config.mlp_types}
    for name, feature in _DIMENSIONS:
        value = getattr(config, name)
        if uses[feature] and value > largest:
            raise CheckpointError(f"{where}: {field_label(name)} = {value} is larger than any dimension of any "
                                  f"tensor in its files (the largest is {largest}): config.json does not "
                                  "describe these weights")
    return depths


def complete_mtp_depths(config: InklingConfig, infos: dict[str, TensorInfo], where="checkpoint",
                        trunk: bool = True) -> int:
    """How many MTP depths the files hold: the first depths, up to the config's count, with every tensor
    (trunk: see check_sizes)."""
    held = check_sizes(where, config, infos, trunk)
    depths = min(config.num_mtp_depths, held)
    full = expected_shapes(config, depths)
    complete = 0
    while complete < depths and all(n in infos for n in full if names.mtp_depth_of(n) == complete):
        complete += 1
    return complete


def inspect_checkpoint(path) -> tuple[InklingConfig, int]:
    """(config, complete MTP depths) of a checkpoint directory, from its config.json and safetensors
    headers only: what a caller can check a request against before loading any weight."""
    directory = _directory(path)
    config, _ = read_config(directory)
    files, weight_map = tensor_files(directory)
    return config, complete_mtp_depths(config, read_headers(directory, files, weight_map), f"checkpoint {directory}")


def plan_load(where, config: InklingConfig, raw: dict, infos: dict[str, TensorInfo],
              num_mtp_depths: int | None) -> tuple[int, list[str]]:
    """Decide how many MTP depths to load and check every tensor it needs against the config.

    Returns (depths to load, the released names to read). Raises CheckpointError listing every missing,
    misshapen and unexpected tensor."""
    check_quantized(where, infos)
    text = {n: i for n, i in infos.items() if not names.is_other_tower(n)}
    declared = config.num_mtp_depths
    held = check_sizes(where, config, text)
    full = expected_shapes(config, min(declared, held + 1))     # depths beyond the files' are not built
    complete = complete_mtp_depths(config, text, where)
    has_mtp = any(names.is_mtp(n) for n in text)
    if num_mtp_depths is None:
        k = declared if has_mtp else 0  # no MTP tensors at all: a trunk without a head
        if has_mtp and held == 0 and declared > 0:
            raise CheckpointError(f"{where}: {field_label('num_mtp_depths')} = {declared}, but its files hold "
                                  "no MTP depth (model.mtp.layers.*), only other model.mtp.* tensors")
    else:
        if not isinstance(num_mtp_depths, int) or isinstance(num_mtp_depths, bool) or num_mtp_depths < 0:
            raise CheckpointError(f"num_mtp_depths must be an integer >= 0 or None, got {num_mtp_depths!r}")
        k = num_mtp_depths
        if k > declared or k > complete:
            raise CheckpointError(
                f"num_mtp_depths={k} requested, but {where} has {complete} complete MTP depth(s) "
                f"(its config.json declares {declared})"
                + (f"; depth {complete} lacks: " + ", ".join(sorted(
                    n for n in full if names.mtp_depth_of(n) == complete and n not in text))
                   if complete < min(k, declared) else ""))

    expected = expected_shapes(config, k)
    # tensors of depths beyond the k loaded ones are simply not read
    skipped = {n for n in text if names.is_mtp(n) and n not in expected and (
        (names.mtp_depth_of(n) is not None and k <= names.mtp_depth_of(n) < declared)
        or (k == 0 and declared > 0 and n == "model.mtp.chain_norm.weight"))}
    missing = sorted(n for n in expected if n not in text)
    unexpected = sorted(n for n in text if n not in expected and n not in skipped)
    misshapen = sorted(f"{n} expected {list(s)} got {list(text[n].shape)}"
                       for n, s in expected.items() if n in text and tuple(text[n].shape) != s)
    if missing or unexpected or misshapen:
        msg = f"{where} does not match its config.json (loading {k} MTP depth(s)):\n"
        if missing:
            msg += _listing("missing tensors", missing)
            if num_mtp_depths is None and complete < declared and all(names.is_mtp(n) for n in missing):
                msg += (f"  (the first {complete} MTP depth(s) are complete: num_mtp_depths={complete} "
                        "loads only those)\n")
        if misshapen:
            msg += _listing("misshapen tensors", misshapen)
            if any(".mlp." in m for m in misshapen):
                msg += f"  (MLP widths: {intermediate_size_reading(raw.get('text_config', raw))})\n"
        if unexpected:
            msg += _listing("unexpected tensors", unexpected)
            if declared == 0 and any(names.is_mtp(n) for n in unexpected):
                msg += "  (config.json declares no MTP depths: its mtp_config is missing or says 0)\n"
            if any(re.match(r"(model\.)?(language_model\.)?layers\.\d+\.self_attn\.", n) for n in unexpected):
                msg += "  (these are transformers names: run `inkling-mtp convert SRC DST` first)\n"
        raise CheckpointError(msg.rstrip("\n"))
    return k, sorted(expected)


# ---------------------------------------------------------------------- tokenizer
def load_tokenizer(path):
    """The checkpoint's `tokenizer.json` as a `tokenizers.Tokenizer`, or None when it has none.
    A file that the tokenizers library cannot read is a CheckpointError naming the file."""
    file = _directory(path) / TOKENIZER
    if not file.exists():
        return None
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(str(file))
    except Exception as e:  # the library raises a bare Exception for unreadable files
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise CheckpointError(f"{file} is not a readable tokenizer file ({reason}); a tokenizer.json is "
                              "written by the tokenizers library (Tokenizer.save)") from None


# ---------------------------------------------------------------------- load
def _loadable_dtype(dtype) -> torch.dtype:
    if isinstance(dtype, str):
        by_name = {v: k for k, v in LOADABLE_DTYPES.items()}
        dtype = by_name.get(dtype.removeprefix("torch."), dtype)
    if not isinstance(dtype, torch.dtype) or dtype not in LOADABLE_DTYPES:
        raise CheckpointError(f"dtype={dtype!r} cannot be loaded: the reference runs in "
                              f"{', '.join('torch.' + n for n in LOADABLE_DTYPES.values())}")
    return dtype


def load_checkpoint(path, dtype=torch.float32, device="cpu", num_mtp_depths: int | None = None) -> InklingModel:
    """Load a released-layout checkpoint directory into an `InklingModel`.

    dtype: float32, float64, bfloat16 or float16 (every tensor is cast to it, except the MoE router bias,
    which keeps fp32 when stored in fp32 and a 16-bit dtype is asked). num_mtp_depths: how many MTP
    depths to build and load; None loads all the config declares when the checkpoint has MTP tensors, and
    a trunk without a head when it has none."""
    dtype = _loadable_dtype(dtype)
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise CheckpointError(f"device={device!r} is not a torch device ({e})") from None
    if device.type == "meta":
        raise CheckpointError("device='meta' holds no values: load onto 'cpu' or a GPU")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise CheckpointError(f"device={str(device)!r}, but this machine has no CUDA GPU "
                              "(torch.cuda.is_available() is False): load onto device='cpu'")
    try:
        torch.empty(0, device=device)
    except (RuntimeError, AssertionError) as e:
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise CheckpointError(f"device={str(device)!r} cannot be used here ({reason})") from None
    directory = _directory(path)
    config, raw = read_config(directory)
    files, weight_map = tensor_files(directory)
    infos = read_headers(directory, files, weight_map)
    k, wanted = plan_load(f"checkpoint {directory}", config, raw, infos, num_mtp_depths)

    model = meta_model(config, k)       # parameters are assigned below
    state, non_finite, overflow = {}, [], []
    for f in files:
        here = [n for n in wanted if infos[n].file == f]
        if not here:
            continue
        with safe_open(directory / f, framework="pt", device="cpu") as s:
            for released in here:
                ours = names.from_released(released)
                t = s.get_tensor(released)
                target = dtype
                if ours.endswith(KEEP_STORED_PRECISION) and t.dtype.itemsize > dtype.itemsize:
                    target = t.dtype
                # copy=True: a fresh, allocator-aligned buffer, so the loaded model computes bit for bit
                # like the saved one (CPU kernels may round differently on misaligned memory)
                state[ours] = t.to(device=device, dtype=target, copy=True)
                # a trained weight is finite: NaN or infinity means corrupted bytes or a diverged run
                bad = t.numel() - int(torch.isfinite(t).sum())
                if bad:
                    non_finite.append(f"{released} in {f}: {bad} of {t.numel()} values")
                elif not bool(torch.isfinite(state[ours]).all()):
                    overflow.append(f"{released} in {f} ({t.dtype} -> {target})")
    if non_finite:
        raise CheckpointError(f"checkpoint {directory} holds weights that are NaN or infinite (corrupted "
                              "files, or saved from a diverged run):\n"
                              + _listing("tensors with non-finite values", non_finite).rstrip("\n"))
    if overflow:
        raise CheckpointError(f"checkpoint {directory}: weights overflow dtype={LOADABLE_DTYPES[dtype]} (load in "
                              "a wider dtype, e.g. float32):\n" + _listing("tensors", overflow).rstrip("\n"))
    model.load_state_dict(state, strict=True, assign=True)
    return model.eval()


# ---------------------------------------------------------------------- save
class ShardWriter:
    """Writes trunk tensors into `model.safetensors`, or into shards of at most `max_shard_bytes`
    (a tensor larger than that gets a shard of its own) plus `model.safetensors.index.json`, and
    MTP tensors into `mtp.safetensors` (not listed in the index, as in the releases). Tensors are
    added one at a time so that a conversion never holds more than one shard in memory."""

    def __init__(self, directory: Path, max_shard_bytes: int | None = None):
        check_max_shard_bytes(max_shard_bytes)
        self.directory, self.max_bytes = directory, max_shard_bytes
        self.shard: dict[str, torch.Tensor] = {}
        self.shard_bytes = 0
        self.written: list[tuple[str, list[str]]] = []  # (temporary file, names)
        self.mtp: dict[str, torch.Tensor] = {}
        self.total_bytes = 0

    def add(self, name: str, t: torch.Tensor) -> None:
        t = t.detach().to("cpu").contiguous()
        if names.is_mtp(name):
            self.mtp[name] = t
            return
        size = t.numel() * t.element_size()
        if self.max_bytes is not None and self.shard and self.shard_bytes + size > self.max_bytes:
            self._flush()
        self.shard[name] = t
        self.shard_bytes += size
        self.total_bytes += size

    def _flush(self) -> None:
        tmp = f".shard-{len(self.written):05d}.tmp"
        save_file(self.shard, str(self.directory / tmp), metadata={"format": "pt"})
        self.written.append((tmp, sorted(self.shard)))
        self.shard, self.shard_bytes = {}, 0

    def close(self) -> list[str]:
        """Write what is left; returns the files written."""
        if self.shard or not self.written:
            self._flush()
        out = []
        if len(self.written) == 1:
            (self.directory / self.written[0][0]).rename(self.directory / SINGLE)
            out.append(SINGLE)
        else:
            n, weight_map = len(self.written), {}
            for i, (tmp, shard_names) in enumerate(self.written):
                final = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
                (self.directory / tmp).rename(self.directory / final)
                weight_map.update({name: final for name in shard_names})
                out.append(final)
            index = {"metadata": {"total_size": self.total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
            (self.directory / INDEX).write_text(json.dumps(index, indent=2) + "\n")
            out.append(INDEX)
        if self.mtp:
            save_file(self.mtp, str(self.directory / MTP_FILE), metadata={"format": "pt"})
            out.append(MTP_FILE)
        return out


# Files a checkpoint directory holds that a writer (re)writes; anything else there (a tokenizer, notes)
# belongs to the user and is carried over untouched.
_CHECKPOINT_NAME = re.compile(r"config\.json|model\.safetensors(\.index\.json)?|mtp\.safetensors"
                              r"|model-\d{5}-of-\d{5}\.safetensors")


def check_max_shard_bytes(max_shard_bytes) -> None:
    if max_shard_bytes is not None and (not isinstance(max_shard_bytes, int) or isinstance(max_shard_bytes, bool)
                                        or max_shard_bytes <= 0):
        raise CheckpointError(f"max_shard_bytes must be a positive integer or None, got {max_shard_bytes!r}")


def check_output(path, overwrite: bool) -> Path:
    """Check the output directory of a writer without touching it. It may be new, empty, or (with
    overwrite=True) hold a checkpoint; a directory that holds other files but no checkpoint is refused
    whatever `overwrite` says, since replacing it could only lose the user's files."""
    if not isinstance(overwrite, bool):
        raise CheckpointError(f"overwrite must be True or False, got {overwrite!r}")
    if not isinstance(path, (str, Path)) or str(path) == "":
        raise CheckpointError(f"the output directory must be a non-empty path, got {path!r}")
    d = Path(path)
    if d.exists() and not d.is_dir():
        raise CheckpointError(f"{d} is a file, not a directory")
    if d.is_dir():
        entries = sorted(p.name for p in d.iterdir())
        ours = [name for name in entries if _CHECKPOINT_NAME.fullmatch(name)]
        if ours and not overwrite:
            raise CheckpointError(f"{d} already holds a checkpoint ({', '.join(ours)}); "
                                  "pass overwrite=True (--overwrite) or choose another directory")
        if entries and not ours:
            shown = ", ".join(entries[:5]) + (", ..." if len(entries) > 5 else "")
            raise CheckpointError(f"{d} is not empty and holds no checkpoint ({shown}): refusing to write a "
                                  "checkpoint into it, even with overwrite; choose a new or empty directory")
    return d


def _rename(old: Path, new: Path) -> None:
    os.replace(old, new)


def _link_or_copy(src, dst) -> None:
    try:
        os.link(src, dst, follow_symlinks=False)
    except OSError:
        shutil.copy2(src, dst, follow_symlinks=False)


def write_staged(directory: Path, write: Callable[[Path], object]):
    """Run write(tmp) into a new temporary directory beside `directory`, and only when it returns swap
    the result in: files of an earlier `directory` that are not checkpoint files are carried over
    (hard links where the file system allows, else copies), then `directory` is renamed aside, the new
    one renamed in its place and the old one removed. Any failure before the swap removes the temporary
    directory and leaves `directory` as it was; a failure inside the swap renames the old one back.
    Returns what `write` returns."""
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{directory.name}.partial-", dir=directory.parent))
    try:
        result = write(tmp)
        if directory.is_dir():
            for p in sorted(directory.iterdir()):
                if not _CHECKPOINT_NAME.fullmatch(p.name):
                    if p.is_dir() and not p.is_symlink():
                        shutil.copytree(p, tmp / p.name, symlinks=True, copy_function=_link_or_copy)
                    else:
                        _link_or_copy(p, tmp / p.name)
            old = directory.parent / f".{directory.name}.old-{secrets.token_hex(6)}"
            _rename(directory, old)
            try:
                _rename(tmp, directory)
            except BaseException:
                _rename(old, directory)
                raise
            shutil.rmtree(old, ignore_errors=True)
        else:
            _rename(tmp, directory)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return result


def _layer_order(name: str):
    """Sort key: tensors in model order (layer 2 before layer 10), so shards hold whole layers."""
    return [int(x) if x.isdigit() else x for x in re.split(r"(\d+)", name)]


def save_checkpoint(model: InklingModel, path, max_shard_bytes: int | None = None, overwrite: bool = False) -> None:
    """Write `model` as a released-layout checkpoint directory. Each tensor keeps its dtype.

    config.json says as many MTP depths as the model has built (the head of a model built with fewer
    depths than its config is saved as a shorter head). The files are written into a temporary
    directory beside `path` and swapped in when complete (`write_staged`): a failure leaves `path` as it
    was. overwrite=True replaces an earlier checkpoint there (its other files are kept); a non-empty
    directory without a checkpoint is always refused."""
    check_max_shard_bytes(max_shard_bytes)
    d = check_output(path, overwrite)
    k = model.num_mtp_depths
    config = model.config
    if k != config.num_mtp_depths:
        config = config.replace(num_mtp_depths=k, mtp_layer_types=config.mtp_layer_types[:k])

    def write(tmp: Path) -> None:
        writer = ShardWriter(tmp, max_shard_bytes)
        tensors = {names.to_released(n): p for n, p in model.named_parameters()}
        for name in sorted(tensors, key=_layer_order):
            writer.add(name, tensors[name])
        writer.close()
        (tmp / CONFIG).write_text(json.dumps(config.to_released_dict(), indent=2) + "\n")

    write_staged(d, write)


# ---------------------------------------------------------------------- convert
def convert_transformers_checkpoint(src, dst, max_shard_bytes: int | None = None,
                                    overwrite: bool = False) -> dict:
    """A transformers-layout Inkling checkpoint (`save_pretrained` of `InklingForCausalLM`, or the text
    part of `InklingForConditionalGeneration`) -> a released-layout checkpoint directory.

    Every argument, name and shape is checked before anything is written; tensors are then converted
    one layer at a time (pure renames and row permutations; dtypes kept) into a temporary directory
    beside `dst`, swapped in when complete (`write_staged`): whatever fails, `dst` is left as it was. The transformers
    layout has no MTP head: the output is a trunk, with the MTP fields of the config kept, so that a
    released `mtp.safetensors` copied next to it completes it. Returns a summary dict."""
    check_max_shard_bytes(max_shard_bytes)
    src_dir = _directory(src)
    if isinstance(dst, (str, Path)) and str(dst) and Path(dst).resolve() == src_dir.resolve():
        raise CheckpointError("convert: SRC and DST are the same directory")
    d = check_output(dst, overwrite)
    config, raw = read_config(src_dir)
    files, weight_map = tensor_files(src_dir)
    infos = {n: i for n, i in read_headers(src_dir, files, weight_map).items()
             if not n.startswith(transformers_layout.TOWERS)}  # vision / audio: not converted
    where = f"transformers checkpoint {src_dir}"
    check_quantized(where, infos)

    # dry run on meta tensors: every name placed, every shape checked, before writing anything
    try:
        dry = transformers_layout.to_released({n: torch.empty(i.shape, device="meta") for n, i in infos.items()})
    except KeyError as e:
        raise CheckpointError(f"{where}: {e.args[0]}") from None
    released_infos = {n: TensorInfo("", "F32", tuple(t.shape)) for n, t in dry.items()}
    plan_load(where + " (after renaming)", config, raw, released_infos, None)

    groups: dict[str, list[str]] = {}  # one group per layer (gate and up halves travel together)
    for n in infos:
        m = re.search(r"layers\.(\d+)\.", n)
        groups.setdefault(f"{n.split('layers.')[0]}{m.group(1)}" if m else "", []).append(n)

    def write(tmp: Path) -> dict:
        writer = ShardWriter(tmp, max_shard_bytes)
        handles = {f: safe_open(src_dir / f, framework="pt", device="cpu") for f in files}
        try:
            for key in sorted(groups, key=_layer_order):
                part = {n: handles[infos[n].file].get_tensor(n) for n in groups[key]}
                converted = transformers_layout.to_released(part)
                for name in sorted(converted, key=_layer_order):
                    writer.add(name, converted[name])
        finally:
            handles.clear()
        written = writer.close()
        (tmp / CONFIG).write_text(json.dumps(config.to_released_dict(), indent=2) + "\n")
        return {"tensors": len(dry), "bytes": writer.total_bytes + sum(t.numel() * t.element_size()
                                                                         for t in writer.mtp.values()),
                "files": written, "mtp_depths": config.num_mtp_depths if writer.mtp else 0}

    return write_staged(d, write)
