"""Failed ranks as :class:`~distnb.core.errors.RankError` failure dicts: tracebacks cleaned, root cause first.

Stdlib only. :func:`clean_traceback` strips ANSI colours and ipyparallel's and distnb's own
frames from a remote traceback and folds torch's call plumbing between the user's frames
(:func:`fold_frames`); :func:`full_traceback` is the same text uncut. :func:`order_failures` marks the failures that look like a
consequence of another rank's (a closed gloo connection) and sorts them last, so that a
:class:`~distnb.core.errors.RankError` names the root cause first.
"""

from __future__ import annotations

import os
import re
import types

from distnb.core.errors import ranks_named  # noqa: F401  (cluster.py names late ranks with it)

_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
_OWN_FRAMES = (os.sep + "ipyparallel" + os.sep,  # distnb/: this file is in distnb/core/
               os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep, "File <string>")
#: Messages of a rank whose peer failed first (rank 0's store gave up on ranks that could not reach it:
#: "waiting for clients").
_COLLATERAL_MARKERS = ("Connection closed by peer", "Connection reset", "process group is broken", "Broken pipe",
                       "waiting for clients", "stopped because rank")


#: The C++ stack torch appends to its errors (c10::Error, DistBackendError): "Exception raised from recvValue at
#: ...:NN (most recent call first):" and one "frame #N: ..." line per native frame, of no use in a notebook.
_CPP_STACK = re.compile(r"\n?Exception raised from [^\n]*\(most recent call first\):"
                        r"(?:\n(?:frame #\d+:|<omitting)[^\n]*)*")


def clean_message(text: str) -> str:
    """An exception's message without the C++ stack torch appends to it (:data:`_CPP_STACK`)."""
    return _CPP_STACK.sub("", text) if isinstance(text, str) else text


def full_traceback(tb: str) -> str:
    """The remote traceback as plain text (no ANSI colours), every frame kept."""
    return _ANSI.sub("", tb or "").strip("\n")


def clean_traceback(tb: str) -> str:
    """The remote traceback as plain text, without ipyparallel's and distnb's own frames, torch's folded.

    IPython formats remote tracebacks as blocks ("File PATH:LINE, in FUNC" plus context
    lines) separated by blank lines; the user's frames (``<distrain-cell-N>``, notebook
    classes and functions), the frame where the error was raised and the exception itself are
    kept; runs of torch frames between them become one line (:func:`fold_frames`).
    """
    keep = []
    for block in clean_message(_ANSI.sub("", tb or "")).split("\n\n"):
        lines = block.split("\n")
        for i, line in enumerate(lines):
            if line.startswith("File ") and any(m in line for m in _OWN_FRAMES):
                lines = lines[:i]  # an own frame: drop it, keep a header above it
                break
        if any(line.strip() for line in lines):
            keep.append("\n".join(lines))
    return "\n\n".join(fold_frames(keep)).strip("\n")


#: A frame in torch's files (the last ``torch/`` of its path), and the file's name there; :func:`fold_frames`.
_FOLDED = re.compile(r"^File .*[\\/]torch[\\/](\S+?\.py)")
_FRAME_STARTS = ("File ", "Cell In[")


def fold_frames(blocks: list) -> list:
    """``blocks`` (of a traceback, see :func:`clean_traceback`) with each run of 2 or more torch frames
    made one line, "... 8 frames in torch (nn/modules/module.py, nn/parallel/distributed.py) ...".

    A frame right before a block that is not a frame (the exception, a chained traceback's
    header) is where the error was raised: it is kept. So is every frame outside torch.
    """
    out, run = [], []  # run: (block, file in torch) of the torch frames not yet written

    def flush():
        if len(run) >= 2:
            files = ", ".join(dict.fromkeys(name for _, name in run))
            out.append(f"... {len(run)} frames in torch ({files}) ...")
        else:
            out.extend(block for block, _ in run)
        run.clear()

    for i, block in enumerate(blocks):
        first = block.split("\n", 1)[0]
        match = _FOLDED.match(first)
        raised_here = i + 1 == len(blocks) or not blocks[i + 1].startswith(_FRAME_STARTS)
        if match is not None and not raised_here:
            run.append((block, match.group(1)))
            continue
        flush()
        out.append(block)
    flush()
    return out


def remote_error(exc) -> dict:
    """A RankError failure's ``ename``, ``evalue``, ``traceback`` (cleaned) and ``full_traceback`` of an
    ipyparallel ``RemoteError``."""
    return dict(ename=exc.ename, evalue=clean_message(exc.evalue), traceback=clean_traceback(exc.traceback),
                full_traceback=full_traceback(exc.traceback))


def is_collateral(failure: dict) -> bool:
    """Whether a failure looks like a consequence of another rank's (a closed gloo connection)."""
    text = f"{failure.get('evalue')}"
    return failure.get("ename") == "PeerFailed" or any(m in text for m in _COLLATERAL_MARKERS)


def order_failures(failures: list, collateral=()) -> list:
    """``failures`` with ``collateral`` set on each, root causes first, then by time failed and rank.

    ``collateral`` are ranks distnb itself interrupted; they sort after the others, with the
    failures that :func:`is_collateral`.
    """
    for f in failures:
        f["collateral"] = bool(f["rank"] in collateral or is_collateral(f))
    return sorted(failures, key=lambda f: (f["collateral"], f.get("failed_at") or float("inf"), f["rank"]))


_UNDEFINED = re.compile(r"^name '([A-Za-z_][A-Za-z0-9_]*)' is not defined")


def notebook_name_hint(failures, ns: dict) -> str:
    """The fix when a ``%%dist`` cell failed with NameError for a name the notebook defines, else ''.

    A ``%%dist`` cell runs on the ranks as written (a training body gets the names it reads pushed; this does
    not): ``os`` imported in the notebook is not defined there, and Python's NameError did not say why.
    """
    for f in failures:
        m = _UNDEFINED.match(f.get("evalue") or "") if f.get("ename") == "NameError" else None
        if m and m.group(1) in ns:
            name = m.group(1)
            module = ns[name].__name__ if isinstance(ns[name], types.ModuleType) else None
            fix = (f"define it in the cell, or send the notebook's with %dist push {name}" if module is None else
                   f"import {module} in the cell" if module == name else f"import {module} as {name} in the cell")
            return (f"{name} is defined in the notebook, not on the ranks: a %%dist cell runs there as written; "
                    f"{fix}")
    return ""


_FRAME = re.compile(r"(?:, line \d+|:\d+), in ([A-Za-z_][A-Za-z0-9_]*)")


def body_name_hint(failures, ns: dict, body_names) -> str:
    """The fix when a notebook function failed with NameError for one of the step body's own names, else ''.

    ``body_names``: what a training body has in scope on the ranks (``model``, ``ctx``, ``batch``, ...).
    A notebook function travels by value with the notebook globals it reads, and those names are not
    among them: ``ctx.after_backward(halve)`` with ``halve`` reading ``model`` failed with Python's bare
    "name 'model' is not defined", while the body beside it used ``model``.
    """
    for f in failures:
        m = _UNDEFINED.match(f.get("evalue") or "") if f.get("ename") == "NameError" else None
        if not m or m.group(1) not in body_names:
            continue
        frames = _FRAME.findall(f.get("full_traceback") or f.get("traceback") or "")
        fn, name = (frames[-1] if frames else None), m.group(1)
        if fn and isinstance(ns.get(fn), types.FunctionType):
            return (f"{fn} is a notebook function: the ranks got it by value with the notebook's globals it reads, and "
                    f"{name} is not one of them ({name} is the step body's, on the ranks); pass it in: "
                    f"def {fn}({name}, ...) and call {fn}({name}) from the body (ctx.after_backward(lambda: {fn}({name})))")
    return ""


def _is_module(obj) -> bool:
    """Whether ``obj`` is a ``torch.nn.Module`` (without importing torch in the kernel's error path)."""
    return any(f"{c.__module__}.{c.__qualname__}" == "torch.nn.modules.module.Module" for c in type(obj).__mro__)


def module_name_hint(failures, ns: dict, model_name: str) -> str:
    """The fix when the body used a notebook name bound to a ``torch.nn.Module`` (``m = net``, then ``m(x)``), else ''.

    Models are never pushed by name: each rank holds its own copy of ``--model``, distributed by the
    strategy, and the body reaches it as ``model``; another notebook name for a module is not defined
    on the ranks, and Python's bare NameError said nothing of that.
    """
    for f in failures:
        m = _UNDEFINED.match(f.get("evalue") or "") if f.get("ename") == "NameError" else None
        if m and _is_module(ns.get(m.group(1))):
            name = m.group(1)
            same = " (the same object as --model " + model_name + ")" if ns.get(name) is ns.get(model_name) else ""
            return (f"{name} is a torch.nn.Module in the notebook{same}: modules are not sent to the ranks by name; "
                    f"the body reaches the model the cell trains as `model` (the strategy's wrapper), e.g. "
                    f"`model(x)`; another module it needs goes in as a submodule of --model, or is built on the ranks "
                    "in a %%dist cell")
    return ""
