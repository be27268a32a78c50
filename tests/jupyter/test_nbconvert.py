"""The notebooks with cells that fail on purpose run clean under ``jupyter nbconvert --execute``.

nbconvert (nbclient) stops at the first cell that raises unless the cell carries the
``raises-exception`` tag; nbval (which runs every notebook in the suite) does not stop, so only
this catches a missing tag. Only the notebooks with such cells are run here
(:func:`support.notebooks.raising_notebooks`): for the others nbconvert and nbval stop at the
same errors. A real ``jupyter nbconvert --to notebook --execute`` in a fresh kernel of this
environment (the suite's isolated Jupyter dirs, text progress); the executed copy goes to a
temporary folder, the stored notebook is untouched. The notebook stops its own cluster.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
from support import notebooks as nbs

pytestmark = pytest.mark.timeout(240)


@pytest.mark.parametrize("path", nbs.raising_notebooks(), ids=lambda p: p.name)
def test_notebook_runs_clean_under_nbconvert_execute(path, tmp_path):
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "jupyter", "nbconvert", "--to", "notebook", "--execute",
                           "--ExecutePreprocessor.timeout=120", "--output-dir", str(tmp_path), str(path)],
                          capture_output=True, text=True, timeout=220, cwd=path.parent)
    seconds = time.monotonic() - t0
    assert proc.returncode == 0, f"nbconvert --execute {path.name} failed ({proc.returncode}):\n{proc.stderr[-3000:]}"
    executed = tmp_path / path.name
    with open(executed, encoding="utf-8") as f:
        cells = [c for c in json.load(f)["cells"] if c["cell_type"] == "code"]
    assert cells and all(c["execution_count"] is not None for c in cells), "a cell was not run"
    raised = {i: [e["ename"] for e in nbs.errors(c)] for i, c in enumerate(cells) if nbs.errors(c)}
    expected = {i: [e["ename"] for e in nbs.errors(c)] for i, (_, c) in enumerate(nbs.code_cells(path))
                if nbs.tagged(c)}
    assert raised == expected, f"cells that raised {raised}, the tagged ones as stored {expected}"
    print(f"nbconvert --execute {path.name}: {seconds:.1f} s")
