"""Parameter-server updates: a few ranks hold the parameters and the optimizer state.

The parameter-server architecture (Li et al., "Scaling Distributed Machine Learning with
the Parameter Server", OSDI 2014) splits the model's parameters among *server* nodes;
*workers* compute gradients on their part of the data, *push* them to the servers, the
servers apply the update with their optimizer and the workers *pull* the new values.
It is the other synchronisation scheme beside all-reduce (which ``ddp`` uses).

Here every rank is a worker (it trains on its own data shard, ``data_parallel``), and
ranks ``0 .. K-1`` are also the servers (``--servers K``, co-located with their workers,
K <= world_size). The trainable parameters are dealt to the servers whole, balanced by
bytes (largest first, each to the least loaded server, ties to the lower rank); server
``s`` builds the real torch optimizer over the parameters it owns only, so the optimizer
state (Adam moments, momentum buffers) lives only on the servers. The training loop's
``optimizer.step()`` is the push/pull exchange (:class:`~.ps_optimizer.ServerOptimizer`); the loop builds
that optimizer from :meth:`ParameterServer.parameters`. A rank that owns nothing gets a
placeholder parameter with no elements (torch optimizers refuse an empty list); it never
steps, so it holds no optimizer state.

Synchronous (``--staleness 0``, default)
    Each step, every rank reduces (sums) the gradients of server ``s``'s parameters to
    rank ``s`` (``torch.distributed.reduce``), the server divides by world_size, applies
    its optimizer and broadcasts the new values back. This equals one process training on
    the global batch (the union of the ranks' batches), like DDP.

Bounded staleness (``--staleness K``, K > 0)
    Stale Synchronous Parallel (Ho et al., "More Effective Distributed ML via a Stale
    Synchronous Parallel Parameter Server", NIPS 2013). Each server keeps its own copy of
    the parameters it owns (the authoritative values) and applies every worker's gradient,
    divided by world_size, as one optimizer step as soon as it arrives: a thread per
    remote worker receives (``torch.distributed.recv``), updates under a lock and sends the
    new values back (``send``). A worker sends its gradients (``isend``) and posts the
    receive of the reply (``irecv``) without waiting; it blocks only when more than K
    replies are outstanding, then trains on the newest values it has received. So a worker
    runs at most K steps ahead of the last parameters it received (like SSP's cache, it
    does not wait for fresher values while within the bound). A server's own worker applies
    its gradient directly and always reads fresh values.

All parameter-server traffic goes over one gloo process group of all ranks (formed once
per main group, buffers on the CPU), so it never interleaves with the loop's collectives
on the main group (progress, epoch losses). At the end of a cell
(:meth:`ParameterServer.full_state`, which the loop calls on every rank) the asynchronous
exchange is drained: workers wait for their outstanding replies and send each remote
server a stop message, the server threads end, and each server broadcasts its
authoritative values to every rank, so every rank (and the kernel's model) holds the
trained parameters and nothing is left in flight for the next cell. The optimizer state
stays on the servers between cells. A failure in the middle of an asynchronous cell ends
the exchange with the same stop messages (:meth:`ParameterServer.close`), so no peer waits
for the collective timeout. The optimizer belongs to this layout, so the strategy is declared as changing
the module in place (:data:`distnb.core.plan.STRATEGIES`): a different ``--servers``/``--staleness`` or a re-formed process group
makes the kernel send the model again (from its weights, the last trained ones).

Buffers (BatchNorm running statistics) are not served: each rank keeps its own, and rank
0's go back to the kernel.

Shapes and dtypes: messages are flat 1-D tensors in the parameters' dtype (one dtype per
model): a gradient message to server ``s`` is ``[header, gradients of s's parameters
(their numel in total), one has-gradient flag per parameter]``; a reply is the flat values
of ``s``'s parameters. ``server_wait_seconds`` in :meth:`ParameterServer.holdings` is
seconds this rank's worker was blocked in the exchange (pushing gradients, waiting for
values; a server's own update is not counted), per cell.

Errors (kernel side, :class:`~distnb.engine.strategies.StrategyError`): ``--servers K``
with more servers than ranks or than trainable parameter tensors, a model without
trainable parameters, parameters of several dtypes. Rank side: sparse gradients
(``ValueError``); a failed server thread is raised on its rank at the next step.
"""

from __future__ import annotations

import collections
import datetime
import threading
import time

import torch

from distnb.engine.process import abort, runtime
from distnb.engine.strategies import Strategy, StrategyError, levers, tensor_bytes
from distnb.engine.strategies.ps_optimizer import (
    ServerOptimizer,
    clone_tensors,
    flat_state,
    init_optimizer_state,
    load_flat_state,
)
from distnb.engine.transport import stateout

#: Tags of the point-to-point messages on the parameter-server group.
GRAD_TAG, PARAMS_TAG = 71, 72
#: Header of a gradient message: a push, or the worker's last message of the cell.
PUSH, STOP = 1.0, 0.0
#: Communication buffers live on the CPU (the ps group is gloo, also on GPU clusters).
COMM_DEVICE = torch.device("cpu")
#: The parameter-server group of the current process group (one per generation, shared by
#: every ps model): {generation: group}.
_GROUP: dict = {}


def ps_group():
    """The gloo group all parameter-server traffic uses (formed on first use; a collective)."""
    import torch.distributed as dist


    group = _GROUP.get(runtime.STATE.generation)
    if group is None:
        _GROUP.clear()
        with abort.tracking():  # a peer's failure ends this group's collectives too
            group = _GROUP[runtime.STATE.generation] = dist.new_group(
                backend="gloo", timeout=datetime.timedelta(seconds=runtime.STATE.timeout))
    return group


def _release(ns) -> None:
    """Runtime release hook (after the strategies' ``close``): forget the group being torn down."""
    _GROUP.clear()


def assign_servers(sizes: list[int], num_servers: int) -> list[int]:
    """Deal whole tensors of ``sizes`` bytes to ``num_servers`` servers, balanced by bytes.

    Largest first, each to the server with the fewest bytes so far (ties: lowest index).

    Returns
    -------
    list of int
        The server of each tensor, in the order of ``sizes``.
    """
    owner = [0] * len(sizes)
    loads = [0] * num_servers
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        s = min(range(num_servers), key=lambda s: (loads[s], s))
        owner[i] = s
        loads[s] += sizes[i]
    return owner


def _trainable(module) -> list:
    return [p for p in module.parameters() if p.requires_grad]


class ParameterServer(Strategy):
    """Ranks ``0..servers-1`` hold the parameters (whole tensors) and the optimizer state.

    Attributes
    ----------
    num_servers, staleness : int
    owned : list of list of torch.nn.Parameter
        ``owned[s]``: the module's trainable parameters server ``s`` holds (module order).
    masters : list of torch.nn.Parameter or None
        With staleness > 0, on a server: its authoritative copy of ``owned[rank]``.
    group : torch.distributed.ProcessGroup
        The gloo group of all parameter-server traffic (:func:`ps_group`).
    wait_seconds : float
        This cell's seconds blocked in the exchange.
    """

    name = "ps"
    # The optimizer is built over this layout's parameters (the servers' shares, or their
    # copies) and the exchange runs over a group of this process-group generation: after a
    # re-formed process group or a different --servers/--staleness the kernel sends the model
    # again (from its weights, which are the last trained ones), as for strategies that shard
    # the module.

    @classmethod
    def check(cls, plan, module, world_size: int) -> None:
        super().check(plan, module, world_size)
        k = plan.servers
        if k > world_size:
            raise StrategyError(f"--servers {k} needs {k} ranks but the cluster has {world_size}: servers are ranks "
                                f"0..{k - 1} (they also compute gradients); use --servers {world_size} or fewer")
        params = _trainable(module)
        if not params:
            raise StrategyError(f"{type(module).__name__} has no trainable parameters to serve")
        if k > len(params):
            n = len(params)
            raise StrategyError(f"--servers {k}: {type(module).__name__} has only {n} trainable parameter "
                                f"tensor{'s' if n != 1 else ''} and each server holds whole tensors; use --servers "
                                f"{n} or fewer")
        dtypes = sorted({str(p.dtype).replace("torch.", "") for p in params})
        if len(dtypes) > 1:
            raise StrategyError(f"{type(module).__name__} has parameters of several dtypes ({', '.join(dtypes)}); "
                                "the parameter server sends them in one buffer: convert the model to one dtype")

    def __init__(self, module, plan, device, ns):
        import torch.distributed as dist

        super().__init__(module, plan, device, ns)
        levers.checkpoint_blocks(module, plan)  # --activation-checkpointing, before wrapping
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.num_servers, self.staleness = plan.servers, plan.staleness
        self.check(plan, module, self.world_size)
        params = _trainable(module)
        owner = assign_servers([tensor_bytes(p) for p in params], self.num_servers)
        self.owned = [[p for p, o in zip(params, owner) if o == s] for s in range(self.num_servers)]
        self.numels = [sum(p.numel() for p in ps) for ps in self.owned]
        self.dtype = params[0].dtype
        self.is_server = self.rank < self.num_servers
        self._names = {id(p): n for n, p in module.named_parameters()}  # the first name of a tied one
        mine = self.owned[self.rank] if self.is_server else []
        self.masters = None
        if self.staleness and self.is_server:
            self.masters = [torch.nn.Parameter(p.detach().clone()) for p in mine]
        held = self.masters if self.masters is not None else mine
        # torch optimizers refuse an empty list: a rank serving nothing gets a 0-element placeholder
        self._held = held or [torch.nn.Parameter(torch.zeros(0, dtype=self.dtype, device=device))]
        self.group = ps_group()
        self._optimizer = None
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._thread_errors: list[BaseException] = []
        self._pending = {s: collections.deque() for s in range(self.num_servers) if s != self.rank}
        self._window = False  # an asynchronous exchange is in progress (threads serve)
        self._stopped = set()
        self._cell = None
        self.wait_seconds, self.max_steps_ahead, self.updates = 0.0, 0, 0

    # the optimizer ------------------------------------------------------------------
    def parameters(self):
        """What this rank's real optimizer updates: the parameters (or copies) it serves."""
        return list(self._held)

    def wrap_optimizer(self, optimizer):
        self._optimizer = optimizer
        return ServerOptimizer(optimizer, self)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.module.parameters():
            if p.grad is None:
                continue
            if set_to_none:
                p.grad = None
            else:
                p.grad.detach_()
                p.grad.zero_()

    # the exchange ------------------------------------------------------------------------
    def exchange(self) -> None:
        """Push this rank's gradients, let the servers update, pull values (``optimizer.step()``)."""
        self._new_cell()
        if self._thread_errors:
            raise RuntimeError(f"rank {self.rank}: the parameter server failed: {self._thread_errors[0]!r}") \
                from self._thread_errors[0]
        if self.staleness == 0:
            self._sync_exchange()
        else:
            self._async_exchange()

    def _new_cell(self) -> None:
        """Reset the per-cell figures when a new training cell runs (its code was just compiled)."""

        cell = getattr(runtime, "_CELLS", [None])[0]  # bumped for every compiled cell
        if cell != self._cell:
            self._cell = cell
            self.wait_seconds, self.max_steps_ahead, self.updates = 0.0, 0, 0

    def _pack(self, s: int, header: bool) -> torch.Tensor:
        """Flat [header?, gradients of server s's parameters, has-gradient flags] on the CPU."""
        params = self.owned[s]
        parts = [torch.full((1,), PUSH, dtype=self.dtype, device=self.device)] if header else []
        flags = torch.zeros(len(params), dtype=self.dtype, device=self.device)
        for i, p in enumerate(params):
            g = p.grad
            if g is None:
                parts.append(torch.zeros(p.numel(), dtype=self.dtype, device=p.device))
                continue
            if g.is_sparse:
                raise ValueError(f"rank {self.rank}: --strategy ps does not support sparse gradients "
                                 "(e.g. nn.Embedding(sparse=True))")
            parts.append(g.detach().reshape(-1).to(self.dtype))
            flags[i] = 1
        parts.append(flags)
        return torch.cat(parts).to(COMM_DEVICE)

    @staticmethod
    def _flat(params) -> torch.Tensor:
        return torch.cat([p.detach().reshape(-1) for p in params]).to(COMM_DEVICE)

    @staticmethod
    def _load(flat: torch.Tensor, params) -> None:
        """Copy the flat values ``flat`` into ``params``."""
        offset = 0
        with torch.no_grad():
            for p in params:
                n = p.numel()
                p.copy_(flat[offset:offset + n].view(p.shape))
                offset += n

    def _apply(self, buf: torch.Tensor, targets, scale: float) -> None:
        """One optimizer step on ``targets`` with the summed gradients in ``buf`` times ``scale``."""
        if self._optimizer is None:
            raise RuntimeError(f"rank {self.rank}: the parameter server has no optimizer (wrap_optimizer was not "
                               "called)")
        n = sum(t.numel() for t in targets)
        grads = buf[:n].mul_(scale)
        flags = buf[n:n + len(targets)].tolist()
        offset = 0
        for t, flag in zip(targets, flags):
            k = t.numel()
            t.grad = grads[offset:offset + k].view(t.shape).to(t.device) if flag > 0 else None
            offset += k
        self._optimizer.step()
        self.updates += 1

    def _sync_exchange(self) -> None:
        import torch.distributed as dist

        k, group = self.num_servers, self.group
        t0 = time.perf_counter()
        bufs = [self._pack(s, header=False) for s in range(k)]
        # group device: _pack's buffers are on COMM_DEVICE, the CPU of ps's gloo group
        for work in [dist.reduce(bufs[s], dst=s, op=dist.ReduceOp.SUM, group=group, async_op=True)
                     for s in range(k)]:
            work.wait()
        waited = time.perf_counter() - t0
        if self.is_server:
            mine = self.owned[self.rank]
            self._apply(bufs[self.rank], mine, 1.0 / self.world_size)
            for p in mine:  # the gradient views into the reduce buffer
                p.grad = None
        t1 = time.perf_counter()
        values = [self._flat(self.owned[s]) if s == self.rank else
                  torch.empty(self.numels[s], dtype=self.dtype, device=COMM_DEVICE) for s in range(k)]
        for work in [dist.broadcast(values[s], src=s, group=group, async_op=True) for s in range(k)]:
            work.wait()
        for s in range(k):
            if s != self.rank:
                self._load(values[s], self.owned[s])
        self.wait_seconds += waited + time.perf_counter() - t1

    def _open_window(self) -> None:
        """Start serving for this cell: refresh the server's copy, one thread per remote worker."""
        if self._window:
            return
        self._window = True
        self._thread_errors = []
        self._stopped = set()  # remote servers this rank has sent its stop message in this window
        if self.masters is not None:
            self._load(self._flat(self.owned[self.rank]), self.masters)
        if self.is_server:
            self._threads = [threading.Thread(target=self._serve, args=(w,), daemon=True,
                                              name=f"distnb-ps-server{self.rank}-worker{w}")
                             for w in range(self.world_size) if w != self.rank]
            for t in self._threads:
                t.start()

    def _serve(self, worker: int) -> None:
        """Server thread for one remote worker: apply each pushed gradient, reply with the values.

        It answers every push until the worker's stop message, even after a failed update
        (recorded, raised on this rank's main thread at its next step) and after this rank
        tore its process groups down (a failed cell, see :meth:`close`), so that no worker
        ever waits for a reply that does not come. It calls the group object's ``send`` and
        ``recv`` because ``torch.distributed.send`` refuses a group that was destroyed.
        """
        group, mine = self.group, self.owned[self.rank]
        buf = torch.empty(1 + self.numels[self.rank] + len(mine), dtype=self.dtype, device=COMM_DEVICE)
        try:
            while True:
                group.recv([buf], worker, GRAD_TAG).wait()  # group ranks are the global ranks
                if buf[0].item() == STOP:
                    return
                with self._lock:
                    if not self._thread_errors:
                        try:
                            self._apply(buf[1:], self.masters, 1.0 / self.world_size)
                        except Exception as exc:
                            self._thread_errors.append(_without_frames(exc))
                        for m in self.masters:
                            m.grad = None
                    values = self._flat(self.masters)
                group.send([values], worker, PARAMS_TAG).wait()  # group device: COMM_DEVICE (_flat)
        except BaseException as exc:  # the group failed: a peer's process group was torn down
            self._thread_errors.append(_without_frames(exc))

    def _async_exchange(self) -> None:
        import torch.distributed as dist

        self._open_window()
        for s in range(self.num_servers):
            if s == self.rank:  # this rank's own server: apply now, read the fresh values
                buf = self._pack(s, header=False)
                with self._lock:
                    self._apply(buf, self.masters, 1.0 / self.world_size)
                    for m in self.masters:
                        m.grad = None
                    self._load(self._flat(self.masters), self.owned[s])
                continue
            buf = self._pack(s, header=True)
            reply = torch.empty(self.numels[s], dtype=self.dtype, device=COMM_DEVICE)
            send = dist.isend(buf, dst=s, group=self.group, tag=GRAD_TAG)  # group device: COMM_DEVICE (_pack)
            recv = dist.irecv(reply, src=s, group=self.group, tag=PARAMS_TAG)
            self._pending[s].append((buf, send, reply, recv))
        t0 = time.perf_counter()
        for s, queue in self._pending.items():
            self._receive(s, keep=self.staleness)
            self.max_steps_ahead = max(self.max_steps_ahead, len(queue))
        self.wait_seconds += time.perf_counter() - t0

    def _receive(self, s: int, keep: int) -> None:
        """Wait for server ``s``'s oldest replies until ``keep`` are outstanding; load the newest."""
        queue, latest = self._pending[s], None
        while len(queue) > keep:
            _, send, reply, recv = queue[0]
            send.wait()
            recv.wait()
            queue.popleft()
            latest = reply
        if latest is not None:
            self._load(latest, self.owned[s])

    def _drain(self) -> None:
        """End the asynchronous exchange on every rank; every rank then holds the servers' values."""
        import torch.distributed as dist


        self._open_window()
        t0 = time.perf_counter()
        for s in self._pending:
            self._receive(s, keep=0)
            stop = torch.zeros(1 + self.numels[s] + len(self.owned[s]), dtype=self.dtype, device=COMM_DEVICE)
            dist.send(stop, dst=s, group=self.group, tag=GRAD_TAG)
            self._stopped.add(s)
        self.wait_seconds += time.perf_counter() - t0
        for t in self._threads:
            t.join(timeout=runtime.STATE.timeout)
        if any(t.is_alive() for t in self._threads):
            raise RuntimeError(f"rank {self.rank}: the parameter server did not finish within "
                               f"{runtime.STATE.timeout:g} s")
        self._threads = []
        if self._thread_errors:
            raise RuntimeError(f"rank {self.rank}: the parameter server failed: {self._thread_errors[0]!r}") \
                from self._thread_errors[0]
        for s in range(self.num_servers):
            values = self._flat(self.masters) if s == self.rank else \
                torch.empty(self.numels[s], dtype=self.dtype, device=COMM_DEVICE)
            dist.broadcast(values, src=s, group=self.group)
            self._load(values, self.owned[s])
        self._window = False

    # results ---------------------------------------------------------------------------------
    streams_state = False  # the drain below ends the cell's exchange: once, at the cell's end

    def full_state(self):
        """Drain the asynchronous exchange (every rank), then rank 0's state: the servers' values."""
        import torch.distributed as dist


        self._new_cell()
        if self.staleness:
            self._drain()
        if dist.get_rank() != 0:
            return None
        return stateout.flatten_state(self.module.state_dict())

    # checkpoints ------------------------------------------------------------------------------
    def checkpoint_state(self, optimizer):
        """(model state, optimizer state) for ``torch.distributed.checkpoint``; every rank calls it.

        Each server contributes the authoritative values of the parameters it serves (its copy
        with staleness) and its optimizer's state by parameter name (``ps_optimizer.flat_state``,
        the pipeline's layout: another --servers or a pipeline reads it); buffers and frozen
        parameters are replicas on every rank (DCP keeps one copy). Tensors are cloned under
        the server lock, so a checkpoint in the middle of an asynchronous cell is a consistent
        snapshot of each server. A fresh optimizer (no state yet) gets its state initialised
        by a zero-gradient step at lr 0 first, as ``torch.distributed.checkpoint.state_dict``
        does, so that loading fills every entry.
        """
        inner = getattr(optimizer, "inner", optimizer)
        trainable = {id(p) for ps in self.owned for p in ps}
        with self._lock:
            model = {}
            if self.is_server:
                values = self.masters if self.masters is not None else self.owned[self.rank]
                for p, v in zip(self.owned[self.rank], values):
                    model[self._name(p)] = v.detach().clone()
            for name, t in self.module.state_dict(keep_vars=True).items():
                if id(t) not in trainable:
                    model[name] = t.detach().clone()
            optim = {}
            if self.is_server and self.owned[self.rank]:
                init_optimizer_state(inner)
                optim = clone_tensors(flat_state(inner, self._served_names()))
        return model, optim

    def load_checkpoint_state(self, optimizer, model_state, optimizer_state) -> None:
        """Load a checkpoint (every rank): the servers load their values and optimizer state
        (``optimizer_state`` None: the values only), then broadcast the values to every rank (a
        collective on the ps group)."""
        import torch.distributed as dist

        inner = getattr(optimizer, "inner", optimizer)
        targets = dict(self.module.state_dict(keep_vars=True))
        with torch.no_grad():
            for name, value in model_state.items():
                targets[name].copy_(value)
        if self.is_server and self.owned[self.rank] and optimizer_state is not None:  # None: the model only
            load_flat_state(inner, self._served_names(), optimizer_state)
        for s in range(self.num_servers):
            values = self._flat(self.owned[s]) if s == self.rank else \
                torch.empty(self.numels[s], dtype=self.dtype, device=COMM_DEVICE)
            dist.broadcast(values, src=s, group=self.group)
            self._load(values, self.owned[s])
        if self.masters is not None:
            self._load(self._flat(self.owned[self.rank]), self.masters)

    def _served_names(self) -> list[str]:
        """The names of the parameters this server's optimizer updates, in its order."""
        return [self._name(p) for p in self.owned[self.rank]]

    def _name(self, param) -> str:
        """The parameter's name in ``module.named_parameters()`` (the first one when tied)."""
        return self._names[id(param)]

    def holdings(self) -> dict:
        """role, param_bytes (the compute replica plus a server's copy), server_param_bytes,
        optimizer_state_bytes, server_wait_seconds, server_updates, steps_ahead_max."""
        self._new_cell()
        served = self.owned[self.rank] if self.is_server else []
        state_bytes = 0
        if self._optimizer is not None:
            for per_param in self._optimizer.state.values():
                state_bytes += sum(tensor_bytes(v) for v in per_param.values() if isinstance(v, torch.Tensor))
        return dict(role="server" if self.is_server else "worker",
                    param_bytes=sum(tensor_bytes(p) for p in self.module.parameters()) +
                    sum(tensor_bytes(m) for m in self.masters or ()),
                    server_param_bytes=sum(tensor_bytes(p) for p in served),
                    optimizer_state_bytes=state_bytes,
                    server_wait_seconds=self.wait_seconds,
                    server_updates=self.updates,
                    steps_ahead_max=self.max_steps_ahead)

    def close(self) -> None:
        """Drop the references to the process group (it is being re-formed, or the strategy rebuilt).

        After a cell that drained normally nothing is in flight. After a failure in the middle
        of an asynchronous cell, this rank's pushes may be unanswered and its server threads
        may be waiting for pushes, both holding the group (and its connections) open, so peers
        blocked on them would wait for the full timeout. The exchange is ended by a handshake
        that needs no healthy main group: this rank sends every remote server a stop message
        (after its pending pushes, which those servers still answer), and a daemon thread
        waits for those sends and replies, then drops them; this rank's own server threads end
        at the peers' stop messages (each peer sends them when it fails in turn) or when a
        peer's connections close. Until then the threads keep this object and its optimizer.
        """
        import torch.distributed as dist


        pending = [item for queue in self._pending.values() for item in queue]
        for queue in self._pending.values():
            queue.clear()
        threads = [t for t in self._threads if t.is_alive()]
        if self.group is not None and (pending or threads):
            stops = []
            for s in self._pending:
                if s in self._stopped:
                    continue
                stop = torch.zeros(1 + self.numels[s] + len(self.owned[s]), dtype=self.dtype, device=COMM_DEVICE)
                try:
                    stops.append((stop, dist.isend(stop, dst=s, group=self.group, tag=GRAD_TAG)))
                except Exception:
                    pass
            threading.Thread(target=_finish, args=(pending, stops, runtime.STATE.timeout), daemon=True,
                             name=f"distnb-ps-close{self.rank}").start()
        if not threads:
            self._optimizer = None
        self._threads, self.group, self.model = [], None, None
        self._window = False


def _without_frames(exc: BaseException) -> BaseException:
    """``exc`` without its traceback: frames would keep the process group (and its sockets) alive."""

    runtime.clear_exception_frames(exc)
    return exc.with_traceback(None)


def _finish(pending, stops, timeout: float) -> None:
    """Wait (each at most ``timeout`` s) for the pushes, replies and stop messages of a failed cell."""
    limit = datetime.timedelta(seconds=timeout)
    works = [w for _, send, _, recv in pending for w in (send, recv)] + [w for _, w in stops]
    for work in works:
        try:
            work.wait(limit)
        except Exception:
            pass


def _register() -> None:

    if _release not in runtime.RELEASE_HOOKS:
        runtime.RELEASE_HOOKS.append(_release)


_register()

STRATEGY = ParameterServer
