"""``%dist pull NAME.path.to.param`` and ``Session.pull("NAME.path")``: one full tensor of a model, any strategy.

After a cell the kernel's model holds rank 0's trained weights, so the tensor pulled by its dotted name
must equal the kernel's (bit for bit): gathered whole from fsdp and tensor-parallel shards
(``DTensor.full_tensor``), from the pipeline stage that holds it, from one ddp replica. An unknown name
is an error with the nearest names, and the
placed model's own name an error that says how to read its weights; the cluster stays usable.
"""

import pytest
import torch
import torch.nn.functional as F

from distnb.core.errors import PlanError, RankError
from support.data import parity_data, parity_model

BODY = "x, y = batch\nloss = F.cross_entropy(model(x), y)"


@pytest.mark.parametrize("strategy", ["ddp", "fsdp", "tensor", "pipeline"])
def test_pull_one_tensor_by_its_dotted_name(dist_session, shell, strategy):
    ns = shell.user_ns
    name = f"pt_{strategy}"
    ns[name], ns["pt_data"], ns["F"] = parity_model(), parity_data(), F
    dist_session.train(BODY, model=name, data="pt_data", epochs=1, batch_size=16, optimizer="sgd", lr=0.1,
                       strategy=strategy, progress="none", quiet=True)
    for key, want in ns[name].state_dict().items():
        got = dist_session.pull(f"{name}.{key}")
        assert type(got) is torch.Tensor and got.shape == want.shape and torch.equal(got, want), key
    got = shell.run_line_magic("dist", f"pull {name}.2.weight")
    assert torch.equal(got, ns[name][2].weight.detach())


def test_an_unknown_tensor_name_is_an_error_with_the_nearest_names(dist_session, shell):
    ns = shell.user_ns
    ns["pt_err"], ns["pt_data"], ns["F"] = parity_model(), parity_data(), F
    dist_session.train(BODY, model="pt_err", data="pt_data", epochs=1, batch_size=16, strategy="fsdp",
                       progress="none", quiet=True)
    with pytest.raises(PlanError, match=r"pt_err has no parameter or buffer '0\.wieght'; nearest: pt_err\.0\.weight"):
        dist_session.pull("pt_err.0.wieght")
    with pytest.raises(PlanError, match="pt_nothing is not defined on the ranks"):
        dist_session.pull("pt_nothing.0.weight")
    assert torch.equal(dist_session.pull("pt_err.0.bias"), ns["pt_err"][0].bias.detach())  # still usable
    assert len(dist_session.pull("pt_data")) == 2  # a plain name pulls as before: a list over the ranks
    # the fsdp-placed model itself cannot travel whole: the error says how to read its weights
    with pytest.raises(RankError, match=r"pt_err is a model placed on the ranks for training .*"
                                        r"%dist pull pt_err\.0\.weight .*%dist save DIR"):
        dist_session.pull("pt_err")
    assert torch.equal(dist_session.pull("pt_err.0.bias"), ns["pt_err"][0].bias.detach())  # still usable
