"""Messages a new user met (issue 36, "Smaller things"), on the real 2-rank cluster.

- a loss computed with ``.item()`` was told to "reduce it, e.g. `.mean()`": the fix is to drop ``.item()``;
- ``--data (X, Y)`` said only "unrecognized arguments: Y)";
- ``%dist start`` on a running cluster named the hang timeout "running: None".
"""

import pytest
from IPython.core.error import UsageError

from distnb.core.errors import RankError

SETUP = """import numpy as np, torch, torch.nn as nn, torch.nn.functional as F
torch.manual_seed(0)
um_X = torch.randn(64, 4)
um_Y = (um_X[:, 0] > 0).long()
um_train = torch.utils.data.TensorDataset(um_X, um_Y)
um_net = nn.Linear(4, 2)"""
TRAIN = "%%distrain --model um_net --data um_train --epochs 1 --batch-size 16 --progress none\nx, y = batch\n"


def run(shell, code):
    return shell.run_cell(code, silent=False)


@pytest.mark.parametrize("loss, kind", [("F.cross_entropy(model(x), y).item()", "float"),
                                        ("float(F.cross_entropy(model(x), y))", "float"),
                                        ("F.cross_entropy(model(x), y).detach().numpy()[()]", "float32")])
def test_a_loss_turned_into_a_number_is_told_to_drop_item(shell, loss, kind):
    run(shell, SETUP)
    err = run(shell, TRAIN + f"loss = {loss}").error_in_exec
    assert isinstance(err, RankError), err
    text = str(err)
    assert f"`loss` is a Python {kind}, not a scalar tensor" in text and "drop `.item()`" in text, text
    assert ".mean()" not in text
    assert run(shell, TRAIN + "loss = F.cross_entropy(model(x), y)").error_in_exec is None


def test_a_loss_cut_from_the_graph_says_how(shell):
    run(shell, SETUP)
    err = run(shell, TRAIN + "loss = torch.tensor(F.cross_entropy(model(x), y).item())").error_in_exec
    assert isinstance(err, RankError) and "`loss` does not require grad" in str(err)
    assert "a `.item()`, `.detach()` or `torch.tensor(...)` on the way cuts it from the graph" in str(err)


@pytest.mark.parametrize("line", ["--data (um_X, um_Y)", "--data=(um_X, um_Y)", "--data (um_X,um_Y)",
                                  "--data [um_X, um_Y]", "--val-data (um_X, um_Y) --data um_train"])
def test_an_expression_where_a_name_goes_says_what_to_write(shell, line):
    run(shell, SETUP)
    res = run(shell, f"%%distrain --model um_net {line} --epochs 1 --progress none\nx, y = batch\n"
                     "loss = F.cross_entropy(model(x), y)")
    err = res.error_in_exec
    assert isinstance(err, UsageError), err
    text = str(err)
    flag = "--val-data" if "--val-data" in line else "--data"
    assert "unrecognized arguments" not in text
    assert f"{flag} takes the name of a notebook object, not an expression" in text, text
    assert "bind it in a cell first, e.g. `" in text and f"then {flag} " in text


def test_a_second_start_names_the_running_hang_timeout_not_none(shell, capsys):
    assert run(shell, "%dist start --hang-after 4 --timeout 30").error_in_exec is None
    out = capsys.readouterr().out
    assert "--hang-after 4.0 (running: 10 s, the default)" in out, out  # min(10, --timeout 30 / 2)
    assert "None" not in out


def test_a_notebook_alias_of_the_model_in_the_body_says_to_call_model(shell):
    """``m = um_net`` then ``m(x)`` in the body: Python's bare NameError on the ranks, though the notebook defines m."""
    run(shell, SETUP + "\num_alias = um_net")
    err = run(shell, TRAIN + "loss = F.cross_entropy(um_alias(x), y)").error_in_exec
    assert isinstance(err, RankError) and "name 'um_alias' is not defined" in str(err)
    assert "um_alias is a torch.nn.Module in the notebook (the same object as --model um_net): modules are not sent " \
           "to the ranks by name" in str(err) and "`model(x)`" in str(err)
    assert run(shell, TRAIN + "loss = F.cross_entropy(model(x), y)").error_in_exec is None  # the cluster goes on
