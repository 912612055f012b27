"""Mutation testing helper: a copy of `inkling_ref` with deliberate source edits, imported under a
fresh package name. Tests use it to prove they fail on a broken implementation.

Each edit is (file, old, new); `old` must occur exactly once in that file, so a mutant cannot
silently stop applying when the reference changes.

Below `load_mutant`: the mutants of the MTP head and of the speculative cycle, grouped by the test
that must catch them. `scripts/pitfalls.py` runs the same mutants on the demo checkpoint to measure
what each mistake costs in acceptance (docs/pitfalls.md).
"""

from __future__ import annotations

import importlib
import itertools
import shutil
import sys
from pathlib import Path

import inkling_ref

_counter = itertools.count()


def load_mutant(tmp_path: Path, edits: list[tuple[str, str, str]], package: str = "inkling_ref"):
    """Copy `package` into tmp_path under a new name, apply `edits`, import and return it."""
    src = Path(importlib.import_module(package).__file__).parent
    name = f"{package}_mutant_{next(_counter)}"
    dst = tmp_path / name
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("__pycache__", "default_checkpoint"))
    for file, old, new in edits:
        path = dst / file
        text = path.read_text()
        count = text.count(old)
        assert count == 1, f"mutation target {old!r} occurs {count} times in {file}"
        path.write_text(text.replace(old, new))
    sys.path.insert(0, str(tmp_path))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(tmp_path))


def assert_some_check_fails(mutant: str, checks) -> None:
    """Run each (name, check) of `checks` (a check: a function of no arguments that asserts) on a mutant's
    code; at least one must fail with an AssertionError. Prints the mutant and the first line of each
    failure."""
    failures = []
    for name, check in checks:
        try:
            check()
        except AssertionError as e:
            failures.append(f"{name}: {str(e).splitlines()[0][:120]}")
    print(mutant, failures)
    assert failures, f"every check passes on the mutant '{mutant}'"


assert inkling_ref  # the original must import before any mutant is made from it


# Caught by tests/test_mtp_spec_formulas.py (the depths recomputed from the spec's formulas).
DEPTH_MUTANTS = {
    "embed-first concat": [("model/mtp.py", "torch.cat([self.hidden_norm(h_prev), e], dim=-1)",
                            "torch.cat([e, self.hidden_norm(h_prev)], dim=-1)")],
    # the embedding normed once, by the trunk's embed_norm only (the depth's own norm skipped)
    "single-normed embedding": [("model/mtp.py", "e = self.embed_norm(token_embed)", "e = token_embed")],
    # the embedding normed once, by the depth's embed_norm only (the raw row E[x] fed to the depth)
    "embedding normed by the depth only": [("model/model.py", "self.mtp.depths[m](h_prev, self.trunk.embed_tokens(tokens), cache)",
                                            "self.mtp.depths[m](h_prev, self.trunk.embed(tokens), cache)")],
    "no hidden_norm": [("model/mtp.py", "self.hidden_norm(h_prev), e]", "h_prev, e]")],
    "trunk final norm in readout": [("model/model.py", "out = self.mtp.chain(y)", "out = self.trunk.norm(self.mtp.chain(y))")],
    "log-tau in the depths": [("model/mtp.py", "log_tau = config.mtp_apply_log_scaling and config.log_scaling_n_floor is not None",
                               "log_tau = config.log_scaling_n_floor is not None")],
    # every draft step runs depth 0's module (norms, input_proj, block); each step keeps its own cache
    "depth 0 for every depth": [("model/model.py", "y = self.mtp.depths[m](", "y = self.mtp.depths[0](")],
}

# Caught by the invariant suite of tests/test_speculative.py (depth caches == the teacher-forced fold).
CYCLE_MUTANTS = {
    "block-0-only history": [(
        "decoding/speculative.py",
        "        cache = state.depth_caches[m]\n        cache.truncate(w0)",
        "        if m > 0:  # MUTANT: deeper depths restore (forget) their history every cycle\n"
        "            state.depth_caches[m] = LayerCache()\n"
        "        cache = state.depth_caches[m]\n        cache.truncate(min(w0, cache.length))")],
    "depth index off by one": [("decoding/speculative.py", "tokens = slots[w0 + m + 1: n + m]", "tokens = slots[w0 + m: n + m - 1]")],
    "depth conv states not rolled back": [(
        "decoding/speculative.py", "        cache.truncate(w0)                                          # drop rows from the window on\n",
        "        if cache.keys is not None:  # MUTANT: only K/V are rolled back\n"
        "            cache.keys, cache.values = cache.keys[:, :, :w0], cache.values[:, :, :w0]\n")],
    # the window covers only the a+1 new rows (from depth 0's first new row): stale rows stay stale
    "stale rows not repaired": [(
        "decoding/speculative.py", 'w0 = v if window == "minimal" else min(max(0, n - 2 - k), v)',
        "w0 = state.depth_valid[0] if k else n - 1  # MUTANT: only the new rows")],
}

# Caught by tests/test_speculative.py::test_windows_are_equivalent (window="minimal" against "full").
WINDOW_MUTANTS = {
    # after a cycle that rejected d_{a+1} with a <= k-2, row v = n-1-k is stale for the deepest depth
    # only (the others are valid there): that row is left out
    "minimal window skips the lowest stale row": [(
        "decoding/speculative.py", 'w0 = v if window == "minimal" else',
        'w0 = v + (v < min(state.depth_valid[:k - 1], default=v)) if window == "minimal" else')],
}

# Measured by scripts/pitfalls.py only: no test can catch it because it changes (almost) nothing. Depth 0
# reads H_p through its hidden_norm, and RMSNorm is scale-invariant up to eps.
PITFALL_ONLY_MUTANTS = {
    "trunk hidden divided by mup": [("decoding/speculative.py", "h_prev = state.hiddens[w0: n - 1][None]",
                                     "h_prev = state.hiddens[w0: n - 1][None] / model.config.mup")],
}
