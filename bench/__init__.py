"""Benchmarks: `make bench` writes bench/results/latest.json."""
