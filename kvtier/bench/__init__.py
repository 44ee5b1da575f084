"""Benchmarks behind `kvtier bench`: each prints ratios against limits measured in the same run."""
