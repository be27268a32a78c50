"""Shared fixtures: one real 2-rank cluster per session, started through a real IPython shell.

The environment (temporary IPython/Jupyter dirs) and the leak check live in ../conftest.py.
"""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def shell():
    """A real IPython shell with distnb loaded and a real 2-rank gloo cluster started by ``%dist start``."""
    from IPython.core.interactiveshell import InteractiveShell
    from traitlets.config import Config

    from distnb import session

    config = Config()
    config.HistoryManager.enabled = False
    sh = InteractiveShell.instance(config=config)
    sh.run_line_magic("load_ext", "distnb")
    sh.run_line_magic("dist", "start -n 2 --timeout 30")
    assert session._CURRENT is not None, "the cluster did not start"
    yield sh
    if session._CURRENT is not None:
        session._CURRENT.stop(quiet=True)


@pytest.fixture
def dist_session(shell):
    """The running :class:`distnb.session.Session` of the shared shell."""
    from distnb import session

    return session.current()
