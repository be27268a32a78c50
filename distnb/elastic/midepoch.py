"""An epoch a resize left in the middle: each rank gets the rows of its part of the epoch's rest.

After ``%dist scale`` (or ``--on-failure shrink``) the ranks hold, for a model stopped in the middle
of an epoch, which samples the epoch trained (:mod:`distnb.engine.train.epochrest`). A map-style Dataset
indexes the rest itself; tensor data the kernel scattered hold only their new shard's rows, so the
kernel sends each rank the rows of its part of the rest, once, after dealing the shards again
(:func:`send`). Data sent again later (changed in the notebook, another seed) carries no rest rows:
the rest then goes on by the count of samples trained, and the cell says so.
"""

from __future__ import annotations

import contextlib

from distnb.core import calls
from distnb.transfer.transfer import columns_of, outgoing_rows


def send(session, dealt: list) -> list:
    """Send the rows of each rest of the tensor data sets ``dealt`` (just dealt into this world's shards).

    Returns the data names sent rows for.
    """
    from distnb.engine.train import epochrest  # loads numpy, torch: at first use, not when this module is imported
    from distnb.engine.transport import shard as sharding  # torch (the kernel imports torch-heavy modules lazily)

    cluster = session.cluster
    held = session.holdings.data
    trails = cluster.wait_all([cluster.apply(0, calls.trails)], timeout=cluster.spec.timeout,
                              what="reading the epochs left in the middle")[0]
    sent = []
    for trail in trails.values():
        name = trail["data"][0]
        info = held.get(name)
        if name not in dealt or info is None or info.get("num_samples") != trail["data"][1] or name in sent:
            continue
        num_shards = info["num_shards"]
        parts = epochrest.layout(info["num_samples"], trail, num_shards)
        columns = columns_of(session.ns[name], name)[1]
        key = list(epochrest.rows_key(trail, num_shards))
        ars = []
        with contextlib.ExitStack() as files:
            for index, part in enumerate(parts):
                ranks = sharding.shard_ranks(index, cluster.world_size, num_shards)
                descs, rows = files.enter_context(outgoing_rows(cluster, columns, part, ranks))
                ars += [cluster.apply(rank, calls.install_rest, name, key, descs, *rows) for rank in ranks]
            cluster.wait_all(ars, timeout=cluster.spec.timeout, what=f"sending the rest of an epoch of {name}")
        sent.append(name)
    return sent
