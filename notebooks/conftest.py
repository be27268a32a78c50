"""nbval collection for the notebooks: 04_multi_node.ipynb needs Open MPI and mpi4py.

Its executed part starts the engines with ``%dist start --launcher mpi``; on a machine
without ``mpiexec`` or ``mpi4py`` its cells are skipped with the reason instead of failing.
"""

from __future__ import annotations

import importlib.util
import shutil

import pytest

MPI_NOTEBOOK = "04_multi_node.ipynb"


def mpi_missing() -> str | None:
    """Why ``--launcher mpi`` cannot run here, or None."""
    if shutil.which("mpiexec") is None:
        return "mpiexec is not on PATH (Debian/Ubuntu: apt install openmpi-bin)"
    if importlib.util.find_spec("mpi4py") is None:
        return 'mpi4py is not installed (pip install mpi4py, or the [mpi] extra of distnb)'
    return None


def pytest_collection_modifyitems(config, items):
    """Skip every cell of the MPI notebook where mpiexec or mpi4py is missing."""
    reason = mpi_missing()
    if reason is None:
        return
    skip = pytest.mark.skip(reason=f"{MPI_NOTEBOOK} runs %dist start --launcher mpi: {reason}")
    for item in items:
        if item.path.name == MPI_NOTEBOOK:
            item.add_marker(skip)
