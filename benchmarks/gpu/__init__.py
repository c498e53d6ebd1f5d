"""The GPU check suite's stages and their shared harness (run by benchmarks/gpu_checks.py)."""
