"""The settings distnb gives ipyparallel's engines, read back from the running engines themselves."""


ENGINE_SETTINGS = """
from ipyparallel.engine.app import IPEngine
_e = IPEngine.instance()
_settings = (_e.timeout, _e.max_heartbeat_misses, _e.enable_nanny)
del _e
"""


def test_engines_wait_for_a_busy_controller_at_least_as_long_as_distnb_waits(dist_session):
    # ipyparallel's 5 s registration wait made engines give up when 32 registered at once under load
    from distnb import placement

    view = dist_session.cluster.client[:]
    view.execute(ENGINE_SETTINGS, block=True)
    settings = view.pull("_settings", block=True)
    view.execute("del _settings", block=True)
    assert len(settings) == dist_session.world_size
    for timeout, misses, nanny in settings:
        assert timeout == placement.REGISTRATION_WAIT >= 60  # distnb's own registration wait is max(60, --timeout)
        assert misses == 0 and nanny is False  # no heartbeat watch, no nanny process on this host
