"""Benchmarks the `kvlab bench` command runs: `serve`, a load generator for the serving engine."""
