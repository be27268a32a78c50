"""The exported job's ``train.py --help``: --checkpoint-dir, --checkpoint-every and --backend come from the option
declarations (TrainPlan, ClusterSpec): the same flags, help, choices and checks as ``%%distrain`` and ``%dist start``."""

import contextlib
import io
import re

import pytest

from distnb.core import options
from distnb.engine import job
from distnb.core.plan import ClusterSpec, TrainPlan

SPEC = {"plan": {"model": "net", "data": "train", "epochs": 3, "checkpoint_every": None}, "cell": {"world_size": 2}}


def _help() -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        job._arguments(["--help"], SPEC)
    return " ".join(out.getvalue().split())


@pytest.mark.parametrize("cls, name", [(TrainPlan, "checkpoint_dir"), (TrainPlan, "checkpoint_every"),
                                       (ClusterSpec, "backend")])
def test_train_py_help_is_the_declarations(cls, name):
    field, opt = next((f, o) for f, o in options.declared(cls) if f.name == name)
    text = _help()
    for flag in options.flags_of(field, opt):
        assert flag in text
    assert " ".join(opt.help.split()) in text  # argparse rewraps: compared with single spaces
    for choice in opt.choices:
        assert re.search(rf"\b{choice}\b", text)


def test_train_py_takes_what_the_declarations_allow_and_refuses_the_rest(capsys):
    args = job._arguments(["--checkpoint-every", "5", "--backend", "gloo", "--checkpoint-dir", "ck"], SPEC)
    assert (args.checkpoint_every, args.backend, args.checkpoint_dir) == (5, "gloo", "ck")
    assert job._arguments([], dict(SPEC, plan=dict(SPEC["plan"], checkpoint_every=7))).checkpoint_every == 7
    for bad, said in ((["--backend", "mpi"], "invalid choice: 'mpi'"), (["--checkpoint-every", "0"], "at least 1"),
                      (["--checkpoint-every", "x"], "invalid int value: 'x'")):
        with pytest.raises(SystemExit):
            job._arguments(bad, SPEC)
        assert said in capsys.readouterr().err
