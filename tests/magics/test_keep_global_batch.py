"""``%dist scale N --keep-global-batch``: for the models live at the scale only, said on every cell it changes,
ended by a later ``%dist scale`` without the flag (the same size too), and exported as what the job needs.

Every test leaves the shared cluster at 2 ranks.
"""

import json
import os
import re

import pytest
import torch.nn.functional as F

from support.data import parity_data, parity_model
from support.worlds import back_to_two_ranks

BODY = "x, y = batch\nloss = F.cross_entropy(model(x), y)"


@pytest.fixture(autouse=True)
def two_ranks(shell):
    yield
    back_to_two_ranks()


def _cell(shell, model, batch):
    res = shell.run_cell(f"%%distrain --model {model} --data kgb_data --epochs 1 --batch-size {batch} --seed 2 "
                         f"--progress none\n{BODY}", silent=False)
    assert res.error_in_exec is None, res.error_in_exec
    return res.result


def test_keep_global_batch_is_for_the_live_models_said_and_ended_by_a_scale_without_it(shell, dist_session, capsys,
                                                                                        tmp_path):
    ns = shell.user_ns
    ns.update(kgb_live=parity_model(), kgb_data=parity_data(n=192), F=F)
    _cell(shell, "kgb_live", 12)  # global batch 24 on 2 ranks
    assert shell.run_cell("%dist scale 3 --keep-global-batch").error_in_exec is None
    said = capsys.readouterr().out
    # (the shared cluster may hold other tests' models too: each live one is named)
    assert re.search(r"the next cells of [^(]*\bkgb_live\b[^(]* have their --batch-size and --accumulate scaled",
                     said), said

    # a brand-new model, and a new object bound to a live model's name: their --batch-size is as written
    ns.update(kgb_new=parity_model(seed=4))
    assert _cell(shell, "kgb_new", 16).plan.batch_size == 16
    assert "--keep-global-batch" not in capsys.readouterr().out

    # the live model: rewritten, and said on every cell it changes
    for _ in range(2):
        assert _cell(shell, "kgb_live", 12).plan.batch_size == 8
        assert "global batch 24 kept on 3 ranks as --batch-size 8 (this cell's --batch-size 12 is for 2 ranks)" in \
            capsys.readouterr().out

    # %dist export writes what the job needs to reproduce the cell (the batch the ranks trained), and says so
    folder = tmp_path / "job"
    assert shell.run_cell(f"%dist export {folder}").error_in_exec is None
    said = capsys.readouterr().out
    assert "the job trains --batch-size 8 --accumulate 1 per rank on 3 ranks, as the cell did, not the cell's own " \
        "--batch-size 12" in said, said
    options = json.loads((folder / "options.json").read_text())
    assert options["plan"]["batch_size"] == 8 and options["keep_global_batch"]["written"] == [12, 1]

    # a scale without the flag ends it, at the same size too (as the README says)
    assert shell.run_cell("%dist scale 3").error_in_exec is None
    said = capsys.readouterr().out
    assert re.search(r"--keep-global-batch ended for [^:]*\bkgb_live\b[^:]*: the next cells' --batch-size", said), said
    assert _cell(shell, "kgb_live", 12).plan.batch_size == 12
    assert "--keep-global-batch" not in capsys.readouterr().out
    assert not os.path.exists(folder / "stale")


def test_a_model_replaced_in_the_notebook_after_the_scale_trains_its_batch_as_written(shell, dist_session, capsys):
    ns = shell.user_ns
    ns.update(kgb_swap=parity_model(), kgb_data=parity_data(n=192), F=F)
    _cell(shell, "kgb_swap", 12)
    assert shell.run_cell("%dist scale 3 --keep-global-batch").error_in_exec is None
    ns["kgb_swap"] = parity_model(seed=7)  # `net = Net()` run again: a brand-new model under the same name
    capsys.readouterr()
    assert _cell(shell, "kgb_swap", 12).plan.batch_size == 12
    assert "--keep-global-batch" not in capsys.readouterr().out
