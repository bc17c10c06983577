"""Eval stage: speculative decoding engines, acceptance metrics, reports; benchmarks/ benchmarks."""
