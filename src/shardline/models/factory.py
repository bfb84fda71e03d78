"""Turn the [model] config section into ModelArgs and a model on the meta device."""

from __future__ import annotations

import dataclasses

import torch

from shardline.config import ModelConfig
from shardline.errors import ConfigError
from shardline.models.llama import Llama, ModelArgs
from shardline.models.presets import get_preset

_OVERRIDES = ("dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "ffn_dim", "vocab_size", "rope_theta")


def model_args_from_config(cfg: ModelConfig, tokenizer_vocab: int, base: ModelArgs | None = None) -> ModelArgs:
    """Preset (or `base`, e.g. read from an HF folder) + overrides, checked against the tokenizer."""
    args = base or get_preset(cfg.preset)
    changes = {k: getattr(cfg, k) for k in _OVERRIDES if getattr(cfg, k)}
    if cfg.tie_embeddings >= 0:
        changes["tie_embeddings"] = bool(cfg.tie_embeddings)
    if not args.vocab_size and "vocab_size" not in changes:
        changes["vocab_size"] = tokenizer_vocab  # tiny presets size their vocabulary to the tokenizer
    args = dataclasses.replace(args, **changes)
    problems = args.validate()
    if problems:
        raise ConfigError(f"[model] shape is invalid: {'; '.join(problems)}")
    if args.vocab_size < tokenizer_vocab:
        raise ConfigError(f"model vocab_size={args.vocab_size} is smaller than the tokenizer's "
                          f"{tokenizer_vocab} tokens; set model.vocab_size >= {tokenizer_vocab}")
    return args


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
