"""HTML and text of the dashboard above :data:`~distnb.display.aggregate.SCALE_THRESHOLD` ranks (pure Python).

What :mod:`distnb.display.aggregate` computes, drawn for a person: a status line (how many
ranks run, are done, failed, were stopped), the failed and stopped ranks first with their
errors, a table of min / median / p90 / max over ranks of step time, busy time, samples/s and
peak memory, the slowest ranks by name, and the loss as the mean over ranks with a p10-p90 band.
The per-rank table (:func:`distnb.display.render.table_html`) is drawn a page at a time
(:func:`~distnb.display.aggregate.pages`).

DOM hooks (stable, used by the browser test): ``.distnb-aggregate``; ``.distnb-counts`` with
one ``span[data-status]`` per status; ``ul.distnb-attention`` with ``li[data-rank][data-status]``;
``table.distnb-distribution`` with ``tr[data-metric]`` and ``td[data-q]`` (min, median, p90,
max); ``ol.distnb-slowest`` with ``li[data-rank]``; ``svg.distnb-loss`` holding
``polygon.distnb-loss-band`` and ``polyline.distnb-loss-mean``.
"""

from __future__ import annotations

from distnb.display import aggregate, render
from distnb.display.render import (
    _FONT,
    BAR,
    COLORS,
    STATUS_COLOR,
    _plot,
    esc,
    fmt_bytes,
    fmt_seconds,
    header_html,
    one_line,
    table_html,
    thin,
    throughput_svg,
    validation_svg,
)

#: Failed or stopped ranks listed by name at most (the others are counted).
ATTENTION_ROWS = 8
_TD = "padding:1px 8px;text-align:right;white-space:nowrap"


def fmt_value(value, unit) -> str:
    """A figure in its unit: seconds as ms/s, bytes as KiB/MiB/GiB, samples/s as an integer."""
    if value is None:
        return "-"
    if unit == "s":
        return fmt_seconds(value)
    if unit == "bytes":
        return fmt_bytes(value)
    return f"{value:,.0f}"


def counts_html(state) -> str:
    """``256 ranks: 250 running · 4 done · 1 failed · 1 interrupted``, each count coloured by status."""
    parts = [f"<span data-status='{esc(s)}' style='color:{STATUS_COLOR.get(s, BAR.get(s, '#333'))}'>"
             f"<b>{n}</b> {esc(s)}</span>" for s, n in aggregate.status_counts(state).items()]
    return f"<div class='distnb-counts'>{state.world_size} ranks: {' · '.join(parts)}</div>"


def attention_html(state, limit: int = ATTENTION_ROWS) -> str:
    """The failed ranks, then the stopped ones, each with host and error (at most ``limit`` named)."""
    rows = aggregate.attention(state)
    if not rows:
        return ""
    items = [f"<li data-rank='{r['rank']}' data-status='{esc(r['status'])}' style='color:{STATUS_COLOR[r['status']]}'>"
             f"<b>rank {r['rank']}</b> ({esc(r['host'])}) {esc(r['status'])} at step {r['step']}"
             + (f": <code>{esc(one_line(r['error'], 120))}</code>" if r.get("error") else "") + "</li>"
             for r in rows[:limit]]
    if len(rows) > limit:
        items.append(f"<li>and {len(rows) - limit} more (see the per-rank table)</li>")
    return (f"<ul class='distnb-attention' style='margin:2px 0 4px;padding-left:18px;background:#fde0dc'>"
            f"{''.join(items)}</ul>")


def distribution_html(state) -> str:
    """A table: one row per figure (step time, busy/step, samples/s, peak memory), columns min..max."""
    head = "".join(f"<th style='{_TD}'>{q}</th>" for q in ("", "min", "median", "p90", "max", "ranks"))
    body = []
    for key, label, unit, s in aggregate.distributions(state):
        cells = [f"<td style='{_TD};text-align:left'>{esc(label)}</td>"]
        for q in ("min", "median", "p90", "max"):
            cells.append(f"<td data-q='{q}' style='{_TD}'>{esc(fmt_value(s and s[q], unit))}</td>")
        cells.append(f"<td data-q='n' style='{_TD};color:#666'>{s['n'] if s else 0}</td>")
        body.append(f"<tr data-metric='{key}'>{''.join(cells)}</tr>")
    return (f"<table class='distnb-distribution' style='border-collapse:collapse;{_FONT}'>"
            f"<thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>")


def slowest_html(state) -> str:
    """The slowest ranks by name: rank, host, time per step and how far above the median."""
    rows = aggregate.slowest(state)
    what = "busy (CPU) time/step" if rows and rows[0]["basis"] == "busy" else "time/step"
    if not rows:
        return f"<div class='distnb-slowest-box'>slowest ranks: waiting for data</div>"
    items = []
    for s in rows:
        skew = "" if s["skew"] is None else f" ({100 * s['skew']:+.0f}% vs median)"
        bad = s["skew"] is not None and s["skew"] > 0.2
        items.append(f"<li data-rank='{s['rank']}' style='{'color:#c62828;font-weight:bold' if bad else ''}'>"
                     f"rank {s['rank']} ({esc(s['host'])}) {esc(fmt_seconds(s['time']))}{esc(skew)}</li>")
    return (f"<div class='distnb-slowest-box'>slowest ranks by {esc(what)}:"
            f"<ol class='distnb-slowest' style='margin:2px 0;padding-left:22px'>{''.join(items)}</ol></div>")


def summary_html(state) -> str:
    """The aggregate block: counts, failed/stopped first, distributions beside the slowest ranks."""
    return (f"<div class='distnb-aggregate' style='{_FONT}'>{counts_html(state)}{attention_html(state)}"
            f"<div style='display:flex;flex-wrap:wrap;gap:16px;align-items:flex-start'>{distribution_html(state)}"
            f"{slowest_html(state)}</div></div>")


def band_svg(state, width=420, height=150) -> str:
    """The loss: the mean over ranks (black) inside its p10-p90 band (``state.band``), against step.

    Returns
    -------
    str
        An ``<svg class='distnb-loss'>`` with ``polygon.distnb-loss-band`` and ``polyline.distnb-loss-mean``.
    """
    pts = thin(state.band.points)
    upper = [(x, v[2]) for x, v in pts]
    lower = [(x, v[1]) for x, v in reversed(pts)]
    lo, hi = int(100 * aggregate.BAND[0]), int(100 * aggregate.BAND[1])
    series = [(upper + lower, COLORS[0], 0, "distnb-loss-band", f"p{lo}-p{hi} over ranks"),
              ([(x, v[0]) for x, v in pts], "#000", 2, "distnb-loss-mean", f"mean of {state.world_size} ranks")]
    return _plot(series, "distnb-loss", f"loss: mean and p{lo}-p{hi} band over ranks", width, height)


def charts_html(state) -> str:
    """The charts at scale: the loss band (and validation), the total throughput."""
    val = validation_svg(state) if state.validation else ""
    return (f"<div class='distnb-charts' style='display:flex;flex-wrap:wrap;gap:8px;margin-top:4px'>"
            f"{band_svg(state)}{val}{throughput_svg(state)}</div>")


def summary_text(state) -> list:
    """The aggregate as text lines (the text fallback and the snapshot's text/plain)."""
    counts = ", ".join(f"{n} {s}" for s, n in aggregate.status_counts(state).items())
    lines = [f"{state.world_size} ranks: {counts}"]
    for r in aggregate.attention(state)[:ATTENTION_ROWS]:
        lines.append(f"  rank {r['rank']} ({r['host']}) {r['status']} at step {r['step']}"
                     + (f": {one_line(r['error'], 120)}" if r.get("error") else ""))
    for key, label, unit, s in aggregate.distributions(state):
        if s:
            lines.append(f"  {label:<18} min {fmt_value(s['min'], unit):>10}  median {fmt_value(s['median'], unit):>10}"
                         f"  p90 {fmt_value(s['p90'], unit):>10}  max {fmt_value(s['max'], unit):>10}")
    slow = aggregate.slowest(state)
    if slow:
        lines.append("  slowest: " + ", ".join(
            f"rank {s['rank']} ({s['host']}) {fmt_seconds(s['time'])}"
            + ("" if s["skew"] is None else f" {100 * s['skew']:+.0f}%") for s in slow))
    return lines


def dashboard_html(state, title="", extra="") -> str:
    """The static snapshot at scale: header, the aggregate, the charts, the whole per-rank table folded.

    Returns
    -------
    str
        A ``<div class='distnb-dashboard distnb-snapshot'>``; the table is in a closed
        ``<details class='distnb-all-ranks'>`` (opened by a click, no kernel needed).
    """
    aggregate.sample_band(state)
    return (f"<div class='distnb-dashboard distnb-snapshot' style='{_FONT}'>{header_html(state, title)}"
            f"{summary_html(state)}{charts_html(state)}<details class='distnb-all-ranks' style='margin-top:4px'>"
            f"<summary>per-rank table ({state.world_size} ranks)</summary>{table_html(state)}</details>{extra}</div>")


class Snapshot(render.Snapshot):
    """:class:`distnb.display.render.Snapshot` at scale: the aggregate, and the per-rank table folded."""

    def __init__(self, state, title="", extra=""):
        self.html = dashboard_html(state, title, extra)
        self.text = "\n".join([f"distnb {state.strategy or 'training'} · {state.world_size} ranks · "
                               f"{render.overall_status(state)}"] + summary_text(state))
