"""Every rank-side function the kernel calls, with its signature: one table (stdlib only).

The kernel never imports engine modules that need torch, so it cannot hold the functions
themselves; instead each entry below is a stub with the same signature as the engine
function it names (without the engine namespace ``ns`` that ``with_ns`` functions get
first). :meth:`distnb.cluster.cluster.Cluster.apply` binds the arguments to that signature before
anything is sent, so a wrong call is a ``TypeError`` in the kernel, and
``tests/unit/test_calls.py`` imports every engine function and checks that its signature
is the stub's, so renaming or changing one side alone fails a test.

Example::

    from distnb.core import calls
    ars = cluster.apply_all(calls.run_cell, "print(rank)")
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

RUNTIME = "distnb.engine.process.runtime"
IPENGINE = "distnb.engine.ipengine"
WIRE = "distnb.engine.transport.wire"
SEGMENTS = "distnb.engine.transport.segments"
LOOP = "distnb.engine.train.loop"
SHARDS = "distnb.engine.train.shards"
KEPT = "distnb.engine.train.kept"
WHERE = "distnb.engine.process.where"
DATASETS = "distnb.engine.train.datasets"
NET = "distnb.core.net"
POSTMORTEM = "distnb.engine.process.postmortem"
ELASTIC = "distnb.engine.elastic"
PULLTENSOR = "distnb.engine.train.pulltensor"
RESTROWS = "distnb.engine.restrows"
MATERIALIZE = "distnb.engine.strategies.materialize"
INSTALL = "distnb.engine.train.install"
VALPARTS = "distnb.engine.valparts"
STATEPARTS = "distnb.engine.train.stateparts"
CARRY = "distnb.engine.train.carry"
SAVES = "distnb.engine.train.saves"
SAVEFOLDER = "distnb.engine.train.savefolder"
PRETRAINED = "distnb.engine.train.pretrained"
LEASESAVE = "distnb.engine.train.leasesave"


@dataclass(frozen=True)
class RankFunction:
    """A function that runs on a rank: where it lives and how it is called.

    Attributes
    ----------
    module, name : str
        The engine module and the function's name in it.
    with_ns : bool
        The function takes the engine's namespace (a dict) as its first argument.
    signature : inspect.Signature
        Its parameters after ``ns``.
    """

    module: str
    name: str
    with_ns: bool
    signature: inspect.Signature

    def check(self, args: tuple) -> None:
        """Raise TypeError (naming the function) unless ``args`` fit its signature."""
        try:
            self.signature.bind(*args)
        except TypeError as exc:
            raise TypeError(f"{self.module}.{self.name}{self.signature}: {exc}") from None

    def __repr__(self):
        return f"<rank function {self.module}.{self.name}>"


TABLE: dict[str, RankFunction] = {}


def _on_rank(module: str, with_ns: bool = False):
    def declare(stub) -> RankFunction:
        fn = RankFunction(module, stub.__name__, with_ns, inspect.signature(stub))
        TABLE[f"{module}.{stub.__name__}"] = fn
        return fn
    return declare


# engine/runtime.py: process group and cells ------------------------------------------
@_on_rank(RUNTIME, with_ns=True)
def setup(rank, world_size, local_rank, backend, device_type, gpu, num_threads, master_addr, master_port,
          timeout, node_rank=0, host=None, interface=None, bind_among=None, local_world_size=None): ...


@_on_rank(RUNTIME)
def info(**extra): ...


@_on_rank(RUNTIME, with_ns=True)
def release(drop_store=False, failed_cell=False): ...


@_on_rank(RUNTIME, with_ns=True)
def reform(master_addr, master_port, generation=0): ...


@_on_rank(RUNTIME)
def leave(): ...


@_on_rank(RUNTIME)
def shutdown(): ...


@_on_rank(RUNTIME, with_ns=True)
def run_cell(code, targets=None, unchecked=False): ...


# engine/elastic.py: %dist scale, the world re-formed at a new size --------------------------
@_on_rank(ELASTIC, with_ns=True)
def resize(rank, world_size, num_threads, master_addr, master_port, local_rank=None, bind_among=None,
           local_world_size=None): ...


@_on_rank(ELASTIC, with_ns=True)
def share(names, old_world, defined=True): ...


# engine/restrows.py: the rest of an epoch a resize left in the middle ---------------------------
@_on_rank(RESTROWS)
def trails(): ...


@_on_rank(RESTROWS)
def install_rest(name, key, descs, *buffers): ...


# engine/postmortem.py: %dist debug, pdb on a failed rank's kept traceback --------------------
@_on_rank(POSTMORTEM)
def debug_kept(): ...


@_on_rank(POSTMORTEM, with_ns=True)
def debug_begin(): ...


@_on_rank(POSTMORTEM, with_ns=True)
def debug_command(line): ...


@_on_rank(POSTMORTEM, with_ns=True)
def debug_end(release=True): ...


# engine/ipengine.py: what an engine loads ahead of its first cell -------------------------
@_on_rank(IPENGINE)
def warm_up(): ...


# distnb/core/net.py: where an engine runs, before it is a rank --------------------------------
@_on_rank(NET)
def whereami(controller_ip): ...


@_on_rank(NET)
def interface_address(name): ...


@_on_rank(NET)
def free_port(host="127.0.0.1"): ...


# engine/wire.py: objects by value ----------------------------------------------------
@_on_rank(WIRE)
def probe_shm(path, token, owner_pid): ...


@_on_rank(SEGMENTS)
def held_segments(owner_pid): ...


@_on_rank(WIRE, with_ns=True)
def bind(name, payload, descs, *buffers): ...


@_on_rank(WIRE, with_ns=True)
def lookup(name): ...


# engine/loop.py: training ------------------------------------------------------------
@_on_rank(INSTALL, with_ns=True)
def install_model(name, payload, descs, steps, *buffers): ...


@_on_rank(INSTALL, with_ns=True)
def place_model(name, plan_dict, steps, payload, descs, rng, *buffers): ...


@_on_rank(MATERIALIZE)
def capacity(): ...


@_on_rank(SHARDS, with_ns=True)
def install_shard(name, num_samples, num_shards, seed, index, structure, descs, *buffers): ...


@_on_rank(LOOP, with_ns=True)
def train(plan_dict, code_text, outbox=None): ...


# engine/kept.py: a training cell's result kept for a kernel that attaches (issue 38) --------
@_on_rank(KEPT, with_ns=True)
def train_kept(token, plan_dict, code_text, outbox=None): ...


@_on_rank(KEPT)
def kept_result(token): ...


# engine/datasets.py: data sets loaded on the ranks ---------------------------------------
@_on_rank(DATASETS, with_ns=True)
def install_dataset(name, kind, num_shards, payload, descs, *buffers): ...


@_on_rank(DATASETS, with_ns=True)
def adopt_dataset(name, num_shards): ...


# engine/valparts.py: a validation set each rank builds (--val-data make) ------------------
@_on_rank(VALPARTS, with_ns=True)
def build_val_part(name, num_shards, seed): ...


# engine/carry.py: a meta model sent again keeps the ranks' trained weights ------------------
@_on_rank(CARRY)
def carry_weights(name, on): ...


# engine/stateparts.py: weights back in bounded parts ----------------------------------------
@_on_rank(STATEPARTS)
def pull_part(name, keys, reserve=0, all_keys=None): ...


# engine/train/saves.py: %dist save (DCP, --format safetensors, --adapters); a failure keeps the group when it can
@_on_rank(SAVEFOLDER)
def writable(directory): ...


@_on_rank(SAVES, with_ns=True)
def save_checkpoint(name, directory): ...


@_on_rank(SAVES, with_ns=True)
def save_safetensors(name, directory, max_shard_bytes): ...


@_on_rank(SAVES, with_ns=True)
def save_peft_adapters(name, directory): ...


@_on_rank(LOOP, with_ns=True)
def restore(name, directory, changes=None): ...


# engine/pretrained.py: --load PATH, each rank its slices ------------------------------------
@_on_rank(PRETRAINED, with_ns=True)
def load_weights(name, plan_dict, found, aliases): ...


# engine/leasesave.py: an expiring lease saves what the ranks trained ------------------------
@_on_rank(LEASESAVE, with_ns=True)
def save_trained(default_dir): ...


# engine/where.py: where a rank is ---------------------------------------------------
@_on_rank(WHERE)
def where_now(): ...


# engine/simulate.py: simulated ranks' progress (a testing and benchmark tool) -------------
@_on_rank("distnb.engine.simulate")
def simulate(ranks, seconds=20.0, step_time=0.05, epochs=4, batch_size=32, group=1, slow=None, fail=None,
             stop=None, seed=0, relay_interval=0.1): ...


# engine/pulltensor.py: %dist pull NAME.path --------------------------------------------------

@_on_rank(PULLTENSOR, with_ns=True)
def locate_tensor(head, path): ...


@_on_rank(PULLTENSOR, with_ns=True)
def fetch_tensor(head, path, gathered, rank): ...
