"""The tutorial notebooks in notebooks/ as stored (read as JSON, nothing is run)."""

from __future__ import annotations

import json
from pathlib import Path

NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"
#: The cell tag with which nbval and ``jupyter nbconvert --execute`` (nbclient) let a cell raise.
RAISES = "raises-exception"


def notebooks() -> list:
    """The tutorial notebooks' paths, sorted."""
    return sorted(NOTEBOOKS.glob("*.ipynb"))


def code_cells(path) -> list:
    """``(index, cell)`` of every code cell of the notebook at ``path``."""
    with open(path, encoding="utf-8") as f:
        cells = json.load(f)["cells"]
    return [(i, c) for i, c in enumerate(cells) if c["cell_type"] == "code"]


def source(cell) -> str:
    return "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]


def tagged(cell, tag=RAISES) -> bool:
    return tag in cell.get("metadata", {}).get("tags", [])


def errors(cell) -> list:
    """The error outputs of ``cell`` (``ename``, ``evalue``, ...)."""
    return [o for o in cell.get("outputs", []) if o["output_type"] == "error"]


def raising_notebooks() -> list:
    """The notebooks with a cell that raises on purpose (tagged ``raises-exception``)."""
    return [p for p in notebooks() if any(tagged(c) for _, c in code_cells(p))]
