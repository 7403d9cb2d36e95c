"""Throughput benchmark suite: workloads, modes, peers, reports. Not needed at train time."""
