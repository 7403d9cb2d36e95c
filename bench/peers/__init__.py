"""Peer systems the benchmark compares colocate against, each run in its own subprocess."""
