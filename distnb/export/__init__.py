"""``%dist export``: the last training cell as a job folder that runs without a notebook."""
