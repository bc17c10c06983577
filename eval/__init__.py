"""Eval stage: speculative decoding engines, acceptance metrics, reports; eval/bench/ benchmarks."""
