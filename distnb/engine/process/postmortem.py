"""A failed rank keeps its traceback for ``%dist debug``: post-mortem pdb, one command per call.

When a ``%%dist`` or ``%%distrain`` cell raises, the rank keeps the exception with its frames
(:func:`keep`) instead of clearing them, so that ``%dist debug`` can show their locals (the
DDP wrapper, the batch, the tensors). The broken process group must still close at once (the
peers blocked in a collective fail on "Connection closed by peer" instead of waiting for the
timeout), and gloo's sockets only close when nothing references the group any more: so
:func:`free_groups` takes the groups out of the objects that hold them (DDP's reducer and
logger, ``process_group`` attributes, dicts and lists, such as FSDP's mesh info or a pipeline
stage) while the objects themselves stay for pdb to show. The frames go (:func:`drop`) when
the debugging session ends or the next cell runs.

The debugging session is a :class:`pdb.Pdb` with its own input and output (text buffers),
set up on the kept traceback at the innermost frame of the user's code, as
``pdb.post_mortem`` does at the innermost frame (when the cell's code had returned, at the frame
of distnb's that ran it, seen with the cell's names: :func:`cell_runner`). The kernel drives it one command at a time
(:func:`debug_begin`, :func:`debug_command`, :func:`debug_end`); each call returns what pdb printed. Stdlib only
at import time (torch is imported when groups are freed).
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import io
import os
import pdb
import sys
import sysconfig
import traceback
import types
import weakref

#: Names the training loop binds in the rank namespace; a failure takes them out (they may hold the
#: wrapper) and the debugging session puts them back while it lasts.
NAMES = ("model", "ctx", "loss", "batch")
#: Commands that end the debugging session (and release the frames).
ENDING = frozenset({"q", "quit", "exit", "EOF", "c", "cont", "continue"})
#: Commands that would run the program on: it has finished, so they are refused.
REFUSED = {**dict.fromkeys(("n", "next", "s", "step", "r", "return", "unt", "until", "j", "jump", "run",
                             "restart"), "the cell has finished; post-mortem pdb cannot run it on"),
           "interact": "not on a rank: evaluate expressions with p, pp or ! instead"}
#: Most characters one command's output sends back to the kernel.
MAX_TEXT = 200_000
PROMPT = "(Pdb) "
#: Code names that start with "<" but are not the user's (generated code, frozen modules).
GENERATED = ("<frozen", "<string>", "<eval_with_key")
#: The names a cell's code is compiled under (:func:`distnb.engine.process.runtime.compile_cell`).
CELL_FILES = ("<dist-cell-", "<distrain-cell-")

#: The kept failure: exc, tb (from where the cell caught it), what ("%%dist cell", "training"), names.
KEPT: dict = {}
_SESSION: dict = {}  # "pdb": the Pdb of the debugging session going on, "restored": names put back in ns


def keep(exc: BaseException, ns: dict, what: str) -> None:
    """Keep ``exc`` with its frames for ``%dist debug`` (the one kept before is released).

    Call it where the cell catches the exception, before the process group is torn down: the
    traceback then starts at the cell's own frame, and :data:`NAMES` still in ``ns`` are kept
    with it (the tear-down takes them out of ``ns``).
    """
    _forget()
    KEPT.update(exc=exc, tb=exc.__traceback__, what=what, names={k: ns[k] for k in NAMES if k in ns})


def drop(ns: dict | None = None) -> bool:
    """End any debugging session and release the kept frames; True if there were any.

    The names a session put back in ``ns`` are taken out again.
    """
    had = bool(KEPT)
    if ns is not None:
        debug_end(ns, release=False)
    _forget()
    if had:
        gc.collect()
    return had


def _forget() -> None:
    exc = KEPT.get("exc")
    seen = set()
    while exc is not None and id(exc) not in seen:  # the locals go with the frames
        seen.add(id(exc))
        traceback.clear_frames(exc.__traceback__)
        exc = exc.__cause__ or exc.__context__
    tb = KEPT.get("tb")
    if tb is not None:
        traceback.clear_frames(tb)
    KEPT.clear()
    _SESSION.clear()


def live_groups() -> list:
    """The process groups torch knows now (before ``destroy_process_group``), or [] when no frames are kept."""
    if not KEPT or "torch.distributed" not in sys.modules:
        return []
    from torch.distributed import distributed_c10d as c10d

    return list(c10d._world.pg_map) if c10d.is_initialized() else []


def free_groups(groups: list) -> int:
    """After ``destroy_process_group``: take ``groups`` out of every object that still holds one.

    Every DistributedDataParallel object loses its reducer and logger (C++ objects holding the
    group) and its autograd hooks. Then each group, and each collective's handle (a ``Work``,
    which holds gloo's connections too) found in the kept frames, is replaced by None wherever
    it is held: in a dict (an object's attributes, a namespace), a list, or a frame's local
    variable. The objects themselves, and the tensors, stay. ``groups`` is emptied. Returns
    how many references were taken out.
    """
    if not groups:
        return 0
    from torch.nn.parallel import DistributedDataParallel

    changed = 0
    for obj in gc.get_objects():
        if type(obj) in weakref.ProxyTypes:  # isinstance() reads a proxy's class: ReferenceError once it is dead
            continue  # (torch.compile leaves such proxies behind; a failing cell then failed with that error)
        if isinstance(obj, DistributedDataParallel) and "reducer" in vars(obj):
            with contextlib.suppress(Exception):
                obj._remove_autograd_hooks()
            for attr in ("reducer", "logger"):
                vars(obj).pop(attr, None)
            changed += 1
    groups.extend(_handles())
    mine = sys._getframe()
    while groups:
        held = groups.pop()
        for holder in gc.get_referrers(held):
            if holder is not mine and holder is not groups:
                changed += _take_out(holder, held)
        del held
    return changed


def _handles() -> list:
    """The collectives' handles (``torch.distributed.Work``) in the kept frames' locals, or one or two steps in."""
    from torch.distributed import Work

    found, seen = [], set()

    def look(value, depth):
        if id(value) in seen or type(value) in weakref.ProxyTypes:  # a dead proxy raises at isinstance()
            return
        seen.add(id(value))
        if isinstance(value, Work):
            found.append(value)
        elif depth and type(value) in (list, tuple, set, dict):
            for item in list(value.values() if type(value) is dict else value)[:1000]:
                look(item, depth - 1)
        elif depth and not isinstance(value, (type, types.ModuleType)) and isinstance(getattr(value, "__dict__", None), dict):
            for item in list(vars(value).values())[:1000]:
                look(item, depth - 1)

    for value in KEPT.get("names", {}).values():  # the training loop's ctx, model, ...
        look(value, 2)
    tb = KEPT.get("tb")
    while tb is not None:
        for value in tb.tb_frame.f_locals.values():
            look(value, 2)
        tb = tb.tb_next
    return found


def _take_out(holder, held, new=None, nested=False) -> int:
    """Replace ``held`` by ``new`` in ``holder`` (a dict, list, frame, or a tuple in one); how many places."""
    if type(holder) is dict:
        keys = [k for k, v in holder.items() if v is held]
        holder.update(dict.fromkeys(keys, new))
        return len(keys)
    if type(holder) is list:
        spots = [i for i, v in enumerate(holder) if v is held]
        for i in spots:
            holder[i] = new
        return len(spots)
    if type(holder) is types.FrameType:
        variables = holder.f_locals  # one snapshot: before 3.13 each read copies the frame's variables again
        names = [k for k, v in variables.items() if v is held]
        for name in names:
            variables[name] = new  # Python 3.13+: written through to the frame
        if names and sys.version_info < (3, 13):  # before: copied back explicitly
            ctypes.pythonapi.PyFrame_LocalsToFast(ctypes.py_object(holder), ctypes.c_int(0))
        return len(names)
    if type(holder) is tuple and not nested:  # e.g. (work, flags): a copy without it, where the tuple was
        copy = tuple(new if v is held else v for v in holder)
        return sum(_take_out(outer, holder, copy, nested=True) for outer in gc.get_referrers(holder)
                   if type(outer) is not tuple)
    return 0


def debug_kept() -> dict | None:
    """What this rank keeps for ``%dist debug``: exception, message, what failed, and whether a session runs."""
    if not KEPT:
        return None
    exc = KEPT["exc"]
    return dict(ename=type(exc).__name__, evalue=str(exc)[:300], what=KEPT["what"], pid=os.getpid(),
                debugging="pdb" in _SESSION)


def _library_dirs() -> tuple:
    paths = sysconfig.get_paths()
    dirs = {paths[k] for k in ("stdlib", "platstdlib", "purelib", "platlib") if k in paths}
    dirs.add(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # distnb itself (distnb/engine/process/postmortem.py)
    return tuple(os.path.join(d, "") for d in dirs)


def user_frame(stack) -> int:
    """Index in pdb's ``stack`` of the innermost frame of the user's code (cell code, notebook functions).

    Frames of the standard library, installed packages (torch) and distnb are not the user's;
    when every frame is, the innermost one.
    """
    found = _user_index(stack)
    return len(stack) - 1 if found is None else found


def _user_index(stack):
    """Index in pdb's ``stack`` of the innermost frame of the user's code, or None when it has none."""
    library = _library_dirs()
    for i in range(len(stack) - 1, -1, -1):
        name = stack[i][0].f_code.co_filename
        ours = not name.startswith(GENERATED) if name.startswith("<") else not os.path.abspath(name).startswith(library)
        if ours:
            return i
    return None


def cell_runner(stack):
    """``(index, ns)``: the innermost frame of pdb's ``stack`` that ran a cell's code (its locals hold the code,
    compiled from the cell, and ``ns``, the namespace it ran in), or None.

    A training step's body is the cell's code run at module level in ``ns``: once it has returned, a
    rank can still fail in what distnb runs after it (DDP's gradient all-reduce in ``backward``, when
    another rank failed), and its traceback then holds no frame of the user's code. This frame, seen
    with ``ns`` as its locals (:class:`_CellPdb`), shows what the body's own frame would have shown.
    """
    for i in range(len(stack) - 1, -1, -1):
        local = stack[i][0].f_locals
        ran = any(isinstance(v, types.CodeType) and v.co_filename.startswith(CELL_FILES) for v in local.values())
        if ran and isinstance(local.get("ns"), dict):
            return i, local["ns"]
    return None


class _CellPdb(pdb.Pdb):
    """pdb whose frame that ran the cell's code (:func:`cell_runner`; ``cell``: ``(index, ns)``) evaluates
    ``p``, ``pp`` and ``!`` in the cell's namespace, also when ``up`` or ``down`` come back to it."""

    cell = None

    def _select_frame(self, number):
        super()._select_frame(number)
        if self.cell is not None and self.curindex == self.cell[0]:
            self.curframe_locals = self.cell[1]


def _has_user_frame(tb) -> bool:
    library = _library_dirs()
    while tb is not None:
        name = tb.tb_frame.f_code.co_filename
        if (not name.startswith(GENERATED)) if name.startswith("<") else not os.path.abspath(name).startswith(library):
            return True
        tb = tb.tb_next
    return False


def _cause_in_user_code(exc):
    """The exception ``exc`` was raised from (its cause or context, even one ``from None`` hides), when
    ``exc``'s own traceback has no frame of the user's code and that one has (a Dataset's
    ``__getitem__`` that raised, wrapped in distnb's SampleError); else None."""
    if _has_user_frame(exc.__traceback__):
        return None
    seen, inner = {id(exc)}, exc.__cause__ or exc.__context__
    while inner is not None and id(inner) not in seen:
        if _has_user_frame(inner.__traceback__):
            return inner
        seen.add(id(inner))
        inner = inner.__cause__ or inner.__context__
    return None


def debug_begin(ns: dict) -> dict:
    """Start the debugging session on the kept traceback; ``{"text", "done", "prompt"}``.

    Raises
    ------
    RuntimeError
        This rank keeps no traceback (it did not fail, or its frames were released).
    """
    rank = ns.get("rank")
    if not KEPT:
        raise RuntimeError(f"rank {rank} keeps no traceback: it did not fail in the last cell, or its frames were "
                           "released (by the next cell or the end of a debugging session)")
    debug_end(ns, release=False)  # a session left open (the kernel went away): start afresh
    out = io.StringIO()  # pdb's output, and the engine's stdout while a command runs
    debugger = _CellPdb(stdin=io.StringIO(), stdout=out, nosigint=True, readrc=False)
    debugger.prompt = PROMPT
    debugger.reset()
    restored = {k: v for k, v in KEPT["names"].items() if k not in ns}
    ns.update(restored)  # the training body's frame reads them from the namespace
    _SESSION.update(pdb=debugger, restored=restored)
    exc = KEPT["exc"]
    cause = _cause_in_user_code(exc)
    debugger.setup(None, cause.__traceback__ if cause is not None else KEPT["tb"])
    innermost = len(debugger.stack) - 1
    chosen = _user_index(debugger.stack)
    if chosen is None:  # the cell's code had returned (a step's body, before distnb's backward): the frame that ran it
        debugger.cell = cell_runner(debugger.stack)
        chosen = debugger.cell[0] if debugger.cell is not None else innermost
    out.write(f"post-mortem pdb on rank {rank} (pid {os.getpid()}): {type(exc).__name__}: {exc}\n")
    if cause is not None:
        out.write(f"(at its cause in your code: {type(cause).__name__}: {cause})\n")
    if chosen != innermost:
        debugger.curindex, debugger.curframe = chosen, debugger.stack[chosen][0]
        debugger.curframe_locals = debugger.cell[1] if debugger.cell is not None else debugger.curframe.f_locals
        deeper = f"`down` goes {innermost - chosen} frame(s) deeper, into library code"
        out.write(f"(the innermost frame of your code; {deeper})\n" if debugger.cell is None else
                  f"(your cell's code had returned: this rank stopped in what distnb runs after it. This is the "
                  f"frame that ran your code; p, pp and ! see the cell's names; {deeper})\n")
    debugger.print_stack_entry(debugger.stack[debugger.curindex])
    return dict(text=_text(out), done=False, prompt=PROMPT)


def debug_command(ns: dict, line: str) -> dict:
    """Run one pdb command line (``;;`` separates several); ``{"text", "done", "prompt"}``.

    ``q``/``quit``/``exit``/``c``/``EOF`` end the session and release the frames (``done``);
    commands that would run the finished cell on (``n``, ``s``, ``r``, ...) are refused.
    """
    debugger = _SESSION.get("pdb")
    if debugger is None:
        return debug_begin(ns) if KEPT else dict(text=f"rank {ns.get('rank')}: no debugging session\n", done=True,
                                           prompt=PROMPT)
    out = debugger.stdout
    queue = [line]
    while queue:
        line = debugger.precmd(queue.pop(0).rstrip("\n"))
        name = debugger.parseline(line)[0] if line.strip() else None
        if name in ENDING:
            debug_end(ns)
            return dict(text=_text(out) + "debugging session ended; the frames were released\n", done=True,
                        prompt=PROMPT)
        if name in REFUSED:
            out.write(f"*** {name}: {REFUSED[name]} (q ends the session)\n")
        else:
            with contextlib.redirect_stdout(out):
                debugger.onecmd(line)
        queue.extend(debugger.cmdqueue)
        debugger.cmdqueue.clear()
    return dict(text=_text(out), done=False, prompt=PROMPT)


def debug_end(ns: dict, release: bool = True) -> dict:
    """End the debugging session (if one runs); with ``release``, also release the kept frames."""
    if release:
        return dict(text="", done=True, released=drop(ns))
    for key, value in (_SESSION.get("restored") or {}).items():
        if ns.get(key) is value:
            del ns[key]
    _SESSION.clear()
    return dict(text="", done=True, released=False)


def _text(out: io.StringIO) -> str:
    text = out.getvalue()
    out.seek(0)
    out.truncate()
    if len(text) > MAX_TEXT:
        text = text[:MAX_TEXT] + f"\n... ({len(text) - MAX_TEXT} more characters not shown)\n"
    return text


def _breakpoint_skipped(*args, **kwargs) -> None:
    """``sys.breakpointhook`` of a notebook's rank: a rank has no terminal, so pdb read EOF and went on without a
    word; this says so, where, and the debugger that works from the notebook (the same line on every rank)."""
    caller = sys._getframe(1)
    name, line = caller.f_code.co_filename, caller.f_lineno
    where = f"cell line {line}" if name.startswith(("<dist-cell-", "<distrain-cell-")) else f"{name}:{line}"
    print(f"distnb: breakpoint() at {where} was skipped: a rank has no terminal for pdb. To look at a rank's "
          "frames, raise an exception there (`raise RuntimeError('look')`) and run %dist debug, which opens pdb "
          "on them from the notebook", file=sys.stderr)


def install_breakpoint_hook() -> None:
    """Make ``breakpoint()`` on this rank say why it cannot stop (unless ``PYTHONBREAKPOINT`` chose a hook)."""
    if not os.environ.get("PYTHONBREAKPOINT"):
        sys.breakpointhook = _breakpoint_skipped
