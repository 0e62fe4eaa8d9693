"""Benchmarks (``flashpage bench <name>``): each measures flashpage and its baselines in one run."""
