"""The kernel's table of rank functions (distnb.core.calls) matches the engine functions it names."""

import importlib
import inspect

import pytest

from distnb.core import calls


@pytest.mark.parametrize("key", sorted(calls.TABLE))
def test_each_rank_function_exists_with_the_declared_signature(key):
    fn = calls.TABLE[key]
    real = getattr(importlib.import_module(fn.module), fn.name)
    params = list(inspect.signature(real).parameters.values())
    if fn.with_ns:
        assert params and params[0].name == "ns", f"{key} must take the engine namespace first"
        params = params[1:]
    got = [(p.name, p.kind, p.default) for p in params]
    want = [(p.name, p.kind, p.default) for p in fn.signature.parameters.values()]
    assert got == want, f"{key}: the engine has {got}, distnb.core.calls declares {want}"


def test_a_call_that_does_not_fit_the_signature_fails_in_the_kernel():
    with pytest.raises(TypeError, match="distnb.engine.train.loop.train"):
        calls.train.check(({},))
    calls.train.check(({}, "loss = 0"))


def test_every_rank_function_the_kernel_calls_is_in_the_table():
    import ast
    import pathlib

    root = pathlib.Path(calls.__file__).parent
    used = set()
    for path in root.rglob("*.py"):
        if "import calls" not in path.read_text():
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "calls":
                used.add(node.attr)
    declared = {fn.name for fn in calls.TABLE.values()}
    assert used - {"TABLE", "RankFunction"} <= declared
