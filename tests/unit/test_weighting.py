"""ctx.num_items's normalisation on one process (distnb.engine.train.weighting.ItemCount; no process group)."""

import types

import pytest
import torch

from distnb.engine.train import weighting


def grads(*values):
    params = [torch.nn.Parameter(torch.zeros(2)) for _ in values]
    for p, v in zip(params, values):
        p.grad = torch.full((2,), float(v))
    return params


def test_a_group_is_divided_by_its_summed_count():
    count = weighting.ItemCount(torch.device("cpu"))
    count.add(weighting.as_count(torch.tensor(3), torch.device("cpu")))
    count.add(weighting.as_count(5, torch.device("cpu")))
    params = grads(16.0, 8.0)
    assert float(count.finish_group(params, world_size=1)) == 8.0
    assert params[0].grad.tolist() == [2.0, 2.0] and params[1].grad.tolist() == [1.0, 1.0]
    assert count.weighted is True


def test_world_size_undoes_the_mean_over_ranks():
    count = weighting.ItemCount(torch.device("cpu"))
    count.add(weighting.as_count(4, torch.device("cpu")))
    params = grads(4.0)
    count.finish_group(params, world_size=2)  # no process group: the count is this rank's alone here
    assert params[0].grad.tolist() == [2.0, 2.0]


def test_no_item_anywhere_gives_no_gradient():
    count = weighting.ItemCount(torch.device("cpu"))
    count.add(weighting.as_count(0, torch.device("cpu")))
    params = grads(3.0)
    count.finish_group(params, world_size=1)
    assert params[0].grad.tolist() == [0.0, 0.0]


def test_set_on_some_micro_steps_only_is_an_error():
    count = weighting.ItemCount(torch.device("cpu"))
    count.add(weighting.as_count(2, torch.device("cpu")))
    count.missing()
    with pytest.raises(ValueError, match="set on 1 and not set on 1 micro-steps"):
        count.finish_group(grads(1.0), world_size=1)
    later = weighting.ItemCount(torch.device("cpu"))
    later.missing()
    assert later.finish_group(grads(1.0), world_size=1) is None and later.weighted is False
    with pytest.raises(ValueError, match="not on the cell's first optimizer step"):
        later.add(weighting.as_count(2, torch.device("cpu")))


@pytest.mark.parametrize("value,words", [(torch.ones(3), "shape (3,)"), ("5", "got str"), (-1, ">= 0"),
                                         (True, "got bool")])
def test_a_bad_count_is_refused(value, words):
    with pytest.raises(ValueError, match=words.replace("(", r"\(").replace(")", r"\)")):
        weighting.as_count(value, torch.device("cpu"))


@pytest.mark.parametrize("strategy,loop,words", [("pipeline", False, "not available with --strategy pipeline"),
                                                 ("ps", False, "not available with --strategy ps"),
                                                 ("ddp", True, "with --loop the body runs backward itself")])
def test_where_it_cannot_apply_it_says_why(strategy, loop, words):
    with pytest.raises(ValueError, match=words):
        weighting.check_allowed(types.SimpleNamespace(strategy=strategy, loop=loop))
    weighting.check_allowed(types.SimpleNamespace(strategy="fsdp", loop=False))
