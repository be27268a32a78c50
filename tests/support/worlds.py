"""The shared session's world between tests that resize it (``%dist scale``, ``--on-failure shrink``)."""


def back_to_two_ranks() -> None:
    """Leave the shared cluster as the session fixture made it: running, 2 ranks, ``--on-failure stop``,
    and no hook of a scale test left behind."""
    from distnb.elastic import scaling
    from distnb import session

    scaling.ON_ENGINES_STARTED.clear()
    current = session._CURRENT
    if current is None or not current.running:
        session.start(n=2, timeout=30, quiet=True)
    elif current.world_size != 2:
        current.scale(2, quiet=True)
    session.current().on_failure = "stop"
