"""A training cell on a rank: the loop, ``ctx``, the optimizer step, validation, data sets, checkpoints, the model received."""
