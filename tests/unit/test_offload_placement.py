"""fsdp --offload cpu materialises the shards in host memory (issue 34, the GPU check of tests/gpu/check_gpu.py).

FSDP2's CPUOffloadPolicy refuses sharded parameters on a GPU ("FSDP parameters should be materialized on
CPU when enabling CPU offloading"), and a GPU capped below the model could not hold them all anyway. The
placement takes the strategy's ``param_device()`` for parameters and leaves buffers on the rank's device,
where the forward runs. No GPU here: the meta device stands in for the rank's device.
"""

from types import SimpleNamespace

import torch
import torch.nn as nn

from distnb.engine.strategies import materialize
from distnb.engine.strategies.fsdp import FSDP


def test_parameters_go_to_the_param_device_and_buffers_stay_on_the_rank_device():
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    placed = materialize.place(model, torch.device("meta"), param_device=torch.device("cpu"))
    assert placed["0.weight"].device.type == "cpu" and placed["1.bias"].device.type == "cpu"
    assert isinstance(placed["0.weight"], nn.Parameter)
    assert placed["1.running_mean"].device.type == "meta"  # a buffer goes where the forward runs (here: meta)


def test_fsdp_places_its_parameters_in_host_memory_with_offload_only():
    gpu = torch.device("cuda", 0)  # a description only: nothing is allocated on it
    offload = SimpleNamespace(plan=SimpleNamespace(offload="cpu"), device=gpu)
    assert FSDP.param_device(offload) == torch.device("cpu")
    plain = SimpleNamespace(plan=SimpleNamespace(offload=None), device=gpu)
    assert FSDP.param_device(plain) == gpu
