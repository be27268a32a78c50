"""What progress from 256 and 1,024 ranks costs the kernel (issue 20: the dashboard at scale).

A real distnb cluster (``distnb.start(n=E)``) whose engines play the simulated ranks of
:mod:`distnb.tools.simulate` (each simulated rank: the training rank's own ``Reporter``, at most 10
messages a second, through ipyparallel's ``publish_data``), watched by this process exactly as
a training cell is (the same intake, progress state and ipywidgets dashboard; the widgets are
built and updated as in a kernel, only no front end draws them). Per case, in alternated rounds:

- ``kernel CPU``: process CPU seconds of this process (every thread: ipyparallel's client
  thread that receives the messages included) over the run, as a share of one core;
- ``rank msgs/s``: rank messages taken in; ``zmq msgs/s``: messages the engines sent to the kernel
  (one per rank message directly, one per host bundle with the host relay);
- ``redraws/s``: dashboard redraws (header and aggregate; charts and table pages separately);
- ``lag``: how late messages were taken in (the kernel's clock minus the rank's send time), the
  median of the first and the last quarter of the run: a growing queue shows as a growing lag;
- ``backlog left``: seconds after the run until the kernel had received every message the engines
  sent (0 when it kept up; the next case starts only then, so cases do not disturb each other);
- ``generator late``: seconds the simulated run ended after its planned length (the engines could
  not keep up with their ranks when that is more than a second or so: then the rates are lower
  than asked, and ``CPU per 1k rank msgs`` is the figure to scale by).

Usage::

    .venv/bin/python benchmarks/scale_progress.py [--seconds 60] [--ranks 256 1024] [--groups 1 8]
        [--engines 2] [--rounds 1]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time


class Unshown:
    """The real dashboard, never displayed (no front end here): refresh and close as in a kernel."""

    def __init__(self, state):
        from distnb.display.widgets import Dashboard

        self.dash = Dashboard(state)

    def show(self):
        pass

    def refresh(self, final=False):
        self.dash.refresh(final)

    def close(self):
        self.dash.refresh(final=True)

    def __getattr__(self, name):
        return getattr(self.dash, name)


def one(session, num_ranks, group, seconds):
    import distnb.tools.simulate as sim

    captured = {}

    def view_for(state):
        captured["view"] = Unshown(state)
        return captured["view"]

    # distnb.tools.simulate.run takes a view object; it is made from the run's state, so build it lazily
    original = sim.make_view
    sim.make_view = lambda state, mode: view_for(state)
    try:
        r = sim.run(num_ranks, seconds=seconds, group=group, session=session, view="widgets", slow={5: 1.6})
    finally:
        sim.make_view = original
    view = captured["view"]
    t_drain = time.monotonic()  # a kernel that fell behind still reads the run's messages: wait, and say how long
    drained = all(ar.wait_for_output(300) for ar in r.ars)
    drain = time.monotonic() - t_drain
    q = max(1, len(r.lag) // 4)
    med = lambda xs: sorted(xs)[len(xs) // 2] if xs else float("nan")  # noqa: E731
    return dict(ranks=num_ranks, group=group, seconds=r.seconds, cpu=r.kernel_cpu, cpu_frac=r.kernel_cpu_fraction,
                rank_msgs=r.rank_messages / r.seconds, zmq_msgs=r.messages_sent / r.seconds,
                cpu_per_k=1000 * r.kernel_cpu / max(1, r.rank_messages),
                redraws=view.redraws / r.seconds, charts=view.chart_redraws / r.seconds,
                pages=view.page_redraws / r.seconds,
                lag_first=med([m for _, m, _ in r.lag[:q]]), lag_last=med([m for _, m, _ in r.lag[-q:]]),
                lag_max=max((x for _, _, x in r.lag), default=float("nan")),
                late=max(e["late"] for e in r.engine), engine_cpu=sum(e["cpu"] for e in r.engine) / r.seconds,
                dropped=sum(e["dropped"] for e in r.engine), done=sum(row["status"] == "done" for row in r.state.rows),
                drain=drain if drained else float("inf"))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=60.0)
    p.add_argument("--ranks", type=int, nargs="+", default=[256, 1024])
    p.add_argument("--groups", type=int, nargs="+", default=[1, 8], help="ranks per relay (1: direct)")
    p.add_argument("--engines", type=int, default=2)
    p.add_argument("--rounds", type=int, default=1)
    args = p.parse_args()
    os.environ.setdefault("IPYTHONDIR", tempfile.mkdtemp(prefix="distnb-bench-ipython-"))
    import distnb

    print(f"load before: {os.getloadavg()}")
    session = distnb.start(n=args.engines, quiet=True)
    rows = []
    try:
        for rnd in range(args.rounds):
            for num_ranks in args.ranks:
                groups = args.groups if rnd % 2 == 0 else list(reversed(args.groups))  # alternate the order
                for group in groups:
                    t = time.monotonic()
                    try:
                        row = one(session, num_ranks, group, args.seconds)
                    except Exception as exc:  # noqa: BLE001 - reported in the table, the next case runs
                        print(f"  round {rnd} {num_ranks} ranks group {group}: FAILED {type(exc).__name__}: "
                              f"{str(exc)[:300]}", flush=True)
                        session.restart() if hasattr(session, "restart") else None
                        continue
                    row["load"] = os.getloadavg()[0]
                    rows.append(row)
                    print(f"  round {rnd} {num_ranks} ranks group {group}: {time.monotonic() - t:.0f} s {row}",
                          flush=True)
    finally:
        session.stop(quiet=True)
    print("\n| ranks | relay | kernel CPU (share of a core) | CPU per 1k rank msgs | rank msgs/s | zmq msgs/s "
          "| redraws/s (charts, pages) | lag first -> last quarter (max) | backlog left (s) | generator late (engine CPU) "
          "| done | load |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        relay = "direct" if r["group"] == 1 else f"per host of {r['group']}"
        print(f"| {r['ranks']} | {relay} | {100 * r['cpu_frac']:.1f} % | {r['cpu_per_k']:.3f} s | {r['rank_msgs']:.0f} "
              f"| {r['zmq_msgs']:.0f} | {r['redraws']:.1f} ({r['charts']:.1f}, {r['pages']:.1f}) "
              f"| {r['lag_first'] * 1e3:.0f} -> {r['lag_last'] * 1e3:.0f} ms ({r['lag_max']:.2f} s) | {r['drain']:.1f} "
              f"| {r['late']:.1f} s ({100 * r['engine_cpu']:.0f} %) | {r['done']}/{r['ranks']} | {r['load']:.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
