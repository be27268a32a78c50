"""Declarations and errors shared by the kernel and the ranks: standard library only."""
