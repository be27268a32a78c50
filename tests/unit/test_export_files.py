"""What ``%dist export`` writes that needs no cluster: a notebook class's source, the cell's flags, the body."""

import linecache

import pytest

from distnb.export import export
from distnb.core.plan import TrainPlan

SOURCE = '''import math

def helper(x):
    return x


@staticmethod
def unrelated():
    pass


class Scaled:
    """Defined in a notebook cell."""

    factor = 2

    def __init__(self, k):
        self.k = k

    @property
    def doubled(self):
        return self.k * self.factor


class Other:
    def __init__(self):
        pass
'''


def _cell(source, filename):
    """Run ``source`` as IPython runs a cell: registered in linecache under its cell name."""
    linecache.cache[filename] = (len(source), None, source.splitlines(keepends=True), filename)
    ns = {"__name__": "__main__"}
    exec(compile(source, filename, "exec"), ns)
    return ns


def test_the_source_of_a_notebook_class_is_found_in_its_cell():
    ns = _cell(SOURCE, "<ipython-input-7-export-test>")
    src = export.class_source(ns["Scaled"])
    assert src.startswith("class Scaled:\n") and "return self.k * self.factor" in src
    assert "class Other" not in src and "def helper" not in src
    assert export.class_source(ns["Other"]).startswith("class Other:")


def test_a_class_without_functions_of_its_own_has_no_source_to_show():
    ns = _cell("class Empty:\n    x = 1\n", "<ipython-input-8-export-test>")
    assert export.class_source(ns["Empty"]) is None


def test_the_cells_options_are_written_as_its_flags():
    plan = TrainPlan(model="net", data="train", epochs=3, optimizer="adam", lr=0.01, fsdp_units=None,
                     drop_last=True, seed=4)
    assert export.cli_line(plan.to_dict()) == ("--model net --data train --epochs 3 --optimizer adam --lr 0.01 "
                                               "--seed 4 --drop-last")
    fsdp = TrainPlan(model="m", data="d", strategy="fsdp", fsdp_units=("a", "b"))
    assert export.cli_line(fsdp.to_dict()) == "--model m --data d --strategy fsdp --fsdp-units a,b"


@pytest.mark.parametrize("code", ["x, y = batch\nloss = F.cross_entropy(model(x), y)\n",
                                  'loss = model(batch).sum()  # a "comment"\n',
                                  "s = '\\\\n'\nloss = model(batch).mean()\n", 'a = """x"""\nloss = a\n'])
def test_the_body_is_written_as_a_literal_that_reads_back_the_same(code):
    literal = export._body_literal(code)
    assert eval(literal) == code
    if "\\" not in code and '"""' not in code:
        assert literal.startswith('"""\\\n')  # readable: the body as it was typed, from the next line on


def test_dist_export_help_has_an_example():
    from distnb.magics import _export

    text = _export.parser.format_help()
    assert "%dist export" in text and "Example: %dist export" in text and "--force" in text


def test_the_job_says_where_it_saves_when_the_cell_had_a_checkpoint_dir():
    """The script repeats the cell's options, --checkpoint-dir included; the job saves in its own checkpoints/."""
    from types import SimpleNamespace

    note = export._checkpoint_note(SimpleNamespace(plan=SimpleNamespace(checkpoint_dir="/tmp/cells-ckpt")))
    assert note.startswith("\n# ") and "checkpoints/ of this folder, not in the cell's --checkpoint-dir" in note
    assert export._checkpoint_note(SimpleNamespace(plan=SimpleNamespace(checkpoint_dir=None))) == ""


def test_the_export_says_where_torchrun_is_when_path_does_not_find_it(monkeypatch):
    """After `make demo` the venv is not activated: `torchrun ...` as printed was 'command not found'."""
    import os
    import sys

    mine = os.path.join(os.path.dirname(sys.executable), "torchrun")
    monkeypatch.setenv("PATH", "/nonexistent")
    assert export._on_path() == f" (torchrun is {mine}: this environment's bin is not on PATH)"
    monkeypatch.setenv("PATH", os.path.dirname(sys.executable))
    assert export._on_path() == ""


def test_a_job_on_another_number_of_ranks_says_whether_its_batches_are_the_cells():
    """tensor and pipeline train every rank on the same batches: on 3 ranks the job's data is the 2-rank cell's
    (its losses came out the cell's), which the job said would differ."""
    from distnb.engine.job import _data_change
    from distnb.core.plan import TrainPlan

    for strategy in ("tensor", "pipeline"):
        said = _data_change(TrainPlan(model="m", data="d", strategy=strategy), 3, 2)
        assert said.startswith("the data is cut into as many shards as in the cell"), said
    for strategy in ("ddp", "fsdp", "ps"):
        assert "will not be the cell's" in _data_change(TrainPlan(model="m", data="d", strategy=strategy), 3, 2)
    mesh = TrainPlan(model="m", data="d", strategy="fsdp+tensor", mesh="1x2")
    assert "will not be the cell's" in _data_change(mesh, 3, 2)  # a mesh that does not fit 3 ranks
