"""A model on the meta device, and ModelArgs to and from JSON (checkpoint metadata)."""

from __future__ import annotations

import dataclasses

import torch

from shardline.models.llama import Llama, ModelArgs
from shardline.models.moe import MoEArgs
from shardline.models.moe.model import MoETransformer


def model_class(args: ModelArgs) -> type[Llama]:
    """The network of a shape: dense Llama, or the mixture-of-experts family when args.moe is set."""
    return Llama if args.moe is None else MoETransformer


def build_model_on(args: ModelArgs, device: str | torch.device) -> Llama:
    with torch.device(device):
        return model_class(args)(args)


def build_meta_model(args: ModelArgs) -> Llama:
    return build_model_on(args, "meta")


def args_to_json(args: ModelArgs) -> dict:
    return dataclasses.asdict(args)


def args_from_json(raw: dict) -> ModelArgs:
    raw = dict(raw)
    if raw.get("rope_scaling") is not None:
        raw["rope_scaling"] = tuple((k, float(v)) for k, v in raw["rope_scaling"])
    if raw.get("moe") is not None:
        raw["moe"] = MoEArgs(**raw["moe"])
    return ModelArgs(**raw)
