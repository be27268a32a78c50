"""The dashboard's view of many ranks: distributions, the slowest, the failed, the loss band (pure Python).

Above :data:`SCALE_THRESHOLD` ranks one row per rank no longer reads (256 rows, 1,024), so the
dashboard shows what a person looks for across ranks instead, all computed here from the
:class:`~distnb.display.progress.ProgressState`:

- :func:`distributions`: min, median, p90 and max over ranks of the time per step, the busy
  (CPU) time per step, samples/s and peak memory;
- :func:`slowest`: the ranks with the longest time per step, by rank and host;
- :func:`attention`: failed ranks first, then stopped (interrupted) ones, with their errors;
- :func:`sample_band`: the loss curve as the mean over ranks with a p10-p90 band, sampled from
  each rank's newest loss (O(ranks) per sample, so the charts cost the same at any run length);
- :func:`pages`: the per-rank table cut into pages of whole hosts.

Every function costs O(ranks) (sorting for the quantiles: O(ranks log ranks)), about 1 ms at
1,024 ranks. Quantiles interpolate linearly between order statistics (numpy's default
``"linear"`` method, Hyndman and Fan's definition 7).
"""

from __future__ import annotations

import math

from distnb.display.progress import STATUSES

#: More ranks than this and the dashboard shows the aggregate (at most this many: one row per rank).
SCALE_THRESHOLD = 16
#: Ranks the slowest-ranks list names.
SLOWEST = 5
#: Rows per page of the per-rank table at most (pages hold whole hosts, unless a host has more).
PAGE_ROWS = 32
#: The band around the mean loss: these quantiles over ranks.
BAND = (0.1, 0.9)
#: The figures :func:`distributions` summarises: (key, label, unit).
METRICS = (("step_time", "step time", "s"), ("busy_time", "busy (CPU) / step", "s"),
           ("rate", "samples/s", "samples/s"), ("peak_memory", "peak memory", "bytes"))


def quantile(sorted_values, q: float) -> float:
    """The ``q`` quantile (0 to 1) of ascending ``sorted_values``, linearly interpolated.

    Raises
    ------
    ValueError
        If ``sorted_values`` is empty.
    """
    if not sorted_values:
        raise ValueError("quantile of no values")
    pos = q * (len(sorted_values) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def summary(values) -> dict | None:
    """``{"min", "median", "p90", "max", "n"}`` of the values that are not None; None if there are none."""
    known = sorted(v for v in values if v is not None)
    if not known:
        return None
    return dict(min=known[0], median=quantile(known, 0.5), p90=quantile(known, 0.9), max=known[-1], n=len(known))


def rank_values(state, key: str) -> list:
    """Per rank, the figure ``key`` of :data:`METRICS` (None while a rank has not reported it).

    ``rate`` is samples/s over the last second when known, else the last message's window;
    ``step_time`` and ``busy_time`` count only ranks that have made a step.
    """
    out = []
    for row in state.rows:
        if key == "rate":
            value = row["rate"] if row.get("rate") is not None else (row["samples_per_s"] or None)
        elif key in ("step_time", "busy_time"):
            value = row[key] if row["step"] and row[key] else None
        else:
            value = row.get(key)
        out.append(value)
    return out


def distributions(state) -> list:
    """For each of :data:`METRICS`: ``(key, label, unit, summary or None)`` over the ranks."""
    return [(key, label, unit, summary(rank_values(state, key))) for key, label, unit in METRICS]


def slowest(state, n: int = SLOWEST) -> list:
    """The ``n`` ranks with the longest time per step: dicts of rank, host, time, skew, basis.

    The time is the busy (CPU) time per step when every rank reports it (time not spent waiting
    for peers: a straggler stands out even though the collectives equalise the wall time), else
    the wall step time (:meth:`ProgressState.time_per_step`); ``skew`` is the fraction above the median.
    """
    times, basis = state.time_per_step()
    skews = state.skews()
    known = sorted(((t, r) for r, t in enumerate(times) if t is not None), reverse=True)[:n]
    return [dict(rank=r, host=state.rows[r]["host"], time=t, skew=skews[r], basis=basis) for t, r in known]


def attention(state) -> list:
    """Ranks that failed, then ranks that were stopped (interrupted): their rows, in rank order within each."""
    rows = state.rows
    return [r for r in rows if r["status"] == "failed"] + [r for r in rows if r["status"] == "interrupted"]


def status_counts(state) -> dict:
    """``{status: number of ranks}`` in :data:`distnb.display.progress.STATUSES` order, zeros left out."""

    counts = {}
    for row in state.rows:
        counts[row["status"]] = counts.get(row["status"], 0) + 1
    return {s: counts[s] for s in (*STATUSES, *sorted(set(counts) - set(STATUSES))) if s in counts}


def sample_band(state) -> bool:
    """Add a point to ``state.band``: the mean, p10 and p90 of the ranks' newest losses; True if added.

    The point's x is the median of the ranks' newest loss steps (data-parallel ranks are within a
    step or two of each other); it is added only when that has moved past the last point, and
    only once every rank has reported a loss. ``state.band`` is a
    :class:`~distnb.display.progress.Series` of ``(step, (mean, low, high))``.
    """
    latest = [c.points[-1] for c in state.curves if c.points]
    if not latest or len(latest) < state.world_size:
        return False
    steps = sorted(s for s, _ in latest)
    losses = sorted(v for _, v in latest)
    x = quantile(steps, 0.5)
    if state.band.points and x <= state.band.points[-1][0]:
        return False
    return state.band.add(x, (math.fsum(losses) / len(losses), quantile(losses, BAND[0]), quantile(losses, BAND[1])))


def pages(state, rows_per_page: int = PAGE_ROWS) -> list:
    """The per-rank table's pages: ``(title, ranks)`` with whole hosts per page, in rank order.

    Ranks are numbered host by host, so a page is a run of hosts; a host with more than
    ``rows_per_page`` ranks is split. A title reads ``"ranks 0-31 · node0-node3"``.
    """
    out, current = [], []

    def close():
        if current:
            hosts = [state.rows[current[0]]["host"], state.rows[current[-1]]["host"]]
            where = hosts[0] if hosts[0] == hosts[1] else f"{hosts[0]}-{hosts[1]}"
            title = f"ranks {current[0]}-{current[-1]}" + (f" · {where}" if where else "")
            out.append((title, list(current)))
            current.clear()

    r = 0
    while r < state.world_size:
        host = state.rows[r]["host"]
        end = r
        while end < state.world_size and state.rows[end]["host"] == host:
            end += 1
        block = list(range(r, end))
        if current and len(current) + len(block) > rows_per_page:
            close()
        while len(block) > rows_per_page:
            current.extend(block[:rows_per_page])
            block = block[rows_per_page:]
            close()
        current.extend(block)
        r = end
    close()
    return out
