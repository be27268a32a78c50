"""``%dist start --linger``: the option's declaration, shared by the kernel and the ranks (stdlib only).

:class:`Lingering` is a base of :class:`distnb.core.plan.ClusterSpec` that adds the field ``linger``
(keyword-only, so it may follow ClusterSpec's required fields); what the lease does with it is in
:mod:`distnb.cluster.lease` (the kernel's side) and :mod:`distnb.cluster.keeper` (the process that keeps the world).
"""

from __future__ import annotations

from dataclasses import dataclass

from distnb.core.options import option

#: ``%dist start --linger``'s default (seconds): how long a world whose kernel died waits for a new one.
DEFAULT_LINGER = 600.0


@dataclass(frozen=True, kw_only=True)
class Lingering:
    """The lease of a world (issue 38): ``linger``, seconds a run outlives its kernel (see :mod:`distnb.cluster.lease`)."""

    linger: float = option(DEFAULT_LINGER, "duration",
                           "how long the world outlives a kernel that dies (killed, restarted or culled) while "
                           "training runs: the run goes on to its end, then waits this long for a new kernel to "
                           "take it over (distnb.cluster.lease.claim); if none comes, the trained state is saved to the "
                           "cell's --checkpoint-dir or the folder the start line names, and everything ends; a "
                           "duration (30s, 10m, 2h; a number is seconds), default 10m; 0 ends everything with the "
                           "kernel, e.g. --linger 1h")
