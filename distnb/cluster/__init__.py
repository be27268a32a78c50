"""The ipyparallel cluster's lifecycle: engines, launchers, placement, the engine template, the reaper."""
