"""Throttled progress messages from a rank to the kernel.

Messages go through ipyparallel's ``publish_data`` (the kernel reads them from
``AsyncResult.data`` while the cell runs), or to :data:`SINK` in a job run without a kernel.
A rank publishes at most once per
``interval`` seconds (default 0.1 s, i.e. <= 10 messages/s), plus once on every
status change and epoch end. Loss values are read off the device (``.item()``)
only when a message goes out, so reporting never forces a GPU sync per step.

Besides progress, each message carries what the kernel's dashboard shows per rank:
``busy_time`` (CPU seconds of the training thread per step, on CPU devices: time not spent
waiting for peers, so a straggler stands out even when collectives equalise the wall
``step_time``), ``peak_memory`` (bytes since the cell began, :mod:`distnb.engine.transport.peaks`: the
process's peak resident set on CPU, or ``torch.cuda.max_memory_allocated`` on a GPU;
``memory_kind`` says which) and, when a
strategy sets it, ``stage`` (the pipeline stage this rank runs).

A message goes to the kernel under the key ``"distnb"`` (the rank of the engine that sends it) or
``"distnb@R"`` (:func:`rank_key`: rank R's message sent by another process, a host's relay
(:class:`HostRelay`) or the simulated ranks of :mod:`distnb.engine.simulate`). ipyparallel merges
each published dict into the cell's ``AsyncResult.data``, so per key the kernel reads the newest.
A training cell's last message of a rank that reports for itself is not published: its reply carries
it (:meth:`Reporter.final_message`).
"""

from __future__ import annotations

import os
import pickle
import socket
import sys
import tempfile
import threading
import time

from distnb.engine.transport import lazyread, peaks

#: Loss points and epoch means a message repeats (the newest), so the kernel loses none when it reads
#: the latest message only every second or so; more would make every message dearer to send and read.
TAIL = 16


#: Seconds after the last message within which an epoch's end waits for the next message (sent by the first
#: step this long after the last one): epochs of a few tens of milliseconds (a small model) each sent a message
#: of their own, which cost about 5 % of the training thread's time on a tiny DDP model.
EPOCH_GAP = 0.1

#: Where messages go outside an engine: a callable taking each payload (a job that torchrun started,
#: :mod:`distnb.engine.job`, prints the epochs' losses from them). None in an engine: to the kernel.
SINK = None


def publish_raw(payload: dict) -> None:
    """``payload`` to the kernel, merged into the running cell's ``AsyncResult.data`` (or to :data:`SINK`)."""
    if SINK is not None:
        SINK(payload)
        return
    from ipyparallel.datapub import publish_data  # lazy: only inside an engine

    publish_data(payload)


def _default_publish(data: dict) -> None:
    publish_raw({"distnb": data})


def encode(msg: dict) -> bytes:
    """A rank message as the bytes a relay or a simulated rank publishes under :func:`rank_key` (pickle).

    ipyparallel's client walks every dict it receives, key by key, before distnb sees it (its
    ``uncan``, in the kernel's receiving thread): a bundle of rank messages as dicts cost it a walk of
    every message, most of which the next bundle supersedes before the kernel looks. As bytes it
    passes through whole, and the kernel decodes only what it takes in
    (:func:`distnb.execute.execute.take_progress`).
    """
    return pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)


def rank_key(rank: int) -> str:
    """The ``publish_data`` key of rank ``rank``'s progress sent on its behalf: ``"distnb@R"``."""
    return f"distnb@{rank}"


def peak_memory(device=None) -> tuple:
    """Peak memory of this process since its cell began: ``(bytes, kind)`` (:func:`distnb.engine.transport.peaks.peak_memory`)."""
    return peaks.peak_memory(device)


def peak_row(device=None) -> dict:
    """This rank's :func:`peak_memory` as a TrainResult row's ``peak_memory`` (bytes) and ``memory_kind``."""
    memory, kind = peak_memory(device)
    return dict(peak_memory=memory, memory_kind=kind)


def _engine_device():
    """The rank's device when running in an engine (None in plain processes and tests)."""
    runtime = sys.modules.get(__package__ + ".runtime") if __package__ else None
    return getattr(getattr(runtime, "STATE", None), "device", None)


class Reporter:
    """Collects per-step figures on one rank and publishes them, throttled.

    Parameters
    ----------
    rank : int
    total_steps : int
        Steps this cell will run at most (for the progress bar).
    epochs : int
        Epochs this cell will run at most.
    interval : float
        Minimum seconds between two throttled messages.
    publish : callable, optional
        ``publish(dict)``; default: ipyparallel's ``publish_data``.
    stage : int, optional
        Pipeline stage of this rank, sent with every message (``extra["stage"]`` works too).
    device : torch.device, optional
        Where the rank computes (for peak memory); default: the engine's device.
    """

    def __init__(self, rank, total_steps, epochs, interval=0.1, publish=None, stage=None, device=None):
        self.rank = rank
        self.total = int(total_steps)
        self.epochs = int(epochs)
        self.interval = float(interval)
        self.publish = publish or _default_publish
        self.step = 0
        self.samples = 0
        self.epoch = 0
        self.status = "waiting"
        self.points = []  # (step, loss) at each published message
        self.epoch_losses = []
        self.epoch_rates = []  # (epoch, this rank's samples/s over that epoch)
        self._epoch_start = None  # (perf_counter, samples) when this epoch's training began
        self._last_loss = None  # a float, or a tensor (a --loop body's ctx.report(loss)) read by _loss_reading
        self._loss_reading = lazyread.Latest()
        self._epoch_loss_reading = lazyread.Latest()
        self._t_last = time.perf_counter()
        self._win_samples = 0
        self._win_steps = 0
        self._win_t0 = self._t_last
        self.samples_per_s = 0.0
        self.step_time = 0.0
        self.extra = {} if stage is None else {"stage": stage}
        self.messages = 0
        self.device = device if device is not None else _engine_device()
        peaks.start_cell(self.device)  # one Reporter per cell: its peak memory is the cell's (GPU review, 10)
        self.busy_time = None  # CPU seconds of the training thread per step (CPU devices only)
        self._win_cpu0 = self._cpu_time()
        self._unsent_epochs = 0  # epoch ends since the last message (they shorten the gap to EPOCH_GAP)
        #: ``() -> (mean, steps)``: this rank's mean loss over its current epoch so far (the training
        #: context's ``running_mean``: a float or a tensor read without waiting); sent as ``epoch_loss``
        self.running_loss = None

    def _cpu_time(self) -> float:
        """CPU seconds of the training thread so far (``busy_time`` is its growth per step)."""
        return time.thread_time()

    def _memory(self) -> tuple:
        """``(bytes, kind)`` of this rank's peak memory (:func:`peak_memory`)."""
        return peak_memory(self.device)

    def record(self, loss, num_samples: int) -> None:
        """Count one finished step of ``num_samples`` samples whose loss tensor is ``loss``."""
        self.step += 1
        self.samples += num_samples
        self._win_samples += num_samples
        self._win_steps += 1
        self._last_loss = loss
        now = time.perf_counter()
        if now - self._t_last >= (min(self.interval, EPOCH_GAP) if self._unsent_epochs else self.interval):
            self._flush(now)

    def set_status(self, status: str, **extra) -> None:
        if status == "running" and self.status != "running":
            self._epoch_start = (time.perf_counter(), self.samples)
        self.status = status
        self.extra.update(extra)
        self._flush(time.perf_counter())

    def final_message(self, status: str) -> dict:
        """The rank's last message (``status`` in :data:`FINAL`), built but not published: the rank's reply carries it.

        A message published just before the reply costs the warm cell about 3 ms on 2 ranks: the engine's
        IOPub hand-off, the controller's relay and the kernel's client each handle it, and the reply
        queues behind it (benchmarks/README.md, issue 17). The kernel takes it from the result
        (:meth:`distnb.execute.execute.Watch`) and ignores that rank's IOPub messages that arrive later.
        """
        self.status = status
        return self._flush(time.perf_counter(), publish=False)

    def end_epoch(self, epoch: int, mean_loss: float) -> None:
        """Record epoch ``epoch``'s mean loss and this rank's samples/s over it (from ``running`` or the last epoch's end)."""
        now = time.perf_counter()
        self.epoch_losses.append((epoch, mean_loss))
        del self.epoch_losses[:-TAIL]
        if self._epoch_start is not None and now > self._epoch_start[0]:
            self.epoch_rates.append((epoch, (self.samples - self._epoch_start[1]) / (now - self._epoch_start[0])))
            del self.epoch_rates[:-TAIL]
        self._epoch_start = (now, self.samples)
        self._unsent_epochs += 1
        if now - self._t_last >= EPOCH_GAP or self._unsent_epochs >= TAIL // 2:
            self._flush(now)  # else a short epoch: its end goes with the message of a step at most EPOCH_GAP later

    def _flush(self, now: float, publish: bool = True) -> dict:
        window = now - self._win_t0
        cpu = self._cpu_time()
        if self._win_steps and window > 0:
            self.samples_per_s = self._win_samples / window
            self.step_time = window / self._win_steps
            on_gpu = getattr(self.device, "type", None) == "cuda"
            self.busy_time = None if on_gpu else (cpu - self._win_cpu0) / self._win_steps
        self._win_t0, self._win_samples, self._win_steps, self._win_cpu0 = now, 0, 0, cpu
        try:
            memory, memory_kind = self._memory()
        except Exception:  # progress must never break training
            memory, memory_kind = None, None
        loss = None
        if self._last_loss is not None:  # a GPU loss is read without waiting; a rank's last message exactly
            try:
                reading = self._loss_reading
                loss = reading.offer(self._last_loss) if publish else reading.now(self._last_loss)
            except Exception:  # a failed device: the failure is the message, not this figure
                loss = None
        if loss is not None:
            if not self.points or self.points[-1][0] != self.step:
                self.points.append((self.step, loss))
                del self.points[:-TAIL]
        epoch_loss = None
        if self.running_loss is not None:
            try:
                mean, steps = self.running_loss()
                reading = self._epoch_loss_reading  # no GPU sync: a value at most a few steps old, exact at the end
                epoch_loss = (reading.offer(mean) if publish else reading.now(mean)) if steps else None
            except Exception:  # progress must never break training
                epoch_loss = None
        self._t_last = now
        self._unsent_epochs = 0
        self.messages += publish
        msg = dict(rank=self.rank, status=self.status, epoch=self.epoch, epochs=self.epochs,
                   step=self.step, total=self.total, samples=self.samples, loss=loss, epoch_loss=epoch_loss,
                   samples_per_s=self.samples_per_s, step_time=self.step_time, busy_time=self.busy_time,
                   peak_memory=memory, memory_kind=memory_kind, points=self.points[-TAIL:],
                   epoch_losses=self.epoch_losses[-TAIL:], epoch_rates=self.epoch_rates[-TAIL:], time=time.time())
        msg.update(self.extra)
        if not publish:
            return msg
        try:
            self.publish(msg)
        except Exception:  # progress must never break training
            pass
        return msg


#: Seconds a host's rank may wait for its leader's socket to take a message that changes its status.
STATUS_SEND_TIMEOUT = 0.5
#: Seconds between two reads of the leader's socket (each rank sends at most 10 messages a second into it).
DRAIN_SECONDS = 0.02


#: Bundles a second the kernel receives at most from all hosts' relays together (see relay_interval).
RELAY_RATE = 50
#: The longest gap between a host's bundles, as a share of what the :data:`TAIL` loss points cover.
TAIL_COVER = 0.8


def relay_interval(num_hosts: int, interval: float = 0.1) -> float:
    """Seconds between a host leader's bundles: ``interval``, longer above ``RELAY_RATE * interval`` hosts.

    The kernel then receives at most :data:`RELAY_RATE` bundles a second (0.64 s between bundles
    with 32 hosts), up to the gap that each rank's newest :data:`TAIL` loss points still cover
    (``TAIL_COVER * TAIL * interval``: 1.28 s, reached at 64 hosts; beyond, the rate grows with the
    hosts: 100 a second at 128). Each bundle carries every rank's newest message. 100 bundles a second
    cost the kernel 15-17 % of a core at 256 ranks (32 hosts), mostly ipyparallel receiving them;
    measured in benchmarks/scale_progress.py (benchmarks/README.md, issue 20).
    """
    return max(interval, min(num_hosts / RELAY_RATE, TAIL_COVER * TAIL * interval))


#: Statuses after which a rank sends nothing more in a cell.
FINAL = frozenset({"done", "failed", "interrupted", "stopped"})
#: Seconds a host's leader waits at the end of a cell for the final message of each rank it heard from.
LINGER = 0.5


def host_relay(world_size: int, local_rank: int, node_rank: int, relay_above: int):
    """This rank's :class:`HostRelay` for a training cell, started; None at ``world_size <= relay_above``.

    One relay per host and process group: the socket is named by the group's rendezvous
    (``MASTER_ADDR``/``MASTER_PORT``: one path per world, reused by its cells) and the host's ``node_rank``, in
    the temporary folder; the host's local rank 0 is its leader. The leader spaces its bundles
    by :func:`relay_interval` of the number of hosts, estimated as ``world_size`` over the ranks
    it hears from.
    """
    if world_size <= relay_above or SINK is not None:
        return None

    group = f"{os.environ.get('MASTER_ADDR', 'local')}-{os.environ.get('MASTER_PORT', '0')}-n{node_rank}"
    path = os.path.join(tempfile.gettempdir(), f"distnb-relay-{os.getuid()}-{group}.sock")
    relay = HostRelay(path, leader=local_rank == 0)
    relay.world_size = world_size
    return relay.start()


class HostRelay:
    """Per-host aggregation of progress: the kernel receives one message per host, not one per rank.

    The host's leader (its local rank 0) binds a Unix datagram socket at ``path``; the host's other
    ranks send their messages there instead of to the kernel (:meth:`send`, non-blocking: when the
    socket is full a message is dropped, and the rank's next one, at most ``interval`` later,
    supersedes it, since every message carries the rank's whole state and its newest
    :data:`TAIL` loss points; a message that changes the rank's status, such as ``done``, waits
    up to :data:`STATUS_SEND_TIMEOUT` for room instead). The leader reads the socket every
    :data:`DRAIN_SECONDS` and every ``interval`` seconds (:meth:`tick`, from
    :meth:`start`'s thread or called by its owner) publishes the newest
    message of each rank heard from since the last flush, all in one ``publish_data`` call under
    :func:`rank_key` keys, so a host of ``L`` ranks sends ``<= 1 / interval`` messages a second
    to the kernel instead of ``L / interval``. Measured in ``benchmarks/scale_progress.py``
    (benchmarks/README.md, issue 20). No torch collective is involved: the training path is not
    touched. The two-level (tree-based) aggregation of monitoring data is MRNet's idea (Roth,
    Arnold and Miller, "MRNet: A Software-Based Multicast/Reduction Network for Scalable Tools",
    SC 2003).

    Parameters
    ----------
    path : str
        The socket's path (at most about 100 bytes, a Unix socket limit), shared by one host's ranks.
    leader : bool
        True on the host's local rank 0: bind ``path`` and publish; False: send to it.
    interval : float
        Seconds between the leader's messages to the kernel (default 0.1 s, 10 a second).
    publish : callable, optional
        ``publish(dict)``; default :func:`publish_raw`.

    Attributes
    ----------
    sent, dropped, bundles : int
        Messages sent to the leader, dropped because its socket was full (or not bound yet),
        and bundles the leader published.
    """

    def __init__(self, path: str, leader: bool, interval: float = 0.1, publish=None):
        self.path, self.leader, self.interval = path, bool(leader), float(interval)
        self.publish = publish or publish_raw
        self.pending = {}  # rank -> its newest message not yet published (the leader's)
        self._lock = threading.Lock()  # the training thread's send and the relay thread's flush
        self.sent = self.dropped = self.bundles = 0
        self._published = 0.0  # time.monotonic() of the last bundle
        self._statuses = {}  # rank -> the status of its last message that reached the leader (a member's)
        self._thread = self._stop = None
        self.world_size = None  # set: the leader spaces its bundles for world_size / (ranks heard) hosts
        self._final = {}  # rank -> whether its newest message to the leader had a final status
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.setblocking(False)
        if self.leader:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
            self.sock.bind(path)

    def send(self, msg: dict) -> None:
        """One rank's message: to the leader's socket (a member), or into the next bundle (the leader)."""
        if self.leader:
            with self._lock:
                self.pending[msg["rank"]] = msg
                self._final[msg["rank"]] = msg.get("status") in FINAL
            return
        status_change = self._statuses.get(msg["rank"]) != msg["status"]
        try:
            if status_change:  # "done", "failed": the last word of a rank, never dropped while the leader reads
                self.sock.settimeout(STATUS_SEND_TIMEOUT)
            self.sock.sendto(encode(msg), self.path)
            self.sent += 1
            self._statuses[msg["rank"]] = msg["status"]
        except OSError:  # full (BlockingIOError, a timeout), or the leader is not there (yet, or any more)
            self.dropped += 1
        finally:
            if status_change:
                self.sock.setblocking(False)

    def drain(self) -> int:
        """The leader: read every message waiting in the socket into :attr:`pending`; how many."""
        n = 0
        while True:
            try:
                data = self.sock.recv(1 << 20)
            except (BlockingIOError, InterruptedError):
                return n
            msg = pickle.loads(data)
            with self._lock:
                self.pending[msg["rank"]] = data  # published as it came (encode), not pickled again
                self._final[msg["rank"]] = msg.get("status") in FINAL
            n += 1

    def flush(self) -> int:
        """The leader: drain, then publish what is pending as one bundle; the ranks it carried."""
        if not self.leader:
            return 0
        self.drain()
        with self._lock:
            pending, self.pending = self.pending, {}
        if not pending:
            return 0
        if self.world_size:
            self.interval = relay_interval(-(-self.world_size // max(1, len(self._final))))
        bundle = {rank_key(r): m if isinstance(m, bytes) else encode(m) for r, m in pending.items()}
        try:
            self.publish(bundle)
            self.bundles += 1
        except Exception:  # progress must never break training
            pass
        return len(bundle)

    def tick(self, now: float | None = None) -> None:
        """The leader: drain the socket, and publish once ``interval`` has passed since the last bundle.

        Called every :data:`DRAIN_SECONDS`: a Unix datagram socket holds only a few
        messages (``net.unix.max_dgram_qlen``, 10 by default on Linux), so it is read more often
        than it is published.
        """
        now = time.monotonic() if now is None else now
        if now - self._published >= self.interval:
            self._published = now
            self.flush()
        else:
            self.drain()

    def start(self) -> "HostRelay":
        """The leader: :meth:`tick` from a daemon thread until :meth:`close`."""
        if self.leader and self._thread is None:
            self._stop = threading.Event()

            def loop():
                while not self._stop.wait(DRAIN_SECONDS):
                    self.tick()

            self._thread = threading.Thread(target=loop, name="distnb-host-relay", daemon=True)
            self._thread.start()
        return self

    def close(self, linger: float = 0.0) -> None:
        """Stop; the leader waits up to ``linger`` seconds for late messages (less once every rank it
        heard from sent its final status), flushes, and removes ``path``."""
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None
        if self.leader:
            deadline = time.monotonic() + linger
            while time.monotonic() < deadline:
                if not self.drain():
                    with self._lock:
                        if self._final and all(self._final.values()):
                            break
                    time.sleep(0.01)
            self.flush()
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
        self.sock.close()
