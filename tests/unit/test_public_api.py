"""``distnb``'s public surface is small and listed (``__all__``): the Python API, the errors, the extension hooks;
every listed name resolves, and ``import distnb`` alone loads neither torch nor ipyparallel."""

import json
import subprocess
import sys

import distnb


def test_every_listed_name_is_there_and_is_the_real_one():
    from distnb.core import errors
    from distnb.train import results
    from distnb import session

    assert len(distnb.__all__) == len(set(distnb.__all__)) <= 20
    assert {"start", "current", "Session", "TrainResult", "DistnbError", "PlanError", "ClusterError", "RankError",
            "load_ipython_extension", "unload_ipython_extension"} <= set(distnb.__all__)
    for name in distnb.__all__:
        assert getattr(distnb, name) is not None and name in dir(distnb)
    assert (distnb.Session, distnb.TrainResult, distnb.start) == (session.Session, results.TrainResult, session.start)
    public_errors = [n for n, v in vars(errors).items() if isinstance(v, type) and issubclass(v, BaseException)
                     and v.__module__ == errors.__name__ and not n.startswith("_")]
    assert set(public_errors) <= set(distnb.__all__), "an error distnb raises is missing from distnb.__all__"


def test_star_import_gives_the_listed_names_only():
    ns = {}
    exec("from distnb import *", ns)
    assert set(ns) - {"__builtins__"} == set(distnb.__all__)


def test_import_distnb_stays_light():
    code = ("import sys, json, distnb; distnb.TrainResult; "
            "print(json.dumps([m for m in ('torch', 'ipyparallel', 'IPython') if m in sys.modules]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == []
