"""Fixtures for tests that need several hosts: network namespaces with real sshd (see hosts.py)."""

from __future__ import annotations

import pytest

from distnb import session

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


@pytest.fixture(scope="module")
def ssh_profile(test_hosts, tmp_path_factory):
    """An ipyparallel profile directory whose ipcluster_config.py points ssh at the test hosts' client config.

    The engines import the distnb under test: an ssh login starts with the host's own environment
    (here the shared venv, whose editable install is another checkout), so PYTHONPATH names this one.
    """
    import os

    import distnb

    tree = os.path.dirname(os.path.dirname(os.path.abspath(distnb.__file__)))
    folder = tmp_path_factory.mktemp("profile_multihost")
    (folder / "ipcluster_config.py").write_text(
        f"c.SSHLauncher.ssh_cmd = {test_hosts.ssh_cmd!r}\nc.SSHLauncher.scp_cmd = {test_hosts.scp_cmd!r}\n"
        f"c.EngineLauncher.environment = {{'PYTHONPATH': {tree!r}}}\n")
    return str(folder)


@pytest.fixture(scope="module")
def own_shell():
    """A real IPython shell whose %dist is free: the suite's shared cluster (if any) is set aside."""
    from IPython.core.interactiveshell import InteractiveShell
    from traitlets.config import Config

    saved = session._CURRENT
    session._CURRENT = None
    config = Config()
    config.HistoryManager.enabled = False
    sh = InteractiveShell.instance(config=config)
    sh.run_line_magic("load_ext", "distnb")
    try:
        yield sh
    finally:
        if session._CURRENT is not None:
            session._CURRENT.stop(quiet=True)
        session._CURRENT = saved


@pytest.fixture(scope="module")
def ssh_world(test_hosts, ssh_profile, own_shell):
    """``%dist start`` of 2 ranks over the two test hosts (one each); the running session."""
    hosts = ",".join(test_hosts.addresses)
    own_shell.run_line_magic("dist", f"start --launcher ssh --hosts {hosts} --profile {ssh_profile} --timeout 20")
    assert session._CURRENT is not None
    yield session._CURRENT
    if session._CURRENT is not None:
        session._CURRENT.stop(quiet=True)


@pytest.fixture(scope="session")
def slurm_cluster():
    """A started :class:`~tests.multihost.slurm.SlurmCluster` (2 nodes), built once per test run.

    ``SLURM_CONF`` points at it while it runs. Afterwards every daemon is stopped and the
    teardown fails if a job was still queued or a daemon had to be killed. Skips, with the
    reason, where it cannot be built (not root, no namespaces, Slurm or munge not installed).
    """
    from .slurm import SlurmCluster

    ok, reason = SlurmCluster.available()
    if not ok:
        pytest.skip(f"slurm: {reason}")
    cluster = SlurmCluster(2)
    try:
        yield cluster.start()
    finally:
        left = cluster.stop()
    assert not left, f"the Slurm tests left behind: {'; '.join(left)}"
