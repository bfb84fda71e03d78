"""The model shape a run trains: a preset, or the weights it starts from (an HF folder, a
checkpoint), with the config's [model] and [moe] overrides; overrides that change the tensors
those weights hold are refused (but for a larger model.vocab_size, which adds vocabulary rows for
tokens added to their tokenizer), as are router settings an HF start's tensor names cannot carry."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from shardline.config import ModelConfig, MoEConfig
from shardline.errors import CheckpointError, ConfigError
from shardline.interop.hf_config import read_hf_config
from shardline.models.factory import args_from_json
from shardline.models.llama import ModelArgs
from shardline.models.moe import MoEArgs
from shardline.models.moe.hf_adapter import hf_family
from shardline.models.presets import get_preset
from shardline.resilience.checkpoint import read_meta

SHAPE_KEYS = ("dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "ffn_dim", "vocab_size", "rope_theta")


def starting_shape(m: ModelConfig, stand_in: Path | None = None) -> ModelArgs | None:
    """The shape of the weights a run starts from (an HF folder or a checkpoint), else None;
    `stand_in` (gone_start_checkpoint): a checkpoint of the run, when they are gone since."""
    if stand_in is not None:
        return args_from_json(json.loads((stand_in / "meta.json").read_text(encoding="utf-8"))["model_args"])
    if m.hf_path:
        return read_hf_config(m.hf_path)
    if m.init_from:  # meta.json as it is (hashing a 70B checkpoint takes minutes: its load verifies it)
        try:
            return args_from_json(json.loads((Path(m.init_from) / "meta.json").read_text(encoding="utf-8"))[
                "model_args"])
        except (OSError, ValueError, KeyError, TypeError):  # what is wrong with it, as verifying it says
            return args_from_json(read_meta(Path(m.init_from))["model_args"])
    return None


def starting_rows(m: ModelConfig) -> int:
    """The vocabulary rows of the weights a run starts from (their starting_shape); 0 for a run from scratch."""
    start = starting_shape(m)
    return start.vocab_size if start is not None else 0


def shape_overrides(m: ModelConfig, moe: MoEConfig | None = None) -> tuple[str, ...]:
    """The [model] and [moe] settings that differ from the preset's (or the starting weights'), as
    "model.n_layers=16", "moe.expert_ffn_dim=256" (the balancing coefficients too): what a report names
    beside the preset (a config's [moe] table over another preset priced another model under its name)."""
    base = starting_shape(m) or get_preset(m.preset)
    said = [f"model.{k}={getattr(m, k)}" for k in SHAPE_KEYS if getattr(m, k) and getattr(m, k) != getattr(base, k)]
    said += [f"model.{k}={getattr(m, k)}" for k in ("tie_embeddings", "qk_norm", "qkv_bias")
             if getattr(m, k) >= 0 and bool(getattr(m, k)) != getattr(base, k)]
    for key, value in (moe.overrides() if moe is not None else {}).items():
        if base.moe is None or getattr(base.moe, key) != value:
            said.append(f"moe.{'num_experts' if key == 'n_experts' else key}={value}")
    return tuple(said)


def model_shape(m: ModelConfig, tokenizer_vocab: int, moe: MoEConfig | None = None,
                stand_in: Path | None = None) -> ModelArgs:
    """Preset (or the starting weights' shape) + [model] and [moe] overrides, checked against the tokenizer."""
    start = starting_shape(m, stand_in)
    args = start or get_preset(m.preset)
    changes = {k: getattr(m, k) for k in SHAPE_KEYS if getattr(m, k)}
    if moe is not None and moe.overrides():
        changes["moe"] = moe_shape(args.moe, moe.overrides())
    for key in ("tie_embeddings", "qk_norm", "qkv_bias"):
        if getattr(m, key) >= 0:
            changes[key] = bool(getattr(m, key))
    if start is not None:
        _check_weights_fit(m, start, dataclasses.replace(start, **changes), stand_in)
    if m.hf_path and start.moe is not None:  # its tensors are named as its family's: the router must fit it too
        try:
            hf_family(dataclasses.replace(start, **changes))
        except CheckpointError as e:
            raise ConfigError(f"model.hf_path={m.hf_path!r}: {e}; drop those [moe] overrides to start from "
                              "it") from None
    if not args.vocab_size and "vocab_size" not in changes:
        changes["vocab_size"] = tokenizer_vocab  # tiny presets size their vocabulary to the tokenizer
    args = dataclasses.replace(args, **changes)
    problems = args.validate()
    if problems:
        raise ConfigError(f"[model] shape is invalid: {'; '.join(problems)}")
    theirs = start.moe if start is not None else None  # (a top-1 renormalised start trains as transformers does)
    if args.moe is not None and args.moe.top_k == 1 and args.moe.norm_topk and not (
            theirs is not None and theirs.top_k == 1 and theirs.norm_topk):
        raise ConfigError("moe.top_k=1 with renormalised weights gives every token the weight 1, so the "
                          "router would learn nothing from the loss; set moe.norm_topk=0 (the Switch "
                          "Transformer's gate: the chosen expert's score)")
    if args.vocab_size < tokenizer_vocab and start is not None and not m.vocab_size:  # another's, or theirs grown
        raise ConfigError(f"the starting weights have {args.vocab_size} vocabulary rows, fewer than the tokenizer's "
                          f"{tokenizer_vocab} tokens: if that tokenizer (data.tokenizer, or the prepared data's) is "
                          f"theirs with tokens added, set model.vocab_size={tokenizer_vocab} (or more) to add rows, "
                          "which start at the mean of theirs; else use the tokenizer.json they came with")
    if args.vocab_size < tokenizer_vocab:
        named = "model.vocab_size" if m.vocab_size else "the model's vocab_size"
        raise ConfigError(f"{named}={args.vocab_size} is smaller than the tokenizer's "
                          f"{tokenizer_vocab} tokens; set model.vocab_size >= {tokenizer_vocab}")
    return args


# What decides which tensors a model has and their shapes: the starting weights must fill
# exactly these (rope_theta, max_seq_len, norm_eps and the router's settings may change).
_WEIGHT_KEYS = (*(k for k in SHAPE_KEYS if k != "rope_theta"), "tie_embeddings", "qk_norm", "qkv_bias")
_EFFECTIVE = {"n_kv_heads": "kv_heads", "head_dim": "head_size"}  # None there means the default
_MOE_WEIGHT_KEYS = ("n_experts", "expert_ffn_dim", "shared_experts", "first_dense_layers")


def weight_changes(start: ModelArgs, wanted: ModelArgs) -> list[str]:
    """What differs between two shapes in the tensors the weights hold ("key=old -> new")."""
    def value(args: ModelArgs, key: str):
        return getattr(args, _EFFECTIVE.get(key, key))  # head_dim None means dim / n_heads: compare that

    changed = [f"{k}={value(start, k)} -> {value(wanted, k)}" for k in _WEIGHT_KEYS
               if value(start, k) != value(wanted, k)]
    if (start.moe is None) != (wanted.moe is None):
        changed.append("dense -> mixture of experts" if start.moe is None else "mixture of experts -> dense")
    elif start.moe is not None:
        changed += [f"moe.{k}={getattr(start.moe, k)} -> {getattr(wanted.moe, k)}" for k in _MOE_WEIGHT_KEYS
                    if getattr(start.moe, k) != getattr(wanted.moe, k)]
    return changed


def _check_weights_fit(m: ModelConfig, start: ModelArgs, wanted: ModelArgs, stand_in: Path | None) -> None:
    """A [model] or [moe] override that changes the weights' shapes would leave tensors the
    starting weights cannot fill (random under a sharded load): refused, naming the keys. A larger
    vocab_size is taken: the loader adds the rows (weights.py), a smaller one would cut trained rows.
    `stand_in`: the run's checkpoint whose shape stands in for the starting weights, gone since."""
    source = f"model.hf_path={m.hf_path!r}" if m.hf_path else f"model.init_from={m.init_from!r}"
    if stand_in is not None:
        source = f"the run's checkpoint {stand_in} (standing in for {source}, gone since)"
    if wanted.vocab_size < start.vocab_size:
        fix = (f"set it to {start.vocab_size} to resume" if stand_in is not None else
               "unset model.vocab_size, or set it above theirs to add rows")
        raise ConfigError(f"model.vocab_size={wanted.vocab_size} is below the {start.vocab_size} vocabulary rows of "
                          f"{source}: trained rows are not cut (another model's tokenizer?); {fix}")
    changed = weight_changes(start, dataclasses.replace(wanted, vocab_size=start.vocab_size))  # grown: see weights.py
    if changed:
        raise ConfigError(f"{source} holds weights of another shape than the overrides ask for "
                          f"({', '.join(changed)}); drop those [model]/[moe] overrides to start from these weights")


def moe_shape(base: MoEArgs | None, changes: dict) -> MoEArgs:
    """The model's MoE shape with [moe] overrides; a dense model needs the three sizes to become one."""
    if base is None:
        missing = [k for k in ("n_experts", "top_k", "expert_ffn_dim") if k not in changes]
        if missing:
            keys = ", ".join("moe.num_experts" if k == "n_experts" else f"moe.{k}" for k in missing)
            raise ConfigError(f"the model is dense: [moe] overrides make it a mixture of experts only with "
                              f"moe.num_experts, moe.top_k and moe.expert_ffn_dim set (missing {keys})")
        return MoEArgs(**changes)
    return dataclasses.replace(base, **changes)
