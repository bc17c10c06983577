"""A stand-in for vLLM (tests/ship/test_serve_check.py): only what draftsmith starts and asks."""
