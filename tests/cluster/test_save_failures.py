"""A ``%dist save`` that fails on the ranks loses nothing: the model stays live on the ranks, the cluster usable.

A model built on the meta device in the notebook has its trained weights on the ranks only. A save
that failed there used to re-form the process group like any failed cell, and a sharded model went
with it (the next save said "the notebook's model holds the last weights", false for a meta model).
On the real 2-rank cluster, a meta model is trained one cell under a sharded strategy, then saved
where the ranks cannot write: a file in the way (every rank), a checkpoint folder taken by a file (met
inside the save), a folder one rank's user may not enter (rank 1 runs as ``nobody`` for the save), a
full disk met mid-write (a 16 KiB tmpfs). Each gives a clear error naming the ranks and the fix; the
process group is not re-formed; a save to a good folder then writes bit for bit the weights pulled
before the failure, and the next training cell ends bit for bit where a run without the failed save
ends.
"""

import glob
import os
import pwd
import shutil
import subprocess
import tempfile

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from distnb.core.errors import PlanError, RankError
from support.data import parity_data
from support.held import assert_bit_exact, ranks_weights

BODY = "x, y = batch\nloss = F.cross_entropy(model(x), y)"
SEED = 7
SHARDED = ["fsdp", "tensor", "fsdp+tensor", "pipeline"]


def make(width: int) -> nn.Sequential:
    return nn.Sequential(nn.Linear(12, width), nn.Tanh(), nn.Linear(width, 8), nn.Tanh(), nn.Linear(8, 3))


def train(session, name: str, strategy: str):
    return session.train(BODY, model=name, data="sf_data", epochs=1, batch_size=16, optimizer="sgd", lr=0.1, seed=4,
                         strategy=strategy, progress="none", quiet=True)


def folder_tensors(folder) -> dict:
    from safetensors.torch import load_file

    out = {}
    for file in sorted(glob.glob(os.path.join(str(folder), "*.safetensors"))):
        out.update(load_file(file))
    return out


def trained_meta(shell, session, name: str, strategy: str, width: int = 16) -> dict:
    """Model ``name``, built on meta in the notebook, trained one cell; the weights the ranks hold then."""
    shell.user_ns["sf_data"], shell.user_ns["F"] = parity_data(), F
    torch.manual_seed(SEED)  # the ranks initialise a meta model from the notebook's generator state
    with torch.device("meta"):
        shell.user_ns[name] = make(width)
    train(session, name, strategy)
    assert all(p.is_meta for p in shell.user_ns[name].parameters())  # its weights are on the ranks only
    return ranks_weights(session, name)


def uninterrupted(shell, session, tag: str, strategy: str, width: int = 16) -> tuple:
    """The weights after one cell and after two of a run that never fails a save (model ``sf_ref_<tag>``)."""
    name = f"sf_ref_{tag}"
    first = trained_meta(shell, session, name, strategy, width)
    train(session, name, strategy)
    return first, ranks_weights(session, name)


def assert_still_live(session, name: str, strategy: str, tmp_path, generation: int, want: tuple) -> None:
    """Nothing re-formed; a save to a good folder writes the weights of before the failure, bit for bit; the next
    cell ends where the run without the failure ends."""
    assert session.holdings.generation == generation, "the process group was re-formed over the failed save"
    good = tmp_path / "good"
    session.save(str(good), model=name, format="safetensors", quiet=True)
    assert_bit_exact(folder_tensors(good), want[0], "the save after the failed one")
    meta = session.save(str(tmp_path / "good_dcp"), model=name, quiet=True)
    assert os.path.exists(os.path.join(meta["path"], "distnb.json"))
    train(session, name, strategy)
    assert_bit_exact(ranks_weights(session, name), want[1], "the cell after the failed save")


@pytest.mark.parametrize("strategy", SHARDED)
def test_a_file_in_the_way_is_named_before_anything_is_written(dist_session, shell, tmp_path, strategy):
    name = f"sf_file_{strategy.replace('+', '_')}"
    want = uninterrupted(shell, dist_session, name, strategy)
    assert_bit_exact(trained_meta(shell, dist_session, name, strategy), want[0], "one cell")
    generation = dist_session.holdings.generation
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    for fmt in ("safetensors", "dcp"):
        with pytest.raises(PlanError, match=rf"%dist save {blocker}/out: not every rank can write it \(ranks 0-1 on "
                                            rf"\S+: {blocker} is a file, not a folder\); give a folder every rank can "
                                            rf"create and write\. Nothing was written, and {name} is still live"):
            dist_session.save(str(blocker / "out"), model=name, format=fmt, quiet=True)
    assert_still_live(dist_session, name, strategy, tmp_path, generation, want)


def test_a_checkpoint_folder_taken_by_a_file_fails_on_every_rank_alike_and_keeps_the_group(dist_session, shell,
                                                                                           tmp_path):
    """The folder is writable, but its ``step_N`` is a file: met inside the save (every rank together)."""
    name = "sf_step"
    want = uninterrupted(shell, dist_session, name, "fsdp")
    trained_meta(shell, dist_session, name, "fsdp")
    first = dist_session.save(str(tmp_path / "ck"), model=name, quiet=True)["path"]
    shutil.rmtree(first)
    open(first, "w").close()
    generation = dist_session.holdings.generation
    with pytest.raises(RankError, match=rf"failed on ranks 0-1 .*{first} cannot be written on rank 0 on \S+ \("
                                        rf"{first} is a file, not a folder\); rank 1 .*: give a folder every rank can "
                                        rf"create and write .*nothing was lost: {name} is still live on the ranks"):
        dist_session.save(str(tmp_path / "ck"), model=name, quiet=True)
    assert_still_live(dist_session, name, "fsdp", tmp_path, generation, want)


@pytest.mark.skipif(os.getuid() != 0, reason="needs root: rank 1 runs the save as the user nobody")
def test_a_folder_only_one_rank_cannot_write_names_that_rank(dist_session, shell, tmp_path):
    name = "sf_uid"
    want = uninterrupted(shell, dist_session, name, "fsdp")
    trained_meta(shell, dist_session, name, "fsdp")
    generation = dist_session.holdings.generation
    private = tempfile.mkdtemp(prefix="distnb-private-")  # 0700, root's, in /tmp: nobody may not enter it
    nobody = pwd.getpwnam("nobody").pw_uid
    try:
        dist_session.run(f"import os\nos.seteuid({nobody})", targets=[1])
        for fmt in ("dcp", "safetensors"):
            with pytest.raises(PlanError, match=rf"not every rank can write it \(rank 1 on \S+: {private} is closed to "
                                                r"this process \(its user may not enter it\): Permission denied\); "
                                                "give a folder every rank"):
                dist_session.save(os.path.join(private, "out"), model=name, format=fmt, quiet=True)
        assert os.listdir(private) == []  # nothing was written, not even by rank 0
    finally:
        dist_session.run("import os\nos.seteuid(0)", targets=[1])
        shutil.rmtree(private)
    assert_still_live(dist_session, name, "fsdp", tmp_path, generation, want)


@pytest.fixture
def full_disk(tmp_path):
    """A 16 KiB tmpfs: a disk that fills during a save (needs the right to mount, as root in a container)."""
    where = tmp_path / "small"
    where.mkdir()
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16k", "tmpfs", str(where)], capture_output=True)
    if made.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {made.stderr.decode().strip()}")
    yield where
    subprocess.run(["umount", str(where)], check=True)


@pytest.mark.parametrize("fmt", ["dcp", "safetensors"])
def test_a_disk_full_mid_write_keeps_the_group_and_the_model(dist_session, shell, tmp_path, full_disk, fmt):
    name = f"sf_full_{fmt}"
    want = uninterrupted(shell, dist_session, name, "fsdp", width=512)  # 43 KB of weights: more than the disk holds
    trained_meta(shell, dist_session, name, "fsdp", width=512)
    generation = dist_session.holdings.generation
    # the full disk shows as each writer meets it: an OSError (ENOSPC), or torch's zip writer failing first
    # ("[enforce fail at inline_container.cc] unexpected pos"), seen on rank 0 in a full run
    with pytest.raises(RankError, match=r"failed on ranks 0-1 .*writing failed on .* ranks \(rank \d: "
                                        rf".*(No space left on device|unexpected pos).*\); nothing was lost: {name} is still live on "
                                        "the ranks as before the save"):
        dist_session.save(str(full_disk / "out"), model=name, format=fmt, quiet=True)
    assert_still_live(dist_session, name, "fsdp", tmp_path, generation, want)


def test_a_save_failed_unevenly_re_forms_the_group_and_says_where_a_meta_model_s_weights_are(dist_session, shell,
                                                                                              tmp_path):
    """Rank 0 alone fails (an earlier save's file is a folder now) while rank 1 waits for it: the group cannot be
    kept, and the message must not claim that the notebook's model (on meta) holds the weights."""
    name = "sf_uneven"
    trained_meta(shell, dist_session, name, "fsdp")
    (tmp_path / "hf" / "model-00001-of-00001.safetensors").mkdir(parents=True)
    generation = dist_session.holdings.generation
    where = (rf"{name} is on the meta device in the notebook, so its trained weights were on the ranks only: load its "
             rf"last checkpoint \(%dist load DIR --model {name}\) or train it again")
    with pytest.raises(RankError, match=rf"rank 0 .*IsADirectoryError.*the process group is re-formed, and the ranks' "
                                        rf"fsdp copy of {name} goes with it; {where}"):
        dist_session.save(str(tmp_path / "hf"), model=name, format="safetensors", quiet=True)
    assert dist_session.holdings.generation == generation + 1
    with pytest.raises(RankError, match=rf"the ranks' fsdp copy of {name} was lost with the process group, re-formed "
                                        rf"after a failed cell; {where}") as lost:
        dist_session.save(str(tmp_path / "ck"), model=name, quiet=True)
    assert "nothing was lost" not in str(lost.value)
    dist_session.run("x = 1")  # the cluster is usable
