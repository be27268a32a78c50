"""Simulated ranks in the kernel: the dashboard and the intake at 256 or 1,024 ranks (a testing tool).

Not for training. :func:`run` makes the few real engines of a running distnb cluster play
``num_ranks`` ranks (:func:`distnb.engine.simulate.simulate`: the training rank's own
``Reporter`` per simulated rank, at its rate, through ipyparallel's ``publish_data``) and
watches them exactly as a training cell does: the same intake
(:func:`distnb.execute.execute.take_progress`), the same :class:`~distnb.display.progress.ProgressState`
and the same dashboard or text view. It measures what that costs the kernel: process CPU time
(every thread: ipyparallel's client thread that receives the messages included), redraws, and
how late messages are taken in (the rank's send time against the kernel's clock), per second,
so a queue that grows shows as a lag that grows.

Example (a notebook, after ``%load_ext distnb`` and ``%dist start -n 2``)::

    import distnb.tools.simulate
    result = distnb.tools.simulate.run(256, seconds=20, group=8, slow={17: 1.5}, fail={200: 300})
    result.kernel_cpu_fraction, result.redraws_per_s, result.lag_growth

``benchmarks/scale_progress.py`` and ``tests/browser/test_dashboard_scale.py`` use it.
"""

from __future__ import annotations

import math
import signal
import time
from dataclasses import dataclass, field

from distnb.core import calls
from distnb.display import ProgressState, make_view
from distnb.engine.transport.report import relay_interval
from distnb.execute.execute import POLL_SECONDS, intake_interval, take_progress

#: Seconds to wait for the engines' last messages after their results (a kernel that fell behind needs longer).
FINAL_WAIT = 10.0


def host_names(num_ranks: int, ranks_per_host: int) -> list:
    """The simulated hosts, per rank: ``sim-node000`` for ranks ``0 .. ranks_per_host - 1``, and so on."""
    width = max(3, len(str(max(0, num_ranks - 1) // ranks_per_host)))
    return [f"sim-node{r // ranks_per_host:0{width}d}" for r in range(num_ranks)]


def split(num_ranks: int, ranks_per_host: int, num_engines: int) -> list:
    """Per engine, the simulated ranks it plays: whole hosts, as evenly as they go, in rank order."""
    num_hosts = math.ceil(num_ranks / ranks_per_host)
    out, host = [], 0
    for e in range(num_engines):
        hosts = num_hosts // num_engines + (e < num_hosts % num_engines)
        out.append(list(range(host * ranks_per_host, min(num_ranks, (host + hosts) * ranks_per_host))))
        host += hosts
    return out


@dataclass
class SimulationResult:
    """What a simulated run cost the kernel.

    Attributes
    ----------
    num_ranks, group : int
        Simulated ranks; ranks per relay (1: every rank sends to the kernel itself).
    seconds : float
        Wall seconds the kernel watched.
    kernel_cpu : float
        CPU seconds of the kernel process over that time (all its threads).
    kernel_cpu_fraction : float
        ``kernel_cpu / seconds``: the share of one core.
    rank_messages : int
        Rank messages the kernel took in (at most one per rank per look, 10 looks a second).
    engine : list of dict
        What each engine reported (:func:`distnb.engine.simulate.simulate`'s return value).
    redraws, chart_redraws, page_redraws : int
        Dashboard redraws of the header and table (or aggregate), the charts, the table pages.
    lag : list of (float, float, float)
        Per second of the run: ``(second, median, max)`` of how late messages were taken in (s).
    state : ProgressState
        The final state (for tests).
    ars : list of ipyparallel.AsyncResult
        The engines' calls (``ar.wait_for_output()`` waits until the kernel has received every
        message they sent: a kernel that fell behind is still reading them after ``run`` returns).
    """

    num_ranks: int
    group: int
    seconds: float
    kernel_cpu: float
    rank_messages: int
    engine: list
    redraws: int = 0
    chart_redraws: int = 0
    page_redraws: int = 0
    lag: list = field(default_factory=list)
    state: object = None
    ars: list = field(default_factory=list, repr=False)

    @property
    def kernel_cpu_fraction(self) -> float:
        return self.kernel_cpu / self.seconds if self.seconds else 0.0

    @property
    def redraws_per_s(self) -> float:
        return self.redraws / self.seconds if self.seconds else 0.0

    @property
    def messages_sent(self) -> int:
        """Messages the engines sent to the kernel: one per rank message, or one per relay bundle."""
        return sum(e["bundles"] if self.group > 1 else e["messages"] for e in self.engine)

    @property
    def lag_growth(self) -> float:
        """Median lag of the last quarter of the run minus that of the first quarter (s); ~0 when nothing backs up."""
        if len(self.lag) < 4:
            return 0.0
        q = max(1, len(self.lag) // 4)
        first = sorted(m for _, m, _ in self.lag[:q])
        last = sorted(m for _, m, _ in self.lag[-q:])
        return last[len(last) // 2] - first[len(first) // 2]


def run(num_ranks: int = 256, seconds: float = 20.0, group: int = 8, ranks_per_host: int = 8,
        step_time: float = 0.05, slow=None, fail=None, stop=None, seed: int = 0, session=None,
        view="auto") -> SimulationResult:
    """Play ``num_ranks`` ranks on the cluster's engines and show their progress as a training cell would.

    Parameters
    ----------
    num_ranks : int
        Simulated ranks (256 and 1,024 are what the benchmark measures).
    seconds : float
        Length of the simulated run (the cell takes that long, plus start-up).
    group : int
        Ranks per relay: ``ranks_per_host`` (default) coalesces each host's messages on its local
        rank 0; 1 sends every rank's messages to the kernel directly.
    ranks_per_host : int
        Ranks per simulated host (host names ``sim-node000``, ...).
    step_time, slow, fail, stop, seed
        As :func:`distnb.engine.simulate.simulate` (``slow={rank: factor}``, ``fail={rank: step}``).
    session : distnb.session.Session, optional
        Default: the running session (``%dist start``).
    view : str or object
        ``"auto"`` (the dashboard in Jupyter, else text), ``"widgets"``, ``"text"``, ``"none"``, or
        a view object (``refresh(final=False)``, ``close()``).

    Returns
    -------
    SimulationResult

    Raises
    ------
    ValueError
        If ``num_ranks``, ``group`` or ``ranks_per_host`` is below 1, or ``ranks_per_host`` is not
        a multiple of ``group`` (a relay serves whole hosts or part of one).
    distnb.core.errors.ClusterError
        If no cluster runs.
    """
    if num_ranks < 1 or group < 1 or ranks_per_host < 1:
        raise ValueError(f"num_ranks={num_ranks}, group={group}, ranks_per_host={ranks_per_host}: each must be >= 1")
    if group > 1 and ranks_per_host % group and group % ranks_per_host:
        raise ValueError(f"group={group} must divide ranks_per_host={ranks_per_host} (or be a multiple of it)")
    if session is None:
        from distnb.session import current  # loads IPython, ipyparallel: at first use, not when this module is imported

        session = current()
    cluster = session.cluster
    total = max(1, int(round(seconds / step_time)))
    epochs = 4
    state = ProgressState(num_ranks, total, epochs, hosts=host_names(num_ranks, ranks_per_host),
                          devices=[f"cuda:{r % ranks_per_host}" for r in range(num_ranks)],
                          strategy="ddp (simulated)")
    shown = make_view(state, view) if isinstance(view, str) else view
    if hasattr(shown, "show"):
        shown.show()
    blocks = [b for b in split(num_ranks, ranks_per_host, cluster.world_size) if b]
    t0, cpu0 = time.monotonic(), time.process_time()
    interval = relay_interval(math.ceil(num_ranks / group)) if group > 1 else 0.1
    ars = [cluster.apply(e, calls.simulate, block, seconds, step_time, epochs, 32, group, slow, fail, stop, seed,
                         interval) for e, block in enumerate(blocks)]
    try:
        taken, lags = _watch(ars, state, shown, t0)
    except KeyboardInterrupt:
        cluster.signal(signal.SIGINT, list(range(len(ars))))
        for ar in ars:
            ar.wait(5)
        raise
    finally:
        elapsed, cpu = time.monotonic() - t0, time.process_time() - cpu0
        shown.close()
    engine = [ar.get(0) for ar in ars]
    lag = [(s, sorted(v)[len(v) // 2], max(v)) for s, v in sorted(lags.items())]
    return SimulationResult(num_ranks, group, elapsed, cpu, taken, engine, getattr(shown, "redraws", 0),
                            getattr(shown, "chart_redraws", 0), getattr(shown, "page_redraws", 0), lag, state, ars)


def _watch(ars, state, shown, t0) -> tuple:
    """Take the engines' progress into ``state`` and refresh ``shown`` until every engine is done.

    Returns
    -------
    tuple of (int, dict)
        The rank messages taken, and per second since ``t0`` the lags (s) of those taken in it.
    """
    progress, raw, taken, lags, next_intake = {}, {}, 0, {}, 0.0
    while True:
        done = all(ar.ready() for ar in ars)
        if done:  # the last progress messages can arrive after the result: wait for the engines' output
            deadline = time.monotonic() + FINAL_WAIT
            for ar in ars:
                ar.wait_for_output(max(0.0, deadline - time.monotonic()))
        elif time.monotonic() < next_intake:  # as Watch: at large worlds the looks are spaced
            shown.refresh()
            _wait_any(ars)
            continue
        next_intake = time.monotonic() + intake_interval(state.world_size)
        now = time.time()
        for e, ar in enumerate(ars):
            for _, msg in take_progress(state, e, ar.data or {}, progress, raw):
                taken += 1
                lags.setdefault(int(time.monotonic() - t0), []).append(now - msg["time"])
        shown.refresh()
        if done:
            return taken, lags
        _wait_any(ars)


def _wait_any(ars) -> None:
    """Up to POLL_SECONDS for the first engine still running (none left: return at once)."""
    pending = [ar for ar in ars if not ar.ready()]
    if pending:
        pending[0].wait(POLL_SECONDS)
