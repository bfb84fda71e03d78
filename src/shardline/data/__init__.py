"""Data: document sources, tokenizer, packing, and the layout-independent sampler.

The names below load their modules when first used: `shardline prepare --help` (data/cli.py)
builds its parser without the loader, which imports torch through the packing's loss mask.
"""

__all__ = ["DataBundle", "build_data", "GlobalBatchSampler", "tokenizer_file"]
_HOMES = {"DataBundle": "loader", "build_data": "loader", "tokenizer_file": "loader", "GlobalBatchSampler": "sampler"}


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module 'shardline.data' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(f"shardline.data.{_HOMES[name]}"), name)
