"""A port to pin (``--master-port``) in tests, as a user would pin one."""

import random
import socket

from distnb.core.net import free_port


def pinned_port() -> int:
    """A free port below Linux's ephemeral range (32768-60999).

    A port from ``free_port()`` lies in that range, where every controller and engine on the
    machine binds its random zmq ports (the new cluster's own, and those of other clusters running
    meanwhile), and one of them can take it before the store binds it: "Address already in use",
    or "Failed to recv, got 0 bytes" while the group forms (seen once each in full runs).
    """
    for port in random.Random().sample(range(20000, 32000), 200):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    return free_port()
