"""The layout by concern (issue 37): imports go one way between distnb's packages, function-local imports included.

Direction (an arrow: may import):

    tools -> distnb (the package's __init__) -> magics -> session -> {elastic, export}
      -> train -> {transfer, execute} -> {display, cluster} -> engine -> core

and inside engine/: the entry points (ipengine, job, elastic, simulate, zygote, ...) -> train/ ->
strategies/ -> process/ -> transport/ -> core. Packages on the same level never import each
other. The kernel packages may import engine/ (lazily: see ALLOWED_LOCAL); engine/ never imports
above core/.

Every import statement counts, at any depth (read with ``ast``, nothing imported). An import inside
a function is allowed only where ALLOWED_LOCAL lists it with its reason; every other import sits
at the top of its module, where a reader sees where the module stands. (A function decorated
``@interactive`` runs with an engine's user namespace as its globals: its imports stay inside it.)
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

#: Package levels: a package imports only packages on a strictly lower level (or itself).
LEVELS = {
    "distnb": 100,
    "magics": 90,   # magics.py, magic_values.py, kernelstop.py (what imports the session)
    "session": 80,
    "tools": 110,   # the demo and simulated ranks drive distnb from outside, as a user does
    "elastic": 70, "export": 70,
    "train": 60,
    "transfer": 50, "execute": 50,
    "display": 40, "cluster": 40,
    "engine": 30,   # engine/'s entry points
    "engine.train": 25,
    "engine.strategies": 24,
    "engine.process": 22,
    "engine.transport": 21,
    "core": 0,
}
#: The modules beside the packages: the magics and what imports the session (on the magics' level), the session.
TOP_MODULES = {"distnb.magics": "magics", "distnb.magic_values": "magics", "distnb.kernelstop": "magics",
               "distnb.attaching": "magics", "distnb.attachverb": "magics",  # %dist attach: a session from a world
               "distnb.session": "session", "distnb": "distnb"}

#: Libraries whose import costs (time, threads) enough to keep them out of a module's import time.
HEAVY = ("torch", "numpy", "ipyparallel", "IPython", "ipykernel", "ipywidgets", "psutil", "zmq", "cloudpickle")
#: The ``who`` of the ALLOWED_LOCAL entry whose condition is computed: the import would load a HEAVY library
#: that the importing module's own top-level imports do not.
HEAVIER = "<heavier>"


#: Function-local imports that are allowed, each with its reason: (what is imported (a dotted prefix),
#: who imports it (a dotted prefix of the importing module; "" for any, "kernel" for any outside engine/), reason).
ALLOWED_LOCAL = [
    ("torch", "", "heavy (1-2 s): the kernel imports it at first use, never at `import distnb`; an engine "
                  "imports it in the background while it registers (engine/ipengine.py)"),
    ("numpy", "", "heavy and only needed on the paths that make arrays (data columns, shared memory)"),
    ("ipyparallel", "", "heavy client (zmq, tornado): not loaded by `import distnb` nor on a rank that does not "
                        "need it"),
    ("IPython", "", "`import distnb` stays free of IPython (a job, a script, a rank)"),
    ("ipykernel", "", "only in a kernel, never on a rank or in a job"),
    ("jupyter_core", "", "Jupyter's runtime folder, read only where a world's record or lease is written"),
    ("ipywidgets", "", "the dashboard's front end, only when a widget front end is there"),
    ("psutil", "", "read on the few paths that measure processes; kept out of a rank's import time"),
    ("cloudpickle", "", "only where a notebook object is pickled by value"),
    ("distnb", HEAVIER, "a distnb module whose own imports load a heavy library (HEAVY: torch, ipyparallel, "
                        "IPython, psutil, ...) that the importing module does not load: imported at first use, so "
                        "`import distnb`, the magics and an engine's registration stay fast (e.g. the session is "
                        "the lazy door to ipyparallel and torch; a rank's modules import torch at their top)"),
    ("distnb.display", "=distnb.display", "the display package picks its view (text, or ipywidgets) at first use"),
    ("tensorboard", "", "optional extra (distnb[tensorboard])"),
    ("peft", "", "optional extra (distnb[hf]); read only for a model that is a peft model"),
    ("transformers", "", "optional extra (distnb[hf]); heavy, read only for a Hugging Face model"),
    ("safetensors", "", "optional extra (distnb[hf]): weight files"),
    ("mpi4py", "", "optional extra (distnb[mpi])"),
    ("sklearn", "", "optional extra (distnb[examples]): the demo's data"),
    ("setproctitle", "", "an engine forked from the template names itself; absent is fine"),
    ("importlib", "", "inside a function that runs on an engine with the user namespace as its globals (the "
                      "keeper's _on_rank, made interactive where it is sent): a module-top import is not there"),
]


def package_of(module: str) -> str | None:
    """The package (a key of LEVELS) that ``module`` belongs to; None outside distnb."""
    if module in TOP_MODULES:
        return TOP_MODULES[module]
    parts = module.split(".")
    if parts[0] != "distnb" or len(parts) < 2:
        return None
    if parts[1] == "engine":
        if len(parts) > 2 and f"engine.{parts[2]}" in LEVELS:
            return f"engine.{parts[2]}"
        return "engine"
    return parts[1] if parts[1] in LEVELS else f"?{parts[1]}"


def modules(root: Path) -> dict[str, Path]:
    found = {}
    for path in sorted((root / "distnb").rglob("*.py")):
        if "__pycache__" in path.parts:
            continue
        parts = path.relative_to(root).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


#: The ``local`` of an import inside a function decorated ``@interactive`` (ipyparallel): allowed, as such a
#: function runs on an engine with the engine's user namespace as its globals, so its module's top-level
#: imports are not there.
INTERACTIVE = "interactive"


def runs_in_user_namespace(func) -> bool:
    """Whether ``func`` is decorated ``@interactive`` / ``@ipp.interactive`` (its globals: the engine's namespace)."""
    return any((isinstance(d, ast.Name) and d.id == "interactive") or
               (isinstance(d, ast.Attribute) and d.attr == "interactive") for d in func.decorator_list)


def imports(name: str, path: Path, known: set[str]):
    """(target, line, local) for every import in module ``name``: ``local`` if inside a function."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = path.name == "__init__.py"
    found = []

    def visit(node, local):
        for child in ast.iter_child_nodes(node):
            inner = local or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) and runs_in_user_namespace(child):
                inner = INTERACTIVE
            if isinstance(child, ast.Import):
                found.extend((a.name, child.lineno, local) for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                if child.level:
                    parts = (name if package else name.rpartition(".")[0]).split(".")
                    parts = parts[:len(parts) - child.level + 1]
                    base = ".".join(parts + ([child.module] if child.module else []))
                else:
                    base = child.module
                for a in child.names:
                    sub = f"{base}.{a.name}"
                    found.append((sub if sub in known else base, child.lineno, local))
            visit(child, inner)

    visit(tree, False)
    return found


def _under(name: str, prefix: str) -> bool:
    if prefix.startswith("="):  # exactly this module
        return name == prefix[1:]
    if prefix == "kernel":  # distnb's kernel side: everything outside engine/
        return _under(name, "distnb") and not _under(name, "distnb.engine")
    return prefix == "" or name == prefix or name.startswith(prefix + ".")


def top_imports(root: Path) -> dict[str, set[str]]:
    """module -> what its top-level statements import (not counting imports inside functions)."""
    mods = modules(root)
    known = set(mods)
    return {name: {t for t, _, local in imports(name, path, known) if not local} for name, path in mods.items()}


def heavy_at_import(top: dict[str, set[str]], module: str) -> set[str]:
    """The HEAVY libraries that importing ``module`` loads (its packages' ``__init__`` included)."""
    seen, todo, heavy = set(), [module], set()
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        if name.split(".")[0] in HEAVY:
            heavy.add(name.split(".")[0])
            continue
        parts = name.split(".")
        todo += [".".join(parts[:i]) for i in range(1, len(parts))]
        todo += list(top.get(name, ()))
    return heavy


def allowed_local(target: str, importer: str, top: dict[str, set[str]] | None = None) -> bool:
    for what, who, _ in ALLOWED_LOCAL:
        if not _under(target, what):
            continue
        if who == HEAVIER:
            if top is not None and heavy_at_import(top, target) - heavy_at_import(top, importer):
                return True
        elif _under(importer, who):
            return True
    return False


def problems(root: Path) -> dict[str, list[str]]:
    """What breaks the layout: imports against the direction, unlisted function-local imports, unknown packages."""
    mods = modules(root)
    known = set(mods)
    top = top_imports(root)
    against, local, unknown = [], [], []
    for name, path in mods.items():
        src = package_of(name)
        where = path.relative_to(root).as_posix()
        if src is None or src.startswith("?"):
            unknown.append(f"{where}: not in a package of the layout ({src})")
            continue
        for target, line, is_local in imports(name, path, known):
            if target.split(".")[0] == "__future__":
                continue
            dst = package_of(target) if target.split(".")[0] == "distnb" else None
            if dst is not None and dst != src and not dst.startswith("?") and LEVELS[dst] >= LEVELS[src]:
                against.append(f"{where}:{line} ({src}) imports {target} ({dst}){' in a function' if is_local else ''}")
            if is_local and is_local != INTERACTIVE and not allowed_local(target, name, top):
                local.append(f"{where}:{line} imports {target} in a function")
    return {"imports against the direction": against, "function-local imports not in ALLOWED_LOCAL": local,
            "modules outside the layout": unknown}


ROOT = Path(__file__).resolve().parents[2]


def test_every_module_is_in_a_package_of_the_layout():
    assert problems(ROOT)["modules outside the layout"] == []


def test_imports_go_one_way_between_packages():
    bad = problems(ROOT)["imports against the direction"]
    assert bad == [], f"{len(bad)} import(s) against the direction:\n  " + "\n  ".join(bad)


def test_function_local_imports_have_a_listed_reason():
    bad = problems(ROOT)["function-local imports not in ALLOWED_LOCAL"]
    assert bad == [], (f"{len(bad)} function-local import(s) without a reason in ALLOWED_LOCAL (move it to the "
                       "module's top, or list why):\n  " + "\n  ".join(bad))


def test_allowed_local_is_short_and_says_why():
    assert len(ALLOWED_LOCAL) <= 20
    assert all(len(reason) > 20 for _, _, reason in ALLOWED_LOCAL)


def test_the_checks_catch_what_they_should(tmp_path):
    """The direction check itself: an upward import (top or local) and an unlisted local import are found."""
    pkg = tmp_path / "distnb"
    for sub in ("core", "train"):
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "core" / "plan.py").write_text("def f():\n    from distnb.train import cell\n")
    (pkg / "train" / "cell.py").write_text("from distnb.core import plan\n\ndef g():\n    import json\n"
                                           "    import torch\n    from distnb.train import heavy\n")
    (pkg / "train" / "heavy.py").write_text("import ipyparallel\n\ndef h():\n    from distnb.train import cell\n")
    found = problems(tmp_path)
    assert found["imports against the direction"] == [
        "distnb/core/plan.py:2 (core) imports distnb.train.cell (train) in a function"]
    assert found["function-local imports not in ALLOWED_LOCAL"] == [
        "distnb/core/plan.py:2 imports distnb.train.cell in a function",
        "distnb/train/cell.py:4 imports json in a function",  # heavy.py's import of cell.py: not heavier
        "distnb/train/heavy.py:4 imports distnb.train.cell in a function"]


if __name__ == "__main__":
    for kind, lines in problems(Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT).items():
        print(f"{kind}: {len(lines)}")
        print("\n".join("  " + line for line in lines))
