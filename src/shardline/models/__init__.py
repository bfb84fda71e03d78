"""Model definitions: one folder per family (llama/). A model file holds the network only,
no process groups or collectives; its parallel plan sits beside it in parallelize.py."""

from shardline.models.flops import flops_per_token, num_params
from shardline.models.llama import Llama, ModelArgs
from shardline.models.presets import PRESETS, get_preset

__all__ = ["Llama", "ModelArgs", "PRESETS", "get_preset", "flops_per_token", "num_params"]
