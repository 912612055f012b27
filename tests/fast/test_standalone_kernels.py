"""The kernels of `inkling_fast/kernels/` stand alone: a porter can copy that folder (or one module and
the modules its docstring names) into another project that has torch and triton and nothing of this
repository, and every kernel still imports and still matches its plain-torch twin.

What the tests below prove, and how:

* **Standalone run.** `kernels/*.py` is copied, alone, into an empty temporary directory as a package
  of a new name (`porter_kernels_<n>`), and a fresh Python process imports every module of that copy
  and runs every kernel module's wrapper against its `*_torch` twin (Triton interpreter, small odd
  sizes, float32, outputs poisoned with NaN / -7 before the call where the wrapper takes `out=`).
  The process cannot reach the repository: its path holds only the temporary directory, and an
  import guard placed first on `sys.meta_path` refuses `inkling_ref` and `inkling_fast` (the
  editable install would otherwise find them), so a kernel that imports the reference or the engine
  fails there with an ImportError. The process prints one line per kernel module; each module is a
  test of its own here, and a kernel module without a `check_<module>` function below fails, so a
  new kernel cannot be added without a standalone check.
* **Mutation.** The same machinery on a copy where `swiglu.py` imports `inkling_ref` (or the engine)
  fails, and the import check below flags that source: the harness really catches such a kernel.
* **Imports, statically** (`ast`, every import statement of a module, also those inside functions,
  which a run may not reach): a kernel module imports only torch, triton, the standard-library
  modules of ALLOWED_TOP_LEVEL, and other modules of kernels/ (`from .x import ...`; nothing from
  the package above, no __import__ or importlib).
* **What to copy with it.** The last line of each module's docstring, `Copy with it: a.py, b.py
  (kernels/; nothing else beyond torch and triton).`, lists exactly the transitive closure of its
  `from .x import` dependencies, sorted; a module that depends on nothing (common.py) has no such line.

The subprocess runs only code of this file (the helpers and `check_*` functions, their source sent
over by `inspect.getsource`), torch, triton and the copied package. Its checks are self-contained:
they take the copied kernel module as their one argument and build their inputs in plain torch.
"""

from __future__ import annotations

import ast
import inspect
import itertools
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
KERNELS = REPO / "inkling_fast" / "kernels"
ALL_MODULES = sorted(p.stem for p in KERNELS.glob("*.py"))                  # __init__ and common included
KERNEL_MODULES = [m for m in ALL_MODULES if m not in ("__init__", "common")]  # one kernel (and its twin) each

# Top-level modules a kernel module may import besides its siblings: torch, triton, and small parts of
# the standard library that every Python has. Anything else (numpy, einops, the repository) is a
# dependency a porter would not know to bring.
ALLOWED_TOP_LEVEL = frozenset({
    "torch", "triton",
    "__future__", "abc", "collections", "contextlib", "dataclasses", "enum", "functools", "itertools", "math",
    "numbers", "operator", "os", "typing", "warnings",
})
REFUSED = ("inkling_ref", "inkling_fast")
COPY_LINE = re.compile(r"^Copy with it: (?P<files>.+) \(kernels/; nothing else beyond torch and triton\)\.$")
REPORT = "STANDALONE"          # prefix of the subprocess's result lines: "STANDALONE <module> <ok|FAIL> <detail>"
_copies = itertools.count()


# =============================================================================================== harness (parent)
def copy_kernels(tmp: Path, inject: dict[str, str] | None = None) -> tuple[Path, str]:
    """kernels/*.py copied into tmp/<package> under a fresh package name, with `inject[file]` (a
    statement) added right after that file's `from __future__` line. Returns (tmp, package)."""
    package = f"porter_kernels_{next(_copies)}"
    dst = tmp / package
    dst.mkdir(parents=True)
    for src in sorted(KERNELS.glob("*.py")):
        shutil.copyfile(src, dst / src.name)
    for file, stmt in (inject or {}).items():
        path = dst / file
        text = path.read_text()
        anchor = "from __future__ import annotations\n"
        assert text.count(anchor) == 1, f"{file}: no single `{anchor.strip()}` line to inject after"
        path.write_text(text.replace(anchor, f"{anchor}{stmt}  # injected: a kernel that reaches into the repo\n"))
    return tmp, package


def harness_source() -> str:
    """The subprocess's script: the import guard (installed before anything else is imported), then
    the helpers and every `check_<module>` function of this file, then `_main`."""
    checks = [f for name, f in sorted(globals().items()) if name.startswith("check_") and callable(f)]
    parts = ["from __future__ import annotations", "import sys", inspect.getsource(_install_import_guard),
             "_install_import_guard()", "import torch"]
    parts += [inspect.getsource(f) for f in (*HELPERS, *CHECK_HELPERS, *checks, _guard_report, _main)]
    parts.append('if __name__ == "__main__":\n    _main(sys.argv[1], sys.argv[2:])\n')
    return "\n\n".join(parts)


def run_harness(root: Path, package: str, modules: list[str]) -> tuple[dict[str, str], str]:
    """Run the checks of `modules` on the copied `package` in a fresh interpreter whose path holds only
    `root`; returns ({module: "ok ..." or "FAIL ..."}, the process's whole output)."""
    script = root / "standalone_check.py"
    script.write_text(harness_source())
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env.update(PYTHONPATH=str(root), PYTHONDONTWRITEBYTECODE="1", TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, str(script), package, *modules], cwd=root, env=env,
                          capture_output=True, text=True, timeout=600)
    log = proc.stdout + proc.stderr
    results = {}
    for line in proc.stdout.splitlines():
        if line.startswith(REPORT + " "):
            _, name, rest = line.split(" ", 2)
            results[name] = rest
    return results, log


@pytest.fixture(scope="module")
def standalone_run(tmp_path_factory):
    root, package = copy_kernels(tmp_path_factory.mktemp("standalone"))
    return run_harness(root, package, KERNEL_MODULES)


# =============================================================================================== tests
@pytest.mark.parametrize("module", KERNEL_MODULES)
def test_kernel_runs_standalone_against_its_twin(standalone_run, module):
    results, log = standalone_run
    assert module in results, f"no result line for {module}; subprocess output:\n{log[-6000:]}"
    assert results[module].startswith("ok"), f"{module}: {results[module]}\n{log[-6000:]}"


def test_the_subprocess_could_not_reach_the_repository(standalone_run):
    """The guard was in force for the whole run: both packages refused, none of their modules loaded,
    no path entry holding them."""
    results, log = standalone_run
    assert results.get("__guard__", "").startswith("ok"), f"{results.get('__guard__')}\n{log[-6000:]}"


def test_every_kernel_module_has_a_standalone_check():
    checks = {name.removeprefix("check_") for name in globals() if name.startswith("check_")}
    assert checks == set(KERNEL_MODULES), (f"kernel modules without a check: {sorted(set(KERNEL_MODULES) - checks)}; "
                                           f"checks of no module: {sorted(checks - set(KERNEL_MODULES))}")


@pytest.mark.parametrize("module", ALL_MODULES)
def test_imports_only_torch_triton_stdlib_and_kernels(module):
    source = (KERNELS / f"{module}.py").read_text()
    assert import_violations(source) == []


@pytest.mark.parametrize("module", [m for m in ALL_MODULES if m != "__init__"])
def test_copy_with_it_names_the_dependency_closure(module):
    want = [f"{m}.py" for m in sorted(dependency_closure(module))]
    stated = stated_copy_list((KERNELS / f"{module}.py").read_text())
    if not want:
        assert stated is None, f"{module}.py depends on no other kernels module but says to copy {stated}"
    else:
        assert stated == want, f"{module}.py: 'Copy with it' says {stated}, its imports need {want}"


@pytest.mark.parametrize("stmt,refused", [("import inkling_ref", "inkling_ref"),
                                          ("from inkling_fast import engine", "inkling_fast")])
def test_a_kernel_that_imports_the_repo_fails(tmp_path, stmt, refused):
    """Proof that the harness above would catch it: the same subprocess run on a copy whose swiglu.py
    imports the reference (or the engine) fails on that import, and the static check flags it."""
    root, package = copy_kernels(tmp_path, inject={"swiglu.py": stmt})
    source = (root / package / "swiglu.py").read_text()
    assert any(refused in v for v in import_violations(source)), import_violations(source)
    results, log = run_harness(root, package, ["swiglu"])
    assert results.get("swiglu", "").startswith("FAIL"), f"the mutant passed: {results}\n{log[-4000:]}"
    assert "ImportError" in results["swiglu"] and refused in results["swiglu"], results["swiglu"]
    assert results.get("__guard__", "").startswith("ok"), results


# =============================================================================================== static checks
def _tree(source: str) -> ast.Module:
    return ast.parse(source)


def import_violations(source: str) -> list[str]:
    """Each import of a module's source (anywhere in it) that a standalone copy of kernels/ could not
    satisfy: a top-level module outside ALLOWED_TOP_LEVEL, a relative import of anything but a module
    of kernels/, or a dynamic import (__import__, importlib)."""
    bad = []
    for node in ast.walk(_tree(source)):
        if isinstance(node, ast.Import):
            bad += [f"line {node.lineno}: import {a.name}" for a in node.names
                    if a.name.split(".")[0] not in ALLOWED_TOP_LEVEL]
        elif isinstance(node, ast.ImportFrom):
            what = f"line {node.lineno}: from {'.' * node.level}{node.module or ''} import ..."
            if node.level == 0:
                if node.module.split(".")[0] not in ALLOWED_TOP_LEVEL:
                    bad.append(what)
            elif node.level > 1:
                bad.append(what + " (reaches outside kernels/)")
            else:
                targets = [node.module] if node.module else [a.name for a in node.names]
                bad += [what + f" ({t} is not a module of kernels/)" for t in targets if t not in ALL_MODULES]
        elif isinstance(node, ast.Name) and node.id == "__import__":
            bad.append(f"line {node.lineno}: __import__")
        elif isinstance(node, ast.Attribute) and node.attr == "import_module":
            bad.append(f"line {node.lineno}: import_module")
    return bad


def relative_deps(module: str) -> set[str]:
    """The kernels modules that `module` imports (`from .x import ...`, `from . import x`)."""
    deps = set()
    for node in ast.walk(_tree((KERNELS / f"{module}.py").read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            deps |= {node.module} if node.module else {a.name for a in node.names}
    return deps


def dependency_closure(module: str) -> set[str]:
    seen, todo = set(), list(relative_deps(module))
    while todo:
        m = todo.pop()
        if m not in seen:
            seen.add(m)
            todo += relative_deps(m)
    seen.discard(module)
    return seen


def stated_copy_list(source: str) -> list[str] | None:
    """The files of the docstring's 'Copy with it:' line (which must be its last line), or None."""
    doc = ast.get_docstring(_tree(source)) or ""
    lines = [line.strip() for line in doc.splitlines() if line.strip()]
    hits = [line for line in lines if line.startswith("Copy with it:")]
    if not hits:
        return None
    assert len(hits) == 1 and hits[0] == lines[-1], "the 'Copy with it:' line must be the docstring's last line"
    m = COPY_LINE.match(hits[0])
    assert m, f"malformed line {hits[0]!r}; expected {COPY_LINE.pattern!r}"
    return [f.strip() for f in m["files"].split(",")]


# =============================================================================================== subprocess code
# Everything below runs in the subprocess (sent as source): it may use only the standard library,
# torch, triton and the copied kernel module each check receives.

def _install_import_guard():
    """Put first on sys.meta_path a finder that refuses the repository's packages (and submodules)."""
    import importlib.abc

    class RefuseRepoPackages(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in ("inkling_ref", "inkling_fast"):
                raise ImportError(f"import of {name!r} refused: a kernel module may import only torch, triton, "
                                  "the standard library and other modules of kernels/", name=name)
            return None

    sys.meta_path.insert(0, RefuseRepoPackages())


def _guard_report():
    """'ok' when the repository's packages cannot be imported and none of their modules is loaded."""
    import os
    problems = []
    for name in ("inkling_ref", "inkling_fast", "inkling_fast.kernels"):
        try:
            __import__(name)
            problems.append(f"{name} imported")
        except ImportError:
            pass
    problems += [f"{m} loaded" for m in sys.modules if m.split(".")[0] in ("inkling_ref", "inkling_fast")]
    problems += [f"{p} on sys.path holds the repository" for p in sys.path
                 if os.path.isdir(os.path.join(p or ".", "inkling_fast"))]
    return "ok" if not problems else "FAIL " + "; ".join(problems)


def _main(package, modules):
    """Import every module of the copied package, then run check_<m>(module) for each m in `modules`;
    print one REPORT line per module, then the guard's."""
    import importlib
    import os
    import time
    import traceback

    def report(name, status):
        print("STANDALONE", name, " ".join(status.split())[:500], flush=True)

    pkg = importlib.import_module(package)
    pkg_dir = os.path.dirname(pkg.__file__)
    loaded = {}
    for f in sorted(os.listdir(pkg_dir)):
        if f.endswith(".py") and f != "__init__.py":
            try:
                loaded[f[:-3]] = importlib.import_module(f"{package}.{f[:-3]}")
            except Exception as e:  # reported for the module's own line below
                loaded[f[:-3]] = e
    for name in modules:
        t0 = time.perf_counter()
        try:
            mod = loaded.get(name)
            if isinstance(mod, Exception):
                raise mod
            assert mod is not None, f"no module {name}.py in the copied package"
            assert os.path.dirname(mod.__file__) == pkg_dir, f"{name} was imported from {mod.__file__}"
            check = globals().get(f"check_{name}")
            assert check is not None, f"no check_{name} in the harness: every kernel module needs one"
            check(mod)
            report(name, f"ok ({time.perf_counter() - t0:.1f} s)")
        except Exception as e:
            report(name, f"FAIL {type(e).__name__}: {e}")
            traceback.print_exc(file=sys.stdout)
    report("__guard__", _guard_report())


# ----------------------------------------------------------------------------------------------- helpers
def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _randn(g, *shape, scale=1.0):
    return torch.randn(*shape, generator=g) * scale


def _poison(t):
    """t filled with a value no kernel writes (NaN, or -7 for integers)."""
    return t.fill_(float("nan") if t.is_floating_point() else -7)


def _norm_weight(g, H):
    """An RMSNorm weight away from 1: 1 +- U(0.15, 0.45)."""
    sign = torch.randint(0, 2, (H,), generator=g).float() * 2 - 1
    return 1 + sign * (0.15 + 0.3 * torch.rand(H, generator=g))


def _close(got, want, what, tol=1e-5):
    """Relative L2 error of got against want (float64, both finite) within tol."""
    a, b = got.detach().double(), want.detach().double()
    assert a.shape == b.shape, f"{what}: shapes {tuple(a.shape)} and {tuple(b.shape)}"
    assert torch.isfinite(a).all() and torch.isfinite(b).all(), f"{what}: non-finite values"
    err = ((a - b).norm() / b.norm().clamp_min(1e-300)).item()
    assert err <= tol, f"{what}: relative L2 error {err:.3g} > {tol:g}"


def _bits_equal(a, b):
    """Same shape, dtype and bits (NaN poison equals itself)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    view = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return torch.equal(a.contiguous().view(view), b.contiguous().view(view))


def _positions(starts, rows, T):
    """pos int32 [B, T]: row b holds positions starts[b] .. starts[b] + rows[b] - 1, then -1 padding."""
    pos = torch.full((len(starts), T), -1, dtype=torch.int32)
    for b, (s, n) in enumerate(zip(starts, rows)):
        pos[b, :n] = torch.arange(s, s + n, dtype=torch.int32)
    return pos


HELPERS = (_gen, _randn, _poison, _norm_weight, _close, _bits_equal, _positions)


# ----------------------------------------------------------------------------------------------- checks, one per module
def check_accept(k):
    g = _gen(1)
    B, K, V = 7, 3, 11
    target = torch.randint(0, V, (B, K + 1), generator=g)
    drafts = torch.randint(0, V, (B, K), generator=g)
    for b in range(B):                                   # agreeing prefixes of every length 0..K
        drafts[b, : b % (K + 1)] = target[b, : b % (K + 1)]
    k_eff = torch.randint(0, K + 1, (B,), generator=g)
    for ke in (k_eff, None):
        for dt in (torch.int64, torch.int32):
            out = (_poison(torch.empty(B, dtype=torch.int32)), _poison(torch.empty(B, dtype=torch.int64)),
                   _poison(torch.empty(B, K + 1, dtype=torch.int64)))
            got = k.greedy_accept(drafts.to(dt), target.to(dt), None if ke is None else ke.to(dt), out=out)
            assert all(x is y for x, y in zip(got, out))
            for x, y, name in zip(got, k.greedy_accept_torch(drafts, target, ke), ("a", "next", "emitted", "bad")):
                assert torch.equal(x, y), name
    scores = (_randn(g, K, B), _randn(g, B, K + 1))
    scores[0][1, 2], scores[1][4, 0], scores[1][5, 3] = float("nan"), float("inf"), float("-inf")
    bad = k.greedy_accept(drafts, target, k_eff, scores=scores)[3]
    assert torch.equal(bad, k.greedy_accept_torch(drafts, target, k_eff, scores=scores)[3]) and bad[2] == 2


def check_attention_decode(k):
    g = _gen(2)
    B, T, nH, nKV, hd, E, slots = 3, 2, 4, 2, 12, 5, 4
    pos = _positions([0, 7, 20], [2, 1, 2], T)
    slot = torch.tensor([2, 0, 3], dtype=torch.int32)
    valid = pos >= 0
    for window, cap, splits in ((None, 24, 2), (6, 8, 1)):          # global split-KV; sliding, ring wrapped
        q, rel = _randn(g, B, T, nH, hd), _randn(g, B, T, nH, E, scale=0.5)
        kc, vc = _randn(g, slots, cap, nKV, hd), _randn(g, slots, cap, nKV, hd)
        out = _poison(torch.empty(B, T, nH, hd))
        got = k.attention_decode(q, rel, kc, vc, slot, pos, window=window, num_splits=splits, out=out)
        assert got is out
        want = k.attention_decode_torch(q, rel, kc, vc, slot, pos, window=window)
        _close(got[valid], want[valid], f"window={window}")
        assert got[~valid].isnan().all(), "a padding row was written"


def check_attention_prefill(k):
    g = _gen(3)
    B, T, nH, nKV, hd, E, slots = 2, 5, 4, 2, 12, 5, 3
    pos = _positions([0, 9], [5, 3], T)                  # a fresh prompt, a chunk after 9 positions
    slot = torch.tensor([1, 0], dtype=torch.int32)
    valid = pos >= 0
    for window, cap in ((4, 5), (None, 16)):
        q, rel = _randn(g, B, T, nH, hd), _randn(g, B, T, nH, E, scale=0.5)
        k_new, v_new = _randn(g, B, T, nKV, hd), _randn(g, B, T, nKV, hd)
        kc, vc = _randn(g, slots, cap, nKV, hd), _randn(g, slots, cap, nKV, hd)
        kc_t, vc_t = kc.clone(), vc.clone()
        out = _poison(torch.empty(B, T, nH, hd))
        got = k.attention_prefill(q, rel, k_new, v_new, kc, vc, slot, pos, window=window, out=out)
        assert got is out
        want = k.attention_prefill_torch(q, rel, k_new, v_new, kc_t, vc_t, slot, pos, window=window)
        _close(got[valid], want[valid], f"window={window}")
        assert got[~valid].isnan().all(), "a padding row was written"
        assert _bits_equal(kc, kc_t) and _bits_equal(vc, vc_t), "cache writes differ from the twin's"


def check_attention_prep(k):
    g = _gen(4)
    nH, nKV, hd, d_rel, E, K, slots, cap = 4, 2, 12, 3, 5, 3, 4, 8
    C = nKV * hd
    weights = dict(q_norm=_norm_weight(g, hd), k_norm=_norm_weight(g, hd), k_conv=_randn(g, C, K, scale=0.5),
                   v_conv=_randn(g, C, K, scale=0.5), rel_proj=_randn(g, d_rel, E))
    # decode/window mode (one launch, caches written; log-tau), then prefill mode (flat k and v, R < T + K - 1)
    for T, starts, rows, R, flat, log_tau in ((2, [0, 3, 9], [2, 1, 2], 4, False, (3, 0.3)),
                                              (6, [0, 5], [6, 4], 4, True, None)):
        B = len(starts)
        pos = _positions(starts, rows, T)
        slot = torch.tensor([2, 0, 3][:B], dtype=torch.int32)
        valid = pos >= 0
        q, k_in, v_in = _randn(g, B, T, nH * hd), _randn(g, B, T, C), _randn(g, B, T, C)
        r = _randn(g, B, T, nH * d_rel)
        state = dict(k_ring=_randn(g, slots, R, C), v_ring=_randn(g, slots, R, C),
                     k_cache=_poison(torch.empty(slots, cap, nKV, hd)),
                     v_cache=_poison(torch.empty(slots, cap, nKV, hd)))
        kern_state = {n: t.clone() for n, t in state.items()}
        twin_state = {n: t.clone() for n, t in state.items()}
        kw = dict(weights, slot=slot, pos=pos, eps=1e-6, log_tau=log_tau, flat_kv=flat)
        outs = dict(q_out=_poison(torch.empty(B, T, nH, hd)), rel_out=_poison(torch.empty(B, T, nH, E)))
        if flat:
            outs.update(k_out=_poison(torch.empty(B, T, nKV, hd)), v_out=_poison(torch.empty(B, T, nKV, hd)))
        kern = k.attention_prep(q, k_in, v_in, r, **kw, **kern_state, **outs)
        twin = k.attention_prep_torch(q, k_in, v_in, r, **kw, **twin_state)
        assert kern.q is outs["q_out"] and kern.rel is outs["rel_out"]
        _close(kern.q[valid], twin.q[valid], "q'")
        _close(kern.rel[valid], twin.rel[valid], "L_rel'")
        assert kern.q[~valid].isnan().all(), "a padding row was written"
        for n in ("k_ring", "v_ring"):
            assert _bits_equal(kern_state[n], twin_state[n]), n
        if flat:
            _close(kern.k[valid], twin.k[valid], "k")
            _close(kern.v[valid], twin.v[valid], "v")
            for n in ("k_cache", "v_cache"):
                assert _bits_equal(kern_state[n], state[n]), f"{n} written in flat_kv mode"
            continue
        written = torch.zeros(slots, cap, dtype=torch.bool)
        b_i, t_i = valid.nonzero(as_tuple=True)
        written[slot.long()[b_i], pos[b_i, t_i].long() % cap] = True
        for n in ("k_cache", "v_cache"):
            _close(kern_state[n][written], twin_state[n][written], n)
            assert _bits_equal(kern_state[n][~written], state[n][~written]), f"{n}: a row it must not touch"


def check_commit_rows(k):
    """commit_rows has no *_torch twin: the docstring's formula, in a few lines of torch, stands in."""
    g = _gen(5)
    B, T, C, KEEP, slots = 4, 5, 19, 4, 4
    pos = _positions([0, 2, 10, 0], [5, 3, 0, 2], T)     # T > KEEP: only each row's last KEEP positions
    slot = torch.tensor([3, 1, 0, 2], dtype=torch.int32)
    src = _randn(g, B, T, C + 3)[..., :C]                # strided rows, last dimension contiguous
    dst = _poison(torch.empty(slots, KEEP, C))
    want = dst.clone()
    valid = pos >= 0
    last = torch.where(valid, pos, -1).amax(dim=1, keepdim=True)
    b_i, t_i = (valid & (pos > last - KEEP)).nonzero(as_tuple=True)
    want[slot.long()[b_i], pos[b_i, t_i].long() % KEEP] = src[b_i, t_i]
    k.commit_rows(src, dst, slot, pos)
    assert _bits_equal(dst, want), "rows written differ from dst[slot[b], p % KEEP] = src[b, t] of the last KEEP"


def check_embed_norm(k):
    g = _gen(6)
    V, H = 29, 40
    table, w1, w2 = _randn(g, V, H, scale=0.7), _norm_weight(g, H), _norm_weight(g, H)
    for shape, dt in (((3, 5), torch.int64), ((7,), torch.int32)):
        ids = torch.randint(0, V, shape, generator=g).to(dt)
        e_ref, n_ref = k.embed_norm_torch(ids, table, w1, 1e-6, weight2=w2)
        out = _poison(torch.empty(shape + (H,)))
        assert k.embed_norm(ids, table, w1, 1e-6, out=out) is out
        _close(out, e_ref, "e")
        out, out2 = _poison(torch.empty(shape + (H,))), _poison(torch.empty(shape + (H,)))
        e, n = k.embed_norm(ids, table, w1, 1e-6, weight2=w2, out=out, out2=out2)
        assert e is out and n is out2
        _close(e, e_ref, "e")
        _close(n, n_ref, "n")


def _check_lm_head(fn, twin, T, seed):
    g = _gen(seed)
    H, V, V_out = 33, 130, 117
    h, W = _randn(g, T, H), _randn(g, V, H, scale=H ** -0.5)
    ids_out = _poison(torch.empty(T, dtype=torch.int64))
    vals_out = _poison(torch.empty(T))
    ids, vals = fn(h, W, V_out, mup=3.0, ids_out=ids_out, vals_out=vals_out)
    assert ids is ids_out and vals is vals_out
    t_ids, t_vals = twin(h, W, V_out, mup=3.0)
    assert torch.equal(ids, t_ids), "ids"
    _close(vals, t_vals, "vals")


def check_lm_head_argmax(k):
    _check_lm_head(k.lm_head_argmax, k.lm_head_argmax_torch, T=5, seed=7)


def check_lm_head_rows(k):
    _check_lm_head(k.lm_head_rows, k.lm_head_argmax_torch, T=37, seed=8)     # two row tiles, the last partial


def _moe_case(seed, N, H=40, F=24, R=7, K=2, S=1):
    """x, a random routing (chosen int32, weights), the expert weights, and a router (weight, bias,
    global scale, route scale, top_k)."""
    g = _gen(seed)
    x = _randn(g, N, H)
    chosen = torch.stack([torch.randperm(R, generator=g)[:K] for _ in range(N)]).int()
    weights = torch.rand(N, K + S, generator=g) + 0.1
    w = (_randn(g, R, 2 * F, H, scale=H ** -0.5), _randn(g, R, H, F, scale=F ** -0.5),
         _randn(g, S, 2 * F, H, scale=H ** -0.5), _randn(g, S, H, F, scale=F ** -0.5))
    router = (_randn(g, R + S, H, scale=2 * H ** -0.5), _randn(g, R, scale=0.2), torch.tensor([1.3]), 2.5, K)
    return x, chosen, weights, w, router


def check_moe(k):
    x, chosen, weights, w, router = _moe_case(9, N=5)
    out = _poison(torch.empty_like(x))
    assert k.moe_experts(x, chosen, weights, *w, out=out) is out
    _close(out, k.moe_experts_torch(x, chosen.long(), weights, *w), "moe_experts")
    out = _poison(torch.empty_like(x))
    assert k.moe(x, *router, *w, out=out) is out
    _close(out, k.moe_torch(x, *router, *w), "moe")


def check_moe_grouped(k):
    x, chosen, weights, w, router = _moe_case(10, N=9)
    out = _poison(torch.empty_like(x))
    assert k.moe_grouped_experts(x, chosen, weights, *w, out=out) is out
    _close(out, k.moe_grouped_experts_torch(x, chosen.long(), weights, *w), "moe_grouped_experts")
    out = _poison(torch.empty_like(x))
    assert k.moe_grouped(x, *router, *w, out=out) is out
    _close(out, k.moe_grouped_torch(x, *router, *w), "moe_grouped")


def check_moe_router(k):
    x, _, _, _, router = _moe_case(11, N=6)
    top_k = router[-1]
    chosen, weights = k.moe_route(x, *router)
    chosen_t, weights_t = k.moe_route_torch(x, *router)
    assert chosen.dtype == torch.int32 and weights.dtype == torch.float32
    assert torch.equal(chosen.long().sort(1).values, chosen_t.sort(1).values), "chosen experts"
    order, order_t = chosen.long().argsort(1), chosen_t.argsort(1)        # compare in expert-id order
    _close(weights[:, :top_k].gather(1, order), weights_t[:, :top_k].gather(1, order_t), "routed weights")
    _close(weights[:, top_k:], weights_t[:, top_k:], "shared weights")


def check_mtp_input(k):
    g = _gen(12)
    V, H, lead = 29, 40, (2, 3)
    h = _randn(g, *lead, H, scale=3.0)
    ids = torch.randint(0, V, lead, generator=g)
    table = _randn(g, V, H, scale=0.5)
    norms = [_norm_weight(g, H) for _ in range(3)]
    want = k.mtp_input_torch(h, ids, table, *norms, 1e-6)
    out = _poison(torch.empty(lead + (2 * H,)))
    assert k.mtp_input(h, ids, table, *norms, 1e-6, out=out) is out
    _close(out[..., :H], want[..., :H], "hidden half")
    _close(out[..., H:], want[..., H:], "embedding half")


def check_rejection(k):
    g = _gen(13)
    B, K, V = 6, 3, 77
    target = _randn(g, B, K + 1, V, scale=2.5)
    target.scatter_add_(2, torch.randint(0, V, (B, K + 1, 1), generator=g), torch.full((B, K + 1, 1), 6.0))
    draft = target[:, :K] + _randn(g, B, K, V, scale=0.5)
    p, q = torch.softmax(target.double(), -1), torch.softmax(draft.double(), -1)
    sampled = torch.multinomial(q.reshape(B * K, V), 1, generator=g).reshape(B, K)
    u_acc, u_fin = torch.rand(B, K, generator=g, dtype=torch.float64), torch.rand(B, generator=g, dtype=torch.float64)
    k_eff = torch.randint(0, K + 1, (B,), generator=g)
    k_eff[:2] = K
    for qq, drafts, ke in ((q, sampled, k_eff), (None, draft.argmax(-1), None)):    # sampled, greedy drafting
        out = (_poison(torch.empty(B, dtype=torch.int32)), _poison(torch.empty(B, dtype=torch.int64)),
               _poison(torch.empty(B, K + 1, dtype=torch.int64)))
        got = k.rejection_sample(p, qq, drafts, u_acc, u_fin, ke, out=out)
        assert all(x is y for x, y in zip(got, out))
        for x, y, name in zip(got, k.rejection_sample_torch(p, qq, drafts, u_acc, u_fin, ke), ("a", "next", "emitted")):
            assert torch.equal(x, y), f"{name} (q {'given' if qq is not None else 'None'})"


def check_rms_norm(k):
    g = _gen(14)
    shape, H = (3, 5, 72), 72
    x = _randn(g, 3, 5, H + 3, scale=2.0)[..., :H]      # rows strided
    r, w = _randn(g, *shape), _norm_weight(g, H)
    out = _poison(torch.empty(shape))
    assert k.rms_norm(x, w, 1e-6, out=out) is out
    _close(out, k.rms_norm_torch(x, w, 1e-6), "rms_norm")
    s_ref, y_ref = k.add_rms_norm_torch(x, r, w, 1e-6)
    out_sum, out = _poison(torch.empty(shape)), _poison(torch.empty(shape))
    s, y = k.add_rms_norm(x, r, w, 1e-6, out_sum=out_sum, out=out)
    assert s is out_sum and y is out
    assert torch.equal(s, s_ref), "the residual sum"
    _close(y, y_ref, "add_rms_norm")


def check_sampling(k):
    g = _gen(15)
    M, V = 5, 1100                                       # more than one 1024-wide block of the scan
    p = torch.softmax(_randn(g, M, V, scale=3.0).double(), -1)
    p[2, 700:] = 0                                       # a zero tail under u near 1: the step-down guard
    u = torch.rand(M, generator=g, dtype=torch.float64)
    u[0], u[1], u[2] = 0.0, 1.0 - 2.0 ** -53, 1.0 - 2.0 ** -53
    out = _poison(torch.empty(M, dtype=torch.int64))
    assert k.sample_tokens(p, u, out=out) is out
    assert torch.equal(out, k.sample_tokens_torch(p, u))


def check_short_conv(k):
    g = _gen(16)
    C, K, slots = 37, 3, 4
    w = _randn(g, C, K, scale=0.5)
    slot = torch.tensor([3, 0, 2], dtype=torch.int32)
    # T + K - 1 <= R: one launch writes the ring as it goes; T = 6 > R - K + 1: outputs, then commit_rows
    for T, R, residual in ((2, 4, True), (6, 4, False)):
        pos = _positions([0, 5, 11], [T, T - 1, 1], T)
        valid = pos >= 0
        x = _randn(g, 3, T, C)
        res = _randn(g, 3, T, C, scale=2.0) if residual else None
        ring = _randn(g, slots, R, C)
        ring_t = ring.clone()
        out = _poison(torch.empty(3, T, C))
        assert k.short_conv(x, ring, w, slot, pos, residual=res, out=out) is out
        want = k.short_conv_torch(x, ring_t, w, slot, pos, residual=res)
        _close(out[valid], want[valid], f"T={T}")
        assert (out[~valid] == 0).all() and (want[~valid] == 0).all(), "padding rows output 0"
        assert _bits_equal(ring, ring_t), f"T={T}: ring writes differ from the twin's"


def check_swiglu(k):
    g = _gen(17)
    for shape, scale in (((3, 2 * 37), torch.tensor([0.73])), ((2 * 5,), None)):
        gu = _randn(g, *shape, scale=3.0)
        out = _poison(torch.empty(shape[:-1] + (shape[-1] // 2,)))
        assert k.swiglu(gu, scale, out=out) is out
        _close(out, k.swiglu_torch(gu, scale), f"shape {shape}")


def check_uniforms(k):
    seeds = torch.tensor([1, 2, -5, 2 ** 40 + 3])
    counters = torch.tensor([0, 7, 2 ** 33 - 5, 5])      # row 2's counter crosses 2^32
    start = counters.clone()
    out = _poison(torch.empty(4, 37, dtype=torch.float64))
    assert k.philox_uniforms(seeds, counters, 37, out=out) is out
    assert torch.equal(out, k.philox_uniforms_torch(seeds, start, 37))
    assert torch.equal(counters, start + 37), "counters advanced in place"


CHECK_HELPERS = (_check_lm_head, _moe_case)     # shared by several checks; sent along with them
