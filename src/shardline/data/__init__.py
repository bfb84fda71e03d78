"""Data: document sources, tokenizer, packing, and the layout-independent sampler."""

from shardline.data.loader import DataBundle, build_data, tokenizer_file
from shardline.data.sampler import GlobalBatchSampler

__all__ = ["DataBundle", "build_data", "GlobalBatchSampler", "tokenizer_file"]
