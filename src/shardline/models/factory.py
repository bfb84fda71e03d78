"""A model on the meta device, and ModelArgs to and from JSON (checkpoint metadata)."""

from __future__ import annotations

import dataclasses

import torch

from shardline.models.llama import Llama, ModelArgs


def build_meta_model(args: ModelArgs) -> Llama:
    with torch.device("meta"):
        return Llama(args)


def args_to_json(args: ModelArgs) -> dict:
    return dataclasses.asdict(args)


def args_from_json(raw: dict) -> ModelArgs:
    raw = dict(raw)
    if raw.get("rope_scaling") is not None:
        raw["rope_scaling"] = tuple((k, float(v)) for k, v in raw["rope_scaling"])
    return ModelArgs(**raw)
