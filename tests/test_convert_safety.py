"""`convert` (and `save_checkpoint`) never lose data: every argument is checked before the destination is
touched, the new checkpoint is written into a temporary directory beside it and swapped in only when
complete, and a directory that holds files but no checkpoint is never written into.

The test injects a failure at each stage of a conversion over an earlier checkpoint (the argument check,
reading each source tensor, writing each shard and the config, carrying the user's other files over,
each rename of the swap) and requires the destination to be byte-identical afterwards, with no
temporary directory left beside it. The same stages run against a writer that removes the old
checkpoint before it validates its arguments, and must fail there.

The transformers-layout source is written here from a random tiny model (`transformers_layout.from_released`),
so this file needs no transformers install."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import inkling_ref
from configs import tiny_config
from inkling_ref import CheckpointError, load_checkpoint, save_checkpoint
from inkling_ref.io import checkpoint as ckpt
from inkling_ref.io import names, transformers_layout
from inkling_mtp.cli import main
from mutants import load_mutant

CFG = tiny_config(num_mtp_depths=0, mtp_layer_types=[])
SHARD = 20_000   # bytes: the tiny trunk in several shards


def write_source(d: Path, seed: int) -> Path:
    """A transformers-layout checkpoint (config.json + model.safetensors) of a random tiny trunk."""
    d.mkdir(parents=True)
    m = inkling_ref.random_model(CFG, seed=seed)
    released = {names.to_released(n): p.detach().clone() for n, p in m.named_parameters()}
    save_file(transformers_layout.from_released(released), d / "model.safetensors")
    (d / "config.json").write_text(json.dumps(dict(CFG.to_transformers_dict(), model_type="inkling_text")))
    return d


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("sources")
    return write_source(root / "old", 1), write_source(root / "new", 2)


def snapshot(d: Path) -> dict[str, bytes]:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


class Inject:
    """Make `module.name` raise OSError on its `at`-th call (0-based), calling through otherwise."""

    def __init__(self, mp, module, name: str, at: int):
        self.calls, real = 0, getattr(module, name)

        def wrapped(*args, **kwargs):
            self.calls += 1
            if self.calls - 1 == at:
                raise OSError(f"injected failure in {name}")
            return real(*args, **kwargs)
        mp.setattr(module, name, wrapped)


class FailingHandle:
    """A safe_open handle whose get_tensor fails at the `at`-th read (counted across handles)."""

    def __init__(self, real, counter: list, at: int):
        self.real, self.counter, self.at = real, counter, at

    def get_tensor(self, name):
        self.counter[0] += 1
        if self.counter[0] - 1 == self.at:
            raise OSError("injected failure while reading a tensor")
        return self.real.get_tensor(name)

    def __getattr__(self, name):
        return getattr(self.real, name)

    def __enter__(self):
        self.real.__enter__()
        return self

    def __exit__(self, *exc):
        return self.real.__exit__(*exc)


def fail_reading(at: int):
    def breaker(mp, module):
        real_open, counter = module.safe_open, [0]
        mp.setattr(module, "safe_open", lambda *a, **k: FailingHandle(real_open(*a, **k), counter, at))
    return breaker


def fail_config(mp, module):
    def refuse(self):
        raise OSError("injected failure while writing config.json")
    mp.setattr(module.InklingConfig, "to_released_dict", refuse)


def count_files(module, src: Path, tmp_path: Path) -> int:
    """How many safetensors files a clean conversion at SHARD bytes writes."""
    summary = module.convert_transformers_checkpoint(src, tmp_path / "count", max_shard_bytes=SHARD)
    return sum(f.endswith(".safetensors") for f in summary["files"])


def stages(files: int):
    """(stage, convert keyword arguments, breaker(monkeypatch, module)): every way a conversion over an
    existing checkpoint can fail, `files` the safetensors files it writes."""
    nothing = lambda mp, module: None  # noqa: E731
    ok = dict(max_shard_bytes=SHARD, overwrite=True)
    out = [(f"argument check: max_shard_bytes={bad!r}", dict(max_shard_bytes=bad, overwrite=True), nothing)
           for bad in (0, -1, 1.5, True, "5GB")]
    out.append(("argument check: overwrite='yes'", dict(max_shard_bytes=SHARD, overwrite="yes"), nothing))
    out += [(f"reading source tensor {at}", ok, fail_reading(at)) for at in (0, 5)]
    out += [(f"writing safetensors file {at}", ok, lambda mp, module, at=at: Inject(mp, module, "save_file", at))
            for at in range(files)]
    out.append(("writing config.json", ok, fail_config))
    out.append(("carrying the user's files over", ok, lambda mp, module: Inject(mp, module, "_link_or_copy", 0)))
    out += [(f"the swap, rename {at}", ok, lambda mp, module, at=at: Inject(mp, module, "_rename", at))
            for at in (0, 1)]
    return out


def check_nothing_lost(module, tmp_path: Path, sources) -> list[str]:
    """Run every stage's failure on a fresh destination; returns the stages after which the destination
    was not byte-identical or something was left beside it (empty: nothing lost)."""
    old_src, new_src = sources
    lost = []
    for i, (stage, kwargs, breaker) in enumerate(stages(count_files(module, new_src, tmp_path))):
        dst = tmp_path / f"case{i}" / "dst"
        module.convert_transformers_checkpoint(old_src, dst, max_shard_bytes=SHARD)
        (dst / "tokenizer.json").write_text('{"kept": true}')
        (dst / "notes").mkdir()
        (dst / "notes" / "README.txt").write_text("the user's notes")
        before, beside = snapshot(dst), sorted(p.name for p in dst.parent.iterdir())
        with pytest.MonkeyPatch.context() as mp:
            breaker(mp, module)
            with pytest.raises((ValueError, OSError)):  # a mutant has its own CheckpointError class
                module.convert_transformers_checkpoint(new_src, dst, **kwargs)
        if snapshot(dst) != before or sorted(p.name for p in dst.parent.iterdir()) != beside:
            lost.append(stage)
    return lost


def test_a_failure_at_any_stage_leaves_the_destination_as_it_was(tmp_path, sources):
    assert count_files(ckpt, sources[1], tmp_path / "n") >= 3      # the trunk in shards: several write stages
    assert check_nothing_lost(ckpt, tmp_path, sources) == []


DELETE_FIRST = [("io/checkpoint.py", "    check_max_shard_bytes(max_shard_bytes)\n    src_dir = _directory(src)\n",
                 "    if overwrite is True and Path(dst).is_dir():  # MUTANT: the old checkpoint goes first\n"
                 "        for p in Path(dst).iterdir():\n"
                 "            if _CHECKPOINT_NAME.fullmatch(p.name):\n"
                 "                p.unlink()\n"
                 "    check_max_shard_bytes(max_shard_bytes)\n    src_dir = _directory(src)\n")]


def test_the_stages_catch_a_writer_that_deletes_before_it_validates(tmp_path, sources):
    mutant = load_mutant(tmp_path, DELETE_FIRST)
    lost = check_nothing_lost(mutant.io.checkpoint, tmp_path / "mutant", sources)
    assert any(stage.startswith("argument check") for stage in lost), lost


def test_a_successful_overwrite_replaces_the_checkpoint_and_keeps_the_other_files(tmp_path, sources):
    old_src, new_src = sources
    dst = tmp_path / "dst"
    ckpt.convert_transformers_checkpoint(old_src, dst, max_shard_bytes=SHARD)
    (dst / "tokenizer.json").write_text("tok")
    ckpt.convert_transformers_checkpoint(new_src, dst, overwrite=True)
    assert sorted(p.name for p in dst.iterdir()) == ["config.json", "model.safetensors", "tokenizer.json"]
    assert (dst / "tokenizer.json").read_text() == "tok"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dst"]
    want = {n: p for n, p in inkling_ref.random_model(CFG, seed=2).named_parameters()}
    got = load_checkpoint(dst)
    assert all(torch.equal(p, want[n]) for n, p in got.named_parameters())


def test_a_directory_without_a_checkpoint_is_never_written_into(tmp_path, sources, capsys):
    home = tmp_path / "home"
    home.mkdir()
    (home / "thesis.tex").write_text("years of work")
    for overwrite in (False, True):
        with pytest.raises(CheckpointError, match=r"is not empty and holds no checkpoint \(thesis.tex\): refusing"):
            ckpt.convert_transformers_checkpoint(sources[0], home, overwrite=overwrite)
        with pytest.raises(CheckpointError, match=r"is not empty and holds no checkpoint"):
            save_checkpoint(inkling_ref.random_model(CFG), home, overwrite=overwrite)
    assert main(["convert", str(sources[0]), str(home), "--overwrite"]) == 1
    assert "holds no checkpoint (thesis.tex)" in capsys.readouterr().err
    assert snapshot(home) == {"thesis.tex": b"years of work"}


def test_save_checkpoint_is_staged_too(tmp_path):
    dst = tmp_path / "dst"
    save_checkpoint(inkling_ref.random_model(CFG, seed=1), dst, max_shard_bytes=SHARD)
    before = snapshot(dst)
    for at in range(3):
        with pytest.MonkeyPatch.context() as mp:
            Inject(mp, ckpt, "save_file", at)
            with pytest.raises(OSError, match="injected"):
                save_checkpoint(inkling_ref.random_model(CFG, seed=2), dst, max_shard_bytes=SHARD, overwrite=True)
        assert snapshot(dst) == before and sorted(p.name for p in tmp_path.iterdir()) == ["dst"]


def test_a_size_below_one_byte_is_refused_before_anything(tmp_path, sources, capsys):
    dst = tmp_path / "dst"
    with pytest.raises(SystemExit) as e:
        main(["convert", str(sources[0]), str(dst), "--max-shard-size", "0.5"])
    assert e.value.code == 2 and "'0.5' is less than one byte" in capsys.readouterr().err
    assert not dst.exists()
