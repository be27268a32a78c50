"""Simulated ranks: many ranks' progress from a few real engines (a testing and benchmark tool).

A real cluster gives a notebook 8 to 1,024 ranks; this machine runs a handful. :func:`simulate`
runs inside a real ipyparallel engine and plays ``len(ranks)`` ranks of a data-parallel run:
each has its own :class:`~distnb.engine.transport.report.Reporter` (the same class a training rank uses,
so the same payload, the same throttle, at most 10 messages a second per rank), fed one step
every ``step_time`` seconds, and its messages go to the kernel through the same
``publish_data`` path as a real rank's, either one message per rank (``group=1``, key
``distnb@R``) or through a :class:`~distnb.engine.transport.report.HostRelay` per ``group`` ranks (a host's
local rank 0 coalescing its host's messages). The kernel's intake, its progress state and the
dashboard then run exactly as in a real cell. Only the figures are made up:

- every rank steps on a shared clock, as data-parallel ranks do (each step's wall time is the
  same on every rank); a rank's offset within the step spreads the messages over time;
- ``busy_time`` (CPU seconds per step) is 55-70 % of the step, and ``slow`` ranks' is multiplied
  by their factor: they are the stragglers the others wait for;
- the loss falls as ``0.1 + 2.2 exp(-step / (total / 3))`` with per-rank noise (about 0.05);
- peak memory is 1.0-1.3 GiB per rank ("cuda", as on GPU ranks), a little more on slow ranks;
- a rank in ``fail`` reports ``failed`` (with an error text) at that step and stops, one in
  ``stop`` reports ``interrupted``; the others go on to ``done``.

The kernel side is :mod:`distnb.tools.simulate` (``distnb.tools.simulate.run``).
"""

from __future__ import annotations

import heapq
import math
import os
import random
import tempfile
import time

from distnb.engine.transport.report import DRAIN_SECONDS, HostRelay, Reporter, encode, publish_raw, rank_key

GIB = 1 << 30


class SimulatedReporter(Reporter):
    """A :class:`Reporter` whose CPU time and memory are the simulated rank's, not the process's."""

    def __init__(self, rank, total_steps, epochs, publish, busy_per_step, memory, interval=0.1):
        self.busy_per_step, self.memory = busy_per_step, memory
        super().__init__(rank, total_steps, epochs, interval=interval, publish=publish, device="cpu")
        self._epoch_sum = [0.0, 0]  # this epoch's loss sum and steps: the dashboard's epoch loss, as a real rank's
        self.running_loss = lambda: (self._epoch_sum[0] / max(1, self._epoch_sum[1]), self._epoch_sum[1])

    def record(self, loss, num_samples: int) -> None:
        self._epoch_sum[0] += float(loss)
        self._epoch_sum[1] += 1
        super().record(loss, num_samples)

    def end_epoch(self, epoch: int, mean_loss: float) -> None:
        super().end_epoch(epoch, mean_loss)
        self._epoch_sum[:] = [0.0, 0]

    def _cpu_time(self) -> float:
        return self.step * self.busy_per_step

    def _memory(self) -> tuple:
        return int(self.memory * (1 + 0.02 * min(1.0, self.step / max(1, self.total)))), "cuda"


def _loss(rng, step, total, bias):
    return 0.1 + bias + 2.2 * math.exp(-3.0 * step / max(1, total)) + rng.gauss(0.0, 0.05)


def _publisher(group, relays, rank, first, socket_dir, interval):
    """The ``publish`` of one simulated rank: direct (``distnb@R``) or through its group's relay."""
    if group <= 1:
        return lambda msg: publish_raw({rank_key(msg["rank"]): encode(msg)})
    leader = first + (rank - first) // group * group
    if leader not in relays:
        path = os.path.join(socket_dir, f"h{leader}.sock")
        relays[leader] = (HostRelay(path, leader=True, interval=interval), HostRelay(path, leader=False))
    lead, member = relays[leader]
    if rank == leader:
        return lead.send

    def send(msg):
        if msg["status"] != "running":  # the leader reads in this thread: make room for a message that must arrive
            lead.drain()
        member.send(msg)

    return send


def simulate(ranks, seconds=20.0, step_time=0.05, epochs=4, batch_size=32, group=1, slow=None, fail=None,
             stop=None, seed=0, relay_interval=0.1) -> dict:
    """Play ``ranks`` (global rank numbers) of a training run, publishing their progress to the kernel.

    Parameters
    ----------
    ranks : list of int
        The simulated ranks this engine plays (whole groups of ``group``, in order).
    seconds : float
        How long the run lasts: ``total = seconds / step_time`` steps per rank.
    step_time : float
        Seconds per step (every rank's wall time per step). 0.05 s with the Reporter's 0.1 s
        throttle gives 10 messages a second per rank, the most a real rank sends.
    epochs : int
        Epochs in the run (each reports its mean loss at its end, as a real rank does).
    batch_size : int
        Samples per step per rank.
    group : int
        Ranks per relay: 1 sends every rank's messages to the kernel itself; 8 is a host of 8
        ranks whose local rank 0 coalesces them (:class:`HostRelay`); ``len(ranks)`` one relay
        for all (the shape of aggregating on rank 0).
    slow : dict, optional
        ``{rank: factor}``: these ranks' busy time per step is ``factor`` times the others'.
    fail, stop : dict, optional
        ``{rank: step}``: the rank reports ``failed`` (``stop``: ``interrupted``) at that step and stops.
    seed : int
        Seeds the figures (the same seed gives the same losses and memory).
    relay_interval : float
        Seconds between a relay's bundles (:func:`distnb.engine.transport.report.relay_interval`).

    Returns
    -------
    dict
        ``ranks``, ``steps`` (per rank), ``records`` (steps recorded, all ranks), ``messages``
        (Reporter messages made), ``bundles`` (relay messages to the kernel), ``sent``/``dropped``
        (messages to relays; dropped when a relay's socket was full), ``seconds`` (wall), ``cpu``
        (this engine's CPU seconds), ``late`` (seconds the run ended after its planned length: the
        engine could not keep up when that is more than a step or two).
    """
    slow, fail, stop = dict(slow or {}), dict(fail or {}), dict(stop or {})
    total = max(1, int(round(seconds / step_time)))
    rng = random.Random(seed * 1_000_003 + (ranks[0] if ranks else 0))
    relays, reporters = {}, {}
    t_start, cpu_start = time.perf_counter(), time.process_time()
    with tempfile.TemporaryDirectory(prefix="distnb-sim-") as socket_dir:
        for rank in ranks:
            r = random.Random(seed * 7919 + rank)
            busy = step_time * r.uniform(0.55, 0.7) * slow.get(rank, 1.0)
            memory = GIB * r.uniform(1.0, 1.3) * (1.1 if rank in slow else 1.0)
            rep = SimulatedReporter(rank, total, epochs, _publisher(group, relays, rank, ranks[0], socket_dir, relay_interval),
                                    busy, memory)
            rep.loss_bias = r.uniform(-0.03, 0.03)
            rep.set_status("running")
            reporters[rank] = rep
        try:
            records = _play(reporters, relays, t_start, total, step_time, epochs, batch_size, fail, stop, rng)
        finally:
            for lead, member in relays.values():
                member.close()
                lead.close(linger=0.05)
    return dict(ranks=len(ranks), steps=total, records=records,
                messages=sum(rep.messages for rep in reporters.values()),
                bundles=sum(lead.bundles for lead, _ in relays.values()),
                sent=sum(member.sent for _, member in relays.values()),
                dropped=sum(member.dropped for _, member in relays.values()),
                seconds=time.perf_counter() - t_start, cpu=time.process_time() - cpu_start,
                late=max(0.0, time.perf_counter() - t_start - total * step_time))


def _play(reporters, relays, t_start, total, step_time, epochs, batch_size, fail, stop, rng) -> int:
    """The run's events in time order: each rank's steps, each relay's ticks; the steps recorded."""
    per_epoch = max(1, total // epochs)
    ranks = list(reporters)
    # events: (time, order, kind, key): a rank's next step, or a relay's next tick
    events = [(t_start + step_time * (i + 1) / len(ranks), i, "step", rank) for i, rank in enumerate(ranks)]
    drain = DRAIN_SECONDS
    events += [(t_start + drain * (j + 1) / max(1, len(relays)), -1 - j, "tick", leader)
               for j, leader in enumerate(relays)]
    heapq.heapify(events)
    records = 0
    while events:
        t, order, kind, key = heapq.heappop(events)
        delay = t - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        if kind == "tick":
            relays[key][0].tick()
            if any(rep.status == "running" for rep in reporters.values()):
                heapq.heappush(events, (t + drain, order, kind, key))
            continue
        rep = reporters[key]
        step = rep.step + 1
        if step == fail.get(key) or step == stop.get(key):
            err = (f"RuntimeError: simulated failure on rank {key} at step {step}" if step == fail.get(key)
                   else f"stopped because rank {min(fail) if fail else key} failed")
            rep.set_status("failed" if step == fail.get(key) else "interrupted", error=err)
            continue
        rep.epoch = (step - 1) // per_epoch
        rep.record(_loss(rng, step, total, rep.loss_bias), batch_size)
        records += 1
        if step % per_epoch == 0 or step == total:
            rep.end_epoch(rep.epoch, 0.1 + 2.2 * math.exp(-3.0 * step / total))
        if step == total:
            rep.set_status("done")
        else:
            heapq.heappush(events, (t + step_time, order, kind, key))
    return records
