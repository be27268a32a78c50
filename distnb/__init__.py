"""distnb: interactive distributed PyTorch training in Jupyter.

``%load_ext distnb`` registers the ``%dist`` / ``%%dist`` and ``%%distrain`` magics;
``distnb.start()`` is the Python API behind them. Nothing heavy (torch, ipyparallel)
is imported until it is used.
"""

from __future__ import annotations

__version__ = "0.1.0"
__all__ = ["start", "current", "attach", "load_ipython_extension", "unload_ipython_extension",
           "DistnbError", "PlanError", "RankError", "ClusterError"]

from .errors import ClusterError, DistnbError, PlanError, RankError


def __getattr__(name):
    """``distnb.start``, ``distnb.current`` and ``distnb.attach`` are :func:`distnb.session.start`,
    :func:`distnb.session.current` and :func:`distnb.attaching.attach`,
    imported at first use (``import distnb`` stays light): their signatures and help are the real ones."""
    if name in ("start", "current"):
        from . import session

        return getattr(session, name)
    if name == "attach":  # %dist attach: join a world from a new kernel (distnb.attaching)
        from .attaching import attach

        return attach
    raise AttributeError(f"module 'distnb' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | {"start", "current", "attach"})


def load_ipython_extension(ipython):
    """Register distnb's magics (``%load_ext distnb``) and start the engine template in the background.

    The template (:mod:`distnb.zygote`) imports torch and the engine's modules once, so that
    ``%dist start`` can fork CPU engines instead of importing all of it in each of them.
    ``DISTNB_ZYGOTE=0`` turns it off.
    """
    from . import kernelstop, zygote  # at load_ext only: `import distnb` stays free of IPython and zmq
    from .magics import DistMagics

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
    from . import session, zygote

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
