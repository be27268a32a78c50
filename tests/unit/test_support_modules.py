"""The tools of the import rule and structure tests (tests/support/modules.py) find what they must."""

from support import modules as mods

SOURCE = '''
import os, torch.nn as nn
from . import sibling, helper_name
from .. import errors
from ..plan import TrainPlan
from .strategies import ddp

def later():
    from distnb import session
    import distnb.engine.loop
    try:
        from ipyparallel.datapub import publish_data
    except ImportError:
        pass
'''
KNOWN = {"distnb", "distnb.errors", "distnb.plan", "distnb.session", "distnb.engine", "distnb.engine.loop",
         "distnb.engine.sibling", "distnb.engine.runtime", "distnb.engine.strategies", "distnb.engine.strategies.ddp"}


def test_every_import_is_found_and_resolved():
    found = [(i.target, i.line) for i in mods.imports_in(SOURCE, "distnb.engine.runtime", False, KNOWN)]
    assert found == [("os", 2), ("torch.nn", 2), ("distnb.engine", 3), ("distnb.engine.sibling", 3),
                     ("distnb.errors", 4), ("distnb.plan", 5), ("distnb.engine.strategies.ddp", 6),
                     ("distnb.session", 9), ("distnb.engine.loop", 10), ("ipyparallel.datapub", 12)]


def test_a_package_resolves_relative_imports_from_itself():
    found = [i.target for i in mods.imports_in("from . import ddp\nfrom .. import loop\n", "distnb.engine.strategies",
                                               True, KNOWN)]
    assert found == ["distnb.engine.strategies.ddp", "distnb.engine.loop"]


def test_every_cycle_is_reported_once():
    graph = {"a": {"b": [1]}, "b": {"a": [2], "c": [3]}, "c": {"a": [4], "d": [5]}, "d": {}, "e": {"e": [6]}}
    assert mods.simple_cycles(graph) == [["a", "b", "a"], ["a", "b", "c", "a"], ["e", "e"]]
    assert mods.simple_cycles({"a": {"b": [1]}, "b": {"c": [1]}, "c": {}}) == []


def test_distnb_is_found_on_disk():
    names = mods.modules()
    assert {"distnb", "distnb.session", "distnb.engine", "distnb.engine.strategies.ps",
            "distnb.display.widgets"} <= set(names)
    assert all(path.is_file() and path.suffix == ".py" for path in names.values())
    graph = mods.internal_graph()
    assert "distnb.engine.process.runtime" in graph["distnb.engine.train.checkpoint"]
