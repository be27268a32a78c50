"""The training dashboard in a real JupyterLab, in Debian's headless Chromium (playwright).

One test, one JupyterLab server (127.0.0.1, a token, a temporary root and temporary
Jupyter/IPython dirs), one notebook whose cells load distnb, start 2 engines and train.
Asserted from the page DOM, as a user would see it:

- a ``%%distrain`` cell draws one row per rank; the progress bars advance while it runs
  (seen at least twice before the end), both reach 100%, the loss curve has points;
- a ``--background`` run leaves the kernel free (a later cell finishes while the dashboard
  still updates) and ``%dist wait`` returns its result;
- the "where" button works while a foreground cell runs (the kernel busy in it): in a run where
  rank 1 sleeps inside its step while rank 0 waits in DDP's gradient all-reduce, a click opens
  every rank's state and stack at once (rank 1 at the sleep's cell line, rank 0 in the
  collective), and the open panel keeps updating before the cell ends; the click-to-stacks time
  is printed;
- a deliberately failing rank turns its row red and shows its exception.

Screenshots of the finished dashboards are saved (paths listed at the end of the test
output). Cleanup: the notebook's ``%dist stop``, then the kernel is shut down through the
server's REST API, then the server (its whole process group); the root conftest checks that
no engine or controller is left.

Chromium comes from Debian (``apt-get install chromium``; ``make test`` installs it) and is
driven through playwright's Python package with ``executable_path``; playwright's own
browser download is never used. Without /usr/bin/chromium the test is skipped.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

CHROMIUM = os.environ.get("DISTNB_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--no-first-run", "--disable-sync"]
pytestmark = [
    pytest.mark.skipif(not os.path.exists(CHROMIUM), reason=f"Chromium is not installed at {CHROMIUM} "
                       "(Debian: apt-get install -y chromium; `make test` installs it)"),
    pytest.mark.timeout(180),
]

SETUP = "%load_ext distnb\n%dist start -n 2 --timeout 30"
DATA = """import time
import torch, torch.nn as nn, torch.nn.functional as F
torch.manual_seed(0)
X = torch.randn(1200, 16)
y = (X[:, :8].sum(1) > 0).long()
train = torch.utils.data.TensorDataset(X, y)
net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 2))"""
# a short sleep per step makes the run last ~2-3 s on any machine, so progress can be watched
BODY = "x, y = batch\ntime.sleep(0.01)\nloss = F.cross_entropy(model(x), y)"
TRAIN = f"%%distrain --model net --data train --epochs 3 --batch-size 16 -o result\n{BODY}"
BACKGROUND = f"%%distrain --model net --data train --epochs 3 --batch-size 16 --background -o bg\n{BODY}"
FREE = "print('kernel is free')"
WAIT = "waited = %dist wait\nprint('waited', waited.epochs)"
# rank 1 sleeps in step 3 (cell line 3) while rank 0 waits for it in DDP's gradient all-reduce: shorter than
# the --hang-after (10 s with --timeout 30), so the cell is still running, and then finishes, when the button is used
STUCK_SLEEP = 7
STUCK = ("%%distrain --model net --data train --epochs 1 --batch-size 16\n"
         "x, y = batch\n"
         "if ctx.rank == 1 and ctx.step == 3:\n"
         f"    time.sleep({STUCK_SLEEP})\n"
         "loss = F.cross_entropy(model(x), y)")
FAIL = ("%%distrain --model net --data train --epochs 2 --batch-size 16\n"
        "x, y = batch\n"
        "if ctx.rank == 1 and ctx.step == 5:\n"
        "    raise ValueError('deliberate failure on rank 1')\n"
        "loss = F.cross_entropy(model(x), y)")
STOP = "%dist stop"
CELLS = [SETUP, DATA, TRAIN, BACKGROUND, FREE, WAIT, STUCK, FAIL, STOP]
I_SETUP, I_DATA, I_TRAIN, I_BACKGROUND, I_FREE, I_WAIT, I_STUCK, I_FAIL, I_STOP = range(len(CELLS))


def _notebook(cells):
    return {"cells": [{"cell_type": "code", "execution_count": None, "id": f"c{i}", "metadata": {}, "outputs": [],
                       "source": src} for i, src in enumerate(cells)],
            "metadata": {"kernelspec": {"display_name": "Python 3 (ipykernel)", "language": "python",
                                        "name": "python3"},
                         "language_info": {"name": "python"}},
            "nbformat": 4, "nbformat_minor": 5}


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Lab:
    """A JupyterLab server in its own process group, with a temporary root and settings."""

    def __init__(self, root, token, port):
        self.root, self.token, self.port = root, token, port
        self.url = f"http://127.0.0.1:{port}"
        self.proc = None
        self.log_path = os.path.join(root, "..", "jupyterlab.log")

    def start(self, timeout=40):
        settings = os.path.join(self.root, "..", "lab-settings")
        for ext, name, value in (("@jupyterlab/notebook-extension", "tracker", {"windowingMode": "none"}),
                                 ("@jupyterlab/apputils-extension", "notification",
                                  {"fetchNews": "false", "checkForUpdates": False})):
            os.makedirs(os.path.join(settings, ext), exist_ok=True)
            with open(os.path.join(settings, ext, f"{name}.jupyterlab-settings"), "w") as f:
                json.dump(value, f)
        env = dict(os.environ, DISTNB_PROGRESS="auto", JUPYTERLAB_SETTINGS_DIR=settings,
                   JUPYTERLAB_WORKSPACES_DIR=os.path.join(self.root, "..", "lab-workspaces"))
        cmd = [sys.executable, "-m", "jupyterlab", "--no-browser", "--allow-root", "--ServerApp.ip=127.0.0.1",
               f"--ServerApp.port={self.port}", "--ServerApp.port_retries=0",
               f"--IdentityProvider.token={self.token}", f"--ServerApp.root_dir={self.root}",
               "--LabApp.expose_app_in_browser=True", "--LabApp.extension_manager=readonly",
               "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate", "--LabApp.news_url=",
               "--ServerApp.terminals_enabled=False"]
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"jupyter lab exited ({self.proc.returncode}):\n{self.log()}")
            try:
                self.api("GET", "/api/status")
                return self
            except OSError:
                time.sleep(0.2)
        raise RuntimeError(f"jupyter lab did not answer within {timeout} s:\n{self.log()}")

    def api(self, method, path, timeout=5):
        req = urllib.request.Request(f"{self.url}{path}", method=method,
                                     headers={"Authorization": f"token {self.token}"})
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            body = resp.read()
        return json.loads(body) if body else None

    def log(self):
        try:
            with open(self.log_path) as f:
                return f.read()[-4000:]
        except OSError:
            return ""

    def stop(self):
        """Shut kernels down through the API (distnb stops its cluster at kernel exit), then the server."""
        if self.proc is None:
            return
        try:
            for kernel in self.api("GET", "/api/kernels"):
                self.api("DELETE", f"/api/kernels/{kernel['id']}", timeout=20)
        except Exception as exc:  # noqa: BLE001 - the server is stopped below either way
            print(f"could not shut the kernels down through the API: {exc}")
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)
        self._log.close()


def serve_notebook(tmp_path, name, cells):
    """A JupyterLab server on a folder holding one notebook ``name`` of ``cells``: yields it, then stops it."""
    root = tmp_path / "root"
    root.mkdir()
    with open(root / name, "w") as f:
        json.dump(_notebook(cells), f)
    server = Lab(str(root), secrets.token_hex(16), _free_port())
    try:
        yield server.start()
    finally:
        server.stop()


@contextlib.contextmanager
def lab_page(lab, name, height=1000):
    """Headless Chromium on notebook ``name`` of ``lab``, its kernel started and idle: the page."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": height})
            page.goto(f"{lab.url}/lab/tree/{name}?reset&token={lab.token}")
            page.wait_for_function(KERNEL_IDLE, timeout=60_000)
            yield page
        finally:
            browser.close()


@pytest.fixture
def lab(tmp_path):
    yield from serve_notebook(tmp_path, "dashboard.ipynb", CELLS)


RUN_CELL = """(i) => {
  const nb = window.jupyterapp.shell.currentWidget.content;
  nb.activeCellIndex = i;
  nb.deselectAll();
  window.__distnbRuns = window.__distnbRuns || {};
  window.__distnbRuns[i] = 'running';
  window.jupyterapp.commands.execute('notebook:run-cell').then(
      () => { window.__distnbRuns[i] = 'done'; }, (e) => { window.__distnbRuns[i] = 'error: ' + e; });
}"""
KERNEL_IDLE = """() => {
  const w = window.jupyterapp && window.jupyterapp.shell.currentWidget;
  const k = w && w.sessionContext && w.sessionContext.session && w.sessionContext.session.kernel;
  return !!(k && k.status === 'idle' && w.content && w.content.widgets.length > 0);
}"""
ROWS = """(i) => {
  const cell = window.jupyterapp.shell.currentWidget.content.widgets[i].node;
  return Array.from(cell.querySelectorAll('tr.distnb-rank')).map(tr => {
    const bar = tr.querySelector('[role=progressbar]');
    const fill = tr.querySelector('.distnb-bar-fill');
    const next = tr.nextElementSibling;
    const err = next && next.classList.contains('distnb-error-row') ? next.querySelector('.distnb-error') : null;
    return {rank: +tr.dataset.rank, status: tr.dataset.status, now: +bar.getAttribute('aria-valuenow'),
            max: +bar.getAttribute('aria-valuemax'), fill: fill.style.width,
            background: getComputedStyle(tr).backgroundColor, error: err ? err.textContent : null};
  });
}"""
CELL_TEXT = "(i) => window.jupyterapp.shell.currentWidget.content.widgets[i].node.querySelector('.jp-OutputArea')" \
            "?.innerText || ''"
LOSS_POINTS = """(i) => {
  const cell = window.jupyterapp.shell.currentWidget.content.widgets[i].node;
  const out = {};
  cell.querySelectorAll('svg.distnb-loss polyline').forEach(p => {
    out[p.getAttribute('class')] = p.getAttribute('points').trim().split(/\\s+/).length; });
  return out;
}"""

# the table's status cell says where a rank is once it stays at one spot for 2 s
STALLED = """(i) => {
  const cell = window.jupyterapp.shell.currentWidget.content.widgets[i].node;
  const w = cell.querySelector('tr.distnb-rank[data-rank="1"] .distnb-where');
  return w ? w.textContent : null;
}"""
# the where panel as shown: null while it is not visible, else per rank what it says
WHERE_PANEL = """(i) => {
  const cell = window.jupyterapp.shell.currentWidget.content.widgets[i].node;
  const panel = cell.querySelector('.distnb-where .distnb-where-panel');
  if (!panel || !panel.checkVisibility() || panel.getBoundingClientRect().height === 0) return null;
  const text = (el, sel) => (el.querySelector(sel) || {}).textContent || '';
  return Array.from(panel.querySelectorAll('.distnb-where-rank')).map(d => ({
    rank: +d.dataset.rank, state: d.dataset.state, words: text(d, '.distnb-where-state'),
    op: text(d, '.distnb-where-op'), cell: text(d, '.distnb-where-cell'),
    user: Array.from(d.querySelectorAll('.distnb-where-user')).map(li => li.textContent)}));
}"""
WHERE_SEEN = """(i) => {
  const ranks = (%s)(i);
  return !!ranks && ranks.length === 2 && ranks[0].state === 'collective'
      && ranks[1].cell.includes('time.sleep(%d)');
}""" % (WHERE_PANEL, STUCK_SLEEP)


def _run(page, i, timeout=60):
    """Run cell ``i`` and wait (bounded) until JupyterLab says it finished."""
    _start(page, i)
    _wait_done(page, i, timeout)


def _start(page, i):
    page.evaluate(RUN_CELL, i)


def _wait_done(page, i, timeout=60):
    page.wait_for_function(f"() => window.__distnbRuns && window.__distnbRuns[{i}] !== 'running'",
                           timeout=timeout * 1000)
    assert page.evaluate(f"() => window.__distnbRuns[{i}]") == "done"


def _watch_progress(page, i, finished, timeout=60):
    """Sample cell ``i``'s progress bars every 50 ms until ``finished()``; the distinct samples taken
    mid-run (every bar between 0 and 100%), each with whether the kernel was idle then."""
    seen = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        rows = page.evaluate(ROWS, i)
        if len(rows) == 2 and all(0 < r["now"] < r["max"] for r in rows):
            sample = tuple(r["now"] for r in rows)
            if not seen or sample != seen[-1][0]:
                seen.append((sample, page.evaluate(KERNEL_IDLE)))
        if finished():
            return seen
        page.wait_for_timeout(50)
    raise AssertionError(f"cell {i} did not finish within {timeout} s")


def _advancing(seen):
    samples = [s for s, _ in seen]
    return len(samples) >= 2 and all(a <= b for x, y in zip(samples, samples[1:]) for a, b in zip(x, y))


def _assert_finished(page, i):
    rows = page.evaluate(ROWS, i)
    assert [r["rank"] for r in rows] == [0, 1], rows  # one row per rank
    for r in rows:
        assert r["status"] == "done" and r["now"] == r["max"] > 0 and float(r["fill"].rstrip("%")) == 100, r
        assert r["background"] == "rgb(227, 244, 228)", r  # green
    points = page.evaluate(LOSS_POINTS, i)
    assert points.get("distnb-loss-rank0", 0) >= 2 and points.get("distnb-loss-rank1", 0) >= 2, points
    assert points.get("distnb-loss-mean", 0) >= 2, points


def _running(page, i):
    return page.evaluate(f"() => window.__distnbRuns[{i}]") == "running"


def _check_where_button(page, artifacts):
    """While the STUCK cell runs (the kernel busy in it), the where button shows every rank's stack."""
    _start(page, I_STUCK)
    page.wait_for_function(f"(i) => ({STALLED})(i) && ({STALLED})(i).includes('time.sleep')", arg=I_STUCK,
                           timeout=30_000)
    assert _running(page, I_STUCK) and not page.evaluate(KERNEL_IDLE)  # the cell runs: the kernel is busy
    cell = page.locator(".jp-Notebook .jp-Cell").nth(I_STUCK)
    button = cell.locator(".distnb-where .jupyter-widget-Collapse-header")  # the Accordion's title bar
    assert page.evaluate(WHERE_PANEL, I_STUCK) is None  # closed until clicked
    t_click = time.monotonic()
    button.click()
    page.wait_for_function(WHERE_SEEN, arg=I_STUCK, timeout=5_000)
    latency = time.monotonic() - t_click
    # the first stacks may come from a look taken just before rank 1 had been in time.sleep long enough
    # to count as stalled (seen once, in a fresh clone's first test): the panel's next look says so
    stalled = f"(i) => {{ const r = ({WHERE_PANEL})(i); return r && r[1].state === 'stalled'; }}"
    page.wait_for_function(stalled, arg=I_STUCK, timeout=5_000)
    ranks = page.evaluate(WHERE_PANEL, I_STUCK)
    assert _running(page, I_STUCK), "the cell ended before the stacks were seen"
    assert "in a collective for" in ranks[0]["words"] and "all-reduce" in ranks[0]["op"], ranks
    assert ranks[1]["state"] == "stalled" and ranks[1]["cell"] == f"cell line 3: time.sleep({STUCK_SLEEP})", ranks
    assert any(f"time.sleep({STUCK_SLEEP})" in u and "your cell, line 3" in u for u in ranks[1]["user"]), ranks
    # the open panel goes on updating from the kernel while the cell runs (iopub arrives during a busy cell)
    before = ranks[1]["words"]
    changed = f"(i) => {{ const r = ({WHERE_PANEL})(i); return r && r[1].words !== {json.dumps(before)}; }}"
    page.wait_for_function(changed, arg=I_STUCK, timeout=3_000)
    cell.screenshot(path=artifacts.path("dashboard-where.png"))
    assert _running(page, I_STUCK), "the cell ended before the panel updated"
    _wait_done(page, I_STUCK)
    # every rank finished: the static snapshot leaves the where panel out
    assert page.evaluate("(i) => !!window.jupyterapp.shell.currentWidget.content.widgets[i].node"
                         ".querySelector('.distnb-snapshot')", I_STUCK)
    assert not page.evaluate("(i) => !!window.jupyterapp.shell.currentWidget.content.widgets[i].node"
                             ".querySelector('.distnb-where-snapshot')", I_STUCK)
    print(f"where button: click to both ranks' stacks visible in {latency * 1000:.0f} ms "
          f"(the kernel busy in the cell; rank 1 then said {before!r})")
    return latency


def test_dashboard_in_jupyterlab(lab, artifacts):
    t0 = time.monotonic()
    with lab_page(lab, "dashboard.ipynb", height=1000) as page:
        try:
            _run(page, I_SETUP, timeout=60)
            assert "2 ranks ready" in page.evaluate(CELL_TEXT, I_SETUP)
            _run(page, I_DATA)

            # a foreground run: rows, live progress, 100%, loss curve
            _start(page, I_TRAIN)
            seen = _watch_progress(page, I_TRAIN, lambda: page.evaluate(f"() => window.__distnbRuns[{I_TRAIN}]")
                                   != "running")
            _wait_done(page, I_TRAIN)
            assert _advancing(seen), seen
            _assert_finished(page, I_TRAIN)
            page.locator(".jp-Notebook .jp-Cell").nth(I_TRAIN).screenshot(
                path=artifacts.path("dashboard-finished.png"))

            # a background run: the kernel is free (the next cell finishes) while the dashboard moves on
            _run(page, I_BACKGROUND)
            _run(page, I_FREE)
            assert "kernel is free" in page.evaluate(CELL_TEXT, I_FREE)
            seen = _watch_progress(page, I_BACKGROUND, lambda: all(
                r["status"] == "done" for r in page.evaluate(ROWS, I_BACKGROUND) or [{"status": ""}]))
            # updates from the watcher thread while the kernel is idle (a front-end request may make it
            # busy for a moment, so not every sample needs to be idle)
            assert _advancing(seen) and sum(idle for _, idle in seen) >= 2, seen
            _run(page, I_WAIT)
            assert "waited [" in page.evaluate(CELL_TEXT, I_WAIT)
            _assert_finished(page, I_BACKGROUND)

            # the where button during a foreground cell (the kernel is busy in it)
            t_where = time.monotonic()
            _check_where_button(page, artifacts)
            print(f"where part of the test: {time.monotonic() - t_where:.1f} s")

            # a failing rank: its row turns red and shows the exception
            _run(page, I_FAIL)
            rows = {r["rank"]: r for r in page.evaluate(ROWS, I_FAIL)}
            assert rows[1]["status"] == "failed", rows
            assert rows[1]["background"] == "rgb(253, 224, 220)", rows  # red
            assert "ValueError: deliberate failure on rank 1" in rows[1]["error"], rows
            assert rows[0]["status"] in ("interrupted", "failed"), rows
            assert "RankError" in page.evaluate(CELL_TEXT, I_FAIL)
            page.locator(".jp-Notebook .jp-Cell").nth(I_FAIL).screenshot(
                path=artifacts.path("dashboard-failed-rank.png"))
        finally:
            if page.evaluate(KERNEL_IDLE):
                _run(page, I_STOP, timeout=30)
    print(f"browser test: {time.monotonic() - t0:.1f} s in the browser; screenshots in {artifacts.dir}")
