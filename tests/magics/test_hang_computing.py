"""A rank that computes while the others wait for it in a collective is slow, not hung (real cluster, real gloo).

On the first step there is no step time to go by: a first step slower than ``--hang-after`` (a big model's first
SGD step of 13 s on a busy 2-core machine, under the default 10 s) was named a hang although every rank computed.
Now a rank whose process uses a share of a CPU core is waited for ``hangs.PATIENT_COMPUTING`` times as long;
one that waits without computing is still a hang at ``--hang-after`` (tests/magics/test_hangs.py).

Rank 1 burns BURN seconds of its own CPU time (``time.thread_time``, so at least BURN seconds of wall time however
loaded the machine is: rank 0's wait is always longer than HANG, which the old check named a hang) while rank 0
waits; the patience for a computing rank (PATIENT_COMPUTING x HANG = 10 s) leaves room for a rank that gets only
a third of a core.
"""

import pytest
from support.cells import hang_after

from distnb.core.errors import HangError
from distnb.execute import hangs

HANG = 2.0
BURN = 3.0
SETUP = """import time
import torch, torch.nn as nn, torch.nn.functional as F
torch.manual_seed(0)
busy_X = torch.randn(64, 6)
busy_train = torch.utils.data.TensorDataset(busy_X, (busy_X.sum(1) > 0).long())
busy_net = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 2))
def burn(seconds):
    start = time.thread_time()
    while time.thread_time() - start < seconds:
        sum(i * i for i in range(1000))"""


def run(shell, code):
    return shell.run_cell(code, silent=False)


@pytest.mark.timeout(120)
def test_a_first_step_that_computes_longer_than_hang_after_on_one_rank_is_not_a_hang(shell):
    assert run(shell, SETUP).error_in_exec is None
    assert run(shell, "%dist push burn").error_in_exec is None
    with hang_after(HANG):
        res = run(shell, "%%distrain --model busy_net --data busy_train --epochs 1 --batch-size 16 --progress none\n"
                         f"x, y = batch\nif rank == 1 and ctx.step == 0:\n    burn({BURN})\n"
                         "loss = F.cross_entropy(model(x), y)")
    assert res.error_in_exec is None, res.error_in_exec
    with hang_after(HANG):  # the same in a %%dist cell: rank 0 waits in the cell's own all_reduce
        res = run(shell, "%%dist\nimport torch, torch.distributed as dist\nt = torch.ones(2)\n"
                         f"if rank == 1:\n    burn({BURN})\ndist.all_reduce(t)\nsummed = t.tolist()")
    assert res.error_in_exec is None, res.error_in_exec
    assert run(shell, "%dist pull summed").result == [[2.0, 2.0], [2.0, 2.0]]
    assert hangs.PATIENT_COMPUTING * HANG >= 3 * BURN  # the room the module's docstring counts on


@pytest.mark.timeout(120)
def test_a_rank_that_computes_forever_is_named_computing_after_the_longer_wait(shell):
    with hang_after(1.0):
        res = run(shell, "%%dist\nimport torch, torch.distributed as dist\nt = torch.ones(3)\n"
                         "while rank == 1:\n    pass\ndist.all_reduce(t)\n")
    err = res.error_in_exec
    assert isinstance(err, HangError), err
    text = str(err)
    assert "rank 0 waited" in text and "all_reduce of [3]" in text, text
    assert "rank 1 never arrived: it is at cell line 3: `while rank == 1:`, computing (" in text, text
    assert f"({hangs.PATIENT_COMPUTING} times --hang-after 1 s" in text and "rank 1 was computing)" in text, text
    res = run(shell, "%%dist\nimport torch, torch.distributed as dist\n_t = torch.ones(2)\ndist.all_reduce(_t)\n"
                     "_t_list = _t.tolist()")
    assert res.error_in_exec is None, res.error_in_exec
    assert run(shell, "%dist pull _t_list").result == [[2.0, 2.0], [2.0, 2.0]]
