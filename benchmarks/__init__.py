"""Benchmarks of frequency_hybrid against stock TorchRec sharding (entry point: run.py)."""
