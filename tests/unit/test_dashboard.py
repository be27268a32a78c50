"""The dashboard's pieces without processes: state, HTML/SVG, widget throttling, snapshot, background runs."""

import re
import threading
import time

import pytest

from distnb.train.background import BUSY_MESSAGE, BackgroundRun, check_idle, collect
from distnb.display import render
from distnb.display.progress import ProgressState
from distnb.engine.transport.report import Reporter, peak_memory
from distnb.core.errors import BusyError, PlanError


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def running(state, rank, step, loss, **extra):
    msg = dict(status="running", epoch=0, step=step, loss=loss, points=[(step, loss)], samples_per_s=100.0,
               step_time=0.01)
    msg.update(extra)
    return state.update(rank, msg)


def test_loss_column_is_the_epoch_mean_so_far_and_throughput_history():
    clock = Clock()
    st = ProgressState(2, total_steps=10, epochs=1, clock=clock)
    running(st, 0, 1, 1.0)
    assert render.loss_text(st.rows[0]) == "1.0000"  # before a rank says its epoch mean: its newest loss
    running(st, 0, 2, 0.0, epoch_loss=0.5)
    assert render.loss_text(st.rows[0]) == "0.5000"  # the rank's mean over the epoch so far, not a lagging EMA
    assert "epoch loss" in render.table_html(st) and "loss (ema)" not in render.table_html(st)
    assert not st.update(0, dict(points=[(2, 0.0)]))  # an old point changes nothing
    clock.t = 1.0
    running(st, 1, 1, 1.0, samples_per_s=300.0)
    assert st.throughput.points[-1] == (1.0, 400.0)  # summed over ranks, seconds since the first report


def test_samples_per_second_from_cumulative_samples_on_the_rank_clock():
    st = ProgressState(1, total_steps=100)
    for i, (t, n, window_rate) in enumerate([(10.0, 0, 0.0), (10.1, 100, 5000.0), (10.3, 300, 200.0),
                                             (10.5, 500, 9000.0)]):
        running(st, 0, i + 1, 1.0, time=t, samples=n, samples_per_s=window_rate)
    assert st.rows[0]["rate"] == pytest.approx(1000.0)  # 500 samples in 0.5 s, whatever the windows said
    assert st.throughput.points[-1] == (pytest.approx(0.5), pytest.approx(1000.0))


def test_straggler_is_the_slowest_rank_beyond_20_percent_of_the_median():
    st = ProgressState(3, total_steps=10)
    for r, busy in enumerate((0.010, 0.010, 0.011)):
        running(st, r, 2, 1.0, busy_time=busy)
    assert st.time_per_step()[1] == "busy" and st.straggler() is None  # 10% slower: not a straggler
    running(st, 2, 3, 1.0, busy_time=0.0125)
    assert st.skews()[2] == pytest.approx(0.25) and st.straggler() == 2
    svg = render.straggler_svg(st)
    assert "distnb-straggler-slow" in svg and "rank 2 is 25% slower" in svg


def test_wall_step_time_is_compared_without_busy_time():
    st = ProgressState(2, total_steps=10)
    running(st, 0, 2, 1.0, step_time=0.010)
    running(st, 1, 2, 1.0, step_time=0.020)
    assert st.time_per_step() == ([0.010, 0.020], "step") and st.straggler() == 1


def test_table_rows_status_colours_error_and_stage():
    st = ProgressState(2, total_steps=4, epochs=2, hosts=["h0", "h1"], devices=["cpu", "cpu"], strategy="ddp")
    running(st, 0, 4, 0.5, peak_memory=3 * 2**20, memory_kind="rss")
    st.update(0, dict(status="done"))
    running(st, 1, 2, 0.7)
    st.set_status("failed", ranks=[1], error="ValueError: <bad> value\nsecond line")
    html = render.table_html(st)
    rows = re.findall(r"<tr class='distnb-rank[^>]*>", html)
    assert len(rows) == 2
    assert "data-status='done'" in rows[0] and render.ROW_BG["done"] in rows[0]
    assert "data-status='failed'" in rows[1] and render.ROW_BG["failed"] in rows[1]
    assert "aria-valuenow='4' aria-valuemin='0' aria-valuemax='4'" in html and "width:100.0%" in html
    assert "ValueError: &lt;bad&gt; value<" in html and "second line<" not in html  # one line, escaped
    assert "3.0 MiB" in html and "stage" not in html
    st.strategy = "pipeline"
    assert ">stage<" in render.table_html(st)
    st.strategy = "ddp"
    st.update(1, dict(stage=1))
    assert "class='distnb-stage'" in render.table_html(st)  # a stage sent by a strategy shows too


def test_a_stream_of_unknown_length_shows_its_steps_without_a_total():
    st = ProgressState(2, total_steps=0, epochs=2, strategy="ddp")  # an IterableDataset: the total is not known
    running(st, 0, 6, 0.5)
    st.update(0, dict(status="done"))
    running(st, 1, 3, 0.7)
    html = render.table_html(st)
    assert "/0" not in html and "aria-valuemax" not in html  # it said 6/0, and aria-valuemax='0'
    assert "<span class='distnb-steps'>6</span>" in html and "a stream: the total is not known" in html
    assert st.fraction(0) == 1.0 and st.fraction(1) == 0.0  # done: a full bar
    assert "step 6  loss" in render.dashboard_text(st) and "step 3  loss" in render.dashboard_text(st)


def test_loss_chart_has_a_line_per_rank_and_the_mean_thinned():
    st = ProgressState(2, total_steps=1000)
    for step in range(1, 1001):
        for r in range(2):
            st.update(r, dict(step=step, points=[(step, 1.0 / step + r)]))
    svg = render.loss_svg(st)
    for cls in ("distnb-loss-rank0", "distnb-loss-rank1", "distnb-loss-mean"):
        points = re.search(rf"class='{cls}' points='([^']*)'", svg).group(1).split()
        assert 2 <= len(points) <= render.MAX_POINTS + 1
    assert render.thin(list(range(10)), 4)[-1] == 9


def test_reporter_sends_memory_busy_time_and_stage():
    sent = []
    r = Reporter(rank=0, total_steps=10, epochs=1, interval=0.0, publish=sent.append, stage=2)
    x = 0
    for _ in range(3):
        for i in range(20000):
            x += i
        r.record(0.5, 4)
    msg = sent[-1]
    assert msg["stage"] == 2 and msg["memory_kind"] == "rss" and msg["peak_memory"] > 10 * 2**20
    assert msg["busy_time"] > 0 and msg["peak_memory"] == peak_memory()[0]


def test_dashboard_throttles_coalesces_and_leaves_a_snapshot(capsys):
    from distnb.display.widgets import Dashboard

    st = ProgressState(2, total_steps=10)
    dash = Dashboard(st, max_fps=10)
    running(st, 0, 1, 1.0)
    dash.refresh()
    running(st, 0, 2, 0.9)
    dash.refresh()  # within 0.1 s of the last redraw: coalesced
    assert dash.redraws == 1 and "data-step='1'" in dash.table.value
    dash.refresh()
    time.sleep(0.11)
    dash.refresh()
    assert dash.redraws == 2 and "data-step='2'" in dash.table.value
    dash.refresh(final=True)
    assert dash.redraws == 3
    st.update(0, dict(status="done", step=10))
    st.update(1, dict(status="done", step=10))
    dash.close()  # no display id here (never shown): the snapshot is displayed instead
    out = capsys.readouterr().out
    assert "rank 0  done" in out and "step 10/10" in out
    assert dash.widget.comm is None and dash.table.comm is None  # widget models closed
    snap = render.Snapshot(st)
    assert "distnb-snapshot" in snap._repr_html_() and "done" in repr(snap)


def test_stop_button_calls_back():
    from distnb.display.widgets import Dashboard

    calls = []
    dash = Dashboard(ProgressState(1))
    dash.attach_stop(lambda: calls.append(1))
    dash.stop_button.click()
    assert calls == [1] and dash.stop_button.disabled and dash.stop_button in dash.widget.children
    dash.close()


class FakeSession:
    _background = None


def test_background_run_raises_preparation_errors_in_the_caller():
    def prepare(**kw):
        raise PlanError("--model nett is not defined")

    run = BackgroundRun(prepare, {})
    with pytest.raises(PlanError, match="nett"):
        run.start()
    assert run.done and run.collected


def test_busy_while_running_then_collected_with_a_note(capsys):
    session = FakeSession()
    release = threading.Event()

    def target(**kw):
        session._background.watching = True
        session._background.started.set()
        release.wait(10)
        check_idle(session)  # the run's own thread is never refused
        return type("Result", (), {"title": "ddp · 2 ranks"})()

    session._background = run = BackgroundRun(target, {})
    results = []
    run.on_result.append(results.append)
    assert run.start() is run and run.active
    with pytest.raises(BusyError, match="%dist wait") as info:
        check_idle(session)
    assert str(info.value) == BUSY_MESSAGE and "%dist stop-training" in BUSY_MESSAGE
    release.set()
    assert run.join(10)
    check_idle(session)  # finished: said by the next command, in one line, and kept for %dist wait
    check_idle(session)
    assert capsys.readouterr().out.count("the background run finished: ddp · 2 ranks") == 1
    assert session._background is run and len(results) == 1  # -o bound once
    assert collect(session) is run.result and session._background is None and len(results) == 1
    assert collect(session) is None


# --- the where panel -----------------------------------------------------------------------------
def where_report(state="running", since=10.0, sent=10.5, op=None, shape=None, stack=None, cell_line=None,
                 cell_code=None):
    return dict(state=state, op=op, shape=shape, cell_line=cell_line, cell_code=cell_code, since=since, sent=sent,
                stack=stack if stack is not None else [("/venv/lib/python3.11/site-packages/distnb/engine/train/loop.py",
                                                        12, "train", "run()")])


def test_where_panel_shows_each_ranks_state_op_cell_line_and_innermost_frames_escaped():
    from distnb.display import stacks

    st = ProgressState(3, total_steps=10)
    for r in range(3):
        running(st, r, 2, 1.0)
    library = [(f"/venv/lib/python3.11/site-packages/torch/f{i}.py", i, f"f{i}", f"g{i}()") for i in range(9)]
    st.set_where(0, where_report("collective", sent=14.2, op="all_reduce", shape=[4, 2], stack=library + [
        ("<distrain-cell-7>", 2, "<module>", "dist.all_reduce(t)")], cell_line=2, cell_code="dist.all_reduce(t)"))
    st.set_where(1, where_report("running", sent=13.1, cell_line=3, cell_code="time.sleep(7)  # <b>&", stack=[
        ("/venv/lib/python3.11/site-packages/distnb/engine/train/loop.py", 40, "step", "body()"),
        ("<distrain-cell-7>", 3, "<module>", "time.sleep(7)  # <b>&")]))
    st.set_where(2, where_report("running", sent=10.5))
    html = stacks.where_html(st)
    blocks = re.findall(r"<div class='distnb-where-rank' data-rank='(\d)' data-state='(\w+)'", html)
    assert blocks == [("0", "collective"), ("1", "stalled"), ("2", "running")]
    rank0, rank1, rank2 = html.split("class='distnb-where-rank'")[1:]
    assert "in a collective for 4 s" in rank0 and "all_reduce of shape (4, 2)" in rank0
    assert "cell line 2: <code>dist.all_reduce(t)</code>" in rank0
    frames = re.findall(r"<li class='distnb-where-frame[^']*'", rank0)
    assert len(frames) == 6 == 1 + len([f for f in frames if "user" not in f])  # the innermost 6, one the cell's
    assert "torch/f8.py:8 in f8" in rank0 and "f3.py" not in rank0  # the outer frames are left out
    assert "stalled for 3 s" in rank1 and "time.sleep(7)  # &lt;b&gt;&amp;" in rank1 and "<b>&" not in rank1
    user = re.search(r"<li class='distnb-where-frame distnb-where-user'[^>]*>(.*?)</li>", rank1).group(1)
    assert "your cell, line 3 in &lt;module&gt;" in user and "time.sleep(7)" in user
    assert "distnb/engine/train/loop.py:40 in step" in rank1  # installed code: from the package on
    assert "/venv" not in html  # no local folder (a stored notebook would keep it)
    assert stacks.short_path("/home/me/src/distnb/distnb/engine/process/where.py") == "distnb/engine/process/where.py"
    assert stacks.short_path("/home/me/train/helpers.py") == "train/helpers.py"
    assert ">running<" in rank2 and "stalled" not in rank2  # half a second at one spot: just running


def test_where_panel_says_which_ranks_ended_or_have_not_reported():
    from distnb.display import stacks

    st = ProgressState(3, total_steps=4)
    running(st, 0, 4, 0.5)
    st.set_where(0, where_report(sent=30.0))
    st.update(0, dict(status="done"))
    running(st, 1, 2, 0.5)
    html = stacks.where_html(st)
    assert re.findall(r"data-state='(\w+)'", html) == ["done", "unknown", "waiting"]
    assert "done: its cell ended" in html and "loop.py" not in html  # a finished rank's old stack is not shown
    assert html.count("no report yet") == 2
    st.set_where(2, where_report("idle", stack=[]))
    assert "data-state='idle'" in stacks.where_html(st)


def test_where_panel_above_16_ranks_shows_one_block_per_spot_naming_its_ranks():
    from distnb.display import stacks

    st = ProgressState(40, total_steps=10)
    cell = [("<distrain-cell-3>", 2, "<module>", "loss = model(x).sum()")]
    for r in range(40):
        running(st, r, 2, 1.0)
        if r == 17:  # the odd one out: stuck in its cell's line 5
            st.set_where(r, where_report("running", sent=19.0, cell_line=5, cell_code="time.sleep(60)",
                                         stack=[("<distrain-cell-3>", 5, "<module>", "time.sleep(60)")]))
        elif r < 38:  # everyone else waits in the same all-reduce, a few seconds each
            st.set_where(r, where_report("collective", sent=13.0 + r % 3, op="all_reduce", shape=[10],
                                         cell_line=2, cell_code="loss = model(x).sum()", stack=cell))
    st.update(39, dict(status="done"))
    html = stacks.where_html(st)
    blocks = re.findall(r"<div class='distnb-where-rank' data-rank='(\d+)'(?: data-ranks='([^']*)')? "
                        r"data-state='(\w+)'", html)
    assert blocks == [("0", "0-16,18-37", "collective"), ("17", "", "stalled"), ("38", "", "unknown"),
                      ("39", "", "done")]
    big = html.split("class='distnb-where-rank'")[1]
    assert "<b>ranks 0-16,18-37</b>" in big and "in a collective for 3-5 s" in big and "all_reduce of shape (10,)" in big
    assert "stalled for 9 s" in html and "<b>rank 17</b>" in html
    small = ProgressState(3, total_steps=10)  # up to 16 ranks: one block per rank, as before
    for r in range(3):
        running(small, r, 2, 1.0)
        small.set_where(r, where_report("collective", op="all_reduce", shape=[10]))
    assert len(re.findall("class='distnb-where-rank'", stacks.where_html(small))) == 3


def test_where_table_above_16_ranks_folds_the_ranks_at_one_spot():
    from distnb.train.results import where_table

    wheres = {r: where_report("collective", sent=12.0 + r % 2, op="all_reduce", shape=[10], cell_line=2,
                              cell_code="loss = f(x)") for r in range(20) if r != 7}
    wheres[7] = where_report("running", sent=30.0, cell_line=4, cell_code="time.sleep(60)")
    table = where_table(wheres, 21, "where")
    assert [(r["rank"], r["state"], r.get("seconds")) for r in table.rows] == [
        ("0-6,8-19", "collective", "2.0-3.0"), (7, "running", 20.0), (20, "unknown", None)]
    assert sorted(table.stacks) == list(range(20))  # every rank's frames are still there
    assert [r["rank"] for r in where_table(wheres, 16, "where").rows] == list(range(16))
    assert table.rows[-1].get("code") == "no report yet"  # a background run's rank before it reported: said


def test_where_table_says_a_rank_has_not_reported_yet():
    from distnb.train.results import where_table

    table = where_table({0: where_report("running", sent=3.0, cell_line=1, cell_code="x = 1")}, 2, "where")
    assert [(r["rank"], r["state"], r.get("code")) for r in table.rows] == [(0, "running", "x = 1"),
                                                                           (1, "unknown", "no report yet")]


def test_where_version_changes_only_when_the_panel_would_draw_differently():
    st = ProgressState(1)
    st.set_where(0, where_report(sent=10.2))
    v = st.where_version
    st.set_where(0, where_report(sent=10.2))  # the kernel polls the same report again
    st.set_where(0, where_report(sent=10.9))  # the same spot, the same whole second
    assert st.where_version == v
    st.set_where(0, where_report(sent=11.0))  # a new second at that spot
    assert st.where_version == v + 1
    st.set_where(0, where_report(sent=11.1, stack=[("<dist-cell-1>", 1, "<module>", "x = 1")]))  # another spot
    assert st.where_version == v + 2


def test_dashboard_where_panel_is_an_accordion_redrawn_at_most_where_fps():
    from distnb.display.widgets import WHERE_TITLE, Dashboard

    st = ProgressState(2, total_steps=10)
    dash = Dashboard(st, where_fps=10)
    assert dash.where_box.selected_index is None and dash.where_box.titles == (WHERE_TITLE,)  # closed
    assert dash.where_box in dash.widget.children and dash.where_box.children == (dash.where_panel,)
    dash.refresh()
    assert dash.where_redraws == 1 and "no report yet" in dash.where_panel.value
    st.set_where(1, where_report(sent=10.1, cell_line=3, cell_code="time.sleep(7)"))
    dash.refresh()  # within 0.1 s of the last where redraw: waits
    assert dash.where_redraws == 1 and "time.sleep" not in dash.where_panel.value
    time.sleep(0.11)
    table_redraws = dash.redraws
    dash.refresh()
    assert dash.where_redraws == 2 and "time.sleep(7)" in dash.where_panel.value
    assert dash.redraws == table_redraws  # nothing the table shows changed: only the where panel is redrawn
    time.sleep(0.11)
    dash.refresh()  # nothing new: no redraw
    assert dash.where_redraws == 2
    dash.close()
    assert dash.where_box.comm is None and dash.where_panel.comm is None


def test_snapshot_keeps_where_the_ranks_were_only_when_not_every_rank_finished():
    from distnb.display import stacks

    st = ProgressState(2, total_steps=4)
    for r in range(2):
        running(st, r, 4, 0.5)
        st.set_where(r, where_report(sent=10.1))
        st.update(r, dict(status="done"))
    assert stacks.snapshot_html(st) == ""  # every rank done: their stacks only show code they left
    st.set_where(1, where_report("collective", op="all_reduce", sent=14.0))
    st.set_status("interrupted", ranks=[1], error="KeyboardInterrupt")
    html = render.Snapshot(st, extra=stacks.snapshot_html(st)).html
    assert "<details class='distnb-where-snapshot'" in html and "<summary>where the ranks were last seen" in html
    assert "interrupted; last seen in a collective for 4 s" in html and "all_reduce" in html


def test_where_panel_from_a_real_watchdog_on_a_thread_in_a_cell():
    """engine/where.py's Watchdog reads a real thread sleeping in cell code; the panel names the line."""
    from distnb.display import stacks
    from distnb.engine.process import runtime, where

    reports = []
    code = runtime.compile_cell("import time\ntime.sleep(0.8)\n", "distrain")

    def cell():
        dog = where.Watchdog(lambda data: reports.append(data["distnb_where"]))
        dog.start()
        try:
            exec(code, {})
        finally:
            dog.stop()
            dog.join(2)

    thread = threading.Thread(target=cell)
    thread.start()
    thread.join(5)
    assert reports, "the watchdog sent nothing"
    st = ProgressState(1, total_steps=1)
    running(st, 0, 0, 1.0)
    st.set_where(0, reports[-1])
    html = stacks.where_html(st)
    assert "cell line 2: <code>time.sleep(0.8)</code>" in html and "distnb-where-user" in html
    assert "data-state='running'" in html or "data-state='stalled'" in html


def test_a_rank_that_passes_the_same_line_step_after_step_is_not_at_one_spot():
    import threading
    import time

    from distnb.engine.process import collectives, where

    def watch(moving: bool) -> list:
        seen = []

        def body():
            dog = where.Watchdog(seen.append)
            dog.start()
            t0 = time.time()
            while time.time() - t0 < 1.3:
                if moving:
                    collectives.PROGRESS[0] += 1  # what each training micro-step and checked collective does
                time.sleep(0.002)
            dog.stop()

        thread = threading.Thread(target=body)
        thread.start()
        thread.join()
        return [w["distnb_where"]["sent"] - w["distnb_where"]["since"] for w in seen]

    assert max(watch(moving=False)) > 0.6  # the same line and no progress: the time there adds up
    waited = watch(moving=True)
    assert len(waited) >= 3 and max(waited) < 0.2  # a new visit at every look


def test_reporter_sends_the_epoch_mean_its_training_context_keeps():
    sent = []
    rep = Reporter(0, 4, 1, interval=0.0, publish=sent.append, device="cpu")
    losses = []
    rep.running_loss = lambda: (sum(losses) / max(1, len(losses)), len(losses))
    for value in (3.0, 1.0, 2.0):
        losses.append(value)
        rep.record(value, 8)
    assert sent[-1]["epoch_loss"] == pytest.approx(2.0)
    losses.clear()  # a new epoch: no step yet, no figure (the row keeps showing the newest loss)
    rep.set_status("running")
    assert sent[-1]["epoch_loss"] is None


def test_epoch_column_after_a_stop_at_an_epoch_end_names_that_epoch():
    st = ProgressState(1, total_steps=30, epochs=3)  # 10 steps an epoch; epochs 4-6 (continued from an earlier cell)
    running(st, 0, 1, 1.0, epoch=4)
    assert st.cell_epoch(0) == 1
    running(st, 0, 10, 0.5, epoch=4)
    st.update(0, dict(status="done", epoch=4, step=10))  # stopped early (--target-loss) at the end of epoch 4
    assert st.cell_epoch(0) == 1  # it was 2 (the step count's next epoch) though no step of epoch 5 ran
    assert "4 (1/3)" in render.table_html(st)
    running(st, 0, 25, 0.5, epoch=6)
    assert st.cell_epoch(0) == 3


def test_ended_ranks_show_the_cells_samples_per_second_counting_each_batch_once():
    clock = Clock()
    st = ProgressState(2, total_steps=10, epochs=1, ranks_per_shard=2, clock=clock)  # a tensor-parallel pair
    for rank in (0, 1):
        running(st, rank, 5, 1.0, samples=500, samples_per_s=900.0, time=1.0)
    assert st.total_rate() == pytest.approx(900.0)  # both ranks train the same batches: counted once
    for rank in (0, 1):  # the final message: the rank's training time over the cell (the TrainResult's figure)
        st.update(rank, dict(status="done", step=10, samples=1000, train_seconds=2.0, samples_per_s=1200.0, time=2.0))
    assert [render.rank_rate(r) for r in st.rows] == [pytest.approx(500.0)] * 2
    assert st.total_rate() == pytest.approx(500.0)
    assert "500 samples/s" in render.header_html(st)


def test_the_header_names_the_options_a_cell_carried():
    st = ProgressState(2, total_steps=10, settings="carried from net's last cell: --optimizer adam, --precision bf16")
    assert "carried from net&#x27;s last cell: --optimizer adam, --precision bf16" in render.header_html(st)
    assert "distnb-settings" not in render.header_html(ProgressState(2, total_steps=10))
