"""distnb: interactive distributed PyTorch training in Jupyter.

``%load_ext distnb`` registers the ``%dist`` / ``%%dist`` and ``%%distrain`` magics;
``distnb.start()`` is the Python API behind them. Nothing heavy (torch, ipyparallel)
is imported until it is used.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"
#: The public names. Everything else (``distnb.session``, ``distnb.engine``, ...) is internal: it may move or
#: change between versions (the magics and these names do not).
__all__ = [
    # the Python API behind the magics (attach: %dist attach, join a world from a new kernel)
    "start", "current", "attach", "Session", "TrainResult",
    # the errors distnb raises on purpose
    "DistnbError", "PlanError", "ClusterError", "RankError", "HangError", "CollectiveMismatchError", "PeerFailed",
    "BusyError", "Interrupted",
    # IPython's extension hooks (%load_ext distnb, %unload_ext distnb)
    "load_ipython_extension", "unload_ipython_extension",
]

from distnb.core.errors import (
    BusyError,
    ClusterError,
    CollectiveMismatchError,
    DistnbError,
    HangError,
    Interrupted,
    PeerFailed,
    PlanError,
    RankError,
)

#: Public names imported at first use (``import distnb`` stays light: no ipyparallel, no torch): name -> module.
_LAZY = {"start": "distnb.session", "current": "distnb.session", "Session": "distnb.session",
         "TrainResult": "distnb.train.results", "attach": "distnb.attaching"}


def __getattr__(name):
    """``distnb.start``, ``distnb.current`` and ``distnb.Session`` are :mod:`distnb.session`'s, ``distnb.attach`` is
    :func:`distnb.attaching.attach`, ``distnb.TrainResult`` is :class:`distnb.train.results.TrainResult`: imported at first
    use (``import distnb`` stays light), their signatures and help are the real ones."""
    if name in _LAZY:

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'distnb' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_LAZY))


def load_ipython_extension(ipython):
    """Register distnb's magics (``%load_ext distnb``) and start the engine template in the background.

    The template (:mod:`distnb.cluster.zygote`) imports torch and the engine's modules once, so that
    ``%dist start`` can fork CPU engines instead of importing all of it in each of them.
    ``DISTNB_ZYGOTE=0`` turns it off.
    """
    from distnb import kernelstop  # loads psutil: at first use, not when this module is imported
    from distnb.cluster import zygote  # at load_ext only: `import distnb` stays free of IPython and zmq
    from distnb.magics import DistMagics  # loads IPython, psutil: at first use, not when this module is imported

    ipython.register_magics(DistMagics)
    kernelstop.install(ipython)  # a kernel restart stops a running training cell as the interrupt does
    if help_cell not in ipython.input_transformers_cleanup:
        ipython.input_transformers_cleanup.append(help_cell)
    zygote.warm()


def help_cell(lines: list) -> list:
    """``%%distrain --help`` (or ``-h``, ``%%dist``) in a cell with no body, as the line magic that prints the help.

    IPython refuses a cell magic whose body is empty before the magic sees its line ("the cell
    body is empty"); this input transformer (``InteractiveShell.input_transformers_cleanup``)
    runs first. Any other cell is returned unchanged.
    """
    head = lines[0].lstrip() if lines else ""
    words = head.split()
    if (words and words[0] in ("%%distrain", "%%dist") and ({"-h", "--help"} & set(words))
            and not "".join(lines[1:]).strip()):
        return [head[1:]]
    return lines


def unload_ipython_extension(ipython):
    """``%unload_ext distnb`` (and ``%reload_ext``): stop the cluster this kernel started and the engine
    template, and unregister the magics (``%dist`` is then an unknown magic, as before ``%load_ext``)."""
    from distnb import session  # loads IPython, ipyparallel, psutil: at first use, not when this module is imported
    from distnb.cluster import zygote  # loads psutil: at first use, not when this module is imported

    if session._CURRENT is not None:
        session._CURRENT._end_background()
        session._CURRENT.stop(quiet=not session._CURRENT.running)  # says what it stopped, as %dist stop does
    zygote.stop()
    if help_cell in ipython.input_transformers_cleanup:
        ipython.input_transformers_cleanup.remove(help_cell)
    manager = ipython.magics_manager
    for kind, name in (("line", "dist"), ("cell", "dist"), ("line", "distrain"), ("cell", "distrain")):
        manager.magics[kind].pop(name, None)
    manager.registry.pop("DistMagics", None)
