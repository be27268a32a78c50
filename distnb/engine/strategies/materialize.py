"""Shard first, then place: a model received as its structure, materialised slice by slice.

The kernel sends a model as a pickle whose tensors are cut out (:func:`distnb.engine.transport.wire.pack`).
:func:`receive` unpickles it with every parameter and buffer on the meta device (the structure,
no data) and keeps a :class:`Source` of where each tensor's bytes are: the kernel's shared-memory
segment (mapped one tensor at a time, read-only), the message's buffers, or nothing at all for a
tensor the notebook built on the meta device. :func:`place_model` then lets the strategy shard the
meta module (``fully_shard``, ``parallelize_module``, the pipeline's stage split) and
:func:`materialize` gives every tensor this rank keeps its memory on the device and copies into it
only the slice this rank holds, one tensor at a time. So a rank never holds more of the model than
its share plus one tensor (fsdp, tensor, fsdp+tensor, pipeline); ddp and ps keep a whole replica.

Tensors with no data (a meta-device model in the notebook) are initialised here, deterministically:
every rank walks the unsharded structure module by module (``named_modules()`` order), makes that
module's own tensors whole on the CPU, runs its ``reset_parameters()`` (or ``--init FN``) from the
notebook's generator state, and keeps its slice. The weights equal those of the model built in one
process after the same ``torch.manual_seed`` (to float rounding: the same ops in the same order).

This is the meta-device initialisation of FSDP2 and torchtitan (``fully_shard`` on a meta module,
then ``to_empty`` and ``reset_parameters``/``init_weights``), with the values of a one-process build.
"""

from __future__ import annotations

import contextlib
import copy
import io
import mmap
import socket
import warnings

import torch

from distnb.core import hfinit
from distnb.engine.process import runtime
from distnb.engine.strategies import finetune
from distnb.engine.transport import wire


def _is_meta(t) -> bool:
    local = t.to_local() if hasattr(t, "to_local") else t
    return local.is_meta


class Source:
    """Where the bytes of each tensor of a received model lie (``descs``' order).

    ``buffers``: one :class:`~distnb.engine.transport.wire.ShmRef` (the kernel's segment) or one flat uint8
    array per tensor (ipyparallel frames). A tensor whose description ends with ``True`` (the
    notebook's tensor was on the meta device) has no bytes: :meth:`has_data` is False.
    """

    def __init__(self, descs, buffers):
        self.descs = list(descs)
        self.ref = buffers[0] if len(buffers) == 1 and isinstance(buffers[0], wire.ShmRef) else None
        self.buffers = None if self.ref is not None else list(buffers)

    def has_data(self, index: int) -> bool:
        return not wire.is_meta_desc(self.descs[index])

    @contextlib.contextmanager
    def full(self, index: int):
        """The whole tensor ``index``, read-only, on the CPU, without a copy.

        From shared memory only that tensor's pages are mapped, and unmapped when the block ends
        (so they leave this process's resident memory).
        """
        desc = self.descs[index]
        dtype, shape = getattr(torch, desc[0]), tuple(desc[1])
        if self.ref is None:
            yield wire.from_buffer(desc[:2] + (False, False), self.buffers[index], copy=False)
            return
        offset, nbytes = self.ref.offsets[index], self.ref.sizes[index]
        if nbytes == 0:
            yield torch.empty(shape, dtype=dtype)
            return
        start = offset - offset % mmap.ALLOCATIONGRANULARITY
        with open(self.ref.path, "rb") as f:
            mapping = mmap.mmap(f.fileno(), offset + nbytes - start, access=mmap.ACCESS_READ, offset=start)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)  # a read-only buffer: only read here
                raw = torch.frombuffer(mapping, dtype=torch.uint8, offset=offset - start, count=nbytes)
            yield raw.view(dtype).view(shape)
        finally:
            raw = None
            try:
                mapping.close()
            except BufferError:  # a view still alive: the mapping goes when it is collected
                pass


class Pending:
    """A received model not yet placed: its :class:`Source`, and each tensor's index by qualified name.

    Attributes
    ----------
    names : dict of str to int
        Every parameter and buffer name (tied ones under each name) to its index in the source.
    shadow : torch.nn.Module or None
        An unsharded copy of the structure (meta tensors) when some tensors have no data, walked to
        initialise them module by module.
    rng : torch.Tensor or None
        The notebook generator's state to initialise from (:func:`place_model`).
    skip : frozenset of int
        Source indices of tensors ``--load`` fills: placed with memory, neither copied nor initialised.
    """

    def __init__(self, source, names, shadow):
        self.source, self.names, self.shadow = source, names, shadow
        self.rng = None
        self.carry = None  # a carry.Carry: the old run's trained weights instead of a fresh init (engine/carry.py)
        self.skip = frozenset()  # indices --load fills: placed without values (engine/pretrained.py)

    @property
    def needs_init(self) -> bool:
        return self.shadow is not None


def _meta_of(desc) -> torch.Tensor:
    return wire._finish(torch.empty(tuple(desc[1]), dtype=getattr(torch, desc[0]), device="meta"), desc)


def _named_tensors(module):
    """(qualified name, tensor) of every parameter and buffer, tied ones under each of their names."""
    for mod_name, mod in module.named_modules(remove_duplicate=False):
        for table in (mod._parameters, mod._buffers):
            for key, t in table.items():
                if t is not None:
                    yield (f"{mod_name}.{key}" if mod_name else key), t


def receive(payload: bytes, descs, buffers):
    """Unpickle a model with its parameters and buffers on the meta device; returns (module, Pending).

    Tensors the model keeps outside its parameters and buffers (plain attributes) are small and
    unknown to any strategy: they are read whole. Raises TypeError for anything but a Module.
    """
    source = Source(descs, buffers)
    metas = [_meta_of(d) for d in descs]
    module = wire._Unpickler(io.BytesIO(payload), metas).load()
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"a {type(module).__name__} was sent as a model, not a torch.nn.Module")
    index = {id(t): i for i, t in enumerate(metas)}
    names = {name: index[id(t)] for name, t in _named_tensors(module) if id(t) in index}
    held = set(names.values())
    loose = [i for i in range(len(descs)) if i not in held]
    if loose:  # unpickle again, those tensors read whole (the module's own stay meta)
        tensors = list(metas)
        for i in loose:
            if source.has_data(i):
                with source.full(i) as full:
                    tensors[i] = wire._finish(full.clone(), descs[i])
        module = wire._Unpickler(io.BytesIO(payload), tensors).load()
        names = {name: index[id(t)] for name, t in _named_tensors(module) if id(t) in index}
    wire.hook_ids_after(module)
    shadow = copy.deepcopy(module) if any(not source.has_data(i) for i in set(names.values())) else None
    return module, Pending(source, names, shadow)


def _piece(full: torch.Tensor, live):
    """The part of ``full`` this rank keeps for ``live`` (a DTensor: its local shard; else all of it)."""
    from torch.distributed.tensor import Replicate, Shard

    if not hasattr(live, "device_mesh"):
        return full
    mesh, coords = live.device_mesh, live.device_mesh.get_coordinate()
    if all(type(p) in (Shard, Replicate) for p in live.placements):
        out = full
        for dim, p in enumerate(live.placements):
            if type(p) is Shard:  # torch.chunk's split, as DTensor's Shard cuts a tensor
                chunks = torch.chunk(out, mesh.size(dim), dim=p.dim)
                out = chunks[coords[dim]] if coords[dim] < len(chunks) else out.narrow(p.dim, 0, 0)
        return out
    from torch.distributed.tensor import distribute_tensor  # strided shards (fsdp+tensor): torch's own cut

    return distribute_tensor(full.to(live.device), mesh, live.placements, src_data_rank=None).to_local()


def _copy_into(live, full) -> None:
    local = live.to_local() if hasattr(live, "to_local") else live
    with torch.no_grad():
        local.copy_(_piece(full, live))


def place(module, device, keep=None, param_device=None) -> dict:
    """Give every meta parameter and buffer of ``module`` that ``keep(name)`` accepts empty memory on ``device``.

    A DTensor gets its local shard only (``torch.empty_like``, as ``Module.to_empty``); tied tensors
    stay tied. ``param_device``: where parameters go instead (fsdp ``--offload cpu``: host memory; buffers
    stay on ``device``, where the forward runs). Returns {qualified name: new tensor} of what was placed
    (tied ones under each name).
    """
    made, placed = {}, {}
    for mod_name, mod in module.named_modules(remove_duplicate=False):
        for table in (mod._parameters, mod._buffers):
            for key, t in list(table.items()):
                name = f"{mod_name}.{key}" if mod_name else key
                if t is None or not _is_meta(t) or (keep is not None and not keep(name)):
                    continue
                new = made.get(id(t))
                if new is None:
                    on_params = param_device is not None and isinstance(t, torch.nn.Parameter)
                    new = torch.empty_like(t, device=param_device if on_params else device)
                    if isinstance(t, torch.nn.Parameter):
                        new = torch.nn.Parameter(new, requires_grad=t.requires_grad)
                    made[id(t)] = new
                table[key] = new
                placed[name] = new
    return placed


def materialize(pending: Pending, module, device, keep=None, init=None, param_device=None) -> None:
    """Place ``module``'s meta tensors (see :func:`place`, ``param_device`` too) and fill each with this rank's slice.

    Tensors with data are copied from the source one at a time; the others are initialised with
    :func:`initialize` (``init``: the ``--init`` function, else each module's ``reset_parameters``).
    """
    placed = place(module, device, keep, param_device)
    by_index: dict[int, list] = {}
    for name, live in placed.items():
        index = pending.names.get(name)
        if index is None:  # not in what was received: it would be left as uninitialised memory
            raise RuntimeError(f"rank {runtime.STATE.rank}: {name} is on the meta device after distributing the "
                               "model but was not among the tensors received; it has no value to take")
        by_index.setdefault(index, []).append(live)
    for index, lives in by_index.items():
        if pending.source.has_data(index):
            with pending.source.full(index) as full:
                for live in lives:
                    _copy_into(live, full)
                del full
    if pending.needs_init and pending.carry is not None:
        pending.skip = pending.skip | pending.carry.fill(pending, by_index)
    if pending.needs_init and any(_without_data(pending, name) for name in pending.names):
        initialize(pending, by_index, init)  # what no carry filled: all of a fresh model, a carried one's non-persistent buffers


def _without_data(pending: Pending, name: str) -> bool:
    index = pending.names.get(name)
    return index is not None and not pending.source.has_data(index) and index not in pending.skip


def _module_label(name: str, mod) -> str:
    return f"{name or 'the root module'} ({type(mod).__name__})"


def initialize(pending: Pending, by_index: dict, init=None) -> None:
    """Initialise the tensors that came without data, as one process would, and keep this rank's slices.

    Walks ``pending.shadow`` (the unsharded structure) in ``named_modules()`` order; for each module
    holding such tensors of its own, makes them whole on the CPU (floats filled with NaN first),
    calls ``init(module)`` or ``module.reset_parameters()`` (for a ``transformers`` model's module
    and no ``init``: then the model's ``_init_weights``, :mod:`.hfinit`) under the notebook's generator state
    ``pending.rng`` (carried from module to module), copies each into the tensors ``by_index`` says
    this rank holds, and drops them. Every rank runs every module, so the generator stays in step.

    Raises
    ------
    RuntimeError
        A module without ``reset_parameters`` (and no ``init``), or one that left a tensor it holds
        uninitialised (still NaN): names the module and the tensor.
    """
    found = hfinit.owners(pending.shadow) if init is None else {}
    used = {}
    with torch.random.fork_rng(devices=[]):
        if pending.rng is not None:
            torch.random.set_rng_state(pending.rng)
        for mod_name, mod in pending.shadow.named_modules():
            own = [(table, key, t) for table in (mod._parameters, mod._buffers) for key, t in table.items()
                   if t is not None and t.is_meta and _without_data(pending, f"{mod_name}.{key}" if mod_name else key)]
            if not own:
                continue
            adapter = finetune.adapter_init(pending.shadow, mod_name, mod)  # a LoRA adapter: peft's own init
            fn = adapter or (init if init is not None else getattr(mod, "reset_parameters", None))
            if adapter is None and init is None:  # a transformers model's module: its _init_weights, as post_init
                fn = hfinit.hf_init(found, mod_name, mod, used, first=fn) or fn
            if fn is None:
                raise RuntimeError(f"{_module_label(mod_name, mod)} was built on the meta device and has no "
                                   "reset_parameters(): pass --init FN, a notebook function that initialises a "
                                   "module's own tensors")
            whole = []
            for table, key, t in own:
                w = torch.empty_like(t, device="cpu")
                w.fill_(float("nan") if w.is_floating_point() else 0)
                table[key] = torch.nn.Parameter(w, requires_grad=t.requires_grad) if isinstance(
                    t, torch.nn.Parameter) else w
                whole.append((table, key, t))
            with torch.no_grad():
                fn(mod) if init is not None and adapter is None else fn()
            for table, key, t in whole:
                value = table[key]
                name = f"{mod_name}.{key}" if mod_name else key
                if value.is_floating_point() and torch.isnan(value).any():
                    how = f"--init {getattr(init, '__name__', init)}" if init is not None and adapter is None else \
                        "reset_parameters()"
                    raise RuntimeError(f"{how} of {_module_label(mod_name, mod)} left {name} uninitialised (it was "
                                       "built on the meta device): initialise every parameter and buffer the module "
                                       "holds itself, or pass --init FN that does")
                for live in by_index.get(pending.names.get(name, -1), ()):
                    _copy_into(live, value.detach())
                table[key] = t  # back to meta: one module's tensors at a time
    if pending.carry is None:  # a carried model made anew only what no state holds (a rotary inv_freq): no news
        hfinit.say_once(used, runtime.STATE.rank)


def place_whole(pending: Pending, module, device, init=None) -> None:
    """Materialise all of ``module`` on ``device`` (ddp, ps: a whole replica on each rank)."""
    materialize(pending, module, device, None, init)


def init_function(ns, plan):
    """The ``--init`` function from the engine namespace, or None."""
    if plan.init is None:
        return None
    fn = ns.get(plan.init)
    if not callable(fn):
        raise NameError(f"--init {plan.init} is not a function on rank {runtime.STATE.rank}")
    return fn


def _cgroup_room():
    """Bytes this process's memory cgroup (v1 or v2) still allows, or None without a limit."""
    try:
        with open("/proc/self/cgroup") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            base = f"/sys/fs/cgroup/memory{path}"
            files = (f"{base}/memory.limit_in_bytes", f"{base}/memory.usage_in_bytes")
        elif controllers == "":
            files = (f"/sys/fs/cgroup{path}/memory.max", f"/sys/fs/cgroup{path}/memory.current")
        else:
            continue
        try:
            with open(files[0]) as f, open(files[1]) as g:
                limit, usage = f.read().strip(), int(g.read().strip())
        except (OSError, ValueError):
            continue
        if limit != "max" and int(limit) < (1 << 60):
            return int(limit) - usage
    return None


def capacity() -> dict:
    """The memory this rank can still fill: ``{"bytes": n, "scope": "rank" | "host", "host": name}``.

    A GPU's free memory (``torch.cuda.mem_get_info``) or the rank's memory cgroup is this rank's
    alone (``"rank"``); otherwise it is the host's available memory, shared by its ranks (``"host"``).
    """

    st = runtime.STATE
    if st.device is not None and st.device.type == "cuda":
        return dict(bytes=int(torch.cuda.mem_get_info(st.device)[0]), scope="rank", host=socket.gethostname())
    room = _cgroup_room()
    if room is not None:
        return dict(bytes=room, scope="rank", host=socket.gethostname())
    with open("/proc/meminfo") as f:
        info = dict(line.split(":", 1) for line in f)
    return dict(bytes=int(info["MemAvailable"].split()[0]) * 1024, scope="host", host=socket.gethostname())
