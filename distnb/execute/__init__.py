"""Running a call on every rank: the one execute path, hangs, the ranks' output, the debugger."""
