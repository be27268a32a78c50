"""engine/ runs inside the ranks: it must not drag in the kernel side, and the kernel side must not import torch.

Checked over every module found on disk (tests/support/modules.py), twice: every import statement
in the source (at any level, lazy ones included), and what importing the modules really loads (in
a fresh interpreter).
"""

import sys

from support import modules as mods

#: Kernel-side modules that engine/ may use, shared by both sides: the stdlib and each other only
#: (and psutil, which distnb.core.net reads network interfaces with, lazily).
SHARED = tuple(m for m in mods.modules() if m == "distnb.core" or m.startswith("distnb.core."))
SHARED_THIRD_PARTY = ("psutil",)
#: What else engine/ may import: the stdlib, torch and the few libraries an engine process needs.
#: The [hf] extra (safetensors, peft, transformers): engine/hfsave.py imports them inside the functions that
#: write a Hugging Face folder or a peft model's adapters, so a rank without the extra trains all the same.
ENGINE_HF_EXTRA = ("safetensors", "peft", "transformers")
ENGINE_THIRD_PARTY = ("torch", "numpy", "cloudpickle", "setproctitle", "mpi4py", *SHARED_THIRD_PARTY, *ENGINE_HF_EXTRA)
#: ipyparallel's engine side only: the engine (engine/ipengine.py runs it), the controller (the engine
#: template, engine/zygote.py, forks it) and datapub (engine/report.py publishes progress). Never the client.
ENGINE_IPYPARALLEL = ("ipyparallel.engine", "ipyparallel.controller", "ipyparallel.datapub")
#: Never loaded by importing engine/ (they are what a kernel runs).
KERNEL_LIBRARIES = ("IPython", "ipywidgets", "ipykernel", "ipyparallel")


def _under(name, prefixes):
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def engine_modules():
    return [m for m in mods.modules() if _under(m, ["distnb.engine"])]


def kernel_modules():
    return [m for m in mods.modules() if not _under(m, ["distnb.engine"])]


def allowed_in_engine(target):
    if target.split(".")[0] == "distnb":
        return _under(target, ["distnb.engine", *SHARED])
    top = target.split(".")[0]
    return top in sys.stdlib_module_names or top in ENGINE_THIRD_PARTY or _under(target, ENGINE_IPYPARALLEL)


def test_modules_are_found_on_disk():
    names = mods.modules()
    assert {"distnb", "distnb.session", "distnb.engine.train.loop", "distnb.engine.strategies.ps"} <= set(names)
    assert set(SHARED) <= set(names)
    assert len(engine_modules()) >= 15 and len(kernel_modules()) >= 15


def test_engine_imports_only_engine_shared_and_engine_libraries():
    """Every import statement under distnb/engine/, at any level: no kernel-side distnb module, no IPython,
    ipywidgets or ipyparallel client."""
    bad = [f"{mods.relpath(i.module)}:{i.line} imports {i.target}"
           for m in engine_modules() for i in mods.imports(m) if not allowed_in_engine(i.target)]
    assert bad == [], "engine/ imports outside what the ranks may import:\n  " + "\n  ".join(bad)


def test_shared_modules_are_stdlib_only():
    bad = [f"{mods.relpath(i.module)}:{i.line} imports {i.target}" for m in SHARED for i in mods.imports(m)
           if not (i.target.split(".")[0] in sys.stdlib_module_names or i.target in SHARED
                   or i.target.split(".")[0] in SHARED_THIRD_PARTY)]
    assert bad == [], "a module shared with engine/ imports more than the stdlib:\n  " + "\n  ".join(bad)


def _first(result, name):
    """``name``, and the distnb import statements (innermost first) that first loaded it."""
    chain = [str(mods.Path(f).relative_to(mods.REPO)) if f.startswith(str(mods.REPO)) else f
             for f in reversed(result["first"].get(name, []))]
    return f"{name} (first imported from {' <- '.join(chain)})" if chain else f"{name} (imported directly)"


def _outermost(names):
    return [n for n in names if not any(n.startswith(other + ".") for other in names)]


def test_importing_engine_loads_no_kernel_side_module():
    kernel_side = [m for m in kernel_modules() if m != "distnb" and m not in SHARED]  # distnb: the package's init
    result = mods.modules_loaded_by(engine_modules(), watch=kernel_side + list(KERNEL_LIBRARIES))
    assert result["errors"] == {}
    bad = [m for m in result["loaded"] if _under(m, kernel_side + list(KERNEL_LIBRARIES))]
    assert bad == [], "importing engine/ loads: " + "; ".join(_first(result, m) for m in _outermost(bad))


def test_kernel_side_does_not_import_torch_at_import_time():
    result = mods.modules_loaded_by(kernel_modules(), watch=["torch"])
    assert result["errors"] == {}
    assert "torch" not in result["loaded"], "the kernel side imports torch at import time: " + _first(result, "torch")
