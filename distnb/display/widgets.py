"""The live training dashboard (ipywidgets): one row per rank and a loss curve.

Drawing is throttled (at most ``max_fps`` redraws a second) and only touches widgets
whose value changed, so the kernel's drawing never competes with training for long.
"""

from __future__ import annotations

import html
import time

import ipywidgets as W

_BAR = {"waiting": "", "running": "info", "done": "success", "failed": "danger", "interrupted": "warning"}
_COLORS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f"]


def _svg_curve(state, width=420, height=120) -> str:
    series = [sorted(c.items()) for c in state.curves]
    mean = state.mean_curve()
    points = [p for s in series for p in s]
    if not points:
        return f"<svg width='{width}' height='{height}' class='distnb-loss'></svg>"
    xmax = max(s for s, _ in points) or 1
    lo, hi = min(v for _, v in points), max(v for _, v in points)
    span = (hi - lo) or 1.0

    def poly(pts, color, w, cls):
        coords = " ".join(f"{4 + (width - 8) * s / xmax:.1f},{4 + (height - 8) * (1 - (v - lo) / span):.1f}"
                          for s, v in pts)
        return f"<polyline class='{cls}' points='{coords}' fill='none' stroke='{color}' stroke-width='{w}'/>"

    lines = [poly(s, _COLORS[r % len(_COLORS)], 1, f"distnb-loss-rank{r}") for r, s in enumerate(series) if s]
    if mean:
        lines.append(poly(mean, "#000", 2, "distnb-loss-mean"))
    return (f"<svg width='{width}' height='{height}' class='distnb-loss' style='background:#fafafa'>"
            + "".join(lines) + f"<text x='6' y='14' font-size='11'>loss {hi:.3g}</text>"
            f"<text x='6' y='{height - 6}' font-size='11'>{lo:.3g}</text></svg>")


class Dashboard:
    """ipywidgets view of a :class:`~distnb.display.progress.ProgressState`."""

    def __init__(self, state, max_fps: float = 5.0):
        self.state = state
        self.min_interval = 1.0 / max_fps
        self._last = 0.0
        self._version = -1
        self.title = W.HTML(f"<b>distnb</b> · {state.world_size} ranks")
        self.labels, self.bars, self.stats = [], [], []
        rows = []
        for r in state.rows:
            label = W.HTML(f"<code>rank {r['rank']}</code> {html.escape(r['host'] or '')} {html.escape(r['device'] or '')}",
                           layout=W.Layout(width="220px"))
            bar = W.IntProgress(value=0, min=0, max=max(1, r["total"]), layout=W.Layout(width="260px"))
            stat = W.HTML("waiting")
            self.labels.append(label)
            self.bars.append(bar)
            self.stats.append(stat)
            rows.append(W.HBox([label, bar, stat], layout=W.Layout(align_items="center")))
        self.curve = W.HTML(_svg_curve(state))
        self.widget = W.VBox([self.title, *rows, self.curve])
        self.widget.add_class("distnb-dashboard")

    def show(self):
        from IPython.display import display

        display(self.widget)

    def refresh(self, final=False):
        now = time.monotonic()
        if not final and (now - self._last < self.min_interval or self.state.version == self._version):
            return
        self._last, self._version = now, self.state.version
        for r, bar, stat in zip(self.state.rows, self.bars, self.stats):
            bar.max = max(1, r["total"])
            bar.value = min(r["step"], bar.max)
            bar.bar_style = _BAR.get(r["status"], "")
            loss = "-" if r["loss"] is None else f"{r['loss']:.4f}"
            text = (f"epoch {r['epoch'] if r['epoch'] is not None else '-'} · step {r['step']}/{r['total']} · "
                    f"loss {loss} · {r['samples_per_s']:.0f} samples/s · {1000 * r['step_time']:.1f} ms/step · "
                    f"<b>{r['status']}</b>")
            if r["status"] == "failed" and r.get("error"):
                text += f" <span style='color:#c00'>{html.escape(str(r['error']))}</span>"
            if stat.value != text:
                stat.value = text
        svg = _svg_curve(self.state)
        if self.curve.value != svg:
            self.curve.value = svg

    def close(self):
        self.refresh(final=True)
