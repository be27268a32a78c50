"""``--load PATH`` errors on the real 2-rank cluster: each before training, each naming the fix, the cluster usable after."""

import os
import shutil

import pytest
import torch

from distnb.train import pretrained
from distnb.core.errors import PlanError, RankError
from support.hfmodels import build, save_sharded

BODY = "(ids,) = batch\nloss = model(input_ids=ids, labels=ids).loss"
PLAIN = "x, = batch\nloss = model(x).pow(2).mean()"


@pytest.fixture
def folder(tmp_path):
    path = str(tmp_path / "gpt2")
    save_sharded(build("gpt2", seed=1), path, num_files=3)
    return path


def train(dist_session, shell, name, model, path, strategy="fsdp"):
    shell.user_ns[name] = model
    shell.user_ns["err_ids"] = torch.utils.data.TensorDataset(torch.randint(0, 64, (8, 12)))
    dist_session.train(BODY, model=name, data="err_ids", epochs=1, batch_size=4, optimizer="sgd", lr=0.0,
                       strategy=strategy, load=path, progress="none", quiet=True)


def still_usable(dist_session, shell):
    shell.user_ns["ok_net"] = torch.nn.Linear(4, 1)
    shell.user_ns["ok_x"] = torch.utils.data.TensorDataset(torch.randn(8, 4))
    result = dist_session.train(PLAIN, model="ok_net", data="ok_x", epochs=1, batch_size=4, progress="none",
                                quiet=True)
    assert all(row["steps"] > 0 for row in result.rows)


@pytest.mark.parametrize("damage", ["architecture", "truncated", "index entry"])
def test_bad_folder_fails_before_anything_is_sent(dist_session, shell, folder, damage):
    model = build("gpt2", seed=2, meta=True)
    if damage == "architecture":
        model, match = build("llama", meta=True), "a folder of another architecture"
    elif damage == "truncated":
        shard = os.path.join(folder, "model-00002-of-00005.safetensors")
        with open(shard, "r+b") as f:
            f.truncate(os.path.getsize(shard) - 1)
        match = "is truncated"
    else:
        import json

        index = os.path.join(folder, "model.safetensors.index.json")
        data = json.load(open(index))
        del data["weight_map"]["transformer.ln_f.bias"]
        json.dump(data, open(index, "w"))
        match = (r"not in it: transformer.ln_f.bias \(model-0000\d-of-00005.safetensors holds it, but "
                 r"model.safetensors.index.json has no entry for it")
    name = "bad_" + damage.replace(" ", "_")
    with pytest.raises(PlanError, match=match):
        train(dist_session, shell, name, model, folder)
    assert name not in dist_session.holdings.models  # nothing was sent
    still_usable(dist_session, shell)


def test_path_the_ranks_cannot_see_names_each_rank(dist_session, shell, folder, monkeypatch):
    """The kernel sees the folder, the ranks do not (removed between the kernel's check and the ranks' read, as a
    folder on the kernel's host only would be): an error naming the ranks and hosts, before training."""
    real = pretrained.load_on_ranks

    def gone_then_load(*args, **kw):
        shutil.rmtree(folder)
        return real(*args, **kw)

    monkeypatch.setattr(pretrained, "load_on_ranks", gone_then_load)
    with pytest.raises(RankError) as exc:
        train(dist_session, shell, "unseen_net", build("gpt2", seed=2, meta=True), folder)
    msg = str(exc.value)
    assert "cannot be read by every rank" in msg and f"{folder} does not exist on this host" in msg
    assert "rank 0 on " in msg and "rank 1 on " in msg and "put the folder where every host sees it" in msg
    assert "unseen_net" not in dist_session.holdings.models  # the next cell sends it afresh
    monkeypatch.undo()
    still_usable(dist_session, shell)


def test_ps_and_a_resumable_checkpoint_dir_are_refused(dist_session, shell, folder, tmp_path):
    with pytest.raises(PlanError, match="--load does not go with --strategy ps"):
        train(dist_session, shell, "ps_net", build("gpt2", seed=2), folder, strategy="ps")
    ns = shell.user_ns
    ns["ck_net"], ns["ck_x"] = torch.nn.Linear(4, 1), torch.utils.data.TensorDataset(torch.randn(8, 4))
    ck = str(tmp_path / "ck")
    dist_session.train(PLAIN, model="ck_net", data="ck_x", epochs=1, batch_size=4, checkpoint_dir=ck, progress="none",
                       quiet=True)
    with pytest.raises(PlanError, match=r"and --checkpoint-dir .*, which holds a checkpoint to resume from"):
        dist_session.train(PLAIN, model="ck_net", data="ck_x", epochs=1, batch_size=4, checkpoint_dir=ck, load=ck,
                           progress="none", quiet=True)


def test_export_of_a_load_cell_is_refused_and_the_next_cell_exports(dist_session, shell, tmp_path):
    """A job exported from a --load cell would start from the notebook's weights, not the loaded ones: refused,
    naming the fix; the next cell (on from the loaded weights, which are back in the notebook) exports."""
    from safetensors.torch import save_file

    ns = shell.user_ns
    torch.manual_seed(0)
    save_file(torch.nn.Linear(4, 1).state_dict(), str(tmp_path / "w.safetensors"))
    ns["exp_net"] = torch.nn.Linear(4, 1)
    ns["exp_x"] = torch.utils.data.TensorDataset(torch.randn(8, 4))
    dist_session.train(PLAIN, model="exp_net", data="exp_x", epochs=1, batch_size=4, load=str(tmp_path / "w.safetensors"),
                       progress="none", quiet=True)
    with pytest.raises(PlanError, match="run one more %%distrain cell without --load"):
        dist_session.export(str(tmp_path / "job1"))
    dist_session.train(PLAIN, model="exp_net", data="exp_x", epochs=1, batch_size=4, progress="none", quiet=True)
    dist_session.export(str(tmp_path / "job2"))
    assert os.path.exists(tmp_path / "job2" / "train.py")
