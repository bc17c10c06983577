"""Drafter families (one module each), the target loader and the explicit drafter registry."""
