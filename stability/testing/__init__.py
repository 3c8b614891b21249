"""Helpers for tests, benchmarks and sample data (tiny models trained on CPU)."""
