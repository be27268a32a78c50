"""The rank side of ``%dist debug`` (distnb/engine/process/postmortem.py): a real pdb on a kept traceback, in this process.

No cluster: a cell's code is compiled as the engine compiles it and raises here; the test then
drives pdb one command at a time as the kernel does. The process group side (frames kept while
gloo's sockets close) is tests/engine/test_postmortem_group.py.
"""

import gc
import weakref

import pytest

from distnb.engine.process import postmortem
from distnb.engine.process.runtime import compile_cell

CELL = """
import json
class Batch:
    pass
def step(scale):
    x = [1, 2, 3]
    held = Batch()
    if rank == 1:
        json.loads("{not json")
    return x
z = 5
step(2.0)
"""


@pytest.fixture
def failed():
    """A rank namespace whose cell raised, its traceback kept; released afterwards."""
    ns = {"rank": 1}
    try:
        exec(compile_cell(CELL, "dist"), ns)
    except Exception as exc:
        postmortem.keep(exc, ns, "%%dist cell")
    yield ns
    postmortem.drop(ns)


def run(ns, *commands):
    return [postmortem.debug_command(ns, c) for c in commands]


def test_pdb_starts_in_the_cells_innermost_frame_and_answers_p_pp_up_l_down(failed):
    info = postmortem.debug_kept()
    assert info["ename"] == "JSONDecodeError" and info["what"] == "%%dist cell" and not info["debugging"]
    first = postmortem.debug_begin(failed)
    assert not first["done"] and first["prompt"] == "(Pdb) "
    assert "post-mortem pdb on rank 1" in first["text"] and "JSONDecodeError" in first["text"]
    assert "step()" in first["text"] and 'json.loads("{not json")' in first["text"]  # the cell's frame, not json's
    assert "`down` goes" in first["text"]
    p, pp, up, listing, z, down, deeper = run(failed, "p x", "pp locals()", "up", "l", "p z", "down", "down")
    assert p["text"] == "[1, 2, 3]\n"
    assert "'scale': 2.0" in pp["text"] and "'x': [1, 2, 3]" in pp["text"] and "'held'" in pp["text"]
    assert "<module>()" in up["text"] and "step(2.0)" in up["text"]
    assert " 12  ->\tstep(2.0)" in listing["text"] and "held = Batch()" in listing["text"]
    assert z["text"] == "5\n"
    assert "step()" in down["text"]
    assert "json" in deeper["text"] and "loads()" in deeper["text"]
    assert postmortem.debug_kept()["debugging"]


def test_q_ends_the_session_and_releases_the_frames(failed):
    postmortem.debug_begin(failed)
    held = weakref.ref(_local(failed, "held"))
    gc.collect()
    assert held() is not None
    end, = run(failed, "q")
    assert end["done"] and "frames were released" in end["text"]
    gc.collect()
    assert held() is None, "the kept frame's locals outlived the session"
    assert postmortem.debug_kept() is None
    with pytest.raises(RuntimeError, match="rank 1 keeps no traceback"):
        postmortem.debug_begin(failed)


def _local(ns, name):
    tb = postmortem.KEPT["tb"]
    while tb.tb_next is not None and tb.tb_frame.f_code.co_name != "step":
        tb = tb.tb_next
    return tb.tb_frame.f_locals[name]


@pytest.mark.parametrize("ending", ["c", "quit", "EOF"])
def test_c_quit_and_eof_end_it_too(failed, ending):
    postmortem.debug_begin(failed)
    assert run(failed, ending)[0]["done"]
    assert postmortem.debug_kept() is None


def test_commands_that_would_run_the_cell_on_are_refused_and_the_session_goes_on(failed):
    postmortem.debug_begin(failed)
    n, s, bad, both, bang = run(failed, "n", "s", "p no_such_name", "p 1;; p 2", "!print('printed', x)")
    assert "cell has finished" in n["text"] and not n["done"] and not s["done"]
    assert "NameError" in bad["text"]
    assert both["text"] == "1\n2\n"
    assert bang["text"] == "printed [1, 2, 3]\n"  # the engine's stdout goes to the reply too
    assert postmortem.debug_kept() is not None


def test_training_names_come_back_for_the_session_and_go_again(failed):
    postmortem.KEPT["names"] = {"batch": "the failing batch"}  # what keep() took before mark_broken popped it
    postmortem.debug_begin(failed)
    assert run(failed, "up", "p batch")[1]["text"] == "'the failing batch'\n"
    run(failed, "q")
    assert "batch" not in failed


def test_ending_without_release_keeps_the_frames_and_the_next_cell_releases_them(failed):
    postmortem.debug_begin(failed)
    assert postmortem.debug_end(failed, release=False) == dict(text="", done=True, released=False)
    assert postmortem.debug_kept() is not None and not postmortem.debug_kept()["debugging"]
    assert "step()" in postmortem.debug_begin(failed)["text"]  # a second session on the same frames
    assert postmortem.drop(failed) is True
    assert postmortem.debug_kept() is None and postmortem.drop(failed) is False


def test_the_users_frame_is_the_innermost_not_of_a_library():
    import json

    stack = [(f, None) for f in _frames(lambda: json.loads("{"))]
    chosen = postmortem.user_frame(stack)
    assert stack[chosen][0].f_code.co_name == "<lambda>"
    assert stack[-1][0].f_code.co_filename.endswith(".py") and "json" in stack[-1][0].f_code.co_filename


def _frames(fn):
    try:
        fn()
    except Exception as exc:
        tb, out = exc.__traceback__, []
        while tb is not None:
            out.append(tb.tb_frame)
            tb = tb.tb_next
        return out
