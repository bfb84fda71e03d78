"""shardline: PyTorch-native training for large language models."""

from shardline.version import __version__

__all__ = ["__version__"]
