"""Scalars on a GPU read without waiting for the GPU (GPU review, finding 8).

``float(t)`` of a CUDA tensor is a host synchronisation: the host waits until every kernel queued
before it has run, and the queue is empty when it goes on (nothing overlaps the next launches).
Figures that are only *shown* (the progress loss of a ``--loop`` body, the gradient norm of
``--clip-grad-norm``) need not be that fresh: :class:`Latest` copies each offered scalar into
page-locked host memory with ``non_blocking=True``, records a CUDA event after the copy, and
answers with the newest value whose event has completed (``Event.query()``: no wait). The answer
is at most a few steps old; :meth:`Latest.now` reads exactly, for a cell's last message (the
cell's end synchronised already).

A tensor on any other device is read at once (on the CPU a read is no synchronisation).
"""

from __future__ import annotations

#: Copies in flight kept per figure: older ones are dropped unread (only the newest value is shown).
IN_FLIGHT = 8


class Latest:
    """The newest readable value of a stream of 0-d (or one-element) tensors.

    Attributes
    ----------
    value : float or None
        The newest value read so far (None before the first read).
    """

    def __init__(self):
        self.value = None
        self._pending = []  # (pinned host tensor, cuda event), oldest first

    def offer(self, tensor) -> float | None:
        """Start reading ``tensor`` (or take a float as it is); returns the newest value read, without waiting."""
        if not hasattr(tensor, "detach"):  # a float already (the kernel imports this module without torch)
            self.value = None if tensor is None else float(tensor)
            return self.value
        tensor = tensor.detach()
        if tensor.device.type != "cuda":
            self.value = float(tensor)
            return self.value
        import torch  # loaded already: the tensor is torch's (the kernel side imports this module without it)

        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        host.copy_(tensor, non_blocking=True)  # the caching host allocator keeps `host` until the copy ran
        event = torch.cuda.Event()
        event.record()
        self._pending.append((host, event))
        del self._pending[:-IN_FLIGHT]
        return self.poll()

    def poll(self) -> float | None:
        """The newest value whose copy has finished (no wait)."""
        while self._pending and self._pending[0][1].query():
            host, _ = self._pending.pop(0)
            self.value = float(host)
        return self.value

    def now(self, tensor=None) -> float | None:
        """Read exactly: ``tensor`` (or the last one offered), waiting for it if it is on a GPU."""
        if tensor is None:
            if not self._pending:
                return self.value
            host, event = self._pending[-1]
            event.synchronize()
            self._pending.clear()
            self.value = float(host)
            return self.value
        self._pending.clear()
        self.value = float(tensor)
        return self.value
