"""Progress display for training cells: pure state, an ipywidgets dashboard, a text fallback."""

from __future__ import annotations

import os

from .progress import ProgressState


def widgets_available() -> bool:
    """True inside a Jupyter kernel (a widget front end may be attached) with ipywidgets installed.

    ``DISTNB_PROGRESS=text`` (or ``none``) in the environment forces the text fallback.
    """
    mode = os.environ.get("DISTNB_PROGRESS", "auto").lower()
    if mode in ("text", "none"):
        return False
    try:
        from IPython import get_ipython

        shell = get_ipython()
        if shell is None or type(shell).__name__ != "ZMQInteractiveShell":
            return False
        import ipywidgets  # noqa: F401
    except ImportError:
        return False
    return True


def make_view(state: ProgressState, mode: str = "auto"):
    """The progress view for ``mode``: ``auto``, ``widgets``, ``text`` or ``none``."""
    env = os.environ.get("DISTNB_PROGRESS", "").lower()
    if mode == "auto" and env in ("text", "none", "widgets"):
        mode = env
    if mode == "none":
        from .text import NullView

        return NullView(state)
    if mode == "widgets" or (mode == "auto" and widgets_available()):
        from .widgets import Dashboard

        return Dashboard(state)
    from .text import TextProgress

    return TextProgress(state)
