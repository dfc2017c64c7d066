"""Benchmarks: speed and memory goals measured as ratios against a baseline measured in the same run."""
