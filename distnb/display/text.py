"""Text progress for terminals and nbval: one line per epoch and one per status change."""

from __future__ import annotations

import sys

from distnb.display import aggregate, scale


def _fmt(x, spec):
    return "-" if x is None else format(x, spec)


def _ranks_text(st, epoch) -> str:
    """Each rank's samples/s over ``epoch``, or above the scale threshold their spread and the slowest rank.

    A rank's rate for an epoch is its own (samples it trained in that epoch over the epoch's time,
    :meth:`distnb.engine.transport.report.Reporter.end_epoch`), "-" while it has not said (the newest figures when
    no rank sent per-epoch rates); above the threshold the slowest rank is the one slowest over the last second.
    """
    rates = [st.epoch_rates[r["rank"]].get(epoch) for r in st.rows]
    if all(x is None for x in rates):  # messages without per-epoch rates: the newest figures instead
        rates = [r["samples_per_s"] for r in st.rows] if st.world_size <= aggregate.SCALE_THRESHOLD else \
            aggregate.rank_values(st, "rate")
    if st.world_size <= aggregate.SCALE_THRESHOLD:
        return "  ".join(f"rank {r['rank']} {_fmt(rate, '.0f')} samples/s" for r, rate in zip(st.rows, rates))
    spread = aggregate.summary(rates)
    slow = aggregate.slowest(st, 1)
    text = f"{st.world_size} ranks"
    if spread:
        text += f" samples/s min {spread['min']:.0f} median {spread['median']:.0f} max {spread['max']:.0f}"
    if slow:
        s = slow[0]
        text += f"  slowest rank {s['rank']} ({s['host']})" + ("" if s["skew"] is None else f" {100 * s['skew']:+.0f}%")
    return text


def _all_said(st, epoch) -> bool:
    """Whether every rank that is still training or done has reported its rate for ``epoch``."""
    return all(epoch in st.epoch_rates[r["rank"]] for r in st.rows if r["status"] in ("running", "done"))


class TextProgress:
    """Prints compact progress lines as rank messages arrive (no redraws, no escape codes)."""

    def __init__(self, state, stream=None):
        self.state = state
        self.stream = stream or sys.stdout
        self._epochs_shown = set()
        self._first = self._slot = None  # the cell's first epoch; the next epoch number due a line
        self._status_shown = {}
        self._where_shown = {}

    def show(self):
        pass

    def refresh(self, final=False):
        st = self.state
        if st.start and not st.start_shown:  # how the cell started (a new optimizer, ...): before its epoch lines

            st.start_shown = True
            for note in start_notes(st.start):
                print(f"distnb: {note}", file=self.stream)
        every = max(1, -(-st.epochs // 10))  # at most ~10 epoch lines per cell: the first, every `every`-th, the last
        epochs = sorted(st.epoch_means)
        if epochs and self._first is None:
            self._first = self._slot = epochs[0]  # the cell's first epoch (epochs are carried between cells)
        for epoch in epochs:
            last = epoch == self._first + st.epochs - 1 or (final and epoch == epochs[-1])  # also a cell stopped early
            # by epoch number, not position: an epoch the kernel never read (more than TAIL of them between two
            # looks) leaves its line to the next one read, and the lines after it keep to the same grid
            if epoch in self._epochs_shown or (epoch < self._slot and not last):
                continue
            if not final and not _all_said(st, epoch):  # the line waits (a report interval) for every rank's rate
                break
            self._epochs_shown.add(epoch)
            self._slot = self._first + ((epoch - self._first) // every + 1) * every
            ranks = _ranks_text(st, epoch)
            extra = ""
            if st.validation:
                loss, metric = st.validation[max(st.validation)]
                extra = f"  val loss {loss:.4f}" + (f" {st.metric_name} {metric:.4f}" if metric is not None else "")
            print(f"epoch {epoch:>3}  mean loss {st.epoch_means[epoch]:.4f}{extra}  |  {ranks}", file=self.stream)
        for r in st.rows:  # a rank that stalls: where it is, once per spot
            if r.get("where") and r["status"] == "running" and self._where_shown.get(r["rank"]) != r["where"].rsplit(" for ", 1)[0]:
                self._where_shown[r["rank"]] = r["where"].rsplit(" for ", 1)[0]
                print(f"rank {r['rank']} is {r['where']}", file=self.stream)
        shown = 0
        attention = aggregate.attention(st) if final else []
        if all(r["status"] == "interrupted" and not r.get("error") for r in attention):
            attention = []  # the interrupt pressed, every rank stopped after one step: the cell's summary says where
        for r in attention:
            if self._status_shown.get(r["rank"]) != r["status"] and shown == scale.ATTENTION_ROWS:
                left = sum(self._status_shown.get(x["rank"]) != x["status"] for x in attention)
                print(f"... and {left} more ranks failed or stopped", file=self.stream)
                break
            if self._status_shown.get(r["rank"]) != r["status"]:
                shown += 1
                self._status_shown[r["rank"]] = r["status"]
                detail = f": {r['error']}" if r.get("error") else ""
                # the cell's step count (the progress bar's), not the step within the epoch that the
                # interrupt summary names; the epoch is the last one the rank reported, if any
                epoch = f" in epoch {r['epoch']}" if r.get("epoch") is not None else ""
                place = f"after {r['step']} of this cell's steps{epoch}"
                if str(r.get("error") or "").startswith("EngineDied"):  # a dead rank says nothing more: its last report
                    place = (f"(last reported after {r['step']} of this cell's steps{epoch}; it may have got further)"
                             if r["step"] or r.get("epoch") is not None else "(it had reported no step)")
                print(f"rank {r['rank']} {r['status']} {place}{detail}", file=self.stream)
        self.stream.flush()

    def close(self):
        self.refresh(final=True)
        if self.state.world_size > aggregate.SCALE_THRESHOLD:  # at scale: the spread, not one line per rank
            print("\n".join(scale.summary_text(self.state)), file=self.stream)
            self.stream.flush()


class NullView(TextProgress):
    """Shows nothing."""

    def refresh(self, final=False):
        pass

    def close(self):
        pass


def start_notes(first: dict) -> list:
    """The sentences about how a training cell started, from rank 0's row or its first progress message.

    What changed about the optimizer or the position, the checkpoint resumed from, the epoch continued.
    The text progress prints them before the cell's epoch lines (:class:`distnb.display.text.TextProgress`).
    """
    notes = first["note"].splitlines() if first.get("note") else []  # one a line (engine/train/loop.notes)
    if first.get("resumed"):
        notes.append(f"resumed from checkpoint {first['resumed']}")
    if first.get("continued"):
        c = first["continued"]
        notes.append(f"continued epoch {c['epoch']} where it stopped ({c['samples']} samples per rank already "
                     "trained); it counts as the first of this cell's epochs")
    return notes
