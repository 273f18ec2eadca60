"""Benchmarks of monarch_kernel against raw ZeroMQ, Monarch, Ray and ipyparallel."""
