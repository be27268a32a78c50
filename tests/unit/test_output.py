"""Rank output folded: identical lines from several ranks shown once, a repeated warning once with a count."""

import io

from distnb.execute.output import LineFolder, rank_list, tag


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def _folder(world=4):
    out, err, clock = io.StringIO(), io.StringIO(), Clock()
    return LineFolder({"stdout": out, "stderr": err}, world, clock=clock), out, err, clock


def test_rank_lists_and_tags():
    assert rank_list([3, 0, 1, 2, 5, 7, 6]) == "0-3,5-7"
    assert tag([2], 4) == "[rank 2] " and tag([1, 0], 4) == "[ranks 0-1] " and tag([0], 1) == ""


def test_the_same_line_from_several_ranks_is_shown_once_with_their_ranks():
    folder, out, err, clock = _folder()
    for rank in range(4):
        folder.feed(rank, "stderr", "UserWarning: FSDP2-wrapped module returned a view\n")
    folder.feed(2, "stdout", "only me\n")
    folder.flush()
    assert err.getvalue() == ""  # held for the window
    clock.t = 1.0
    folder.flush()
    assert err.getvalue() == "[ranks 0-3] UserWarning: FSDP2-wrapped module returned a view\n"
    assert out.getvalue() == "[rank 2] only me\n"


def test_a_warning_repeated_every_step_is_shown_once_with_a_count_and_distinct_lines_keep_their_order():
    folder, out, err, clock = _folder(2)
    for step in range(5):
        folder.feed(0, "stderr", "Warning: deprecated\n")
        folder.feed(0, "stdout", f"step {step}\n")
        clock.t += 1.0
        folder.flush()
    folder.feed(1, "stdout", "partial ")
    folder.feed(1, "stdout", "line")
    folder.flush(final=True)
    assert err.getvalue().splitlines() == ["[rank 0] Warning: deprecated",
                                           "[rank 0] (the line above, 'Warning: deprecated', came 4 more times)"]
    assert out.getvalue().splitlines() == [f"[rank 0] step {i}" for i in range(5)] + ["[rank 1] partial line"]


def test_an_interrupt_that_lands_inside_a_lock_is_still_an_interrupt():
    from distnb.execute import execute

    try:
        try:
            raise KeyboardInterrupt
        except KeyboardInterrupt:
            raise RuntimeError("release unlocked lock")
    except RuntimeError as exc:
        assert execute._is_interrupt(exc)
    assert execute._is_interrupt(KeyboardInterrupt()) and not execute._is_interrupt(RuntimeError("other"))


def test_a_result_that_finished_no_epoch_names_the_mean_loss_of_its_steps_not_nan():
    import math

    from distnb.core.plan import TrainPlan
    from distnb.train.results import TrainResult

    rows = [dict(rank=r, steps=3, samples=96, seconds=0.5, samples_per_s=192.0, final_loss=0.5 + r, param_bytes=8,
                 final_loss_steps=3, epoch_losses=[], first_epoch=0, next_epoch=0, stopped_early=False,
                 interrupted=True) for r in (0, 1)]
    result = TrainResult(rows, TrainPlan(model="net", data="ds"), wall_seconds=0.6)
    assert result.final_loss == 1.0 and result.final_loss_of == "steps"  # documented: the mean of the steps trained
    assert "no epoch finished, mean loss of its 3 steps 1.0000" in result.title and "nan" not in result.title
    for row in rows:
        row.update(final_loss=math.nan, final_loss_steps=0)  # no step reported a loss: said, not a silent nan
    result = TrainResult(rows, TrainPlan(model="net", data="ds"), wall_seconds=0.6)
    assert math.isnan(result.final_loss) and result.final_loss_of is None
    assert "no epoch finished, no step loss reported" in result.title
    rows[0].update(epoch_losses=[0.7, 0.6], next_epoch=2)
    assert TrainResult(rows, TrainPlan(model="net", data="ds"), wall_seconds=0.6).final_loss_of == "epoch"


def test_the_drop_last_sentence_counts_only_the_full_batches_a_rank_trains():
    from distnb.transfer.data import describe_cut
    from distnb.core.plan import TrainPlan

    text = describe_cut(TrainPlan(model="m", data="d", batch_size=150, drop_last=True), {"num_samples": 400}, 2, 2)
    assert "each rank uses 150 of its 200 samples" in text and "1 step/epoch" in text
    text = describe_cut(TrainPlan(model="m", data="d", batch_size=64, drop_last=True), {"num_samples": 401}, 2, 2)
    assert "each rank uses 192 of its 200-201 samples" in text


def test_the_interrupt_summary_names_a_position_at_an_epochs_end_as_after_it():
    from distnb.execute.execute import _progress_position, position

    assert position(dict(epoch=54, step=3)) == "epoch 54, step 3"
    assert position(dict(epoch=55, step=0)) == "after epoch 54" and position(dict(epoch=0, step=0)) == "epoch 0, step 0"
    assert position(dict(epoch=54, step=8, last_step=True)) == \
        "after the last step of epoch 54 (the next cell starts epoch 55)"
    assert _progress_position(dict(epoch=3, step=57)) == "epoch 3, 57 of this cell's steps"  # not the epoch's step
    assert _progress_position({}) == ""


def test_a_cpp_backtrace_on_stderr_is_left_out_with_one_line_saying_how_many():
    """torch's warning when a peer's socket closes (every rank left when rank 0, the store's server, dies) came with
    its whole C++ backtrace, about 40 lines each time; the frames are left out, the warning and a count stay."""
    folder, out, err, clock = _folder(2)
    block = ("[rank1]:[W1204 04:43:45 TCPStore.cpp:125] [c10d] recvValue failed on SocketImpl(fd=51): Failed to recv\n"
             "Exception raised from recvBytes at Utils.hpp:787 (most recent call first):\n"
             + "".join(f"frame #{i}: c10::Error::Error() + 0x9d (0x7f37 in libc10.so)\n" for i in range(8))
             + "<omitting python frames>\nframe #23: <unknown function> + 0x8c79\n\n")
    for rank in (0, 1):
        folder.feed(rank, "stderr", block)
    folder.feed(0, "stdout", "frame #1: a line of the user's own, on stdout\n")
    clock.t = 1.0
    folder.flush(final=True)
    lines = err.getvalue().splitlines()
    assert not any("frame #" in line or "omitting python" in line for line in lines), lines
    assert lines[1:3] == ["[ranks 0-1] Exception raised from recvBytes at Utils.hpp:787 (most recent call first):",
                          "[ranks 0-1] (the 10 lines of its C++ backtrace left out)"], lines
    assert out.getvalue() == "[rank 0] frame #1: a line of the user's own, on stdout\n"
    folder.feed(1, "stderr", "frame #0: at the very end\n")  # a backtrace the cell ends in: counted at the end
    folder.flush(final=True)
    assert err.getvalue().endswith("[rank 1] (the 1 line of its C++ backtrace left out)\n")


def _folded_as_before(events, world):
    """The folding as it was first written (each line compared with every pending one), for stdout, in one window."""
    pending = []
    for rank, line in events:
        for item in pending:
            if item[0] == line and rank not in item[1]:
                item[1].append(rank)
                break
        else:
            pending.append([line, [rank]])
    return "".join(tag(ranks, world) + line + "\n" for line, ranks in pending)


def test_folding_is_the_same_as_comparing_each_line_with_every_pending_one():
    # a rank printing 100,000 lines at once took minutes in the kernel: each line was compared with all pending ones
    from hypothesis import given, settings, strategies as st

    @settings(max_examples=200, deadline=None)
    @given(st.lists(st.tuples(st.integers(0, 2), st.sampled_from(["a", "b", "c", ""])), max_size=40),
           st.integers(0, 40))
    def check(events, flush_after):
        folder, out, _, clock = _folder(world=3)
        for k, (rank, line) in enumerate(events):
            if k == flush_after:  # some lines written before the rest arrive: later copies start new items
                clock.t += 1.0
                folder.flush()
            folder.feed(rank, "stdout", line + "\n")
        folder.flush(final=True)
        before, after = events[:flush_after], events[flush_after:]
        assert out.getvalue() == _folded_as_before(before, 3) + _folded_as_before(after, 3)

    check()
