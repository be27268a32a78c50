"""What an interrupted cell says of its model's weights: never that the notebook holds what it does not."""

import types

import torch

from distnb.train.homecoming import interrupted_weights

PLAN = types.SimpleNamespace(model="net")


def test_weights_brought_back_are_said_to_be_the_notebooks():
    said = interrupted_weights(PLAN, torch.nn.Linear(2, 2), None)
    assert "from rank 0's weights (now the notebook's)" in said


def test_weights_that_could_not_come_back_are_said_lost_not_the_notebooks():
    said = interrupted_weights(PLAN, torch.nn.Linear(2, 2), RuntimeError("the process group is broken"))
    assert "now the notebook's" not in said
    assert "could not be brought back" in said and "the process group is broken" in said
    assert "this cell's steps are lost" in said and "--checkpoint-dir" in said


def test_a_meta_model_is_said_to_start_afresh():
    with torch.device("meta"):
        net = torch.nn.Linear(2, 2)
    said = interrupted_weights(PLAN, net, None)
    assert "now the notebook's" not in said and "initialises net afresh" in said
