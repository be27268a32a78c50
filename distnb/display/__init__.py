"""Progress display for training cells: pure state, an ipywidgets dashboard, a text fallback."""

from __future__ import annotations

import os

from distnb.display.progress import ProgressState


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


def view_kind(mode: str = "auto") -> str:
    """Resolve ``mode`` (auto, widgets, text, none) to the view that will be shown."""
    env = os.environ.get("DISTNB_PROGRESS", "").lower()
    if mode == "auto" and env in ("text", "none", "widgets"):
        mode = env
    if mode == "auto":
        return "widgets" if widgets_available() else "text"
    return mode


def make_view(state: ProgressState, mode: str = "auto"):
    """The progress view for ``mode``: ``auto``, ``widgets``, ``text`` or ``none``."""
    kind = view_kind(mode)
    if kind == "none":
        from distnb.display.text import NullView  # the view is picked at first use

        return NullView(state)
    if kind == "widgets":
        from distnb.display.widgets import Dashboard  # loads IPython, ipywidgets at first use

        return Dashboard(state)
    from distnb.display.text import TextProgress  # the view is picked at first use

    return TextProgress(state)
