"""Remote tracebacks and messages as a RankError shows them (distnb.core.tracebacks), without a cluster."""

from distnb.core.tracebacks import clean_message, clean_traceback, full_traceback

STORE_ERROR = """failed to recv, got 0 bytes
Exception raised from recvBytes at /pytorch/torch/csrc/distributed/c10d/Utils.hpp:671 (most recent call first):
frame #0: c10::Error::Error(c10::SourceLocation, std::string) + 0x98 (0x7f00 in libc10.so)
frame #1: <unknown function> + 0x5f1 (0x7f01 in libtorch_cpu.so)
<omitting python frames>
frame #2: clone + 0x44 (0x7f02 in libc.so.6)
"""


def test_the_cpp_stack_torch_appends_is_dropped_and_the_message_kept():
    assert clean_message(STORE_ERROR) == "failed to recv, got 0 bytes\n"
    assert clean_message("ValueError: no stack here") == "ValueError: no stack here"
    tb = "Traceback (most recent call last):\n  cell line 3\n\nDistBackendError: " + STORE_ERROR + "\n\nafter"
    cleaned = clean_traceback(tb)
    assert "frame #" not in cleaned and "Exception raised from" not in cleaned
    assert "DistBackendError: failed to recv, got 0 bytes" in cleaned and cleaned.endswith("after")


def _frame(path, line, func, code):
    return f"File {path}:{line}, in {func}\n----> {line} {code}"


TORCH = "/venv/lib/python3.11/site-packages/torch"
RAISED = (["-" * 20 + "\nRuntimeError                              Traceback (most recent call last)",
           _frame("/venv/lib/python3.11/site-packages/ipyparallel/engine/kernel.py", 9, "apply", "f()"),
           "File <distrain-cell-1>:2\n      1 x, y = batch\n----> 2 loss = F.cross_entropy(model(x[:, :5]), y)"]
          + [_frame(f"{TORCH}/nn/modules/module.py", 1778, "Module._wrapped_call_impl", "self._call_impl()"),
             _frame(f"{TORCH}/nn/modules/module.py", 1884, "Module._call_impl", "inner()"),
             _frame(f"{TORCH}/nn/parallel/distributed.py", 1890, "DistributedDataParallel.forward", "f()"),
             _frame(f"{TORCH}/nn/parallel/distributed.py", 1715, "DistributedDataParallel._run_ddp_forward", "f()"),
             _frame("<ipython-input-3-abc>", 5, "M.forward(self, x)", "h = self.fc(x)"),
             _frame(f"{TORCH}/nn/modules/module.py", 1778, "Module._wrapped_call_impl", "self._call_impl()"),
             _frame(f"{TORCH}/nn/modules/linear.py", 134, "Linear.forward(self, input)", "F.linear(input)"),
             "RuntimeError: mat1 and mat2 shapes cannot be multiplied (8x5 and 10x16)"])


def test_torch_frames_between_the_users_fold_into_one_line_and_the_raising_frame_stays():
    cleaned = clean_traceback("\n\n".join(RAISED))
    blocks = cleaned.split("\n\n")
    assert blocks[1].startswith("File <distrain-cell-1>:2") and "ipyparallel" not in cleaned
    assert blocks[2] == "... 4 frames in torch (nn/modules/module.py, nn/parallel/distributed.py) ..."
    assert blocks[3].startswith("File <ipython-input-3-abc>:5, in M.forward")
    assert blocks[4].startswith(f"File {TORCH}/nn/modules/module.py:1778")  # a run of one: kept
    assert blocks[5].startswith(f"File {TORCH}/nn/modules/linear.py:134") and blocks[6].startswith("RuntimeError: mat1")
    assert len(blocks) == 7
    full = full_traceback("\x1b[0;31m" + "\n\n".join(RAISED) + "\x1b[0m")
    assert full == "\n\n".join(RAISED)  # every frame, colours off


def test_a_chained_tracebacks_raising_frame_in_torch_is_kept_before_the_next_section():
    first = [_frame(f"{TORCH}/a.py", 1, "a", "b()"), _frame(f"{TORCH}/b.py", 2, "b", "raise X"), "KeyError: 'k'",
             "During handling of the above exception, another exception occurred:"]
    cleaned = clean_traceback("\n\n".join(first + RAISED[2:]))
    assert cleaned.startswith(first[0] + "\n\n" + first[1] + "\n\nKeyError")  # a run of one is not folded


def test_a_notebook_function_reading_a_body_name_is_told_to_take_it_as_an_argument():
    from distnb.core.tracebacks import body_name_hint

    def halve():
        pass

    tb = ("NameError                                 Traceback (most recent call last)\n\n"
          "File <ipython-input-1-837d25b7894c>:6, in halve()\n----> 6     for p in model.parameters():\n\n"
          "NameError: name 'model' is not defined")
    failure = dict(ename="NameError", evalue="name 'model' is not defined", traceback=tb)
    hint = body_name_hint([failure], {"halve": halve}, {"model", "ctx"})
    assert hint.startswith("halve is a notebook function") and "ctx.after_backward(lambda: halve(model))" in hint
    assert body_name_hint([failure], {}, {"model"}) == ""  # not a notebook function: Python's words are enough
    assert body_name_hint([dict(failure, evalue="name 'other' is not defined")], {"halve": halve}, {"model"}) == ""
    plain = dict(failure, traceback='  File "/tmp/x.py", line 6, in halve\nNameError: name \'model\' is not defined')
    assert body_name_hint([plain], {"halve": halve}, {"model"}).startswith("halve is")


def test_a_rank_error_carries_the_ranks_traceback_as_a_note_for_scripts():
    """Outside IPython (a plain script) a RankError printed distnb's kernel frames and one line: the line that failed
    on the rank was nowhere. Python prints __notes__ after the message; IPython uses _render_traceback_."""
    import traceback

    from distnb.core.errors import RankError

    tb = "\x1b[0;31mValueError\x1b[0m Traceback\nFile <distrain-cell-1>:3\n----> 3 raise ValueError('bad')\n"
    err = RankError([dict(rank=1, host="h", ename="ValueError", evalue="bad", traceback=tb)], context="training")
    printed = "".join(traceback.format_exception(err))
    assert "--- traceback from rank 1 on h ---" in printed and "----> 3 raise ValueError('bad')" in printed
    assert "\x1b[" not in printed  # no terminal colour codes in a log
    assert err._render_traceback_()[0].startswith("RankError: training failed on rank 1")


def test_a_hang_names_where_a_missing_rank_is_from_its_stack_and_how_old_that_is():
    """A rank waiting for its DataLoader workers was 'in select (selectors.py:415)'; one whose watchdog could not run
    (native code holding the GIL) was said to have finished the cell, or to be at a line it had long left."""
    from distnb.execute.hangs import _spot

    loader = [("/x/torch/utils/data/dataloader.py", 1, "_try_get_data", ""), ("/py/queues.py", 2, "get", ""),
              ("/py/selectors.py", 415, "select", "")]
    assert "waiting for a batch from its DataLoader workers" in _spot(dict(sent=10.0, seen=10.5, stack=loader))
    assert _spot(None) == "it finished the cell without calling it"
    assert _spot(dict(seen=10.0)).startswith("it is still in its cell but has not said where (native code holding")
    old = _spot(dict(sent=10.0, seen=16.0, cell_line=4, cell_code="time.sleep(1)"))
    assert old.startswith("it was at cell line 4: `time.sleep(1)` 6 s before and has not said where since")
    assert _spot(dict(sent=10.0, seen=10.3, cell_line=4, cell_code="x = 1")) == "it is at cell line 4: `x = 1`"
