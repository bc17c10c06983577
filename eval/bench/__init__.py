"""Benchmarks: scripts that print ratios measured side by side in one run (never timed unit tests)."""
