"""The live training dashboard (ipywidgets).

Three HTML widgets (header, the per-rank table, the charts: loss, throughput, stragglers)
drawn by :mod:`distnb.display.render` from the :class:`~distnb.display.progress.ProgressState`
that the kernel fills from the ranks' progress messages. Redraws are throttled and coalesced:
the table at most ``max_fps`` (10) a second and the charts ``chart_fps`` (3), only when a rank
message changed the state, and only widgets whose HTML changed are sent to the front end.
Histories are kept short by :class:`~distnb.display.progress.Series`, so a redraw costs the
same (about 1 ms) at the start of a run and after hours. For a background run a "Stop training" button
is added (it works because the kernel is idle while the run goes on).

The "where" button is the header of an Accordion holding every rank's state and innermost stack
frames (:mod:`distnb.display.stacks`). Opening it is the front end's own state, so it opens at once
even while the kernel is busy in a foreground training cell (a click on a button that needs the
kernel would wait for the cell to end); the kernel keeps its HTML up to date from the ranks' where
reports, at most ``where_fps`` (2) times a second and only when it would draw differently (another
spot, another whole second there). It is updated while closed too: the kernel cannot know it was
opened before the cell ends.

Above :data:`~distnb.display.aggregate.SCALE_THRESHOLD` (16) ranks the table gives way to the
aggregate of :mod:`distnb.display.scale` (counts, failed and stopped ranks first, min / median /
p90 / max of step time, busy time, samples/s and memory, the slowest ranks by name) and the loss
chart to the mean over ranks with a p10-p90 band. The per-rank table is still there on demand: an
Accordion ("per-rank table") holding a Tab with one page of whole hosts (at most 32 rows) each.
Opening it and turning pages is the front end's own state, so both work while a foreground cell
keeps the kernel busy; the kernel redraws the selected page (as far as it knows) ``page_fps`` (2)
times a second and the others in turn, one per tick, so the cost does not grow with the pages.

When the run ends the widget's output is replaced by a static snapshot of the final state
(:class:`~distnb.display.render.Snapshot`: HTML, with a text fallback), so a saved notebook
shows what happened without a kernel or widget state, and the widget models are closed. The
snapshot keeps where the ranks were last seen (a closed ``<details>``) when the run did not end
with every rank done; after a clean run the stacks would only show code the ranks have left.
"""

from __future__ import annotations

import time

import ipywidgets as W

from distnb.display import aggregate, render, scale, stacks

#: The where button's text (the Accordion's title).
WHERE_TITLE = "where: every rank's state and stack"


def _page_html(state, title, ranks) -> str:
    """One page of the per-rank table at scale: its ranks and hosts in a line, then their rows."""
    return (f"<div class='distnb-page-caption' style='font-size:12px;color:#555;margin:2px 0'>"
            f"{render.esc(title)}</div>{render.table_html(state, ranks)}")


class Dashboard:
    """ipywidgets view of a :class:`~distnb.display.progress.ProgressState`.

    Parameters
    ----------
    state : ProgressState
    max_fps : float
        Redraws of the header and the table per second at most (rank messages arrive at most
        10 a second per rank).
    chart_fps : float
        Redraws of the charts per second at most.
    where_fps : float
        Redraws of the where panel per second at most.
    page_fps : float
        Redraws of the per-rank table's pages per second at most (above the threshold): the
        selected page, and one other in turn.
    """

    def __init__(self, state, max_fps: float = 10.0, chart_fps: float = 3.0, where_fps: float = 2.0,
                 page_fps: float = 2.0):
        self.state = state
        self.scaled = state.world_size > aggregate.SCALE_THRESHOLD
        self.min_interval = 1.0 / max_fps
        self.chart_interval = 1.0 / chart_fps
        self.where_interval = 1.0 / where_fps
        self.page_interval = 1.0 / page_fps
        self._last = self._last_charts = self._last_where = self._last_pages = 0.0
        self._version = -1
        self._where_key = None
        self._handle = None
        self.redraws = self.where_redraws = self.chart_redraws = self.page_redraws = 0
        self._table_draw = scale.summary_html if self.scaled else render.table_html
        self._charts_draw = scale.charts_html if self.scaled else render.charts_html
        self.header = W.HTML(render.header_html(state))
        self.table = W.HTML(self._table_draw(state))
        self.charts = W.HTML(self._charts_draw(state))
        self.where_panel = W.HTML(stacks.where_html(state))
        self.where_box = W.Accordion(children=[self.where_panel], titles=(WHERE_TITLE,), selected_index=None)
        self.where_box.add_class("distnb-where")
        self.stop_button = None
        self.pages, self.pages_box = [], None
        parts = [self.header, self.table, self.where_box, self.charts]
        if self.scaled:
            self._make_pages()
            parts.insert(2, self.pages_box)
        self.widget = W.VBox(parts)
        self.widget.add_class("distnb-dashboard")

    def _make_pages(self):
        """The per-rank table on demand: an Accordion holding a Tab of pages of whole hosts."""
        pages = aggregate.pages(self.state)
        self.pages = [(W.HTML(_page_html(self.state, title, ranks)), title, ranks) for title, ranks in pages]
        self._page_versions, self._next_page = [-1] * len(pages), 0
        # a tab's title is its ranks (a tab is about 20 characters wide); the page says its hosts
        tab = W.Tab(children=[w for w, _, _ in self.pages], titles=tuple(t.split(" · ")[0] for t, _ in pages))
        tab.add_class("distnb-pages")
        title = f"per-rank table: {self.state.world_size} ranks in {len(pages)} pages by host"
        self.pages_box = W.Accordion(children=[tab], titles=(title,), selected_index=None)
        self.pages_box.add_class("distnb-table-box")

    def show(self):
        """Display the dashboard in the current output (with a display id, for the final snapshot)."""
        from IPython.display import display

        self._handle = display(self.widget, display_id=True)

    def attach_stop(self, callback):
        """Add a "Stop training" button calling ``callback()`` (for background runs)."""
        if self.stop_button is not None:
            return
        button = W.Button(description="Stop training", icon="stop", button_style="warning",
                          tooltip="stop every rank after the same step (like %dist stop-training)")
        button.add_class("distnb-stop")

        def clicked(_):
            button.disabled = True
            button.description = "stopping..."
            callback()

        button.on_click(clicked)
        self.stop_button = button
        self.widget.children = (*self.widget.children, button)

    def refresh(self, final=False):
        """Redraw what changed, at most ``max_fps`` times a second (always when ``final``).

        The where panel is redrawn on its own clock (``where_fps``), when a where report or a
        rank's status changed what it shows.
        """
        now, state, parts = time.monotonic(), self.state, []
        if final or (state.version != self._version and now - self._last >= self.min_interval):
            self._last, self._version = now, state.version
            self.redraws += 1
            parts += [(self.header, render.header_html), (self.table, self._table_draw)]
            if final or now - self._last_charts >= self.chart_interval:  # the SVG charts: a few times a second
                self._last_charts = now
                self.chart_redraws += 1
                if self.scaled:
                    aggregate.sample_band(state)
                parts.append((self.charts, self._charts_draw))
        if self.pages and (final or now - self._last_pages >= self.page_interval):
            self._last_pages = now
            parts += self._due_pages(final)
        where_key = (state.where_version, tuple(row["status"] for row in state.rows))
        if final or (where_key != self._where_key and now - self._last_where >= self.where_interval):
            self._last_where, self._where_key = now, where_key
            self.where_redraws += 1
            parts.append((self.where_panel, stacks.where_html))
        for widget, draw in parts:
            html = draw(self.state)
            if widget.value != html:
                widget.value = html

    def _due_pages(self, final: bool) -> list:
        """The table pages to redraw now: all when ``final``; else the selected one and the next in turn.

        The selected page is the one the kernel last heard of (while a foreground cell runs it
        hears nothing, so that is the first page until the cell ends); the others are redrawn one
        per ``page_fps`` tick, round robin, and only when the state changed since their last redraw.
        """
        tab = self.pages_box.children[0]
        due = range(len(self.pages)) if final else {tab.selected_index or 0, self._next_page}
        if not final:
            self._next_page = (self._next_page + 1) % len(self.pages)
        out = []
        for i in due:
            widget, title, ranks = self.pages[i]
            if final or self._page_versions[i] != self.state.version:
                self._page_versions[i] = self.state.version
                self.page_redraws += 1
                out.append((widget, lambda st, title=title, ranks=ranks: _page_html(st, title, ranks)))
        return out

    def close(self):
        """Final redraw, then leave a static snapshot in place of the widget and close the widgets."""
        self.refresh(final=True)
        snapshot = (scale.Snapshot if self.scaled else render.Snapshot)(self.state, extra=stacks.snapshot_html(self.state))
        if self._handle is not None:
            self._handle.update(snapshot)
        else:
            from IPython.display import display

            display(snapshot)
        tab = self.pages_box.children[0] if self.pages_box is not None else None
        for w in (self.header, self.table, self.charts, self.where_panel, self.where_box, self.stop_button,
                  *(w for w, _, _ in self.pages), tab, self.pages_box, self.widget):
            if w is not None:
                w.close()
