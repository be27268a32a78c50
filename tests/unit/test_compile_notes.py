"""What a --compile cell says about dynamo (distnb.train.compiled), from a rank's row: never a compile time for nothing."""

from distnb.train import compiled
from distnb.train.results import training_notes

ROW = dict(rank=0, compiled=True, first_step_seconds=16.2, step_seconds=0.004, eager_step_seconds=0.008)


def dynamo(graphs, since=None, breaks=(), recompiles=0, reasons=()):
    return dict(graphs=graphs, graphs_since_compile=graphs if since is None else since,
                graph_breaks=sum(n for _, n in breaks), break_reasons=[list(b) for b in breaks],
                recompiles=recompiles, recompile_reasons=list(reasons))


def test_nothing_compiled_is_said_with_the_reason_and_no_time():
    row = dict(ROW, dynamo=dynamo(0, breaks=[("Attempted to call function marked as skipped", 3)]))
    said = compiled.note(row)
    assert said.startswith("torch.compile compiled nothing on rank 0: dynamo made 0 graphs (Attempted to call "
                           "function marked as skipped x 3); the steps ran eagerly")
    assert "compiling" not in said and "x the eager" not in said
    assert compiled.compile_seconds(row) is None and not compiled.compiled_anything(row)
    assert said in training_notes(row)


def test_graphs_breaks_and_recompiles_are_counted_with_the_compile_time():
    row = dict(ROW, dynamo=dynamo(2, breaks=[("Unsupported method call", 1)], recompiles=1,
                                  reasons=["0/0: GLOBAL_STATE changed: grad_mode"]))
    said = compiled.note(row)
    assert said.startswith("torch.compile on rank 0: 2 graphs compiled this cell, 1 graph break (Unsupported method "
                           "call), 1 recompile (0/0: GLOBAL_STATE changed: grad_mode); the first step took 16.2 s "
                           "(16.2 s compiling); later steps 4.0 ms, 2.00x the eager steps")
    assert compiled.compile_seconds(row) == 16.2 - 0.004


def test_graphs_of_an_earlier_cell_reused_are_no_compile_time():
    row = dict(ROW, first_step_seconds=0.005, dynamo=dynamo(0, since=1))
    said = compiled.note(row)
    assert "no new graph this cell (the 1 graph of an earlier cell reused)" in said and "compiling" not in said
    assert compiled.compile_seconds(row) is None and compiled.compiled_anything(row)


def test_no_compile_no_note():
    assert compiled.note(dict(ROW, compiled=False)) is None
    assert compiled.compile_seconds(dict(ROW, compiled=False)) is None
