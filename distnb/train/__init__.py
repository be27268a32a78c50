"""A training cell in the kernel: plan, preparation, run, results, checkpoints, background runs."""
