"""KV-cache surgery after verification: crop to the accepted prefix, keep a tree's accepted path."""

from __future__ import annotations

import torch


def crop_cache(cache, length: int) -> None:
    """Keep the first `length` positions of a transformers Cache (its `crop` takes a count to remove)."""
    remove = cache.get_seq_length() - length
    if remove > 0:
        cache.crop(-remove)


def keep_cache_positions(cache, prefix: int, positions: list[int]) -> None:
    """Keep the first `prefix` positions of a Cache plus the given later ones, in order: after tree
    verification, the accepted path. A contiguous path is a plain crop."""
    if positions == list(range(prefix, prefix + len(positions))):
        return crop_cache(cache, prefix + len(positions))
    index = torch.tensor(list(range(prefix)) + positions, device=cache.layers[0].keys.device)
    for layer in cache.layers:
        layer.keys = layer.keys.index_select(-2, index)
        layer.values = layer.values.index_select(-2, index)
