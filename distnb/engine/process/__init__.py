"""A rank's process: runtime and process group, CPU binding, abort, checked collectives, where it is, post-mortem."""
