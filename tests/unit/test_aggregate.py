"""The dashboard above 16 ranks (issue 20): the aggregate state, its HTML and text, the host relay, the intake."""

import io
import os
import pickle
import statistics
import tempfile

import pytest

from distnb.display import aggregate, render, scale
from distnb.display.progress import ProgressState
from distnb.display.text import TextProgress
from distnb.engine.transport.report import HostRelay, Reporter, encode, rank_key, relay_interval
from distnb.execute.execute import intake_interval, take_progress
from distnb.tools.simulate import host_names, split

N = 64


def scaled_state(n=N, per_host=8):
    """n ranks: rank 17 busy 3x the others, memory rising with rank, rank 40 failed, rank 41 and 3 stopped."""
    st = ProgressState(n, total_steps=100, epochs=2, hosts=host_names(n, per_host))
    for r in range(n):
        st.update(r, dict(status="running", step=10, total=100, samples=320, samples_per_s=600.0 + r,
                          step_time=0.05 + 0.001 * (r % 5), busy_time=0.03 * (3 if r == 17 else 1) + 1e-5 * r,
                          peak_memory=(1 << 30) + r * (1 << 20), memory_kind="cuda", loss=2.0 + 0.01 * r,
                          points=[(9, 2.1 + 0.01 * r), (10, 2.0 + 0.01 * r)], time=100.0))
    st.set_status("failed", ranks=[40], error="RuntimeError: boom on rank 40")
    st.set_status("interrupted", ranks=[3, 41], error="stopped because rank 40 failed")
    return st


def test_quantiles_interpolate_like_numpy_linear():
    values = sorted([5.0, 1.0, 3.0, 2.0, 4.0, 10.0])
    assert aggregate.quantile(values, 0.5) == statistics.median(values)
    assert aggregate.quantile(values, 0.9) == pytest.approx(5.0 + 0.5 * (10.0 - 5.0))  # numpy: 7.5
    assert aggregate.quantile([7.0], 0.9) == 7.0
    assert aggregate.summary([None, 2.0, 1.0]) == dict(min=1.0, median=1.5, p90=pytest.approx(1.9), max=2.0, n=2)
    assert aggregate.summary([None]) is None
    with pytest.raises(ValueError):
        aggregate.quantile([], 0.5)


def test_distributions_over_ranks():
    st = scaled_state()
    d = {key: s for key, _, _, s in aggregate.distributions(st)}
    mem = sorted((1 << 30) + r * (1 << 20) for r in range(N))
    assert d["peak_memory"]["min"] == mem[0] and d["peak_memory"]["max"] == mem[-1]
    assert d["peak_memory"]["median"] == statistics.median(mem)
    assert d["rate"]["min"] == 600.0 and d["rate"]["max"] == 600.0 + N - 1 and d["rate"]["n"] == N
    assert d["busy_time"]["max"] == pytest.approx(0.09 + 17e-5)
    assert d["step_time"]["min"] == 0.05 and d["step_time"]["max"] == pytest.approx(0.054)


def test_slowest_ranks_by_name_and_failed_then_stopped_first():
    st = scaled_state()
    slow = aggregate.slowest(st, 3)
    assert [s["rank"] for s in slow] == [17, 63, 62] and slow[0]["host"] == "sim-node002"
    assert slow[0]["basis"] == "busy" and slow[0]["skew"] == pytest.approx(1.97, abs=0.01)
    assert [(r["rank"], r["status"]) for r in aggregate.attention(st)] == [(40, "failed"), (3, "interrupted"),
                                                                           (41, "interrupted")]
    assert aggregate.status_counts(st) == {"running": N - 3, "failed": 1, "interrupted": 2}


def test_loss_band_is_the_mean_and_p10_p90_of_the_newest_losses_sampled_once_per_step():
    st = ProgressState(20, total_steps=10)
    for r in range(19):
        st.update(r, dict(status="running", step=1, points=[(1, float(r))]))
    assert not aggregate.sample_band(st)  # rank 19 has not reported: no point yet
    st.update(19, dict(status="running", step=1, points=[(1, 19.0)]))
    assert aggregate.sample_band(st)
    (x, (mean, lo, hi)), = st.band.points
    losses = sorted(float(r) for r in range(20))
    assert x == 1 and mean == pytest.approx(9.5)
    assert lo == pytest.approx(aggregate.quantile(losses, 0.1)) and hi == pytest.approx(aggregate.quantile(losses, 0.9))
    assert not aggregate.sample_band(st)  # the same step again: nothing new
    for r in range(20):
        st.update(r, dict(points=[(2, 0.0)]))
    assert aggregate.sample_band(st) and st.band.points[-1] == (2, (0.0, 0.0, 0.0))


def test_pages_hold_whole_hosts_in_rank_order():
    st = ProgressState(80, hosts=host_names(80, 8))
    pages = aggregate.pages(st, rows_per_page=32)
    assert [len(ranks) for _, ranks in pages] == [32, 32, 16]
    assert pages[0] == ("ranks 0-31 · sim-node000-sim-node003", list(range(32)))
    assert [r for _, ranks in pages for r in ranks] == list(range(80))
    big = ProgressState(70, hosts=["a"] * 70)  # one host with more ranks than a page: split
    assert [(t, len(r)) for t, r in aggregate.pages(big, 32)] == [("ranks 0-31 · a", 32), ("ranks 32-63 · a", 32),
                                                                   ("ranks 64-69 · a", 6)]


def test_aggregate_html_names_what_a_person_looks_for():
    st = scaled_state()
    aggregate.sample_band(st)
    html = scale.summary_html(st)
    assert "tr class='distnb-rank'" not in html and "distnb-rank " not in html  # no row per rank
    assert "<li data-rank='40' data-status='failed'" in html
    assert html.index("data-rank='40'") < html.index("data-rank='3' data-status='interrupted'")
    assert "<tr data-metric='peak_memory'>" in html and "1.0 GiB" in html
    assert "rank 17 (sim-node002)" in html and "+197% vs median" in html
    charts = scale.charts_html(st)
    assert "polygon class='distnb-loss-band'" in charts and "polyline class='distnb-loss-mean'" in charts
    page = render.table_html(st, range(8, 16))
    assert page.count("tr class='distnb-rank") == 8 and "data-rank='8'" in page and "data-rank='16'" not in page


def test_snapshot_and_text_at_scale_are_aggregate_lines_not_one_per_rank():
    st = scaled_state()
    snap = scale.Snapshot(st)
    assert "details class='distnb-all-ranks'" in snap.html and snap.html.count("tr class='distnb-rank") == N
    assert len(snap.text.splitlines()) < 12 and "rank 40 (sim-node005) failed" in snap.text
    out = io.StringIO()
    view = TextProgress(st, stream=out)
    st.update(0, dict(epoch_losses=[(0, 1.5)]))
    view.close()
    text = out.getvalue()
    assert len(text.splitlines()) < 20, text
    assert "epoch   0  mean loss 1.5000  |  64 ranks samples/s min 600 median 632 max 663  slowest rank 17" in text
    assert "peak memory" in text and "slowest: rank 17 (sim-node002)" in text


def test_small_worlds_keep_one_row_per_rank():
    st = ProgressState(16, total_steps=10)
    pytest.importorskip("ipywidgets")
    from distnb.display.widgets import Dashboard

    dash = Dashboard(st)
    assert not dash.scaled and dash.pages_box is None and dash.table.value.count("tr class='distnb-rank") == 16
    big = Dashboard(scaled_state())
    assert big.scaled and "distnb-aggregate" in big.table.value and len(big.pages) == 2
    big.refresh(final=True)
    assert all(w.value.count("tr class='distnb-rank") == 32 for w, _, _ in big.pages)
    assert [t for _, t, _ in big.pages] == ["ranks 0-31 · sim-node000-sim-node003", "ranks 32-63 · sim-node004-sim-node007"]
    assert big.pages_box.children[0].titles == ("ranks 0-31", "ranks 32-63")


def test_take_progress_reads_own_and_relayed_keys_once():
    st = ProgressState(4, total_steps=10)
    seen = {}
    own, relayed = dict(rank=0, status="running", step=1), dict(rank=3, status="running", step=2)
    data = {"distnb": own, rank_key(3): relayed, "distnb_where": {"state": "running"}}
    assert take_progress(st, 0, data, seen) == [(0, own), (3, relayed)]
    assert st.rows[3]["step"] == 2 and st.rows[0]["step"] == 1
    assert take_progress(st, 0, data, seen) == []  # the same objects: already taken
    raw = {}
    encoded = {rank_key(2): encode(dict(rank=2, status="done", step=5))}  # as a relay publishes it
    assert take_progress(st, 0, encoded, seen, raw) == [(2, dict(rank=2, status="done", step=5))]
    assert st.rows[2]["step"] == 5 and st.rows[2]["status"] == "done"
    assert take_progress(st, 0, encoded, seen, raw) == []  # the same bytes: not decoded again
    assert intake_interval(100) == 0.1 and intake_interval(1024) == pytest.approx(1.024)
    assert relay_interval(4) == 0.1 and relay_interval(32) == 0.64 and relay_interval(128) == pytest.approx(1.28)
    assert relay_interval(1024) == pytest.approx(1.28)  # the newest 16 loss points still cover the gap


def test_host_relay_coalesces_a_hosts_messages_into_one_bundle():
    published = []
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "h0.sock")
        lead = HostRelay(path, leader=True, publish=published.append)
        member = HostRelay(path, leader=False)
        reporters = [Reporter(r, 100, 1, interval=0.0, publish=(lead.send if r == 0 else member.send)) for r in range(4)]
        for _ in range(2):
            for rep in reporters:
                rep.record(1.0, 8)
        assert published == []  # nothing goes to the kernel before the leader's tick
        lead.tick(now=1e9)
        assert len(published) == 1
        bundle = published[0]
        assert sorted(bundle) == [rank_key(r) for r in range(4)]
        assert all(isinstance(m, bytes) and pickle.loads(m)["step"] == 2 for m in bundle.values())  # report.encode
        reporters[2].set_status("done")
        lead.tick(now=1e9)  # within the interval: read into pending, not published
        assert len(published) == 1
        member.close()
        lead.close()
        assert len(published) == 2 and pickle.loads(published[1][rank_key(2)])["status"] == "done"
        assert not os.path.exists(path) and member.sent == 7 and member.dropped == 0
        assert pickle.loads(pickle.dumps(bundle)) == bundle


def test_simulated_ranks_are_split_by_whole_hosts():
    assert split(20, 8, 2) == [list(range(16)), list(range(16, 20))]
    assert [len(b) for b in split(256, 8, 2)] == [128, 128]
    assert host_names(9, 8)[7:] == ["sim-node000", "sim-node001"]
