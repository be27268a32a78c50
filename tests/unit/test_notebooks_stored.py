"""The notebooks' stored form: cells that fail on purpose are tagged, stored outputs are current.

``jupyter nbconvert --execute`` (nbclient) stops at the first error unless the cell carries the
``raises-exception`` tag; nbval honours the same tag (and its ``NBVAL_RAISES_EXCEPTION`` comment,
which nbconvert ignores). tests/jupyter/test_nbconvert.py runs the notebooks with such cells
under nbconvert; these checks read the files only.
"""

import re

import pytest
from support import notebooks as nbs

from distnb.train.results import StatusTable


def test_the_notebooks_are_found():
    names = [p.name for p in nbs.notebooks()]
    assert "01_quickstart.ipynb" in names and "03_failures.ipynb" in names
    assert "03_failures.ipynb" in [p.name for p in nbs.raising_notebooks()]  # the checks below are not empty


@pytest.mark.parametrize("path", nbs.notebooks(), ids=lambda p: p.name)
def test_every_cell_stored_with_an_error_is_tagged_raises_exception_and_no_other(path):
    cells = nbs.code_cells(path)
    untagged = [i for i, c in cells if nbs.errors(c) and not nbs.tagged(c)]
    assert untagged == [], f"{path.name}: cells {untagged} store an error but lack the {nbs.RAISES!r} tag " \
                           "(jupyter nbconvert --execute stops there)"
    stale = [i for i, c in cells if nbs.tagged(c) and not nbs.errors(c)]
    assert stale == [], f"{path.name}: cells {stale} are tagged {nbs.RAISES!r} but their stored output has no error"
    comment = [i for i, c in cells if "NBVAL_RAISES_EXCEPTION" in nbs.source(c) and not nbs.tagged(c)]
    assert comment == [], f"{path.name}: cells {comment} say NBVAL_RAISES_EXCEPTION (nbval only) without the tag"


def test_stored_status_tables_have_the_current_columns_and_live_ranks():
    """Every ``%dist status`` table stored in a notebook shows today's columns, every rank alive."""
    checked = []
    for path in nbs.notebooks():
        for i, cell in nbs.code_cells(path):
            if not re.search(r"^%dist status\b", nbs.source(cell), re.MULTILINE):
                continue
            for output in cell.get("outputs", []):
                lines = "".join(output.get("data", {}).get("text/plain", "")).splitlines()
                head = next((j for j, line in enumerate(lines) if line.startswith("rank ")), None)
                if head is None:
                    continue
                where = f"{path.name} cell {i}"
                assert tuple(lines[head].split()) == StatusTable.columns, f"{where}: stale columns {lines[head]!r}"
                alive = [line.split()[-1] for line in lines[head + 2:] if line.strip()]
                assert alive and set(alive) == {"True"}, f"{where}: a stored rank is not alive: {alive}"
                checked.append(where)
    assert "01_quickstart.ipynb cell 6" in checked  # the quickstart's table was found and read
