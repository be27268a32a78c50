"""The shape of distnb/, over every module found on disk: no import cycle among distnb's modules, no module
over 600 lines, no function (methods and nested functions included, docstrings included) over 80 lines.

Every import statement counts, lazy ones in functions included (tests/support/modules.py): a cycle
hidden in a function is still two modules that cannot be understood, or split, one without the other.
"""

import ast

from support import modules as mods

MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 80


def test_no_import_cycle_among_distnb_modules():
    graph = mods.internal_graph()
    cycles = mods.simple_cycles(graph)

    def chain(cycle):
        return " -> ".join(f"{a}:{','.join(map(str, graph[a][b]))}" for a, b in zip(cycle, cycle[1:])) + \
            f" -> {cycle[-1]}"

    assert cycles == [], (f"{len(cycles)} import cycle(s) among distnb's modules (module:line is where that module "
                          "imports the next one):\n  " + "\n  ".join(map(chain, cycles)))


def test_every_module_is_at_most_600_lines():
    sizes = {mods.relpath(m): len(path.read_text().splitlines()) for m, path in mods.modules().items()}
    over = sorted(((n, f) for f, n in sizes.items() if n > MAX_MODULE_LINES), reverse=True)
    assert over == [], f"modules over {MAX_MODULE_LINES} lines:\n  " + "\n  ".join(f"{f}: {n} lines" for n, f in over)


def functions(tree):
    """(qualified name, first line, number of lines from ``def`` to the last line) of every function in ``tree``."""
    found = []

    def visit(node, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = prefix + child.name
                found.append((name, child.lineno, child.end_lineno - child.lineno + 1))
                visit(child, name + ".")
            elif isinstance(child, ast.ClassDef):
                visit(child, prefix + child.name + ".")
            else:
                visit(child, prefix)

    visit(tree, "")
    return found


def test_functions_are_found_with_their_length():
    source = ("class A:\n    def f(self):\n        '''doc'''\n\n        def g():\n            pass\n        return g\n"
              "async def h():\n    if True:\n        def k(): pass\n")
    assert functions(ast.parse(source)) == [("A.f", 2, 6), ("A.f.g", 5, 2), ("h", 8, 3), ("h.k", 10, 1)]


def test_every_function_is_at_most_80_lines():
    over = []
    for m, path in mods.modules().items():
        for name, line, length in functions(ast.parse(path.read_text(), filename=str(path))):
            if length > MAX_FUNCTION_LINES:
                over.append((length, f"{mods.relpath(m)}:{line} {name}"))
    over.sort(reverse=True)
    assert over == [], f"functions over {MAX_FUNCTION_LINES} lines:\n  " + "\n  ".join(
        f"{where}: {n} lines" for n, where in over)


def test_test_modules_outside_packages_have_unique_names():
    """pytest imports test modules by file name (``prepend`` mode): two ``test_x.py`` in folders that are
    not packages clash at collection, and the whole run stops."""
    import collections
    import pathlib

    tests = pathlib.Path(__file__).resolve().parents[1]
    loose = [p for p in tests.rglob("test_*.py") if not (p.parent / "__init__.py").exists()]
    clashes = {name: paths for name, paths in collections.Counter(p.name for p in loose).items() if paths > 1}
    assert clashes == {}, sorted(str(p.relative_to(tests)) for p in loose if p.name in clashes)
