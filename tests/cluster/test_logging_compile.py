"""--log-dir (TensorBoard event files, read back with tensorboard's own reader) and --compile on the cluster."""

import os

import pytest
import torch
import torch.nn.functional as F

from support.data import parity_data, parity_model

BODY = "x, y = batch\nloss = F.cross_entropy(model(x), y)"


def scalars(path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(path)
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_log_dir_writes_loss_lr_grad_norm_throughput_and_validation(dist_session, shell, tmp_path):
    pytest.importorskip("tensorboard")
    ns = shell.user_ns
    ns["tb_net"], ns["tb_data"], ns["tb_val"], ns["F"] = parity_model(), parity_data(n=192), parity_data(50, 3), F
    result = dist_session.train(BODY, model="tb_net", data="tb_data", val_data="tb_val", epochs=2, batch_size=16,
                                accumulate=2, clip_grad_norm=1.0, lr_schedule="cosine", optimizer="sgd", lr=0.1,
                                log_dir=str(tmp_path), progress="none", quiet=True)
    assert sorted(os.listdir(tmp_path)) == ["rank0", "rank1"]
    zero, one = scalars(str(tmp_path / "rank0")), scalars(str(tmp_path / "rank1"))
    assert {"train/loss", "train/lr", "train/grad_norm", "train/samples_per_s", "train/epoch_loss", "val/loss",
            "val/accuracy"} <= set(zero)
    assert {"train/loss", "train/samples_per_s"} <= set(one)
    assert [v for _, v in zero["train/lr"]] == pytest.approx([v for _, v in result.lr_history])
    assert [v for _, v in zero["train/grad_norm"]] == pytest.approx([v for _, v in result.grad_norm_history])
    assert len(zero["train/loss"]) == result.optimizer_steps == 6
    assert [v for _, v in zero["val/loss"]] == pytest.approx([e["loss"] for e in result.val_history])
    assert [v for _, v in zero["train/epoch_loss"]] == pytest.approx(result.epoch_losses)


def test_compile_trains_to_a_loss_bound_and_shows_the_compile_time(dist_session, shell, capsys):
    ns = shell.user_ns
    ns["cc_net"], ns["cc_data"], ns["F"] = parity_model(), parity_data(n=192), F
    opts = dict(model="cc_net", data="cc_data", batch_size=16, optimizer="adam", lr=0.02, progress="none")
    dist_session.train(BODY, epochs=1, **opts)  # an eager cell first: its step time is the speedup's base
    result = dist_session.train(BODY, epochs=6, compile=True, **opts)
    assert result.final_loss < 0.5
    # torch.compile(DDP(net)) made no graph (DDP's forward graph-breaks) and a compile time was reported anyway:
    # the module DDP wraps is compiled, and what dynamo did is said
    assert sorted(result.dynamo) == [0, 1] and all(d["graphs"] >= 1 for d in result.dynamo.values()), result.dynamo
    assert result.compile_seconds is not None and result.compile_seconds > 0 and result.speedup is not None
    out = capsys.readouterr().out
    assert f"torch.compile on rank 0: {result.dynamo[0]['graphs']} graph" in out and "the first step took" in out
    assert all(p.dtype == torch.float32 for p in ns["cc_net"].parameters())
    dist_session.run("_kind = type(ctx.model).__name__\n_fwd = type(ctx.model.module.forward).__name__")
    assert dist_session.pull("_kind") == ["DistributedDataParallel"] * 2
    assert dist_session.pull("_fwd") == ["CompiledForward"] * 2
    pulled = dist_session.pull("cc_net", rank=1)  # the rank's module pickles with its eager forward
    assert "forward" not in vars(pulled) or type(vars(pulled)["forward"]).__name__ == "method"
    dist_session.run("import torch\n_w = torch.cat([p.detach().flatten() for p in cc_net.parameters()])")
    w = dist_session.pull("_w")
    assert torch.equal(w[0], w[1])
    assert torch.equal(w[0], torch.cat([p.detach().flatten() for p in ns["cc_net"].parameters()]))


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])  # the module DDP wraps; FSDP2 units (tensor: the module)
def test_compile_after_sharding_trains_like_eager(dist_session, shell, strategy):
    ns = shell.user_ns
    ns[f"cc_{strategy}"], ns["cc_data"], ns["F"] = parity_model(), parity_data(n=192), F
    ns[f"ref_{strategy}"] = parity_model()
    opts = dict(data="cc_data", epochs=2, batch_size=16, optimizer="sgd", lr=0.1, seed=4, strategy=strategy,
                progress="none", quiet=True)
    result = dist_session.train(BODY, model=f"cc_{strategy}", compile=True, **opts)
    assert all(d["graphs"] >= 1 for d in result.dynamo.values()), result.dynamo  # FSDP2 units compile
    dist_session.train(BODY, model=f"ref_{strategy}", **opts)
    for a, b in zip(ns[f"cc_{strategy}"].parameters(), ns[f"ref_{strategy}"].parameters()):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_a_compile_that_makes_no_graph_says_so_and_states_no_compile_time(dist_session, shell, capsys):
    # a forward dynamo must not trace: 0 graphs on every rank; the cell said "0.4 s compiling" for such a run
    ns = shell.user_ns
    assert shell.run_cell("import torch, torch.nn as nn\nclass NotTraced(nn.Module):\n    def __init__(self):\n"
                          "        super().__init__()\n        self.fc = nn.Linear(12, 3)\n"
                          "    @torch.compiler.disable\n    def forward(self, x):\n        return self.fc(x)\n"
                          "nt_net = NotTraced()").error_in_exec is None
    ns["nt_data"], ns["F"] = parity_data(n=64), F
    capsys.readouterr()
    result = dist_session.train(BODY, model="nt_net", data="nt_data", epochs=2, batch_size=16, compile=True,
                                progress="none")
    assert [d["graphs_since_compile"] for d in result.dynamo.values()] == [0, 0]
    assert result.compile_seconds is None and result.speedup is None
    out = capsys.readouterr().out
    assert "torch.compile compiled nothing on rank 0: dynamo made 0 graphs" in out and "compiling" not in out
