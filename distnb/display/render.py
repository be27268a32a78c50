"""HTML and SVG of the training dashboard, drawn from a ProgressState (pure Python).

The live ipywidgets dashboard (:mod:`distnb.display.widgets`) shows these strings in HTML
widgets, and the same strings make the static snapshot left in the notebook when a run
ends, so a saved notebook shows the final state without a kernel. Only inline styles are
used (no ``<style>`` or scripts), which survive the HTML sanitizers of notebook viewers.

DOM hooks (used by the browser test, stable): the dashboard root ``.distnb-dashboard``;
one ``tr.distnb-rank`` per rank with ``data-rank``, ``data-status``, ``data-step`` and
``data-total``; a ``[role=progressbar]`` per rank with ``aria-valuenow``/``aria-valuemax``;
after a failed (or stopped) rank's row a ``tr.distnb-error-row`` whose ``.distnb-error`` holds
the exception in one line; ``svg.distnb-loss`` with one
``polyline.distnb-loss-rankR`` per rank and ``polyline.distnb-loss-mean``;
``svg.distnb-throughput``; ``svg.distnb-straggler`` with ``rect.distnb-straggler-slow`` on
a straggler.
"""

from __future__ import annotations

import html
import math
import statistics

from distnb.display.progress import STRAGGLER_THRESHOLD, loss_text, rank_rate

COLORS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f"]
#: Row background and bar colour by status.
ROW_BG = {"failed": "#fde0dc", "done": "#e3f4e4", "interrupted": "#fff3cd"}
BAR = {"waiting": "#bbb", "running": "#1976d2", "done": "#2e7d32", "failed": "#c62828", "interrupted": "#ef8f00"}
STATUS_COLOR = {"failed": "#b71c1c", "done": "#1b5e20", "interrupted": "#8a5a00"}
#: Points drawn per line at most (longer histories are thinned, keeping the last point).
MAX_POINTS = 150
_FONT = "font-family:var(--jp-ui-font-family,system-ui,sans-serif);font-size:12px"
_CELL = "padding:2px 6px;text-align:right;white-space:nowrap"
_MONO = "font-family:var(--jp-code-font-family,monospace);font-size:11px;white-space:pre-wrap;word-break:break-all"


def esc(x) -> str:
    """HTML-escaped ``str(x)`` ("" for None)."""
    return "" if x is None else html.escape(str(x), quote=True)


def fmt_bytes(n) -> str:
    """``1536 -> '1.5 KiB'``; ``None -> '-'``."""
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"  # pragma: no cover


def fmt_seconds(t) -> str:
    """A time per step: ``0.0123 -> '12.3 ms'``; ``None`` or 0 -> '-'."""
    if not t:
        return "-"
    return f"{t * 1e3:.1f} ms" if t < 1 else f"{t:.2f} s"


def one_line(text, limit=160) -> str:
    """The first line of ``text``, at most ``limit`` characters."""
    first = str(text or "").strip().splitlines()[0] if str(text or "").strip() else ""
    return first if len(first) <= limit else first[: limit - 1] + "…"


def thin(points, limit=MAX_POINTS) -> list:
    """At most ``limit`` of ``points`` (evenly spaced, always keeping the last)."""
    if len(points) <= limit:
        return list(points)
    stride = math.ceil(len(points) / limit)
    out = list(points[::stride])
    if out[-1] != points[-1]:
        out.append(points[-1])
    return out


# --- the per-rank table ------------------------------------------------------------------------
def steps_done(row) -> str:
    """``12/40``: a rank's steps of the cell's total; ``12`` where the total is not known (a stream)."""
    return f"{row['step']}/{row['total']}" if row["total"] else f"{row['step']}"


def _bar(row, fraction) -> str:
    pct = 100.0 * fraction
    color = BAR.get(row["status"], BAR["running"])
    # a stream's total is not known: an indeterminate bar (ARIA: no value), full once the rank is done
    value = (f"aria-valuenow='{row['step']}' aria-valuemin='0' aria-valuemax='{row['total']}' title='{pct:.0f}%'"
             if row["total"] else f"title='{row['step']} steps (a stream: the total is not known)'")
    return (f"<div role='progressbar' class='distnb-bar' {value} style='display:inline-block;vertical-align:middle;"
            f"width:110px;height:10px;background:#e8e8e8;border-radius:3px;overflow:hidden'>"
            f"<div class='distnb-bar-fill' style='width:{pct:.1f}%;height:100%;background:{color}'></div></div>")


def table_html(state, ranks=None) -> str:
    """The per-rank table: rank, host, device, [stage], progress, loss, samples/s, times, memory, status.

    Parameters
    ----------
    state : ProgressState
    ranks : iterable of int, optional
        The rows to draw (a page of the table at scale); default every rank. Skews are
        relative to the median over all ranks either way.

    Returns
    -------
    str
        An HTML ``<table>``; a failed or stopped rank's row is followed by a row with its error.
    """
    skews = state.skews()
    slow = state.straggler()
    times, basis = state.time_per_step()
    stage = state.show_stage
    head = ["rank", "host", "device"] + (["stage"] if stage else []) + [
        "progress", "epoch", "epoch loss", "samples/s", "step time",
        "busy/step" if basis == "busy" else "skew", "peak memory", "status"]
    ths = "".join(f"<th style='{_CELL};text-align:{'left' if h in ('host', 'device', 'status') else 'right'};"
                  f"border-bottom:1px solid #ccc'>{esc(h)}</th>" for h in head)
    body = []
    for r in range(state.world_size) if ranks is None else ranks:
        row = state.rows[r]
        status = row["status"]
        bg = ROW_BG.get(status, "")
        frac = state.fraction(r)
        epoch = "-" if row["epoch"] is None else f"{row['epoch']} ({state.cell_epoch(r)}/{state.epochs})"
        loss = loss_text(row)
        skew = skews[r]
        busy = "-" if times[r] is None else fmt_seconds(times[r])
        if skew is not None and state.world_size > 1:
            busy += f" ({100 * skew:+.0f}%)"
        busy_style = "color:#c62828;font-weight:bold" if slow == r else ""
        mem = fmt_bytes(row["peak_memory"])
        if row["memory_kind"] == "cuda":
            mem += " GPU"
        status_html = f"<b style='color:{STATUS_COLOR.get(status, '#333')}'>{esc(status)}</b>"
        if row.get("where") and status == "running":  # a rank that stalls: where it is (engine/where.py)
            status_html += f"<div class='distnb-where' style='{_MONO};color:#8a6d00'>{esc(one_line(row['where'], 90))}</div>"
        cells = [f"<td style='{_CELL}'><code>{r}</code></td>",
                 f"<td style='{_CELL};text-align:left'>{esc(row['host'])}</td>",
                 f"<td style='{_CELL};text-align:left'>{esc(row['device'])}</td>"]
        if stage:
            cells.append(f"<td class='distnb-stage' style='{_CELL}'>{esc(row['stage'])}</td>")
        cells += [f"<td style='{_CELL}'>{_bar(row, frac)} <span class='distnb-steps'>{steps_done(row)}"
                  f"</span></td>",
                  f"<td style='{_CELL}'>{esc(epoch)}</td>",
                  f"<td class='distnb-loss-value' style='{_CELL}'>{esc(loss)}</td>",
                  f"<td style='{_CELL}'>{rank_rate(row):.0f}</td>",
                  f"<td style='{_CELL}'>{esc(fmt_seconds(row['step_time']))}</td>",
                  f"<td class='distnb-skew' style='{_CELL};{busy_style}'>{esc(busy)}</td>",
                  f"<td style='{_CELL}'>{esc(mem)}</td>",
                  f"<td class='distnb-status' style='{_CELL};text-align:left'>{status_html}</td>"]
        body.append(f"<tr class='distnb-rank distnb-status-{esc(status)}' data-rank='{r}' data-status='{esc(status)}' "
                    f"data-step='{row['step']}' data-total='{row['total']}' style='background:{bg or 'transparent'}'>"
                    + "".join(cells) + "</tr>")
        if status in ("failed", "interrupted") and row.get("error"):  # the exception, one line, under the row
            body.append(f"<tr class='distnb-error-row' data-rank='{r}' style='background:{bg}'><td></td>"
                        f"<td colspan='{len(cells) - 1}' class='distnb-error' title='{esc(row['error'])}' "
                        f"style='padding:0 6px 3px;text-align:left;color:{STATUS_COLOR[status]};{_MONO}'>"
                        f"{esc(one_line(row['error'], 140))}</td></tr>")
    return (f"<table class='distnb-ranks' style='border-collapse:collapse;{_FONT}'><thead><tr>{ths}</tr></thead>"
            f"<tbody>{''.join(body)}</tbody></table>")


# --- charts ------------------------------------------------------------------------------------
def _plot(series, cls, title, width=300, height=130, ylabel_fmt="{:.3g}", xlabel="step") -> str:
    """An SVG line chart: ``series`` is a list of (points, colour, stroke width, css class, label)."""
    pts = [p for s in series for p in s[0]]
    frame = (f"<svg class='{cls}' width='{width}' height='{height}' viewBox='0 0 {width} {height}' "
             f"style='background:#fafafa;border:1px solid #e0e0e0;{_FONT}' xmlns='http://www.w3.org/2000/svg'>"
             f"<text x='6' y='13' font-size='11' fill='#333'>{esc(title)}</text>")
    if not pts:
        return frame + f"<text x='6' y='{height // 2}' font-size='11' fill='#999'>waiting for data</text></svg>"
    x0, x1 = min(x for x, _ in pts), max(x for x, _ in pts)
    lo, hi = min(y for _, y in pts), max(y for _, y in pts)
    xspan, yspan = (x1 - x0) or 1.0, (hi - lo) or (abs(hi) or 1.0)
    left, top, right, bottom = 48, 20, 6, 16
    w, h = width - left - right, height - top - bottom

    sx, sy = w / xspan, h / yspan

    out = [frame,
           f"<text x='{left - 4}' y='{top + 8}' font-size='10' text-anchor='end' fill='#666'>"
           f"{esc(ylabel_fmt.format(hi))}</text>",
           f"<text x='{left - 4}' y='{top + h}' font-size='10' text-anchor='end' fill='#666'>"
           f"{esc(ylabel_fmt.format(lo))}</text>",
           f"<text x='{width - right}' y='{height - 3}' font-size='10' text-anchor='end' fill='#666'>"
           f"{esc(xlabel)} {x1:.4g}</text>",
           f"<line x1='{left}' y1='{top + h}' x2='{left + w}' y2='{top + h}' stroke='#ccc'/>"]
    legend_x = left + 4
    for points, color, stroke, pcls, label in series:
        if not points:
            continue
        if pcls.endswith("-band"):  # a closed area (its upper edge, then its lower edge back), already thinned
            coords = " ".join([f"{left + sx * (x - x0):.1f},{top + h - sy * (y - lo):.1f}" for x, y in points])
            out.append(f"<polygon class='{pcls}' points='{coords}' fill='{color}' fill-opacity='0.25' "
                       f"stroke='none'><title>{esc(label)}</title></polygon>")
            continue
        coords = " ".join([f"{left + sx * (x - x0):.1f},{top + h - sy * (y - lo):.1f}" for x, y in thin(points)])
        out.append(f"<polyline class='{pcls}' points='{coords}' fill='none' stroke='{color}' "
                   f"stroke-width='{stroke}' ><title>{esc(label)}</title></polyline>")
        if label and len(series) > 1:
            out.append(f"<text x='{legend_x}' y='{top + 10}' font-size='10' fill='{color}'>{esc(label)}</text>")
            legend_x += 7 * len(label) + 8
    return "".join(out) + "</svg>"


def loss_svg(state, width=300, height=130) -> str:
    """Loss against step for every rank, and the mean over ranks (black).

    Parameters
    ----------
    state : ProgressState
    width, height : int
        Pixels.

    Returns
    -------
    str
        An ``<svg class='distnb-loss'>`` element.
    """
    series = [(thin(c.points), COLORS[r % len(COLORS)], 1, f"distnb-loss-rank{r}", f"rank {r}")
              for r, c in enumerate(state.curves)]
    if state.world_size > 1:
        series.append((state.mean_curve([x for x, _ in series[0][0]]), "#000", 2, "distnb-loss-mean", "mean"))
    return _plot(series, "distnb-loss", "loss", width, height)


def throughput_svg(state, width=300, height=130) -> str:
    """Samples per second summed over ranks, against seconds since the first report.

    Parameters
    ----------
    state : ProgressState
    width, height : int
        Pixels.

    Returns
    -------
    str
        An ``<svg class='distnb-throughput'>`` element.
    """
    return _plot([(state.throughput.points, "#00897b", 1.5, "distnb-throughput-total", "")], "distnb-throughput",
                 "samples/s (all ranks)", width, height, ylabel_fmt="{:.0f}", xlabel="s")


def straggler_svg(state, width=300, height=130, threshold=STRAGGLER_THRESHOLD) -> str:
    """One bar per rank: time per step against the median (dashed); a straggler's bar is red.

    Parameters
    ----------
    state : ProgressState
    width, height : int
        Pixels.
    threshold : float
        A rank more than this fraction above the median is the straggler (default 0.2).

    Returns
    -------
    str
        An ``<svg class='distnb-straggler'>`` element.
    """
    times, basis = state.time_per_step()
    skews = state.skews()
    slow = state.straggler(threshold)
    label = "busy time/step (CPU)" if basis == "busy" else "time/step"
    out = [f"<svg class='distnb-straggler' width='{width}' height='{height}' viewBox='0 0 {width} {height}' "
           f"style='background:#fafafa;border:1px solid #e0e0e0;{_FONT}' xmlns='http://www.w3.org/2000/svg'>"
           f"<text x='6' y='13' font-size='11' fill='#333'>stragglers: {esc(label)} vs median</text>"]
    known = [t for t in times if t is not None]
    if not known:
        return "".join(out) + f"<text x='6' y='{height // 2}' font-size='11' fill='#999'>waiting for data</text></svg>"
    top, left = 20, 50
    bar_h = max(4, min(16, (height - top - 18) // max(1, state.world_size) - 2))
    scale = (width - left - 60) / (max(known) or 1.0)
    median = statistics.median(known)
    for r, t in enumerate(times):
        y = top + r * (bar_h + 2)
        out.append(f"<text x='{left - 4}' y='{y + bar_h - 1}' font-size='10' text-anchor='end'>rank {r}</text>")
        if t is None:
            continue
        cls = "distnb-straggler-slow" if r == slow else "distnb-straggler-bar"
        color = "#c62828" if r == slow else COLORS[r % len(COLORS)]
        out.append(f"<rect class='{cls}' data-rank='{r}' x='{left}' y='{y}' width='{max(1.0, t * scale):.1f}' "
                   f"height='{bar_h}' fill='{color}'><title>rank {r}: {esc(fmt_seconds(t))}</title></rect>")
        if skews[r] is not None:
            out.append(f"<text x='{left + t * scale + 4:.1f}' y='{y + bar_h - 1}' font-size='10' "
                       f"fill='{color}'>{100 * skews[r]:+.0f}%</text>")
    mx = left + median * scale
    out.append(f"<line x1='{mx:.1f}' y1='{top - 2}' x2='{mx:.1f}' y2='{height - 14}' stroke='#555' "
               f"stroke-dasharray='3,2'><title>median {esc(fmt_seconds(median))}</title></line>")
    note = (f"rank {slow} is {100 * skews[slow]:.0f}% slower than the median" if slow is not None
            else f"no rank more than {100 * threshold:.0f}% above the median")
    out.append(f"<text x='6' y='{height - 3}' font-size='10' fill='{'#c62828' if slow is not None else '#666'}'>"
               f"{esc(note)}</text></svg>")
    return "".join(out)


def validation_svg(state, width=300, height=130) -> str:
    """The validation loss (and metric, in the title) at each validation, against the cell's step.

    Returns
    -------
    str
        An ``<svg class='distnb-validation'>`` element with ``polyline.distnb-val-loss``.
    """
    points = sorted(state.validation.items())
    title = "validation loss"
    if points and points[-1][1][1] is not None:
        title += f" · {state.metric_name or 'metric'} {points[-1][1][1]:.4f}"
    series = [([(s, v[0]) for s, v in points], "#d62728", 2, "distnb-val-loss", "validation")]
    return _plot(series, "distnb-validation", title, width, height)


def charts_html(state) -> str:
    """Loss curve (and the validation curve beside it), throughput line and straggler view side by side."""
    val = validation_svg(state) if state.validation else ""
    return (f"<div class='distnb-charts' style='display:flex;flex-wrap:wrap;gap:8px;margin-top:4px'>"
            f"{loss_svg(state)}{val}{throughput_svg(state)}{straggler_svg(state)}</div>")


# --- header and the whole dashboard --------------------------------------------------------------
def overall_status(state) -> str:
    """One word for the run: failed, interrupted, done, running or waiting."""
    statuses = [r["status"] for r in state.rows]
    for s in ("failed", "interrupted"):
        if s in statuses:
            return s
    if all(s == "done" for s in statuses):
        return "done"
    return "running" if any(s != "waiting" for s in statuses) else "waiting"


def header_html(state, title="") -> str:
    """Title line: strategy, ranks, overall status, mean epoch loss, total samples/s."""
    status = overall_status(state)
    parts = ["<b>distnb</b>", esc(state.strategy or "training"), f"{state.world_size} ranks",
             f"<b class='distnb-overall' data-status='{status}' style='color:{STATUS_COLOR.get(status, '#333')}'>"
             f"{status}</b>"]
    if state.epoch_means:
        last = max(state.epoch_means)
        parts.append(f"epoch {last} mean loss {state.epoch_means[last]:.4f}")
    parts += step_parts(state)
    total = state.total_rate()
    if total:
        parts.append(f"{total:.0f} samples/s")
    if title:
        parts.append(esc(title))
    settings = (f"<div class='distnb-settings' style='color:#6a1b9a'>{esc(state.settings)}</div>"
                if getattr(state, "settings", "") else "")
    return f"<div class='distnb-header' style='{_FONT};margin-bottom:2px'>{' · '.join(parts)}{settings}</div>"


def step_parts(state) -> list:
    """Header pieces of the optimizer step: micro/optimizer steps, lr, grad norm, last validation."""
    row, parts = state.rows[0], []
    if row.get("opt_step") is not None and row["opt_step"] != row["step"]:
        parts.append(f"optimizer step {row['opt_step']} ({row['step']} micro-steps)")
    if row.get("lr") is not None:
        parts.append(f"<span class='distnb-lr'>lr {row['lr']:.3g}</span>")
    if row.get("grad_norm") is not None:
        parts.append(f"grad norm {row['grad_norm']:.3g}")
    if state.validation:
        loss, metric = state.validation[max(state.validation)]
        extra = f" {esc(state.metric_name or 'metric')} {metric:.4f}" if metric is not None else ""
        parts.append(f"<span class='distnb-val'>validation loss {loss:.4f}{extra}</span>")
    return parts


def dashboard_html(state, title="", extra="") -> str:
    """The whole dashboard as one HTML fragment (the static snapshot).

    Parameters
    ----------
    state : ProgressState
    title : str, optional
        Extra text for the header line.
    extra : str, optional
        HTML put after the charts (the dashboard's where panel, :func:`distnb.display.stacks.snapshot_html`).

    Returns
    -------
    str
        A ``<div class='distnb-dashboard distnb-snapshot'>`` with header, table and charts.
    """
    return (f"<div class='distnb-dashboard distnb-snapshot' style='{_FONT}'>{header_html(state, title)}"
            f"{table_html(state)}{charts_html(state)}{extra}</div>")


def dashboard_text(state) -> str:
    """Plain-text summary of the final state (the snapshot's text/plain).

    Parameters
    ----------
    state : ProgressState

    Returns
    -------
    str
        A title line and one line per rank.
    """
    lines = [f"distnb {state.strategy or 'training'} · {state.world_size} ranks · {overall_status(state)}"]
    for r, row in enumerate(state.rows):
        loss = loss_text(row)
        line = (f"rank {r}  {row['status']:<11} step {steps_done(row)}  loss {loss}  "
                f"{rank_rate(row):.0f} samples/s  peak {fmt_bytes(row['peak_memory'])}")
        if row["status"] in ("failed", "interrupted") and row.get("error"):
            line += f"  {one_line(row['error'])}"
        lines.append(line)
    return "\n".join(lines)


class Snapshot:
    """The final dashboard as a static output: HTML in Jupyter, a text summary elsewhere.

    Parameters
    ----------
    state : ProgressState
    title : str, optional
        Extra text for the header line.
    extra : str, optional
        HTML put after the charts.
    """

    def __init__(self, state, title="", extra=""):
        self.html = dashboard_html(state, title, extra)
        self.text = dashboard_text(state)

    def _repr_html_(self):
        return self.html

    def __repr__(self):
        return self.text
