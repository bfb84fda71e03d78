"""Model definitions only: no process groups, no collectives (DESIGN rule 1)."""

from shardline.models.flops import flops_per_token, num_params
from shardline.models.llama import Llama, ModelArgs
from shardline.models.presets import PRESETS, get_preset

__all__ = ["Llama", "ModelArgs", "PRESETS", "get_preset", "flops_per_token", "num_params"]
