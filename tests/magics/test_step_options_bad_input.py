"""Bad input for the training-step, validation and logging options (issue 15): each is a UsageError naming
the option, through the magic, before anything is sent to the ranks; the cluster stays usable."""

import pytest
import torch
from IPython.core.error import UsageError

from distnb import session as session_mod

SETUP = """
import torch, torch.nn as nn, torch.nn.functional as F
g = torch.Generator().manual_seed(0)
sX = torch.randn(128, 8, generator=g)
step_ds = torch.utils.data.TensorDataset(sX, (sX[:, 0] > 0).long())
step_val = torch.utils.data.TensorDataset(sX[:40], (sX[:40, 0] > 0).long())
a_word = "hello"
torch.manual_seed(0)
opt_net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
bn_net = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Linear(16, 2))
sync_net = nn.Sequential(nn.Linear(8, 16), nn.SyncBatchNorm(16), nn.Linear(16, 2))
"""
BODY = "x, y = batch\nloss = F.cross_entropy(model(x), y)"
CASES = [
    ("--accumulate 0", "--accumulate must be at least 1"),
    ("--clip-grad-norm -1", "--clip-grad-norm must be positive"),
    ("--strategy ps --precision fp16", "--precision fp16 is not available with --strategy ps"),
    ("--val-data a_word", "--val-data a_word is a str, not a data set"),
    ("--val-data nowhere", "--val-data 'nowhere' is not defined"),
    ("--patience 3", "--patience needs validation"),
    ("--lr-schedule a_word", "--lr-schedule a_word is a str, not callable"),
    ("--lr-schedule nothing_here", "--lr-schedule 'nothing_here' is not defined"),
    ("--lr-schedule 3x", "--lr-schedule must be cosine, linear, constant"),
    ("--warmup-steps 5", "--warmup-steps needs --lr-schedule"),
    ("--val-data step_val --metric a_word", "--metric a_word is a str, not callable"),
    ("--sync-bn", "--sync-bn needs GPU ranks"),
    ("--model bn_net --sync-bn", "--sync-bn needs GPU ranks"),
    ("--model sync_net", "holds torch.nn.SyncBatchNorm layers, which needs GPU ranks"),
    ("--loop --accumulate 2", "act on distnb's own step"),
    ("--strategy ps --clip-grad-norm 1", "--clip-grad-norm is not available with --strategy ps"),
]


@pytest.mark.parametrize("options,message", CASES)
def test_bad_step_option_is_a_usage_error_before_anything_is_sent(shell, options, message):
    assert shell.run_cell(SETUP).error_in_exec is None
    s = session_mod.current()
    models = dict(s.holdings.models)
    if "--model" not in options:
        options = "--model opt_net " + options
    res = shell.run_cell(f"%%distrain {options} --data step_ds --progress none\n{BODY}")
    err = res.error_in_exec
    assert isinstance(err, UsageError), (options, err)
    assert message in str(err), (options, str(err))
    assert s.holdings.models == models  # nothing was sent
    ok = shell.run_cell(f"%%distrain --model opt_net --data step_ds --epochs 1 --progress none\n{BODY}")
    assert ok.error_in_exec is None
