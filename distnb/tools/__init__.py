"""Tools beside the package: the demo job and simulated ranks."""
