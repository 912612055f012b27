"""The package's layering, as docs/spec/design.md states it:

    inkling_ref     imports nothing from inkling_fast or inkling_mtp (not even lazily, inside a function)
    inkling_fast    imports inkling_ref (config, checkpoints, the cycle's records), never inkling_mtp; no
                    private Triton API and no assignment to a Triton class attribute (a porter can take
                    the engine without deciding what to do with hooks into Triton's internals)
    inkling_mtp     the command line, above both: a CPU-only install without Triton runs it (--engine ref)

plus the engine's files small enough to read in one sitting, and the command line's list of the fast
engine's dtypes equal to the engine's own. (The kernels' own isolation: tests/fast/test_standalone_kernels.py.)
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ENGINE_FILES_MAX_LINES = 350


def imported_modules(path: Path, package: str | None = None) -> set[str]:
    """Every module an `import` or `from ... import` anywhere in the file names (absolute names; a relative
    import is resolved against `package`, by default the file's own)."""
    package = package or ".".join(path.relative_to(ROOT).with_suffix("").parts[:-1])
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                out.add(".".join(base + ([node.module] if node.module else [])))
            else:
                out.add(node.module)
    return out


def package_files(name: str) -> list[Path]:
    return sorted((ROOT / name).rglob("*.py"))


def test_the_reference_imports_neither_the_fast_path_nor_the_command_line():
    bad = {str(p.relative_to(ROOT)): sorted(m for m in imported_modules(p) if m.split(".")[0] in
                                            ("inkling_fast", "inkling_mtp"))
           for p in package_files("inkling_ref")}
    assert not {p: m for p, m in bad.items() if m}, bad


def test_the_fast_path_never_imports_the_command_line():
    bad = {str(p.relative_to(ROOT)): sorted(m for m in imported_modules(p) if m.split(".")[0] == "inkling_mtp")
           for p in package_files("inkling_fast")}
    assert not {p: m for p, m in bad.items() if m}, bad


def triton_internals(path: Path, package: str | None = None) -> list[str]:
    """Uses of Triton's private modules (a `_name` component), and assignments to an attribute of a Triton
    class (`KernelInterface.__getitem__ = ...`, `JITFunction.run = ...`)."""
    tree = ast.parse(path.read_text())
    found = [f"imports {m}" for m in imported_modules(path, package)
             if m.split(".")[0] == "triton" and any(part.startswith("_") for part in m.split("."))]
    names = {"KernelInterface", "JITFunction", "Autotuner", "CompiledKernel", "CUDALauncher"}
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__") \
                and isinstance(node.value, ast.Attribute) and "triton" in ast.unparse(node.value):
            found.append(f"reads {ast.unparse(node)}")
        if isinstance(node, (ast.Assign, ast.AugAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                if isinstance(target, ast.Attribute) and isinstance(target.value, (ast.Name, ast.Attribute)) \
                        and ast.unparse(target.value).split(".")[-1] in names:
                    found.append(f"assigns {ast.unparse(target)}")
    text = path.read_text()
    found += [f"names {word}" for word in ("_async_compile", "launcher_cls", "_do_compile") if word in text]
    return found


@pytest.mark.parametrize("package", ["inkling_fast", "inkling_mtp"])
def test_no_private_triton_api_and_no_patching_of_triton(package):
    bad = {str(p.relative_to(ROOT)): triton_internals(p) for p in package_files(package)}
    assert not {p: f for p, f in bad.items() if f}, bad


def test_the_triton_check_catches_what_it_is_for(tmp_path):
    """Mutation check of the check above: a file that patches a Triton class or reaches into a private
    Triton module is flagged."""
    for source in ("from triton.runtime.jit import KernelInterface\nKernelInterface.__getitem__ = None\n",
                   "from triton.runtime._async_compile import AsyncCompileMode\n",
                   "import triton\nx = triton.runtime.driver.active.launcher_cls\n"):
        path = tmp_path / "probe.py"
        path.write_text(source)
        assert triton_internals(path, package="inkling_fast"), source


def library_patches(path: Path) -> list[str]:
    """Assignments to an attribute of an imported module or of a name imported from one
    (`nn.init.normal_ = ...`, `torch.Tensor.foo = ...`, `setattr(triton, ...)`): patching a library."""
    tree = ast.parse(path.read_text())
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level:
            imported.update(a.asname or a.name for a in node.names)
    found = []
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else \
            [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
        for target in targets:
            root = target
            while isinstance(root, ast.Attribute):
                root = root.value
            if isinstance(target, ast.Attribute) and isinstance(root, ast.Name) and root.id in imported:
                found.append(f"assigns {ast.unparse(target)}")
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("setattr", "delattr") \
                and node.args and isinstance(node.args[0], (ast.Name, ast.Attribute)):
            root = node.args[0]
            while isinstance(root, ast.Attribute):
                root = root.value
            if isinstance(root, ast.Name) and root.id in imported:
                found.append(f"{node.func.id}({ast.unparse(node.args[0])}, ...)")
    return found


@pytest.mark.parametrize("package", ["inkling_ref", "inkling_fast", "inkling_mtp"])
def test_no_package_patches_a_library(package):
    bad = {str(p.relative_to(ROOT)): library_patches(p) for p in package_files(package)}
    assert not {p: f for p, f in bad.items() if f}, bad


def test_the_patch_check_catches_what_it_is_for(tmp_path):
    """Mutation check of the check above: patching torch's initializer, a Triton class, or a module
    through setattr is flagged; assigning to one's own objects is not."""
    for source in ("from torch import nn\nnn.init.normal_ = lambda t, *a, **k: t\n",
                   "import torch.nn as nn\nnn.Embedding.reset_parameters = None\n",
                   "from triton.runtime.jit import KernelInterface\nKernelInterface.__getitem__ = None\n",
                   "import triton\nsetattr(triton.runtime, 'x', 1)\n"):
        path = tmp_path / "probe.py"
        path.write_text(source)
        assert library_patches(path), source
    path = tmp_path / "own.py"
    path.write_text("import torch\nclass A:\n    pass\na = A()\na.x = torch.zeros(1)\nself_like = a\nself_like.y = 1\n")
    assert not library_patches(path)


def test_the_engine_files_fit_one_sitting():
    """Every file of the engine (inkling_fast outside kernels/: the engine, its steps, scheduler, graphs,
    caches, forwards, weights) and of the command line stays under ENGINE_FILES_MAX_LINES lines. The cost
    model (cost_model.py) reads measurements and predicts; no engine code calls it."""
    long = {str(p.relative_to(ROOT)): len(p.read_text().splitlines())
            for p in package_files("inkling_fast") + package_files("inkling_mtp")
            if "kernels" not in p.parts and p.name != "cost_model.py"}
    assert all(n <= ENGINE_FILES_MAX_LINES for n in long.values()), \
        {p: n for p, n in long.items() if n > ENGINE_FILES_MAX_LINES}


BLOCK_IMPORTS = """
import importlib.abc, sys
class Refuse(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {blocked!r}:
            raise ImportError(f"{{name}} is not installed (blocked by the test)")
sys.meta_path.insert(0, Refuse())
"""


def run_blocked(blocked: set[str], code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", BLOCK_IMPORTS.format(blocked=blocked) + code],
                          capture_output=True, text=True, cwd=ROOT, timeout=300)


def test_every_reference_module_imports_without_the_fast_path_or_triton():
    modules = [".".join(p.relative_to(ROOT).with_suffix("").parts) for p in package_files("inkling_ref")]
    modules = [m.removesuffix(".__init__") for m in modules]
    r = run_blocked({"inkling_fast", "inkling_mtp", "triton"},
                    "import importlib\nfor m in %r:\n    importlib.import_module(m)\nprint('ok')" % modules)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-2000:]


def test_the_command_line_runs_the_reference_without_triton():
    """A CPU-only install has no Triton: `inkling-mtp generate --engine ref` and `convert --help` still run."""
    r = run_blocked({"inkling_fast", "triton"}, "from inkling_mtp.cli import main\nsys.exit(main(["
                    "'generate', '--prompt-ids', '3 17 5', '--k', '2', '--max-new-tokens', '5', '--engine', 'ref']))")
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() and "acceptance length" in r.stderr


def test_the_command_line_offers_the_fast_engine_its_own_dtypes():
    import torch

    from inkling_fast.engine import DTYPES
    from inkling_mtp.generate import FAST_DTYPES
    assert FAST_DTYPES == tuple(str(d).removeprefix("torch.") for d in DTYPES)
    assert all(getattr(torch, name) in DTYPES for name in FAST_DTYPES)
