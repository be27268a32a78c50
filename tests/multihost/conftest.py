"""Fixtures for tests that need several hosts: network namespaces with real sshd (see hosts.py)."""

from __future__ import annotations

import pytest

from .hosts import TestHosts


@pytest.fixture(scope="module")
def test_hosts(request):
    """Started :class:`~tests.multihost.hosts.TestHosts`, torn down after the module.

    Two hosts by default; another number by indirect parametrization,
    ``@pytest.mark.parametrize("test_hosts", [3], indirect=True)``. Skips, with the reason,
    where the machine cannot host them (not root, no ``ip netns``, no sshd).
    """
    ok, reason = TestHosts.available()
    if not ok:
        pytest.skip(f"multihost: {reason}")
    hosts = TestHosts(getattr(request, "param", 2))
    try:
        yield hosts.start()
    finally:
        hosts.stop()
