"""Objects between the kernel and the ranks: by value, resident tensors, data shards, weights back."""
