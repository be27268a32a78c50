"""How the kernel cuts a state into parts for weights back (distnb.transfer.weights_back.parts)."""

import torch.nn as nn

from distnb.transfer.weights_back import parts


def test_consecutive_keys_up_to_the_part_size_and_a_larger_tensor_alone():
    model = nn.Sequential(nn.Linear(16, 16), nn.Linear(64, 64), nn.Linear(8, 8))  # 1 KiB + 64 B, 16 KiB + 256 B, 256 B + 32 B
    groups, largest = parts(model, 2048)
    assert groups == [["0.weight", "0.bias"], ["1.weight"], ["1.bias", "2.weight", "2.bias"]]
    assert largest == 64 * 64 * 4  # the larger tensor alone sets the outbox size
    assert [k for g in groups for k in g] == list(model.state_dict())  # every key once, in order


def test_a_model_without_state_has_no_parts():
    assert parts(nn.ReLU(), 1024) == ([], 0)
