"""What travels between the kernel and a rank: the wire format, shared memory, shards, sources, progress reports."""
