"""The dashboard's where panel: every rank's state and innermost stack frames, as HTML (pure Python).

Drawn from the where reports the ranks publish while a cell runs (:mod:`distnb.engine.process.where`,
kept by :meth:`~distnb.display.progress.ProgressState.set_where`). The live dashboard
(:mod:`distnb.display.widgets`) shows it in an ipywidgets Accordion whose opening is front-end
state, so it can be opened while the kernel is busy in a foreground training cell; the kernel
keeps its HTML up to date from iopub messages, which the front end applies at once.

DOM hooks (used by the browser test, stable): the live dashboard's Accordion carries
``.distnb-where`` (its title bar, the button, is ipywidgets' ``.jupyter-widget-Collapse-header``);
the static snapshot's ``details.distnb-where-snapshot``; ``div.distnb-where-panel``; one
``div.distnb-where-rank`` per rank with ``data-rank`` and ``data-state`` (``running``,
``stalled``, ``collective``, ``idle``, ``done``, ``failed``, ``interrupted``, ``waiting`` or
``unknown``; above 16 ranks one block per spot, with ``data-ranks`` listing its ranks, e.g.
``0-14,16-31``); in it ``.distnb-where-state`` (the state in words), ``.distnb-where-op`` (the
collective and shape), ``.distnb-where-cell`` (the cell line) and ``ol.distnb-where-stack`` with
one ``li.distnb-where-frame`` per frame, innermost last; frames of the user's cell also carry
``distnb-where-user``.
"""

from __future__ import annotations

import re

from distnb.core.errors import rank_list
from distnb.display.aggregate import SCALE_THRESHOLD
from distnb.display.progress import STALL_SECONDS, WHERE_FRAMES
from distnb.display.render import _FONT, esc

#: File names of the user's cell code on a rank (``%%dist`` and ``%%distrain`` bodies).
CELL_FILES = ("<dist-cell-", "<distrain-cell-")
#: Row statuses after which a rank's stack no longer says anything (its cell ended).
ENDED = ("done", "failed")
_STACK = ("font-family:var(--jp-code-font-family,monospace);font-size:11px;line-height:1.4;"
          "white-space:normal;overflow-wrap:anywhere")
_STATE_COLOR = {"collective": "#8a6d00", "stalled": "#b71c1c", "failed": "#b71c1c", "done": "#1b5e20",
                "interrupted": "#8a5a00"}


def short_path(path: str) -> str:
    """A frame's file, short and free of local folders: from the package on for installed code and
    for distnb itself (a development install too), else its last two parts; a cell's name as it is."""
    path = str(path or "?").replace("\\", "/")
    if path.startswith("<"):
        return path
    for marker in ("site-packages/", "dist-packages/"):
        if marker in path:
            return path.rsplit(marker, 1)[1]
    if "/distnb/" in path:
        return "distnb/" + path.rsplit("/distnb/", 1)[1]
    return "/".join(path.split("/")[-2:])


def rank_state(row: dict, where) -> tuple:
    """``(data-state, words)`` for one rank: what the panel says it is doing.

    Parameters
    ----------
    row : dict
        The rank's row of the ProgressState (its ``status``).
    where : dict or None
        Its latest where report.

    Returns
    -------
    tuple of (str, str)
        E.g. ``("collective", "in a collective for 4 s")``, ``("stalled", "stalled for 3 s")``.
    """
    status = row.get("status")
    if status in ENDED:
        return status, f"{status}: its cell ended"
    if where is None:
        return ("waiting", "no report yet") if status == "waiting" else ("unknown", "no report yet")
    waited = max(0.0, where.get("sent", 0.0) - where.get("since", 0.0))
    state = where.get("state") or "unknown"
    prefix = "interrupted; last seen " if status == "interrupted" else ""
    if state == "collective":
        return "collective", f"{prefix}in a collective for {waited:.0f} s"
    if state == "running" and waited >= STALL_SECONDS:
        return "stalled", f"{prefix}stalled for {waited:.0f} s"
    if state == "running":
        return "running", f"{prefix}running"
    return state, prefix + state


def _frame_html(frame) -> str:
    filename, line, function, code = (list(frame) + ["", 0, "", ""])[:4]
    user = str(filename).startswith(CELL_FILES)
    where = f"your cell, line {line}" if user else f"{short_path(filename)}:{line}"
    style = "margin:0;background:#fff3cd;font-weight:bold" if user else "margin:0;color:#555"
    code_html = f" <code style='color:#000;background:none;padding:0'>{esc(code)}</code>" if code else ""
    return (f"<li class='distnb-where-frame{' distnb-where-user' if user else ''}' style='{style}'>"
            f"{esc(where)} in {esc(function)}:{code_html}</li>")


def rank_html(rank: int, row: dict, where, ranks=None, words=None) -> str:
    """One rank's block: state, collective and shape, the cell line, the innermost frames.

    ``ranks`` (several ranks in the same spot, :func:`where_html`) names them all in one block
    (``ranks 0-14,16-31``, and a ``data-ranks`` attribute); ``words`` then replaces the state in
    words (their time there as a range).
    """
    state, said = rank_state(row, where)
    color = _STATE_COLOR.get(state, "#333")
    who = f"rank {rank}" if not ranks or len(ranks) == 1 else f"ranks {rank_list(ranks)}"
    parts = [f"<b>{who}</b>",
             f"<span class='distnb-where-state' style='color:{color};font-weight:bold'>{esc(words or said)}</span>"]
    frames = ""
    if where is not None and state not in ENDED:
        if where.get("op"):
            shape = f" of shape {tuple(where['shape'])}" if where.get("shape") is not None else ""
            parts.append(f"<span class='distnb-where-op'>{esc(where['op'])}{esc(shape)}</span>")
        if where.get("cell_line"):
            parts.append(f"<span class='distnb-where-cell'>cell line {esc(where['cell_line'])}: "
                         f"<code>{esc(where.get('cell_code'))}</code></span>")
        stack = (where.get("stack") or [])[-WHERE_FRAMES:]
        if stack:
            frames = (f"<ol class='distnb-where-stack' style='margin:2px 0 0 0;padding-left:26px;{_STACK}'>"
                      + "".join(_frame_html(f) for f in stack) + "</ol>")
    many = f" data-ranks='{rank_list(ranks)}'" if ranks and len(ranks) > 1 else ""
    return (f"<div class='distnb-where-rank' data-rank='{rank}'{many} data-state='{esc(state)}' "
            f"style='padding:3px 0;border-top:1px solid #eee'>{' · '.join(parts)}{frames}</div>")


def _spot(row: dict, where) -> tuple:
    """What a rank's block shows, but for its seconds there: ranks with equal spots share one block."""
    state = rank_state(row, where)[0]
    if where is None or state in ENDED:
        return (state,)
    stack = tuple(tuple(f)[:3] for f in (where.get("stack") or [])[-WHERE_FRAMES:])
    shape = tuple(where["shape"]) if where.get("shape") is not None else None
    return (state, row.get("status") == "interrupted", where.get("op"), shape, where.get("cell_line"),
            where.get("cell_code"), stack)


def _folded(state) -> str:
    """One block per spot (:func:`_spot`), the ranks in it named as a list; the most ranks first."""
    groups = {}
    for r, row in enumerate(state.rows):
        groups.setdefault(_spot(row, state.wheres.get(r)), []).append(r)
    blocks = []
    for ranks in sorted(groups.values(), key=lambda g: (-len(g), g[0])):
        first = ranks[0]
        row, where = state.rows[first], state.wheres.get(first)
        words = None
        if len(ranks) > 1 and where is not None:
            said = [rank_state(state.rows[r], state.wheres.get(r))[1] for r in ranks]
            words = said[0] if len(set(said)) == 1 else _span_of(said)
        blocks.append(rank_html(first, row, where, ranks=ranks, words=words))
    return "".join(blocks)


def _span_of(said: list) -> str:
    """``["in a collective for 3 s", "in a collective for 5 s"]`` as ``"in a collective for 3-5 s"``."""

    seconds = [int(m.group(1)) for m in (re.search(r"for (\d+) s", w) for w in said) if m]
    if len(seconds) != len(said):
        return said[0]
    return re.sub(r"for \d+ s", f"for {min(seconds)}-{max(seconds)} s", said[0])


def where_html(state) -> str:
    """The where panel: one block per rank (see the module's DOM hooks), or above
    :data:`~distnb.display.aggregate.SCALE_THRESHOLD` ranks one block per spot: the ranks at the
    same state, collective, cell line and innermost frames share a block that names them
    (``ranks 0-14,16-31``; ``data-rank`` is the first of them, ``data-ranks`` all), the most
    ranks first, so that the odd one out of 256 stands out.

    Parameters
    ----------
    state : ProgressState
        Its ``wheres`` (the latest report of each rank) and rows (each rank's status).

    Returns
    -------
    str
        A ``<div class='distnb-where-panel'>``.
    """
    if len(state.rows) > SCALE_THRESHOLD:
        blocks = _folded(state)
    else:
        blocks = "".join(rank_html(r, row, state.wheres.get(r)) for r, row in enumerate(state.rows))
    note = (f"each rank reports where its cell is about 4 times a second; the innermost {WHERE_FRAMES} frames, "
            "innermost last; your cell's lines are marked")
    return (f"<div class='distnb-where-panel' style='{_FONT}'><div style='color:#666;font-size:11px'>{esc(note)}"
            f"</div>{blocks}</div>")


def snapshot_html(state) -> str:
    """The where panel for the static snapshot: a closed ``<details>`` with where ranks were last seen.

    Empty when every rank finished (``done``): their stacks would only show code they left.
    After a failure, an interrupt or a hang it keeps the last report of each rank, which says
    where the ranks that did not finish were stopped.
    """
    if not state.wheres or all(row["status"] == "done" for row in state.rows):
        return ""
    return (f"<details class='distnb-where-snapshot' style='margin-top:4px;{_FONT}'><summary>where the ranks "
            f"were last seen</summary>{where_html(state)}</details>")
