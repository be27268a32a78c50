"""The magics' help text (their docstrings), without a shell or a cluster."""

import pytest

from distnb.magics import DistMagics


def test_every_verb_has_help_with_an_example():
    doc = DistMagics.dist.__doc__
    for verb in ("wait", "stop-training"):
        section = doc[doc.index(f"%dist {verb}"):]
        assert "Example" in section.split("::")[1]
    assert "--background" in DistMagics.distrain.__doc__ and "%dist wait" in DistMagics.distrain.__doc__


def _magics():
    from IPython.core.interactiveshell import InteractiveShell
    from traitlets.config import Config

    config = Config()
    config.HistoryManager.enabled = False
    return DistMagics(shell=InteractiveShell.instance(config=config))


def test_help_is_printed_for_dist_help_and_for_help_on_every_verb(capsys):
    from distnb.magics import VERBS

    magics = _magics()
    for line in ("", "help", "--help"):
        magics.dist(line)
        out = capsys.readouterr().out
        assert "Verbs:" in out and "%dist start" in out and "%dist where" in out
    for verb in VERBS:
        for line in (f"{verb} --help", f"{verb} -h", f"help {verb}"):
            magics.dist(line)
            out = capsys.readouterr().out
            assert f"%dist {verb}" in out, (line, out[:200])
    magics.distrain("--help", "loss = 0")
    assert "--epochs" in capsys.readouterr().out  # printed, and the body not run
    magics.distrain("-h", "")
    out = capsys.readouterr().out
    assert "%%distrain --model MODEL --data DATA" in out and "Example" in out
    magics.dist("--help", "print(1)")
    assert "--targets" in capsys.readouterr().out
    # an empty `%%distrain --help` cell: IPython refuses it and points to the line magic %distrain, which helps
    for line in ("", "--help"):
        magics.distrain(line)
        assert "%%distrain --model MODEL --data DATA" in capsys.readouterr().out
    from IPython.core.error import UsageError

    with pytest.raises(UsageError, match="%%distrain is a cell magic: its options on the first line"):
        magics.distrain("--model m --data d")
    with pytest.raises(UsageError, match="unknown %dist verb 'bogus'; use one of: start, "):
        magics.dist("help bogus")  # it printed the whole help, as for %dist help
    for line in ("help train", "help distrain", "train"):  # a verb for training is a natural guess: say where it is
        with pytest.raises(UsageError, match=r"training is the cell magic %%distrain \(%distrain --help\)"):
            magics.dist(line)


def test_restart_takes_the_start_options_and_only_those_given():
    from distnb.magics import _restart, _start

    assert vars(_restart.parser.parse_args([])) == {}
    assert vars(_restart.parser.parse_args(["-n", "3", "--timeout", "20"])) == {"n": 3, "timeout": 20.0}
    assert vars(_start.parser.parse_args(["--no-auto-restart"])) == {"auto_restart": False}


def test_an_abbreviated_option_is_an_error_not_a_guess():
    import pytest
    from IPython.core.error import UsageError
    from IPython.core.magic_arguments import parse_argstring

    from distnb import magics

    args = parse_argstring(magics._distrain, "--model net --data train --epochs 3")
    assert args.epochs == 3
    for verb, line in ((magics._distrain, "--model net --data train --epoch 3"),
                       (magics.VERBS["start"], "--hang 3"), (magics._cell, "--all")):
        with pytest.raises(UsageError, match="unrecognized arguments"):
            parse_argstring(verb, line)


@pytest.mark.parametrize("verb, line, hint", [
    ("distrain", "--model net --data d --epoch 3", "--epoch: did you mean --epochs?"),
    ("distrain", "--model net --data d --clip-grad 1", "--clip-grad: did you mean --clip-grad-norm?"),
    ("distrain", "--model net --data d --lr-sched=cosine", "--lr-sched: did you mean --lr-schedule?"),
    ("distrain", "--model net --data d --batchsize 8", "--batchsize: did you mean --batch-size?"),
    ("start", "--n 2", "--n: did you mean -n?"),
])
def test_an_unknown_option_names_the_one_meant(verb, line, hint):
    from IPython.core.error import UsageError

    from distnb import magics

    magic = magics._distrain if verb == "distrain" else magics.VERBS[verb]
    with pytest.raises(UsageError) as err:
        magics._parse(magic, line)
    assert str(err.value).startswith("unrecognized arguments:") and hint in str(err.value)


def test_an_unknown_option_like_no_other_gets_no_guess():
    from IPython.core.error import UsageError

    from distnb import magics

    with pytest.raises(UsageError) as err:
        magics._parse(magics._cell, "--bogus")
    assert str(err.value) == "unrecognized arguments: --bogus"


@pytest.mark.parametrize("verb, line, said", [
    ("distrain", "--model net --data d --epochs 1 --epochs 2", "--epochs is given twice"),
    ("distrain", "--model net --data d --lr=0.1 --batch-size 8 --lr 0.2", "--lr is given twice"),
    ("start", "-n 2 --engines 3", "-n (the same as --engines) is given twice"),
])
def test_an_option_given_twice_is_refused_not_settled_by_the_last(verb, line, said):
    from IPython.core.error import UsageError

    from distnb import magics

    magic = magics._distrain if verb == "distrain" else magics.VERBS[verb]
    with pytest.raises(UsageError, match="give it once") as err:
        magics._parse(magic, line)
    assert said in str(err.value)
    assert magics._parse(magic, line.rsplit(" -", 1)[0]) is not None  # once is fine


INTERRUPTED_IMPORT = r'''
import importlib.abc, os, signal, sys
from IPython.testing.globalipapp import start_ipython
ip = start_ipython()
ip.run_line_magic("load_ext", "distnb")
assert "distnb.cluster.cluster" not in sys.modules  # %load_ext stays light: the first %dist line imports the rest

class CtrlC(importlib.abc.MetaPathFinder):  # the interrupt button, pressed in the middle of that import
    def find_spec(self, name, path=None, target=None):
        if name == "distnb.cluster.cluster":
            sys.meta_path.remove(self)
            os.kill(os.getpid(), signal.SIGINT)
        return None

sys.meta_path.insert(0, CtrlC())
first = ip.run_cell("%dist status").error_in_exec
print("first", type(first).__name__, first)
again = ip.run_cell("%dist status")
print("again", again.error_in_exec, "distnb.cluster.cluster" in sys.modules)
'''


def test_an_interrupt_while_the_first_dist_line_imports_leaves_the_modules_whole(tmp_path):
    # it left a module half made: "module 'jupyter_client' has no attribute 'session'" at every later %dist start
    import subprocess
    import sys

    script = tmp_path / "interrupted_import.py"
    script.write_text(INTERRUPTED_IMPORT)
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120).stdout
    assert "first Interrupted interrupted while distnb loaded its modules (they are loaded now; nothing was started)" \
        in out, out
    assert "again no distnb cluster is running; start one with %dist start (or distnb.start()) True" in out, out


def test_distnb_start_has_the_real_signature_and_help():
    """``distnb.start`` is the session's start (keyword completion, ``help``), not a ``(*args, **kwargs)`` stand-in."""
    import inspect

    import distnb
    from distnb import session

    assert distnb.start is session.start and distnb.current is session.current
    params = inspect.signature(distnb.start).parameters
    assert {"n", "backend", "cpu_bind", "timeout"} <= set(params) and "args" not in params
    assert "start" in dir(distnb)


def test_every_documented_magic_line_parses_as_written_comments_included():
    """IPython hands a line magic its whole line, comment included: the README's first cell (`%dist start   # 2 CPU
    engines here ...`) and the help's examples were "unrecognized arguments: # ..." when pasted."""
    import pathlib
    import re

    from distnb.core import options
    from distnb.magics import VERBS, _cell, _distrain, _parse

    root = pathlib.Path(__file__).resolve().parents[2]
    texts = [root.joinpath("README.md").read_text(), *(p.read_text() for p in sorted(root.joinpath("docs").rglob("*.md"))),
             DistMagics.dist.__doc__, DistMagics.distrain.__doc__]
    lines = {m.group(0).strip() for text in texts for m in re.finditer(r"^\s*%%?(dist|distrain)\b[^\n]*#[^\n]*$", text,
                                                                       re.M)}
    assert any(line.startswith("%dist start") for line in lines), lines  # the quickstart's, at least
    for line in lines:
        magic, _, rest = line.partition(" ")
        rest = options.uncommented(rest)
        assert "#" not in rest or re.search(r"\S#", rest), line
        if magic == "%%distrain":
            _parse(_distrain, rest)
        elif magic == "%%dist":
            _parse(_cell, rest)
        else:
            verb, _, args = rest.strip().partition(" ")
            if verb in VERBS:
                _parse(VERBS[verb], args)
    assert options.uncommented("--log-dir runs/a#b  # where") == "--log-dir runs/a#b "
    magics = _magics()
    magics.dist("status --help   # what it shows")  # the magic itself drops the comment
    magics.distrain("--help  # the options", "loss = 0")
