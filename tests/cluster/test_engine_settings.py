"""The settings distnb gives ipyparallel's engines, read back from the running engines themselves."""


ENGINE_SETTINGS = """
from ipyparallel.engine.app import IPEngine
_e = IPEngine.instance()
_settings = (_e.timeout, _e.max_heartbeat_misses, _e.enable_nanny)
del _e
"""


def test_engines_wait_for_a_busy_controller_at_least_as_long_as_distnb_waits(dist_session):
    # ipyparallel's 5 s registration wait made engines give up when 32 registered at once under load
    from distnb.cluster import placement

    view = dist_session.cluster.client[:]
    view.execute(ENGINE_SETTINGS, block=True)
    settings = view.pull("_settings", block=True)
    view.execute("del _settings", block=True)
    assert len(settings) == dist_session.world_size
    for timeout, misses, nanny in settings:
        assert timeout == placement.REGISTRATION_WAIT >= 60  # distnb's own registration wait is max(60, --timeout)
        assert misses == 0 and nanny is False  # no heartbeat watch, no nanny process on this host


def test_an_engine_the_client_never_heard_of_is_found_in_the_hubs_list(dist_session):
    # as when its registration notification went out before the client's SUB socket had joined
    from distnb.cluster import launchers

    client = dist_session.cluster.client
    engine_id = dist_session.cluster.engine_ids[1]
    uuid = client._engines[engine_id]
    client._ids.remove(engine_id)
    del client._engines[engine_id]
    try:
        assert engine_id not in client.ids
        launchers.refresh_engines(client)
        assert engine_id in client.ids and client._engines[engine_id] == uuid
    finally:
        if engine_id not in client._engines:
            client._update_engines({engine_id: uuid})
    assert dist_session.run("rank", all_output=True) == ["0", "1"]  # routed to the right engines still
