"""A rank's traceback through notebook code sent by value, as the RankError and ``%dist debug`` show it.

On the shared real 2-rank cluster: the frames of a notebook class's method show the notebook's
source lines (not cloudpickle's ``<dynamic-code>`` without source), and torch's module-call
plumbing between the user's frames is one line (every frame stays in ``full_traceback``).
"""

import re

import pytest

from distnb.core.errors import RankError

pytestmark = pytest.mark.timeout(240)

MODEL = """import torch, torch.nn as nn, torch.nn.functional as F
class TbNet(nn.Module):
    def __init__(self): super().__init__(); self.fc = nn.Linear(10, 16); self.out = nn.Linear(16, 3)
    def forward(self, x):
        h = self.fc(x)          # the failing line when x has 5 features
        return self.out(h)
tb_net = TbNet()
tb_data = (torch.randn(32, 10), torch.randint(0, 3, (32,)))
"""
TRAIN = """%%distrain --model tb_net --data tb_data --epochs 1 --batch-size 8
x, y = batch
loss = F.cross_entropy(model(x[:, :5]), y)
"""
HELPER = """def tb_helper(values):
    total = sum(values)
    return total.no_such_attribute
"""


def _rendered(err) -> str:
    assert isinstance(err, RankError), err
    return "\n".join(err._render_traceback_())


def test_a_notebook_models_forward_shows_its_source_in_a_training_cells_traceback(shell):
    assert shell.run_cell(MODEL).error_in_exec is None
    text = _rendered(shell.run_cell(TRAIN).error_in_exec)
    assert "in TbNet.forward(self, x)" in text
    assert "h = self.fc(x)          # the failing line when x has 5 features" in text
    assert "<dynamic-code>" not in text and "Could not get source" not in text
    assert "mat1 and mat2 shapes cannot be multiplied (8x5 and 10x16)" in text


def test_torchs_call_plumbing_folds_between_the_users_frames_and_the_full_traceback_is_kept(shell):
    assert shell.run_cell(MODEL).error_in_exec is None
    err = shell.run_cell(TRAIN).error_in_exec
    text = _rendered(err)
    cell, model, raised = (text.index("File <distrain-cell-"), text.index("in TbNet.forward(self, x)"),
                           text.index("in Linear.forward(self, input)"))
    ddp = re.search(r"\.\.\. \d+ frames in torch \(nn/modules/module\.py, nn/parallel/distributed\.py\) \.\.\.", text)
    assert ddp and cell < ddp.start() < model, text  # the module call through DDP into the notebook's forward
    assert model < text.index("... 2 frames in torch (nn/modules/module.py) ...") < raised
    assert "_call_impl" not in text and "_run_ddp_forward" not in text
    assert "sys.last_value.full_traceback has every frame" in text
    for full in (err.full_traceback, err.failures[-1]["full_traceback"]):
        assert "in Module._wrapped_call_impl" in full and "in DistributedDataParallel._run_ddp_forward" in full
        assert "h = self.fc(x)" in full and "\x1b[" not in full


def test_a_pushed_notebook_function_shows_its_source_in_a_dist_cell_and_in_dist_debug(shell, dist_session):
    assert shell.run_cell(HELPER).error_in_exec is None
    assert shell.run_cell("%dist push tb_helper").error_in_exec is None
    text = _rendered(shell.run_cell("%%dist\ntb_helper([rank, 1])").error_in_exec)
    assert "in tb_helper(values)" in text and "return total.no_such_attribute" in text
    assert "<dynamic-code>" not in text
    listing = dist_session.debug(rank=0, commands=["l", "q"])
    assert "return total.no_such_attribute" in listing and "total = sum(values)" in listing
