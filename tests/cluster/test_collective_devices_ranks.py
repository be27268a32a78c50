"""At run time, every collective distnb calls on the ranks gets its tensors on the group's device (finding 2).

On each rank of the real 2-rank group, ``torch.distributed``'s tensor collectives are wrapped by a
checker that compares every tensor a call gets with ``collectives.group_device(group)``: what the
group's backend takes (the CPU for this gloo group, the current CUDA device for an nccl one). Then
distnb's own paths run: a ddp training cell with validation, ``--nan skip``, ``--clip-grad-norm`` and
the stop check, and :func:`distnb.engine.elastic.share` (what ``%dist scale`` runs after a grow; it
broadcast a CPU tensor on nccl's group). On CPU the checker guards the rule for gloo; the static half,
which fails on a CPU tensor built for an nccl group, is tests/unit/test_collective_devices.py.
"""

import torch.nn.functional as F

from distnb.core import calls
from support.data import parity_data, parity_model

INSTALL = """
import torch, torch.distributed as dist
from distnb.engine.process import collectives as _coll

_OPS = ("all_reduce", "broadcast", "reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor",
        "send", "recv", "isend", "irecv")
# in a cell, torch.distributed holds distnb's checked collectives, and puts back _ORIGINALS when it ends
_seen, _wrong, _saved = [], [], {op: _coll._ORIGINALS.get(op, getattr(dist, op)) for op in _OPS}

def _checking(op, original):
    def call(*args, **kwargs):
        expected = _coll.group_device(kwargs.get("group"))
        tensors = [a for a in args[:2] if isinstance(a, torch.Tensor)]
        tensors += [t for a in args[:1] if isinstance(a, list) for t in a if isinstance(t, torch.Tensor)]
        for t in tensors:
            _seen.append(op)
            if t.device != expected:
                _wrong.append((op, str(t.device), str(expected)))
        return original(*args, **kwargs)
    return call

for _op in _OPS:
    if _op in _coll._ORIGINALS:
        _coll._ORIGINALS[_op] = _checking(_op, _saved[_op])
    else:
        setattr(dist, _op, _checking(_op, _saved[_op]))
"""

REMOVE = """
for _op, _fn in _saved.items():
    if _op in _coll._ORIGINALS:
        _coll._ORIGINALS[_op] = _fn
    else:
        setattr(dist, _op, _fn)
(sorted(set(_seen)), _wrong)
"""


def test_distnb_collectives_get_tensors_on_the_group_device(dist_session, shell):
    ns = shell.user_ns
    ns["dev_net"], ns["dev_train"], ns["dev_val"], ns["F"] = parity_model(), parity_data(n=96), \
        parity_data(n=33, seed=3), F
    dist_session.run(INSTALL)
    try:
        dist_session.train("x, y = batch\nloss = F.cross_entropy(model(x), y)", model="dev_net", data="dev_train",
                           val_data="dev_val", epochs=2, batch_size=16, optimizer="sgd", lr=0.05, nan="skip",
                           clip_grad_norm=1.0, progress="none", quiet=True)
        cluster = dist_session.cluster
        shared = cluster.wait_all(cluster.apply_all(calls.share, [], 1), timeout=60, what="sharing the state")
        assert shared[0]["bytes"] > 0 and "dev_net" in shared[0]["models"]  # a tensor really was broadcast
    finally:
        outcomes = [eval(x) for x in dist_session.run(REMOVE)]
        dist_session.holdings.carried.pop("dev_net", None)  # later tests' %dist status lists no model of ours
    for seen, wrong in outcomes:
        assert wrong == []
        assert {"all_reduce", "broadcast"} <= set(seen)  # the checker saw distnb's own calls
