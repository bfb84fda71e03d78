"""The Llama family: the network (model.py), its parallel plan (parallelize.py) and its
Hugging Face name mapping (hf_adapter.py). Importing the package gives the network only."""

from shardline.models.llama.model import (
    Attention,
    FeedForward,
    Llama,
    ModelArgs,
    RMSNorm,
    TransformerBlock,
    apply_rotary,
    document_causal_mask,
    initial_value,
    rope_frequencies,
)

__all__ = ["Attention", "FeedForward", "Llama", "ModelArgs", "RMSNorm", "TransformerBlock", "apply_rotary",
           "document_causal_mask", "initial_value", "rope_frequencies"]
