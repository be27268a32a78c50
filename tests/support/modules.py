"""distnb's modules as found on disk, and what each imports (read with ``ast``, nothing is imported).

Every ``import`` and ``from ... import`` statement counts, wherever it is (module level, inside a
function, under ``try``): relative imports are resolved, and ``from pkg import name`` is an import
of the submodule ``pkg.name`` when that module exists, else of ``pkg``. Importing a module also
runs its packages' ``__init__``; that implicit edge is not counted (every module would then import
``distnb``), so a package is a dependency only where it is named.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "distnb"


@dataclass(frozen=True)
class Import:
    """``module`` imports ``target`` (a dotted name) on ``line``."""

    module: str
    target: str
    line: int


@lru_cache(maxsize=None)
def modules() -> dict[str, Path]:
    """Every module of the distnb package on disk: dotted name -> file (a package is its ``__init__.py``)."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(REPO).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def relpath(name: str) -> str:
    return modules()[name].relative_to(REPO).as_posix()


def is_package(name: str) -> bool:
    return modules()[name].name == "__init__.py"


@lru_cache(maxsize=None)
def imports(name: str) -> tuple[Import, ...]:
    """What module ``name`` imports, anywhere in its source, in source order."""
    path = modules()[name]
    return imports_in(path.read_text(), name, is_package(name), set(modules()), filename=str(path))


def imports_in(source: str, name: str, package: bool, known: set[str],
               filename: str = "<source>") -> tuple[Import, ...]:
    """The imports of ``source``, the code of module ``name`` (a package's ``__init__`` if ``package``).

    ``from pkg import x`` is an import of ``pkg.x`` when that is in ``known`` (the modules that exist).
    """
    tree = ast.parse(source, filename=filename)
    parent = name if package else name.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [Import(name, alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base_parts = parent.split(".")
                if node.level > 1:
                    base_parts = base_parts[:-(node.level - 1)]
                base = ".".join(base_parts + ([node.module] if node.module else []))
            else:
                base = node.module
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.append(Import(name, sub if sub in known else base, node.lineno))
    return tuple(sorted(found, key=lambda i: (i.line, i.target)))


def internal_graph() -> dict[str, dict[str, list[int]]]:
    """module -> {distnb module it imports -> the lines that import it} (self-imports left out)."""
    graph: dict[str, dict[str, list[int]]] = {}
    for name in modules():
        edges = graph.setdefault(name, {})
        for imp in imports(name):
            if imp.target in modules() and imp.target != name:
                edges.setdefault(imp.target, []).append(imp.line)
    return graph


def simple_cycles(graph: dict[str, dict[str, list[int]]], limit: int = 100) -> list[list[str]]:
    """The elementary cycles of ``graph`` (each once, starting at its smallest name), at most ``limit``."""
    cycles: list[list[str]] = []
    order = sorted(graph)
    for start in order:
        allowed = {n for n in order if n >= start}
        stack = [(start, iter(sorted(graph[start])))]
        path, on_path = [start], {start}
        while stack:
            node, children = stack[-1]
            for child in children:
                if child == start:
                    cycles.append(path + [start])
                    if len(cycles) >= limit:
                        return cycles
                elif child in allowed and child not in on_path:
                    stack.append((child, iter(sorted(graph[child]))))
                    path.append(child)
                    on_path.add(child)
                    break
            else:
                stack.pop()
                on_path.discard(path.pop())
    return cycles


def modules_loaded_by(names, watch, timeout=120) -> dict:
    """Import ``names`` in a fresh interpreter (this tree's distnb) and report, as a dict:

    ``loaded``: the modules in ``sys.modules`` afterwards; ``errors``: {name: exception} for
    imports that failed; ``first``: for each loaded module whose name is in ``watch`` (or under
    one of them), the distnb import that first pulled it in (``"path:line (in module)"``), and
    ``distnb_file``: where the imported distnb came from.
    """
    code = r'''
import json, sys, traceback
names, watch = json.loads(sys.argv[1]), json.loads(sys.argv[2])
first = {}
class Watch:
    def find_spec(self, fullname, path=None, target=None):
        if fullname not in first and any(fullname == w or fullname.startswith(w + ".") for w in watch):
            chain = [f"{f.filename}:{f.lineno}" for f in traceback.extract_stack()
                     if "/distnb/" in f.filename.replace("\\", "/") and "<frozen" not in f.filename]
            first[fullname] = chain
        return None
sys.meta_path.insert(0, Watch())
errors = {}
for name in names:
    try:
        __import__(name)
    except BaseException as e:
        errors[name] = f"{type(e).__name__}: {e}"
import distnb
print(json.dumps({"loaded": sorted(sys.modules), "errors": errors, "first": first, "distnb_file": distnb.__file__}))
'''
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    out = subprocess.run([sys.executable, "-c", code, json.dumps(list(names)), json.dumps(list(watch))],
                         capture_output=True, text=True, timeout=timeout, cwd=REPO, env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert Path(result["distnb_file"]).resolve().parent == PACKAGE, result["distnb_file"]
    return result
