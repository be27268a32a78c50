"""Exceptions raised by distnb (stdlib only: importable in the kernel and on the engines)."""

from __future__ import annotations

import os
import re
import sys


class DistnbError(Exception):
    """Base class of every error distnb raises on purpose."""

    def _render_traceback_(self):
        # IPython shows this instead of distnb's own frames: the message says what to do.
        return [f"{type(self).__name__}: {self}"]


class Interrupted(KeyboardInterrupt):
    """A cell stopped by the interrupt button; the message says where each rank stopped.

    Attributes
    ----------
    result : distnb.train.results.TrainResult or None
        A training cell whose ranks all stopped after the same step: the result of what was trained
        (marked ``interrupted``; also bound by ``-o NAME`` and kept as the session's last result).
    """

    def __init__(self, *args, result=None):
        super().__init__(*args)
        self.result = result

    def _render_traceback_(self):
        return [f"KeyboardInterrupt: {self}"]


def stop_interrupted(what: str, call):
    """``call()`` (``%dist stop`` or ``restart``); an interrupt while it stops the cluster is one line saying what was
    done (the cluster's processes are ended anyway, the session is gone) instead of ipyparallel's frames, and that
    ``%dist start`` (not ``restart``, which then finds no cluster) starts a new one."""
    try:
        return call()
    except Interrupted:  # %dist restart's start interrupted: it says what it stopped
        raise
    except KeyboardInterrupt:
        raise Interrupted(f"{what} interrupted while it stopped the cluster: its engines and controller were ended "
                          "all the same; %dist start starts a new one") from None


class PlanError(DistnbError, ValueError):
    """An option or plan is invalid; raised before anything starts on the ranks.

    The message names the option and the fix.
    """


class ClusterError(DistnbError, RuntimeError):
    """The cluster is missing, not started, or could not start."""


class CollectiveMismatchError(DistnbError, ValueError):
    """Ranks called a collective with tensors of different shapes or dtypes (or different collectives).

    Raised on every rank of the collective, before it runs (see ``distnb.engine.process.collectives``).
    """


class PeerFailed(DistnbError, RuntimeError):
    """Raised on a rank whose collective distnb ended because another rank failed (:mod:`distnb.engine.process.abort`)."""


class BusyError(DistnbError, RuntimeError):
    """A background training run is going on; only ``%dist wait`` / ``%dist stop-training`` may run."""


def rank_list(ranks) -> str:
    """``[0, 1, 2, 5]`` as ``"0-2,5"``: how messages and output tags name several ranks."""
    ranks = sorted(set(ranks))
    runs, start = [], None
    for i, r in enumerate(ranks):
        if start is None:
            start = r
        if i + 1 == len(ranks) or ranks[i + 1] != r + 1:
            runs.append(f"{start}" if start == r else f"{start}-{r}")
            start = None
    return ",".join(runs)


def ranks_named(ranks) -> str:
    """``[3]`` as ``"rank 3"``, ``[0, 1, 2, 5]`` as ``"ranks 0-2,5"``: one rank or several, named in a message."""
    ranks = sorted(set(ranks))
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {rank_list(ranks)}"


#: A terminal colour code (IPython colours the ranks' tracebacks).
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
#: The line :func:`distnb.core.tracebacks.fold_frames` puts in place of torch's frames.
_FOLDED_LINE = re.compile(r"\.\.\. \d+ frames in torch \(")


def _key(failure):
    """A failure's identity across ranks: its exception with rank numbers taken out."""
    text = re.sub(r"\brank \d+", "rank ?", str(failure.get("evalue")))
    return failure.get("ename"), text


class RankError(DistnbError, RuntimeError):
    """One or more ranks raised while running a cell.

    Parameters
    ----------
    failures : list of dict
        One dict per failing rank, earliest first, with keys ``rank`` (int),
        ``engine_id`` (int), ``host`` (str), ``ename`` (str, the remote exception
        class name), ``evalue`` (str), ``traceback`` (str, the remote traceback
        text, distnb's frames left out and torch's folded between the user's) and optionally
        ``full_traceback`` (str, every frame), ``epoch`` and ``step`` (int) where the failure happened.
    context : str
        What was running ("%%dist cell", "training", ...).

    Attributes
    ----------
    rank : int
        The rank of the first (root-cause) failure.
    ranks : list of int
        Every failing rank.
    full_traceback : str
        The first failure's traceback with every frame (``remote_traceback`` folds torch's).
    group_kept : bool
        Every rank ended the cell with a failure that left nothing half-done, so their process group was kept,
        not re-formed, and what they hold with it (see ``distnb.engine.process.health``).
    """

    group_kept = False

    def __init__(self, failures, context="cell"):
        self.failures = list(failures)
        self.context = context
        first = self.failures[0] if self.failures else {}
        self.rank = first.get("rank")
        self.host = first.get("host")
        self.ename = first.get("ename")
        self.evalue = first.get("evalue")
        self.remote_traceback = first.get("traceback", "")
        self.full_traceback = first.get("full_traceback") or self.remote_traceback
        self.ranks = [f.get("rank") for f in self.failures]
        self.hint = module_hint(first)
        super().__init__(self._summary())
        # outside IPython (a script) Python prints notes after the message: the ranks' tracebacks, where the bug is
        self.__notes__ = [_ANSI.sub("", "\n".join(self._render_traceback_()[1:])).strip()]

    def add_hint(self, hint: str) -> None:
        """Append ``hint`` (a sentence: the likely cause and its fix, known in the kernel) to the message."""
        self.hint = hint
        self.args = (self._summary(),)

    def _where(self, f, who=None):
        parts = [who or f"rank {f.get('rank')}"]
        if f.get("host"):
            parts.append(f"on {f['host']}")
        text = " ".join(parts)
        if f.get("epoch") is not None and f.get("step") is not None:  # rank 1 on vm, last reported at epoch 0, step 5
            text += (", " if f.get("reported") else " ") + position(f)
        return text

    def _summary(self):
        if not self.failures:
            return f"{self.context} failed"
        f = self.failures[0]
        others = self.failures[1:]
        same = [o for o in others if _key(o) == _key(f)]
        if same:  # one error, said once, with the ranks that raised it ("ranks 0-31")
            one_host = len({x.get("host") for x in [f, *same]}) == 1
            where = self._where(dict(f, host=f.get("host") if one_host else None),
                                who=f"ranks {rank_list(x['rank'] for x in [f, *same])}")
            msg = f"{self.context} failed on {where}: {f.get('ename')}: {f.get('evalue')} (the same error on each)"
        else:
            msg = f"{self.context} failed on {self._where(f)}: {f.get('ename')}: {f.get('evalue')}"
        seen = {o["rank"] for o in same}
        own = [o for o in others if o["rank"] not in seen and not o.get("collateral")]
        stopped = [o["rank"] for o in others if o["rank"] not in seen and o.get("collateral")]
        for o in own:  # a rank that failed for a reason of its own is named with it
            msg += f"; rank {o.get('rank')} raised {o.get('ename')}: {o.get('evalue')}"
        if stopped:
            msg += (f"; rank {stopped[0]} was" if len(stopped) == 1 else
                    f"; ranks {rank_list(stopped)} were") + " stopped as a consequence"
        return f"{msg}. {self.hint}" if getattr(self, "hint", "") else msg

    def _render_traceback_(self):
        # IPython calls this instead of printing the kernel-side traceback.
        lines = [f"{type(self).__name__}: {self._summary()}"]  # HangError names itself
        shown = set()
        root_causes = [f for f in self.failures if not f.get("collateral") or f is self.failures[0]]
        for f in root_causes:  # ranks stopped as a consequence are named in the summary only
            key = _key(f)
            if key in shown:
                continue
            shown.add(key)
            lines.append("")
            lines.append(f"--- traceback from {self._where(f)} ---")
            lines.extend((f.get("traceback") or f"{f.get('ename')}: {f.get('evalue')}").rstrip().splitlines())
        if any(_FOLDED_LINE.match(line) for line in lines):
            lines.append("(torch's frames are folded: sys.last_value.full_traceback has every frame)")
        return lines


def module_hint(failure: dict) -> str:
    """The fix for a rank's ``ModuleNotFoundError`` of a module this process (the kernel) imported, else "".

    A model or Dataset whose class lives in a module (not the notebook) travels by reference: the
    ranks import that module. One the kernel found through a folder it put on its own ``sys.path``
    (``sys.path.append('../src')`` in a notebook, before or after ``%dist start``) is not on the ranks'.

    Parameters
    ----------
    failure : dict
        A :class:`RankError` failure (``ename``, ``evalue``).
    """
    found = re.match(r"No module named '([\w.]+)'", str(failure.get("evalue") or ""))
    if failure.get("ename") != "ModuleNotFoundError" or not found:
        return ""
    top = found.group(1).split(".")[0]
    path = getattr(sys.modules.get(top), "__file__", None)
    if not path:
        return ""
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.basename(path) == "__init__.py":  # a package: its parent folder is the one on sys.path
        folder = os.path.dirname(folder)
    return (f"The kernel imports {top} from {path}, but the ranks cannot: its folder {folder} is on the kernel's "
            f"sys.path and not on theirs. Add it there with a %%dist cell (import sys; sys.path.insert(0, {folder!r})) "
            "and run this again, or install it as a package both import")


def position(failure: dict) -> str:
    """Where a failing rank was: ``at epoch E, step S``, or for a rank whose engine died (``reported``: no word
    came from it after its last progress message) ``last reported at epoch E, step S``.

    Parameters
    ----------
    failure : dict
        A :class:`RankError` failure (``epoch`` and ``step`` not None; ``reported`` optional).
    """
    at = "last reported at" if failure.get("reported") else "at"
    return f"{at} epoch {failure['epoch']}, step {failure['step']}"


class HangError(RankError):
    """Ranks waited in a collective that other ranks never reached (see ``distnb.execute.execute``).

    ``failures`` are those of :class:`RankError`: the ranks that never arrived first (their
    traceback is the stack where each one was), then the ranks that waited. ``message`` says
    which ranks waited in which collective, where the others were, and what was done.
    """

    def __init__(self, failures, context="cell", message=""):
        self.message = message
        super().__init__(failures, context)

    def _summary(self):
        return self.message or super()._summary()
