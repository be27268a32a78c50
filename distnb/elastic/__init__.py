"""A world that changes size: ``%dist scale`` and ``--on-failure shrink``."""
