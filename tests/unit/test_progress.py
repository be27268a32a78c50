import io

from distnb.display import make_view
from distnb.display.progress import ProgressState
from distnb.display.text import TextProgress
from distnb.engine.transport.report import Reporter


def test_state_merges_rank_messages_and_mean_curve():
    st = ProgressState(2, total_steps=10, epochs=1)
    assert st.update(0, dict(status="running", step=3, loss=1.0, points=[(1, 2.0), (3, 1.0)]))
    assert st.update(1, dict(status="running", step=3, loss=3.0, points=[(1, 4.0), (3, 3.0)]))
    assert not st.update(1, dict(status="running", step=3, loss=3.0))
    assert st.mean_curve() == [(1, 3.0), (3, 2.0)]
    assert st.fraction(0) == 0.3
    st.update(0, dict(epoch_losses=[(0, 0.5)]))
    assert st.epoch_means == {0: 0.5}


def test_reporter_throttles_and_reads_loss_only_when_publishing():
    sent = []

    class Loss:
        reads = 0

        def __float__(self):
            Loss.reads += 1
            return 0.25

    r = Reporter(rank=1, total_steps=1000, epochs=1, interval=3600, publish=sent.append)
    for _ in range(1000):
        r.record(Loss(), 8)
    assert sent == [] and Loss.reads == 0  # nothing published within the interval
    r.set_status("done")
    assert len(sent) == 1 and sent[0]["step"] == 1000 and sent[0]["samples"] == 8000
    assert sent[0]["loss"] == 0.25 and Loss.reads == 1 and sent[0]["rank"] == 1


def test_the_final_message_is_built_for_the_reply_not_published():
    sent = []
    r = Reporter(rank=0, total_steps=10, epochs=1, interval=3600, publish=sent.append)
    r.set_status("running")
    for _ in range(10):
        r.record(0.5, 4)
    r.end_epoch(0, 0.5)  # a short epoch: its end waits for the next message
    msg = r.final_message("done")
    assert len(sent) == 1 and sent[0]["status"] == "running" and r.messages == 1
    assert msg["status"] == "done" and msg["step"] == 10 and msg["epoch_losses"] == [(0, 0.5)]
    st = ProgressState(1, total_steps=10, epochs=1)
    assert st.update(0, msg) and st.rows[0]["status"] == "done" and st.epoch_means == {0: 0.5}


def test_text_progress_prints_epoch_lines_and_failures():
    st = ProgressState(2, total_steps=4, epochs=2)
    out = io.StringIO()
    view = TextProgress(st, stream=out)
    for r in range(2):
        st.update(r, dict(status="running", samples_per_s=100.0, epoch_losses=[(0, 1.5)]))
    view.refresh()
    st.set_status("failed", ranks=[1], error="ValueError: x")
    view.close()
    text = out.getvalue()
    assert "epoch   0  mean loss 1.5000" in text
    assert "rank 1 failed" in text and "ValueError: x" in text


def test_view_selection_without_a_widget_front_end(monkeypatch):
    monkeypatch.setenv("DISTNB_PROGRESS", "auto")
    st = ProgressState(1)
    assert type(make_view(st)).__name__ == "TextProgress"  # plain Python: no kernel, no widgets
    assert type(make_view(st, "none")).__name__ == "NullView"
    assert type(make_view(st, "widgets")).__name__ == "Dashboard"


def test_text_progress_names_no_epoch_for_a_rank_that_never_reported():
    st = ProgressState(2, total_steps=4, epochs=2)
    out = io.StringIO()
    view = TextProgress(st, stream=out)
    st.update(0, dict(status="running", epoch=1, step=3, samples_per_s=100.0))
    st.set_status("failed", ranks=[1], error="EngineDied: gone")
    st.set_status("interrupted", ranks=[0])
    view.close()
    text = out.getvalue()
    assert "None" not in text
    assert "rank 1 failed (it had reported no step): EngineDied: gone" in text
    assert "rank 0 interrupted after 3 of this cell's steps in epoch 1" in text


def test_text_progress_leaves_a_clean_interrupt_to_the_cells_summary():
    """Every rank stopped after the same step (no error): the Interrupted summary names where, once."""
    st = ProgressState(2, total_steps=40, epochs=2)
    out = io.StringIO()
    view = TextProgress(st, stream=out)
    for r in (0, 1):
        st.update(r, dict(status="interrupted", epoch=1, step=23, samples_per_s=100.0))
    view.close()
    assert "interrupted after" not in out.getvalue()


def test_text_progress_shows_the_last_epoch_of_a_cell_that_stopped_early():
    st = ProgressState(1, total_steps=300, epochs=30)  # every third epoch is shown while it runs
    out = io.StringIO()
    view = TextProgress(st, stream=out)
    for epoch in range(6):  # --target-loss reached after epoch 5
        st.update(0, dict(status="running", epoch_losses=[(e, 1.0 / (e + 1)) for e in range(epoch + 1)]))
        view.refresh()
    view.close()
    lines = [line.split("mean")[0].split() for line in out.getvalue().splitlines() if line.startswith("epoch")]
    assert lines == [["epoch", "0"], ["epoch", "3"], ["epoch", "5"]]


def test_text_progress_keeps_its_epoch_grid_when_epochs_were_never_read():
    # 200 short epochs from epoch 40 (carried), a line every 20th; the kernel never read 180-187 (more than TAIL
    # epoch ends between two looks): 188 takes 180's line, and 200 follows as due (by position: 188, 208, 228, ...)
    st = ProgressState(1, total_steps=400, epochs=200)
    out = io.StringIO()
    view = TextProgress(st, stream=out)
    read = [e for e in range(40, 240) if not 180 <= e < 188]
    for k in range(0, len(read), 4):
        st.update(0, dict(status="running", samples_per_s=1.0, epoch_rates=[(e, 1.0) for e in read[k:k + 4]],
                          epoch_losses=[(e, 1.0) for e in read[k:k + 4]]))
        view.refresh()
    view.close()
    shown = [int(line.split()[1]) for line in out.getvalue().splitlines() if line.startswith("epoch")]
    assert shown == [40, 60, 80, 100, 120, 140, 160, 188, 200, 220, 239]


def test_reporter_gives_each_epoch_its_own_rate(monkeypatch):
    import distnb.engine.transport.report as report

    clock = [100.0]
    monkeypatch.setattr(report.time, "perf_counter", lambda: clock[0])
    sent = []
    r = Reporter(rank=0, total_steps=20, epochs=2, interval=3600, publish=sent.append)
    clock[0] = 105.0  # set-up before training is not in the first epoch
    r.set_status("running")
    for _ in range(10):
        r.record(0.5, 8)
    clock[0] = 107.0
    r.end_epoch(0, 0.5)
    for _ in range(10):
        r.record(0.5, 8)
    clock[0] = 111.0
    r.end_epoch(1, 0.4)
    assert sent[-1]["epoch_rates"] == [(0, 40.0), (1, 20.0)]  # 80 samples in 2 s, then in 4 s


def test_short_epochs_share_messages_and_none_is_lost(monkeypatch):
    # epochs of 10 ms: each end waits for a step at least EPOCH_GAP after the last message, which carries it
    import distnb.engine.transport.report as report

    clock = [100.0]
    monkeypatch.setattr(report.time, "perf_counter", lambda: clock[0])
    sent = []
    r = Reporter(rank=0, total_steps=400, epochs=40, interval=0.1, publish=sent.append)
    r.set_status("running")
    for epoch in range(40):
        for _ in range(10):
            clock[0] += 0.001
            r.record(0.5, 8)
        r.end_epoch(epoch, 1.0 / (epoch + 1))
    r.set_status("done")
    seen = {e for msg in sent for e, _ in msg["epoch_losses"]}
    assert seen == set(range(40))  # every epoch's mean reached the kernel
    assert len(sent) <= 40 * 0.01 / report.EPOCH_GAP + 3  # about one message per EPOCH_GAP, not one per epoch
    assert sent[-1]["epoch_losses"][-1] == (39, 1.0 / 40) and sent[-1]["status"] == "done"


def test_an_epoch_line_waits_for_every_ranks_own_rate_of_that_epoch():
    st = ProgressState(2, total_steps=4, epochs=3)
    out = io.StringIO()
    view = TextProgress(st, stream=out)
    st.update(0, dict(status="running", samples_per_s=999.0, epoch_losses=[(0, 1.5), (1, 1.2)],
                      epoch_rates=[(0, 100.0), (1, 110.0)]))
    st.update(1, dict(status="running", samples_per_s=0.0, epoch_losses=[(0, 1.5)], epoch_rates=[(0, 90.0)]))
    view.refresh()
    assert out.getvalue().splitlines() == ["epoch   0  mean loss 1.5000  |  rank 0 100 samples/s  rank 1 90 samples/s"]
    assert st.update(1, dict(status="running", epoch_losses=[(0, 1.5), (1, 1.2)], epoch_rates=[(0, 90.0), (1, 95.0)]))
    view.refresh()
    assert out.getvalue().splitlines()[1] == "epoch   1  mean loss 1.2000  |  rank 0 110 samples/s  rank 1 95 samples/s"
    st.update(0, dict(status="running", epoch_losses=[(2, 1.0)], epoch_rates=[(2, 120.0)]))
    st.set_status("failed", ranks=[1], error="ValueError: x")  # rank 1 never reports epoch 2
    view.close()
    assert "epoch   2  mean loss 1.0000  |  rank 0 120 samples/s  rank 1 - samples/s" in out.getvalue()


def test_the_text_view_prints_the_cells_start_notes_before_an_epoch_line_of_the_same_message():
    import io

    from distnb.display import ProgressState
    from distnb.display.text import TextProgress

    state = ProgressState(1, total_steps=4, epochs=2)
    out = io.StringIO()
    view = TextProgress(state, stream=out)
    state.update(0, dict(rank=0, status="running", epoch=1, step=4, samples=64, epoch_losses=[(0, 0.5), (1, 0.4)],
                         epoch_rates=[(0, 100.0), (1, 100.0)],
                         start=dict(note="new sgd optimizer (was adam)", resumed=None,
                                    continued=dict(epoch=0, samples=16))))
    view.refresh()
    view.refresh(final=True)
    lines = out.getvalue().splitlines()
    assert lines[:2] == ["distnb: new sgd optimizer (was adam)", "distnb: continued epoch 0 where it stopped (16 "
                         "samples per rank already trained); it counts as the first of this cell's epochs"]
    assert lines[2].startswith("epoch   0") and state.start_shown and len(lines) == 4  # once


def test_a_dead_rank_s_line_gives_its_last_report_not_a_place_it_failed():
    """A SIGKILLed engine says nothing more: the line read 'rank 1 failed after 86 ... in epoch 1' while rank 0 was at
    step 100 of epoch 2; it now says that 86 is its last report."""
    import io

    st = ProgressState(2, total_steps=200, epochs=4)
    st.update(1, dict(status="running", epoch=1, step=86))
    st.update(1, dict(status="failed", error="EngineDied: rank 1 (engine 3, pid 7) died: killed by SIGKILL"))
    st.update(0, dict(status="failed", epoch=2, step=100, error="RuntimeError: boom"))
    out = io.StringIO()
    TextProgress(st, stream=out).refresh(final=True)
    text = out.getvalue()
    assert "rank 1 failed (last reported after 86 of this cell's steps in epoch 1; it may have got further): " \
           "EngineDied" in text
    assert "rank 0 failed after 100 of this cell's steps in epoch 2: RuntimeError: boom" in text
