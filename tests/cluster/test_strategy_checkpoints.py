"""Save, wander off, load, continue: for every strategy the result equals an uninterrupted run.

The checkpoint holds each rank's part (a shard, a stage, a replica) of the model and of the
optimizer state, and the position in the data; restoring it and training on must give the
same parameters as never having stopped (Adam, so optimizer state matters).
"""

import pytest
import torch
import torch.nn.functional as F

from support.data import blobs, mlp

BODY = "x, y = batch\nloss = F.cross_entropy(model(x), y)"
OPTIONS = {"ddp": {}, "fsdp": {}, "tensor": {}, "pipeline": {"microbatches": 2}, "ps": {}}


def make_data():
    return blobs(64, num_features=8, num_classes=2, num_summed=3)


def make_model():
    return mlp(8, 16, 8, 2, seed=7)


def params(model):
    return torch.cat([p.detach().flatten() for p in model.parameters()])


@pytest.mark.parametrize("strategy", list(OPTIONS))
def test_save_load_continue_equals_uninterrupted(dist_session, shell, tmp_path, strategy):
    ns = shell.user_ns
    ns["sc_data"], ns["F"] = make_data(), F
    name_ref, name = f"sc_ref_{strategy}", f"sc_{strategy}"
    ns[name_ref], ns[name] = make_model(), make_model()

    def train(model, epochs, **kw):
        return dist_session.train(BODY, model=model, data="sc_data", epochs=epochs, batch_size=8, seed=2,
                                  strategy=strategy, progress="none", quiet=True, **OPTIONS[strategy], **kw)

    train(name_ref, 1, optimizer="adam", lr=0.01)
    train(name_ref, 1)
    want = params(ns[name_ref])

    train(name, 1, optimizer="adam", lr=0.01)
    meta = dist_session.save(str(tmp_path), model=name, quiet=True)
    assert meta["plan"]["strategy"] == strategy
    saved = params(ns[name]).clone()
    train(name, 1, lr=0.5)  # wander off
    dist_session.load(str(tmp_path), model=name, quiet=True)
    torch.testing.assert_close(params(ns[name]), saved)
    result = train(name, 1)
    assert result.epochs == [1]
    torch.testing.assert_close(params(ns[name]), want, atol=1e-5, rtol=1e-5)


SHARDS = {"ddp": 2, "fsdp": 2, "ps": 2, "tensor": 1, "pipeline": 1}


@pytest.mark.parametrize("saved,resumed", [("fsdp", "pipeline"), ("pipeline", "fsdp"), ("ps", "tensor"),
                                           ("fsdp", "tensor"), ("ps", "pipeline")])
def test_resume_into_another_strategy(dist_session, shell, tmp_path, saved, resumed):
    """A model sent fresh with another --strategy resumes a --checkpoint-dir: the weights and position always;
    the optimizer state where the two lay it out alike (ddp, fsdp, tensor nested by name; pipeline and ps
    flattened by name), else a fresh optimizer of the same kind. Before, pipeline and ps failed to
    load the others' checkpoints ("Missing key in checkpoint state_dict"), and a mid-epoch position was kept
    in the saving strategy's steps, not converted to the samples trained."""
    import itertools
    import shutil

    from distnb.engine.transport import shard

    ns = shell.user_ns
    ns["sx_data"], ns["F"] = make_data(), F
    name = f"sx_{saved}_{resumed}"

    def train(strategy, **kw):
        return dist_session.train(BODY, model=name, data="sx_data", epochs=1, batch_size=8, seed=2, optimizer="adam",
                                  lr=0.01, strategy=strategy, checkpoint_dir=str(tmp_path), progress="none",
                                  quiet=True, **OPTIONS[strategy], **kw)

    ns[name] = make_model()
    train(saved, checkpoint_every=3)  # 64 samples: 4 steps of 8 on 2 shards, 8 on 1; saved at step 3
    mid = "step_00000003" if SHARDS[saved] == 2 else "step_00000006"
    for d in tmp_path.iterdir():
        if d.name != mid:
            shutil.rmtree(d)
    ns[name] = make_model()  # a new object: sent fresh, it resumes from the checkpoint
    result = train(resumed)
    # where the checkpoint stood: 3 x 2 x 8 = 48 or 6 x 8 = 48 samples of epoch 0; the rest on the new layout
    assert [row["steps"] for row in result.rows] == [16 // (8 * SHARDS[resumed])] * 2
    ref_mid = make_model()  # one process: the saving layout's first global batches, then the rest on the new one
    x, y = ns["sx_data"].tensors
    opt = torch.optim.Adam(ref_mid.parameters(), lr=0.01)
    batches = list(shard.global_batches(len(x), SHARDS[saved], 2, 0, 8, False))
    for idx in itertools.islice(batches, int(mid[-1])):
        opt.zero_grad()
        F.cross_entropy(ref_mid(x[idx]), y[idx]).backward()
        opt.step()
    same_state = {"pipeline": "flat", "ps": "flat"}.get(saved, "nested") == \
        {"pipeline": "flat", "ps": "flat"}.get(resumed, "nested")
    if not same_state:
        opt = torch.optim.Adam(ref_mid.parameters(), lr=0.01)
    rest = list(shard.global_batches(len(x), SHARDS[resumed], 2, 0, 8, False))[48 // (8 * SHARDS[resumed]):]
    for idx in rest:
        opt.zero_grad()
        F.cross_entropy(ref_mid(x[idx]), y[idx]).backward()
        opt.step()
    torch.testing.assert_close(params(ns[name]), params(ref_mid), atol=1e-5, rtol=1e-5)


def test_a_resumed_schedule_goes_on_exactly_and_a_new_one_is_named(dist_session, shell, tmp_path, capsys):
    """The cell run again after a lost world (a new object: it resumes from the mid-run checkpoint) with its --lr
    and without --lr-schedule goes on with the checkpoint's cosine at its step: before, its first optimizer step
    ran at the --lr itself (0.01 where the cosine was at 0.0015). With --lr-schedule the cell says it starts anew."""
    import shutil

    ns = shell.user_ns
    ns["rs_data"], ns["F"] = make_data(), F
    opts = dict(data="rs_data", batch_size=8, seed=2, optimizer="adam", lr=0.01, strategy="fsdp", accumulate=2,
                progress="none", quiet=True)
    ns["rs_whole"] = make_model()
    whole = dist_session.train(BODY, model="rs_whole", epochs=2, lr_schedule="cosine", warmup_steps=1, **opts)
    ns["rs_net"] = make_model()
    dist_session.train(BODY, model="rs_net", epochs=2, lr_schedule="cosine", warmup_steps=1,
                       checkpoint_dir=str(tmp_path), checkpoint_every=6, **opts)  # 4 micro-steps an epoch
    for d in sorted(tmp_path.iterdir())[1:]:
        shutil.rmtree(d)  # the world was lost after step 6: epoch 1, micro-step 2 of 4
    ns["rs_net"] = make_model()
    again = dist_session.train(BODY, model="rs_net", epochs=1, checkpoint_dir=str(tmp_path), **opts)
    assert [lr for _, lr in again.lr_history] == pytest.approx([lr for _, lr in whole.lr_history][3:], rel=1e-9)
    torch.testing.assert_close(params(ns["rs_net"]), params(ns["rs_whole"]), atol=1e-6, rtol=1e-6)
    ns["rs_net"] = make_model()
    capsys.readouterr()
    dist_session.train(BODY, model="rs_net", epochs=1, checkpoint_dir=str(tmp_path), lr_schedule="cosine",
                       **dict(opts, quiet=False))
    said = capsys.readouterr().out  # (the cell before saved its last step: the cosine at its end)
    assert ("this cell's --lr-schedule cosine starts a new schedule over its own steps in place of the checkpoint's "
            "--lr-schedule cosine at step 4 of 4 (leave --lr-schedule and --warmup-steps out") in said, said


def test_a_ps_checkpoint_resumes_with_other_servers(dist_session, shell, tmp_path):
    """A ps checkpoint keeps each server's optimizer state by parameter name: --servers 2 resumes as --servers 1
    (and back) with Adam's moments, equal to one uninterrupted process. Before, each server's state was saved by
    its optimizer's own numbering ('Size mismatch ... for optimizer.server0.state.1.exp_avg')."""
    from support.reference import reference

    ns = shell.user_ns
    ns["sv_data"], ns["F"] = make_data(), F
    ref = make_model()
    reference(ref, ns["sv_data"], num_shards=2, batch_size=8, epochs=3, seed=2, optimizer=torch.optim.Adam, lr=0.01)
    for epoch, servers in enumerate((2, 1, 2)):
        ns["sv_net"] = make_model()  # sent fresh: resumes from the newest checkpoint (none at first)
        result = dist_session.train(BODY, model="sv_net", data="sv_data", epochs=1, batch_size=8, seed=2,
                                    optimizer="adam", lr=0.01, strategy="ps", servers=servers,
                                    checkpoint_dir=str(tmp_path), progress="none", quiet=True)
        assert result.epochs == [epoch]
    torch.testing.assert_close(params(ns["sv_net"]), params(ref), atol=1e-5, rtol=1e-5)
