"""What the ranks print, shown in the notebook once: identical lines folded across ranks and over time.

:class:`LineFolder` receives each rank's new stdout/stderr text as the execute path reads it
(:class:`distnb.execute.execute.Watch`) and writes complete lines to the notebook's streams, tagged
with the ranks that printed them:

- the same line printed by several ranks within :data:`WINDOW` seconds is shown once,
  ``[ranks 0-3] UserWarning: ...`` (``[rank 2] ...`` when one rank printed it);
- a line on stderr that was already shown (a warning repeated every step) is not shown
  again; when the cell ends, one line says how many more times it came, and from which ranks;
- lines that differ are all shown, in the order they were read (``--all-output`` shows every
  rank's distinct lines in time order);
- the frames of a C++ backtrace on stderr (``frame #3: c10d::TCPStore::check(...)``, torch's warnings
  when a peer's socket closes: about 40 lines per warning on every rank left when rank 0, which serves
  the store, dies) are left out, and one line says how many.
"""

from __future__ import annotations

import collections
import re
import time

from distnb.core.errors import rank_list  # noqa: F401  (named here too: the tags use it)

#: Seconds lines are held so the same line from several ranks can be shown once.
WINDOW = 0.3
#: A line of a C++ backtrace that torch prints under ``Exception raised from ... (most recent call first):``
CPP_FRAME = re.compile(r"^frame #\d+: |^<omitting python frames>$")


def tag(ranks, world_size: int) -> str:
    """The prefix of a line printed by ``ranks`` (none in a 1-rank world)."""
    if world_size <= 1:
        return ""
    ranks = sorted(set(ranks))
    return f"[rank {ranks[0]}] " if len(ranks) == 1 else f"[ranks {rank_list(ranks)}] "


class LineFolder:
    """Folds the lines ranks print; see the module docstring.

    Parameters
    ----------
    streams : dict
        ``{"stdout": file, "stderr": file}`` to write to.
    world_size : int
    clock : callable, optional
        Seconds (default ``time.monotonic``).
    """

    def __init__(self, streams: dict, world_size: int, clock=time.monotonic):
        self.streams, self.world_size, self.clock = streams, world_size, clock
        self._partial = {}  # (rank, stream) -> text after the last newline
        self._pending = collections.deque()  # [stream, line, ranks, first seen], in arrival order
        # (stream, line) -> [items of it written already, its pending items in order, {rank: items it is in}]:
        # a rank's k-th copy of a line joins that line's k-th item, so no line is compared with every pending one
        # (a rank printing 100,000 lines at once took minutes: each line scanned all those before it)
        self._by_line = {}
        self._repeats = {}  # (stream, line) -> {rank: times} for stderr lines already shown
        self._frames = {}  # (rank, "stderr") -> C++ backtrace frames left out since its last other line

    def feed(self, rank: int, stream: str, text: str) -> None:
        """``rank`` printed ``text`` (any piece of its output) to ``stream``."""
        text = self._partial.pop((rank, stream), "") + text
        *lines, rest = text.split("\n")
        if rest:
            self._partial[(rank, stream)] = rest
        now = self.clock()
        for line in lines:
            self._add(rank, stream, line, now)

    def _add(self, rank, stream, line, now) -> None:
        if stream == "stderr" and CPP_FRAME.match(line):
            self._frames[(rank, stream)] = self._frames.get((rank, stream), 0) + 1
            return
        if self._frames.get((rank, stream)):
            self._say_frames(rank, stream, now)
        key = (stream, line)
        if stream == "stderr" and key in self._repeats:
            counts = self._repeats[key]
            counts[rank] = counts.get(rank, 0) + 1
            return
        entry = self._by_line.setdefault(key, [0, collections.deque(), {}])
        written, items, joined = entry
        position = max(joined.get(rank, 0), written)  # the first of the line's items this rank is not in
        joined[rank] = position + 1
        if position - written < len(items):
            items[position - written][2].append(rank)
            return
        item = [stream, line, [rank], now]
        items.append(item)
        self._pending.append(item)

    def _say_frames(self, rank, stream, now) -> None:
        n = self._frames.pop((rank, stream))
        self._add(rank, stream, f"(the {n} line{'s' if n != 1 else ''} of its C++ backtrace left out)", now)

    def flush(self, final: bool = False) -> None:
        """Write the lines held longer than :data:`WINDOW` (all of them, and the repeat counts, if ``final``)."""
        if final:
            for (rank, stream), rest in sorted(self._partial.items()):
                self._add(rank, stream, rest, self.clock())
            self._partial.clear()
            for rank, stream in sorted(k for k, n in self._frames.items() if n):
                self._say_frames(rank, stream, self.clock())
        now = self.clock()
        while self._pending and (final or now - self._pending[0][3] >= WINDOW):
            stream, line, ranks, _ = self._pending.popleft()
            entry = self._by_line[(stream, line)]
            entry[1].popleft()
            entry[0] += 1
            if not entry[1]:
                del self._by_line[(stream, line)]
            self._write(stream, tag(ranks, self.world_size) + line + "\n")
            if stream == "stderr" and line.strip():
                self._repeats.setdefault((stream, line), {})
        if final:
            for (stream, line), counts in self._repeats.items():
                if counts:
                    n = sum(counts.values())
                    self._write(stream, f"{tag(counts, self.world_size)}(the line above, {line.strip()[:60]!r}, came "
                                        f"{n} more time{'s' if n != 1 else ''})\n")
            self._repeats.clear()
        for out in self.streams.values():
            out.flush()

    def _write(self, stream: str, text: str) -> None:
        self.streams[stream].write(text)
