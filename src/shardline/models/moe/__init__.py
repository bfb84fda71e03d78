"""The mixture-of-experts family: Llama's attention and blocks with a routed feed-forward.

args.py (the shape, torch-free), layer.py (router, grouped experts, the MoE feed-forward),
model.py (the network), parallelize.py (expert parallelism), hf_adapter.py (Mixtral and
Qwen3-MoE names). Importing the package gives the shape only, so the dense family can
name it without importing this one's network.
"""

from shardline.models.moe.args import ROUTERS, MoEArgs

__all__ = ["MoEArgs", "ROUTERS"]
