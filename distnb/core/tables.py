"""Plain-text and HTML tables for results shown in a notebook (status, training figures)."""

from __future__ import annotations

import html


def _cell(v):
    if isinstance(v, float):
        return f"{v:.4g}" if abs(v) < 1e4 else f"{v:.0f}"
    return "" if v is None else str(v)


class Table:
    """A list of rows (dicts) shown as a text table (``repr``) or an HTML table in Jupyter."""

    columns: tuple = ()

    def __init__(self, rows, columns=None, title=""):
        self.rows = list(rows)
        if columns is not None:
            self.columns = tuple(columns)
        self.title = title
        self.notes = []  # lines shown under the table

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return self.rows[i]

    def __iter__(self):
        return iter(self.rows)

    def text(self) -> str:
        cells = [[_cell(r.get(c)) for c in self.columns] for r in self.rows]
        widths = [max([len(c)] + [len(row[i]) for row in cells]) for i, c in enumerate(self.columns)]
        line = lambda vals: "  ".join(v.rjust(w) for v, w in zip(vals, widths))  # noqa: E731
        out = [self.title] if self.title else []
        out += [line(self.columns), line(["-" * w for w in widths])] + [line(r) for r in cells]
        return "\n".join(out + list(self.notes))

    def __repr__(self):
        return self.text()

    def _repr_html_(self):
        head = "".join(f"<th>{html.escape(c)}</th>" for c in self.columns)
        body = "".join("<tr>" + "".join(f"<td>{html.escape(_cell(r.get(c)))}</td>" for c in self.columns) + "</tr>"
                       for r in self.rows)
        title = f"<b>{html.escape(self.title)}</b>" if self.title else ""
        notes = "".join(f"<div class='distnb-note'>{html.escape(n)}</div>" for n in self.notes)
        return f"{title}<table class='distnb-table'><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>{notes}"


def count(n: int, word: str) -> str:
    """``"1 rank"``, ``"2 ranks"``: a number and its noun."""
    return f"{n} {word}" if n == 1 else f"{n} {word}s"
