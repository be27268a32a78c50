"""The dashboard at 256 ranks in a real JupyterLab (issue 20), in Debian's headless Chromium.

The ranks are simulated (:mod:`distnb.tools.simulate`): two real engines of a real ``%dist start -n 2``
cluster play 256 ranks of 32 hosts, each with the training rank's own ``Reporter`` publishing
through ipyparallel as a real rank does, with the kernel's intake, progress state and dashboard
as in a training cell; the host relay coalesces each host's messages. Rank 17 is a straggler,
rank 200 fails and ranks 201 and 202 are stopped. Asserted from the page, as a person sees it:

- while the cell runs (the kernel busy in it): the aggregate, not 256 rows; the distribution of
  step time, busy time, samples/s and memory (min, median, p90, max) filled in; rank 17 first
  among the slowest ranks; the loss as a mean line inside a band;
- the per-rank table on demand: a click opens it on its first page (ranks 0-31, hosts
  sim-node000-003, 32 rows), a click on the second tab shows ranks 32-63, both while the cell runs;
- when the cell ends: the static snapshot shows the failed rank first, then the stopped ones,
  the counts (253 done, 1 failed, 2 interrupted), and the whole table folded in a ``<details>``.

Screenshots: the live dashboard with the table open, and the final snapshot (paths at the end of
the test output). Fixtures and page helpers are test_dashboard_lab.py's.
"""

from __future__ import annotations

import os
import time

import pytest
from test_dashboard_lab import (CHROMIUM, KERNEL_IDLE, _run, _start, lab_page, serve_notebook,
                                _wait_done)

pytestmark = [
    pytest.mark.skipif(not os.path.exists(CHROMIUM), reason=f"Chromium is not installed at {CHROMIUM} "
                       "(Debian: apt-get install -y chromium; `make test` installs it)"),
    pytest.mark.timeout(180),
]

SETUP = "%load_ext distnb\n%dist start -n 2 --timeout 30"
SIMULATE = ("import distnb.tools.simulate\n"
            "result = distnb.tools.simulate.run(256, seconds=10, group=8, slow={17: 1.6}, fail={200: 120},\n"
            "                             stop={201: 120, 202: 120})")
FIGURES = ("print(f'kernel CPU {100 * result.kernel_cpu_fraction:.1f} % of a core, '\n"
           "      f'{result.rank_messages} rank messages, {result.redraws_per_s:.1f} redraws/s, '\n"
           "      f'lag growth {result.lag_growth:.3f} s; engines: {result.engine}')")
STOP = "%dist stop"
CELLS = [SETUP, SIMULATE, FIGURES, STOP]
I_SETUP, I_SIM, I_FIGURES, I_STOP = range(len(CELLS))

# what the aggregate says, as shown
AGGREGATE = """(i) => {
  const cell = window.jupyterapp.shell.currentWidget.content.widgets[i].node;
  const agg = cell.querySelector('.distnb-aggregate');
  if (!agg) return null;
  const q = (m, k) => (agg.querySelector(`tr[data-metric=${m}] td[data-q=${k}]`) || {}).textContent;
  const metrics = {};
  for (const m of ['step_time', 'busy_time', 'rate', 'peak_memory'])
    metrics[m] = {min: q(m, 'min'), median: q(m, 'median'), p90: q(m, 'p90'), max: q(m, 'max'), n: q(m, 'n')};
  const visible = el => el.checkVisibility() && el.getBoundingClientRect().height > 0;
  return {
    metrics,
    slowest: Array.from(agg.querySelectorAll('ol.distnb-slowest li')).map(li => +li.dataset.rank),
    attention: Array.from(agg.querySelectorAll('ul.distnb-attention li[data-rank]')).map(
        li => [+li.dataset.rank, li.dataset.status]),
    counts: Object.fromEntries(Array.from(agg.querySelectorAll('.distnb-counts span[data-status]')).map(
        s => [s.dataset.status, +s.querySelector('b').textContent])),
    band: !!cell.querySelector('svg.distnb-loss polygon.distnb-loss-band'),
    mean: (cell.querySelector('svg.distnb-loss polyline.distnb-loss-mean') || {getAttribute: () => ''})
        .getAttribute('points').trim().split(/\\s+/).filter(Boolean).length,
    visible_rows: Array.from(cell.querySelectorAll('tr.distnb-rank')).filter(visible).map(tr => +tr.dataset.rank),
    snapshot: !!cell.querySelector('.distnb-snapshot'),
    all_rows: cell.querySelectorAll('details.distnb-all-ranks tr.distnb-rank').length,
  };
}"""


def _aggregate(page, i):
    return page.evaluate(AGGREGATE, i)


def _running(page, i):
    return page.evaluate(f"() => window.__distnbRuns[{i}]") == "running"


@pytest.fixture
def lab(tmp_path):
    yield from serve_notebook(tmp_path, "scale.ipynb", CELLS)


def _check_live(page, artifacts):
    """While the simulated run goes on: the aggregate, then the paged table opened and turned."""
    ready = f"(i) => {{ const a = ({AGGREGATE})(i); return !!a && a.metrics.step_time.median !== '-' " \
            f"&& a.slowest.length > 0 && a.mean >= 2; }}"
    page.wait_for_function(ready, arg=I_SIM, timeout=40_000)
    agg = _aggregate(page, I_SIM)
    assert _running(page, I_SIM), "the cell ended before the aggregate was seen"
    assert agg["visible_rows"] == [], agg["visible_rows"][:5]  # no row per rank until asked for
    for m in ("step_time", "busy_time", "rate", "peak_memory"):
        assert all(agg["metrics"][m][k] not in (None, "-") for k in ("min", "median", "p90", "max")), agg["metrics"]
    assert agg["metrics"]["peak_memory"]["median"].endswith("GiB"), agg["metrics"]
    assert agg["slowest"][0] == 17, agg["slowest"]  # the straggler, by name
    assert agg["band"], "the loss band is missing"

    cell = page.locator(".jp-Notebook .jp-Cell").nth(I_SIM)
    cell.locator(".distnb-table-box .jupyter-widget-Collapse-header").click()
    page.wait_for_function(f"(i) => ({AGGREGATE})(i).visible_rows.length > 0", arg=I_SIM, timeout=5_000)
    rows = _aggregate(page, I_SIM)["visible_rows"]
    assert rows == list(range(32)), rows  # page 1: hosts sim-node000-003
    tabs = cell.locator(".distnb-pages .lm-TabBar-tab")
    assert tabs.all_inner_texts() == [f"ranks {32 * i}-{32 * i + 31}" for i in range(8)], tabs.all_inner_texts()
    tabs.nth(1).click()
    page.wait_for_function(f"(i) => ({AGGREGATE})(i).visible_rows[0] === 32", arg=I_SIM, timeout=5_000)
    assert _aggregate(page, I_SIM)["visible_rows"] == list(range(32, 64))
    captions = [c.inner_text() for c in cell.locator(".distnb-page-caption").all() if c.is_visible()]
    assert captions == ["ranks 32-63 · sim-node004-sim-node007"], captions
    tabs.nth(0).click()
    cell.screenshot(path=artifacts.path("dashboard-256-ranks-live.png"))
    assert _running(page, I_SIM), "the cell ended before the table was turned"


def test_aggregated_dashboard_at_256_simulated_ranks(lab, artifacts):
    t0 = time.monotonic()
    with lab_page(lab, "scale.ipynb", height=1100) as page:
        try:
            _run(page, I_SETUP, timeout=60)
            _start(page, I_SIM)
            _check_live(page, artifacts)
            _wait_done(page, I_SIM, timeout=90)
            final = _aggregate(page, I_SIM)
            assert final["snapshot"], "no static snapshot after the run"
            assert final["attention"] == [[200, "failed"], [201, "interrupted"], [202, "interrupted"]], final
            assert final["counts"] == {"done": 253, "failed": 1, "interrupted": 2}, final["counts"]
            assert final["all_rows"] == 256 and final["visible_rows"] == [], final["all_rows"]
            assert final["slowest"][0] == 17, final["slowest"]
            page.locator(".jp-Notebook .jp-Cell").nth(I_SIM).screenshot(
                path=artifacts.path("dashboard-256-ranks-final.png"))
            _run(page, I_FIGURES)
            print(page.evaluate("(i) => window.jupyterapp.shell.currentWidget.content.widgets[i].node"
                                ".querySelector('.jp-OutputArea').innerText", I_FIGURES))
        finally:
            if page.evaluate(KERNEL_IDLE):
                _run(page, I_STOP, timeout=30)
    print(f"browser test at 256 ranks: {time.monotonic() - t0:.1f} s in the browser; screenshots in {artifacts.dir}")
