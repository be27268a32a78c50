"""What this kernel's same-host transfers leave in /dev/shm, against what their pools keep on purpose.

Transfers reuse their shared-memory segments (distnb/engine/transport/segments.py): the kernel's pool keeps its
files between transfers (and those notebook tensors live in: distnb/transfer/resident.py), and each rank keeps at
most two outbox files for the weights it sends back.
Anything else is a leak.
"""

import collections
import glob
import os

import pytest

from distnb.transfer import transfer
from distnb.engine.transport import segments, wire


def files():
    return sorted(glob.glob(os.path.join(segments.SHM_DIR, f"distnb-{os.getpid()}-*")))


def strays() -> list:
    """Files of this kernel that no pool keeps, and ranks with more than two outbox files; [] when clean."""
    pool = transfer._POOL
    segments = [] if pool is None else [*pool.free, *pool.lent.values(), *pool.busy.values(), *pool.resident.values()]
    kept = {s.path for s in segments}
    out = [f for f in files() if os.path.basename(f).split("-")[2] == "k" and f not in kept]
    per_rank = collections.Counter(os.path.basename(f).split("-")[2] for f in files()
                                   if os.path.basename(f).split("-")[2].startswith("r"))
    out += [f"{tag}: {n} outbox files" for tag, n in sorted(per_rank.items()) if n > 2]
    if pool is not None and pool.busy:
        out += [f"still busy: {p}" for p in pool.busy]
    return out


@pytest.fixture
def shm_dir(tmp_path, monkeypatch):
    """A private folder standing in for /dev/shm (same code path; files checked afterwards)."""
    monkeypatch.setattr(segments, "SHM_DIR", str(tmp_path))
    yield tmp_path
    wire.drop_outstanding()  # a rank leaving its group: its outbox goes
    transfer.sweep_shm()  # the cluster stopping: the kernel's pool goes
    assert os.listdir(tmp_path) == [], "a transfer left files behind"


@pytest.fixture
def rank_shm(monkeypatch):
    """This process plays a rank whose probe succeeded (flatten_state writes shared memory)."""
    monkeypatch.setitem(wire._SHM, "ok", True)
    monkeypatch.setitem(wire._SHM, "owner", os.getpid())
