"""The one execute path: run a rank function on every rank, watch it, and the single failure path.

Every call that runs user code or training on the ranks goes through :class:`Watch`: it
streams each rank's output (tagged ``[rank r]``, identical lines folded: :mod:`distnb.execute.output`)
and progress while the ranks run, names a hang (:mod:`distnb.execute.hangs`), notices
dead engines (``LIVENESS_SECONDS``) and failed ranks (releasing their peers from a
collective at once, interrupting them after ``FAILURE_GRACE``), turns the interrupt button
into a stop at one step boundary (``STOP_WAIT``, then a hard interrupt), and ends in one
of three ways: the per-rank results, a :class:`~distnb.core.errors.RankError` naming the root
cause (after re-forming the process group so the next cell works), or an
:class:`~distnb.core.errors.Interrupted` saying where every rank stopped.
"""

from __future__ import annotations

import math
import pickle
import signal
import sys
import time

from distnb.cluster import hub
from distnb.core import calls
from distnb.core.errors import ClusterError, Interrupted, PlanError, RankError
from distnb.core.tracebacks import notebook_name_hint
from distnb.execute import hangs, presses
from distnb.execute.output import LineFolder

#: Seconds between checks that the ranks' engine processes are alive while a cell runs.
LIVENESS_SECONDS = 0.5
#: Seconds between checks of running ranks (results, output, progress) in the kernel.
POLL_SECONDS = 0.1
#: Seconds to wait for the other ranks once one rank has failed, before interrupting them.
FAILURE_GRACE = 5.0
#: The same once a rank's engine died: nothing the others wait for can come from it (a %%dist cell that
#: runs on without a collective was named after 5.4 s instead of about a second).
DEATH_GRACE = 1.0
#: Rank messages a second the kernel takes in at most, by spacing its looks at large worlds (see intake_interval).
INTAKE_RATE = 1000
#: Seconds to wait for a finished rank's remaining output messages.
OUTPUT_WAIT = 2.0
#: Seconds to wait for ranks to stop together at a step boundary after the first SIGINT.
STOP_WAIT = 3.0
#: Seconds to wait for ranks to stop after the second (hard) SIGINT.
INTERRUPT_WAIT = 10.0
#: Seconds the ranks still have to stop at a step boundary once the interrupt is pressed again (each press
#: shortens the first stop's :data:`STOP_WAIT` to this from that press; then they are stopped where they are).
AGAIN_GRACE = 1.0
#: Seconds between two looks at the stopping ranks (a press again is noticed at the next).
STOP_POLL = 0.02


def targets_of(targets, world_size: int):
    """``targets=`` of ``Session.run`` (``%%dist --targets``) as a sorted tuple of ranks, or None (every rank).

    Takes one rank (``int``) or a sequence of them (``(0, 2)``; ``"0,2"`` as the magic spells it).

    Raises
    ------
    PlanError
        Naming the value: no rank in it, a rank that is not an int, or one outside ``0..world_size-1``.
    """
    if targets is None:
        return None
    given = targets
    if isinstance(targets, str):
        targets = [t.strip() for t in targets.split(",")]
        if not all(t.lstrip("-").isdigit() for t in targets):
            raise PlanError(f"targets= takes ranks (an int, or ints such as targets=(0, 2)), got {given!r}")
        targets = [int(t) for t in targets]
    elif isinstance(targets, int) and not isinstance(targets, bool):
        targets = [targets]
    try:
        ranks = list(targets)
    except TypeError:
        raise PlanError(f"targets= takes ranks (an int, or ints such as targets=(0, 2)), got {given!r}") from None
    wrong = [r for r in ranks if isinstance(r, bool) or not isinstance(r, int) or not 0 <= r < world_size]
    if wrong or not ranks:
        why = "names no rank" if not ranks else f"has {wrong[0]!r}"
        example = tuple(range(min(world_size, 2)))
        raise PlanError(f"targets= {why}: it takes ranks between 0 and {world_size - 1} (e.g. targets={example}, "
                        f"%%dist --targets {','.join(map(str, example))}), got {given!r}")
    return tuple(sorted(set(ranks)))


def run_on_ranks(session, fn, *args, what: str, state=None, view=None, show_ranks=(0,), may_keep=None) -> list:
    """``fn(*args)`` (a :mod:`distnb.core.calls` entry) on every rank of ``session``, watched; per-rank results.

    ``may_keep``: see :class:`Watch`.
    """
    return Watch(session, session.cluster.apply_all(fn, *args), what, state, view, show_ranks, may_keep).wait()


def restart_world(session, failures, dead) -> None:
    """``--on-failure restart``: a fresh world of the same spec after ``dead`` ranks died; ``failures`` (their
    dicts, in place) say so in place of "run %dist restart"."""
    note = session._restart_in_place()
    for f in failures:
        if f["rank"] in dead:
            f["evalue"] = f["evalue"].split("; run %dist restart")[0] + f"; {note}"


class Watch:
    """Wait for one AsyncResult per rank, streaming tagged output and progress.

    Parameters
    ----------
    session : distnb.session.Session
    ars : list of ipyparallel.AsyncResult
        One per rank, in rank order.
    what : str
        What runs, for messages ("training", "%%dist cell").
    state : distnb.display.ProgressState, optional
        Receives each rank's progress messages.
    view : optional
        The dashboard or text progress (``refresh``, ``close``).
    show_ranks : tuple of int
        Ranks whose printed output is shown (a failed rank's always is).
    may_keep : bool, optional
        The rank function judges on each rank whether its failure left the process group whole (a ``%%dist``
        cell and a training cell, the default for ``what="%%dist cell"`` and ``"training"``: a training cell
        that failed before any step, :mod:`distnb.engine.train.beforestep`; a ``%dist save``:
        :mod:`distnb.engine.process.callfail`): after a failure the ranks are asked, and when every rank says
        so the group is kept, not re-formed (the RankError's ``group_kept`` says so).
    """

    def __init__(self, session, ars, what, state=None, view=None, show_ranks=(0,), may_keep=None):
        self.session, self.cluster, self.ars, self.what = session, session.cluster, ars, what
        self.state, self.view, self.show_ranks = state, view, show_ranks
        self.offsets, self.progress, self.dead = {}, {}, {}
        self.raw = {}  # rank -> the bytes its last message came as (take_progress)
        self.wheres = session.last_where = {}  # rank -> where its cell is (engine/where.py), for %dist where
        self.released, self.interrupted = set(), set()
        self.pressed_again = False  # the interrupt pressed while the ranks were being stopped
        self.again_at = None  # time.monotonic() of the last such press
        self.failed_since = None
        self.next_liveness = time.monotonic() + LIVENESS_SECONDS
        self.hang = None  # set when ranks wait in a collective others never reached (see hangs.py)
        self.may_keep = what in ("%%dist cell", "training") if may_keep is None else may_keep
        self.folder = LineFolder({"stdout": sys.stdout, "stderr": sys.stderr}, len(self.cluster.engine_ids))
        self.next_intake = 0.0  # time.monotonic() of the next look at progress (intake_interval)

    def wait(self) -> list:
        """The per-rank results; RankError (after re-forming the group) or Interrupted otherwise."""
        bg = self.session._background
        bg = bg if bg is not None and bg.current_thread_is_runner() else None
        if bg is not None:  # a background run: the ranks train, the caller of train() may return
            bg.watching = True
            bg.started.set()
            if hasattr(self.view, "attach_stop"):
                self.view.attach_stop(bg.request_stop)
        try:
            while not self._tick(bg):
                pass
        except (KeyboardInterrupt, RuntimeError) as exc:
            if not _is_interrupt(exc):
                raise
        else:
            return self._conclude(False)
        release = presses.absorb(self._pressed)  # from the first press on, another only hurries the stop
        try:
            self._after_interrupt()
            return self._conclude(True)
        finally:
            release()

    def _pressed(self) -> None:
        """The interrupt pressed again while the ranks stop (a SIGINT handler: :mod:`distnb.execute.presses`)."""
        self.pressed_again = True
        self.again_at = time.monotonic()

    def _after_interrupt(self) -> None:
        """Stop the ranks (:meth:`_interrupt_ranks`), then read what they sent. The interrupt pressed again
        meanwhile, even while distnb signals the ranks, means "stop them now": the next stage at once, never a
        traceback of zmq's or threading's frames (a double press 0.1 s apart ended the cell with one)."""
        for _ in range(3):
            try:
                self.interrupted |= self._interrupt_ranks()
                self._poll(force=True)
                return
            except (KeyboardInterrupt, RuntimeError) as again:
                if not _is_interrupt(again):
                    raise
                self._pressed()

    def _tick(self, bg) -> bool:
        """One round of checks; True when every rank has finished (or died)."""
        ars = self.ars
        if bg is not None and bg.stop_requested.is_set():  # %dist stop-training: as the interrupt button
            raise KeyboardInterrupt
        if time.monotonic() >= self.next_liveness:  # a dead engine never answers: stop waiting for it
            self.next_liveness = time.monotonic() + LIVENESS_SECONDS
            self.dead.update({r: d for r, d in self.cluster.dead_ranks().items() if not ars[r].ready()})
            if self.dead and self.failed_since is None:
                self.failed_since = time.monotonic()
            self._check_controller()
        done = all(ar.ready() or r in self.dead for r, ar in enumerate(ars))
        if done:  # a result can arrive before the rank's last printed output
            deadline = time.monotonic() + OUTPUT_WAIT
            for ar in ars:
                ar.wait_for_output(max(0.0, deadline - time.monotonic()))
        self._poll(force=done)
        if done:
            return True
        failed = {r for r, ar in enumerate(ars) if ar.ready() and not ar.successful() and r not in self.dead}
        for r in failed - self.released:  # let peers blocked in a collective fail at once
            self.released.add(r)
            try:
                # a rank that kept its group ignores it; only a call that may keep it asks (no earlier call's verdict)
                self.cluster.apply(r, calls.release, False, self.may_keep)
            except ClusterError:  # its engine died: the liveness check reports it
                pass
        if failed and self.failed_since is None:
            self.failed_since = time.monotonic()
        grace = DEATH_GRACE if self.dead else FAILURE_GRACE
        if self.failed_since is not None and time.monotonic() - self.failed_since > grace:
            self.interrupted |= self._interrupt_ranks()
            self.failed_since = math.inf
        self.hang = hangs.check(self) if self.hang is None else hangs.follow_up(self, self.hang)
        pending = [ar for r, ar in enumerate(ars) if not ar.ready() and r not in self.dead]
        if pending:
            pending[-1].wait(POLL_SECONDS)  # the last sent is about the last to finish: one wake-up, not one per rank
        return False

    def _check_controller(self) -> None:
        """ClusterError when the controller died: no rank's result can come back (the cell would wait forever)."""
        how = hub.controller_death(self.cluster)
        if not how:
            return
        pending = [r for r, ar in enumerate(self.ars) if not ar.ready()]
        if self.state is not None and pending:
            self.state.set_status("interrupted", ranks=pending, error="the controller died: no result can come back")
        self.folder.flush(final=True)
        if self.view is not None:
            self.view.close()
        raise ClusterError(f"{self.what} cannot finish: {hub.controller_message(self.cluster, how)} (the ranks "
                           "may still be running the cell: the restart ends them)")

    def _conclude(self, user_interrupt: bool) -> list:
        ars = self.ars
        self.folder.flush(final=True)
        for rank, ar in enumerate(ars):  # after the last look at what the ranks published (Watch._tick, wait)
            if ar.ready():
                self._take_final(rank, ar)
        clean = all(ar.ready() and ar.successful() for ar in ars)
        if not clean:  # every rank answered: none died during the cell (a /proc read per rank spared)
            self.dead.update(self.cluster.dead_ranks())
        failures = self._failures()
        self._mark_failures(failures)
        if self.view is not None:
            self.view.close()
        kept = False
        if (failures or not clean) and not self.dead:
            kept = group_kept(self)
            if not kept:
                recover(self.session)
        if user_interrupt:
            stop = Interrupted(self._interrupted_message(clean))
            # every rank stopped after the same step and returned its figures: what was trained comes back
            stop.results = [ar.get(0) for ar in ars] if clean and not failures else None
            raise stop
        # a training cell takes rank 0's weights back first, from this world (training.train_cell restarts then)
        restart_later = self.dead and self.session.auto_restart and self.what == "training"
        if self.dead and self.session.auto_restart and not restart_later:
            restart_world(self.session, failures, self.dead)
        if self.hang is not None or failures:  # the error is %dist debug's default rank
            error = hangs.error(self, failures) if self.hang is not None else RankError(failures, context=self.what)
            error.restart_dead = set(self.dead) if restart_later else None
            error.group_kept = kept
            self.session.last_error = error
            if self.hang is None and self.what == "%%dist cell":

                self.session.last_error.add_hint(notebook_name_hint(failures, self.session.ns))
            raise self.session.last_error
        return [ar.get(0) for ar in ars]

    def _mark_failures(self, failures) -> None:
        if self.state is None:
            return
        for f in failures:
            if self.hang is not None and f["ename"] != "EngineDied":  # distnb ended the hang: the HangError says why
                self.state.set_status("interrupted", ranks=[f["rank"]], error="ended by distnb: a hang (the error below)")
                continue
            status = "interrupted" if f["rank"] in self.interrupted or f.get("collateral") else "failed"
            error = f"{f['ename']}: {f['evalue']}"[:200]
            if f.get("collateral") and f["rank"] not in self.interrupted and failures[0] is not f:
                error = f"stopped because rank {failures[0]['rank']} failed"
            self.state.set_status(status, ranks=[f["rank"]], error=error)

    def _interrupted_message(self, clean: bool) -> str:
        rows = {r: ar.get(0).get("where") for r, ar in enumerate(self.ars) if clean and isinstance(ar.get(0), dict)}
        spots = {r: position(rows[r]) if rows.get(r) else _progress_position(self.progress.get(r) or {})
                 for r in range(len(self.ars))}
        texts = [text for _, text in sorted(spots.items()) if text]
        if len(texts) == len(spots) > 1 and len(set(texts)) == 1:
            where = f"every rank: {texts[0]}"
        else:
            where = ", ".join(f"rank {r}: {text}" for r, text in sorted(spots.items()) if text)
        how = "every rank stopped after the same step" if clean else "ranks stopped where they were" + (
            " (the interrupt was pressed again)" if self.pressed_again else "")
        return f"{self.what} interrupted: {how}" + (f" ({where})" if where else "")

    def _failures(self) -> list:
        """RankError failure dicts: dead engines first, then raised exceptions, root cause first."""
        cluster = self.cluster
        failures = [f for f in cluster.failures(self.ars, self.progress, collateral=self.interrupted)
                    if f["rank"] not in self.dead]
        for rank, how in sorted(self.dead.items(), reverse=True):
            # a dead rank says nothing more: its position is its last progress message (every 0.1 s with the
            # dashboard, 2 s with text progress, at epoch ends with none: it may have got further), marked
            # ``reported``, and RankError and --on-failure shrink say so ("last reported at epoch E, step S")
            where = self.progress.get(rank) or {}
            failures.insert(0, dict(rank=rank, engine_id=cluster.engine_ids[rank], host=cluster.host_of(rank),
                                    ename="EngineDied", traceback="", epoch=where.get("epoch"), step=where.get("step"),
                                    reported=True,
                                    evalue=f"{cluster.death_message(rank, how)}; run %dist restart for a "
                                           f"fresh world of {cluster.world_size} ranks"))
        return failures

    def _poll(self, force: bool = False) -> None:
        intake = self.state is not None and (force or time.monotonic() >= self.next_intake)
        if intake:
            self.next_intake = time.monotonic() + intake_interval(self.state.world_size)
        for rank, ar in enumerate(self.ars):
            md = metadata(ar)
            if rank in self.show_ranks or (ar.ready() and not ar.successful()):  # a failed rank's output too
                for stream_name in ("stdout", "stderr"):
                    text = md.get(stream_name) or ""
                    seen = self.offsets.get((rank, stream_name), 0)
                    if len(text) > seen:
                        self.offsets[(rank, stream_name)] = len(text)
                        self.folder.feed(rank, stream_name, text[seen:])
            data = md.get("data") or {}
            if "distnb_where" in data:
                self.wheres[rank] = data["distnb_where"]
                if self.state is not None:
                    self.state.set_where(rank, data["distnb_where"])
            if intake:
                take_progress(self.state, rank, data, self.progress, self.raw)
        self.folder.flush()
        if self.view is not None:
            self.view.refresh()

    def _take_final(self, rank: int, ar) -> None:
        """The final progress message that a rank's reply carries (``progress_message``, from
        :meth:`distnb.engine.transport.report.Reporter.final_message`), taken out of its result and given to the
        progress state after everything the rank published (:meth:`_conclude`, once per rank). A reply without one (a failure, a host's
        relay) changes nothing."""
        value = ar.get(0) if ar.successful() else None
        msg = value.pop("progress_message", None) if isinstance(value, dict) else None
        if msg is not None:
            self.progress[rank] = msg
            if self.state is not None:
                self.state.update(rank, msg)

    def _interrupt_ranks(self) -> set:
        """SIGINT every rank still running, then wait (bounded) for them to stop."""
        ars = self.ars
        running = [r for r, ar in enumerate(ars) if not ar.ready()]
        if not running:
            return set()
        # first SIGINT: a training cell stops every rank after the same step (engine.loop.StopRequest)
        self.cluster.signal(signal.SIGINT, running)
        stuck = self._wait_stopped(running, STOP_WAIT)
        if stuck:  # second SIGINT (or the button pressed again): KeyboardInterrupt wherever they are
            self.cluster.signal(signal.SIGINT, stuck)
            self._wait_stopped(stuck, INTERRUPT_WAIT)
        return {r for r in running if not (ars[r].ready() and ars[r].successful())}

    def _wait_stopped(self, ranks, seconds: float) -> list:
        """Wait up to ``seconds`` for ``ranks`` to finish; those still running. The interrupt pressed
        meanwhile (:meth:`_pressed`) leaves them :data:`AGAIN_GRACE` seconds from that press: ranks about to stop
        at a step boundary still do, with their state (a hard stop mid-step lost the optimizer's)."""
        deadline = time.monotonic() + seconds
        while True:
            end = deadline if self.again_at is None else min(deadline, self.again_at + AGAIN_GRACE)
            pending = [r for r in ranks if not self.ars[r].ready()]
            if not pending or time.monotonic() >= end:
                return pending
            try:
                self.ars[pending[-1]].wait(min(STOP_POLL, max(0.0, end - time.monotonic())))
            except (KeyboardInterrupt, RuntimeError) as exc:  # a press before distnb's handler was in place
                if not _is_interrupt(exc):
                    raise
                self._pressed()


def _is_interrupt(exc: BaseException) -> bool:
    """A KeyboardInterrupt, or the RuntimeError ("release unlocked lock") that Python raises instead when
    the interrupt lands inside a ``threading.Condition``'s ``with`` (an AsyncResult's ``ready()``/``wait``)."""
    return isinstance(exc, KeyboardInterrupt) or (isinstance(exc, RuntimeError)
                                                  and isinstance(exc.__context__, KeyboardInterrupt))


def metadata(ar) -> dict:
    """The metadata of a one-engine AsyncResult (``stdout``, ``stderr``, ``data``), as it stands now.

    ipyparallel's client thread updates this dict as the engine's messages arrive. Reading
    ``ar.stdout`` or ``ar.data`` instead parses the metadata's four dates with dateutil at each
    first access (about 0.2 ms a date here, so 30 ms of the kernel's time for a cell on 32
    ranks: issue 20), and dates are not needed here.
    """
    mds = getattr(ar, "_metadata", None)
    if isinstance(mds, list) and len(mds) == 1 and isinstance(mds[0], dict):
        return mds[0]
    return {key: getattr(ar, key, None) for key in ("stdout", "stderr", "data")}  # another ipyparallel


def intake_interval(world_size: int) -> float:
    """Seconds between two looks at the ranks' progress: ``POLL_SECONDS``, longer above 100 ranks.

    The kernel reads each rank's newest message at each look, so it takes in at most
    ``world_size / interval`` rank messages a second; above ``INTAKE_RATE * POLL_SECONDS`` (100) ranks
    the looks are spaced to keep that at :data:`INTAKE_RATE` (0.26 s at 256 ranks, 1.02 s at 1,024),
    since each costs the kernel about 30-40 us. Nothing is lost: each message repeats its rank's newest
    16 loss points (:data:`distnb.engine.transport.report.TAIL`), 1.6 s of them at 10 messages a second.
    Measured in benchmarks/scale_progress.py (issue 20).
    """
    return max(POLL_SECONDS, world_size / INTAKE_RATE)


def take_progress(state, rank: int, data: dict, progress: dict, raw: dict | None = None) -> list:
    """Feed the progress messages in one rank's ``AsyncResult.data`` to ``state``; the new ones.

    ``data["distnb"]`` is the message of ``rank`` itself; ``data["distnb@R"]`` is rank R's, sent
    on its behalf (a host's relay, :class:`distnb.engine.transport.report.HostRelay`, or simulated ranks,
    :mod:`distnb.engine.simulate`), as a dict or as the bytes of :func:`distnb.engine.transport.report.encode`,
    decoded here only when taken. ``progress`` maps each rank to the last message taken from
    it, ``raw`` (optional) each rank to the bytes that message came as; ipyparallel makes a new
    object for every message it receives, so one seen before (the same object) is skipped without
    being read again.

    Returns
    -------
    list of (int, dict)
        ``(rank, message)`` for every message not taken before.
    """
    new = []
    for key, msg in tuple(data.items()):  # ipyparallel's client thread adds to ``data`` meanwhile
        if key == "distnb":
            r = rank
        elif key.startswith("distnb@"):
            r = int(key[7:])
        else:
            continue
        if not msg or progress.get(r) is msg:
            continue
        if isinstance(msg, bytes):
            if raw is not None:
                if raw.get(r) is msg:
                    continue
                raw[r] = msg
            msg = pickle.loads(msg)
        progress[r] = msg
        state.update(r, msg)
        new.append((r, msg))
    return new


def group_kept(watch) -> bool:
    """Whether every rank kept its process group after a failed ``%%dist`` cell, ``%dist save`` or training cell
    (:mod:`distnb.engine.process.health`: each failure was the call's own, before any step for a training cell,
    and every rank had finished it with no collective half-done). Then the group is not re-formed, and what the
    ranks hold (sharded models, their optimizers) stays."""
    if not watch.may_keep or watch.hang is not None or watch.interrupted:
        return False
    try:
        infos = watch.cluster.wait_all(watch.cluster.apply_all(calls.info), timeout=watch.cluster.spec.timeout,
                                       what="asking the ranks whether their group is whole")
    except (ClusterError, RankError):
        return False
    return all(not info.get("broken", True) for info in infos)


def recover(session) -> None:
    """After a failure: re-form the process group so the next cell works."""
    session.cluster.check_alive()
    try:
        session.holdings.generation += 1
        session.cluster.reform()
    except Exception as exc:
        raise ClusterError(f"could not re-form the process group after the failure ({exc}); "
                           "run %dist restart") from exc


def position(where: dict) -> str:
    """Where a rank stopped, from its row's ``where`` (:func:`distnb.engine.train.loop._where`), as the summary says it.

    ``epoch 3, step 5`` in the middle of an epoch; ``after epoch 3`` at the start of the next one (the
    epoch ended: its mean, validation and checkpoint ran); ``after the last step of epoch 3`` when its
    end had not run yet (the next cell starts epoch 4).
    """
    epoch, step = where.get("epoch"), where.get("step")
    if where.get("last_step"):
        return f"after the last step of epoch {epoch} (the next cell starts epoch {epoch + 1})"
    if step == 0 and epoch:
        return f"after epoch {epoch - 1}"
    return f"epoch {epoch}, step {step}"


def _progress_position(msg: dict) -> str:
    """Where a rank was at its last progress message (a rank that returned no row): its step counts the cell's."""
    if msg.get("epoch") is None:
        return ""
    return f"epoch {msg['epoch']}, {msg.get('step')} of this cell's steps"
