"""HF Llama config.json <-> ModelArgs, for both transformers < 5 and >= 5 layouts.

transformers < 5 writes `rope_theta` at the top level and the scaling dict (or null)
under `rope_scaling`; transformers 5 writes a single `rope_parameters` dict holding
`rope_type`, `rope_theta` and the scaling keys. Both are read, and both are written.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from shardline.errors import CheckpointError
from shardline.models.llama import ModelArgs

CONFIG_NAME = "config.json"
_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def _hf_folder(path: str | os.PathLike) -> Path:
    folder = Path(path)
    if not folder.exists():
        raise CheckpointError(f"Hugging Face folder {folder} does not exist")
    if not folder.is_dir():
        raise CheckpointError(f"{folder} is not a folder; expected a Hugging Face Llama folder "
                              f"holding {CONFIG_NAME} and safetensors weights")
    return folder


def _load_json(file: Path) -> Any:
    try:
        return json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{file} cannot be read as JSON: {e}") from None


def _number(cfg: dict, key: str, where: Path, kind: type, default: Any = None) -> Any:
    value = cfg.get(key)
    if value is None:
        if default is None:
            raise CheckpointError(f"{where} lacks {key!r}, which a Llama config needs")
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and value != int(value)):
        raise CheckpointError(f"{where}: {key}={value!r} is not {'an integer' if kind is int else 'a number'}")
    return kind(value)


def _read_rope(cfg: dict, where: Path, max_pos: int) -> tuple[float, tuple[tuple[str, float], ...] | None]:
    """(rope_theta, Llama-3 scaling pairs or None) from either config layout."""
    scaling, params = cfg.get("rope_scaling"), cfg.get("rope_parameters")
    for key, value in (("rope_scaling", scaling), ("rope_parameters", params)):
        if value is not None and not isinstance(value, dict):
            raise CheckpointError(f"{where}: {key} must be an object or null, got {value!r}")
    # Same precedence as transformers: a rope_scaling dict wins over rope_parameters, and a
    # rope_theta inside the dict wins over the top-level one.
    rope = dict(scaling or params or {})
    if any(isinstance(v, dict) for v in rope.values()):
        raise CheckpointError(f"{where}: rope_parameters given per layer type are not supported "
                              "(shardline's Llama uses one RoPE for every layer)")
    theta = _number({"rope_theta": rope.get("rope_theta", cfg.get("rope_theta"))}, "rope_theta", where,
                    float, default=10000.0)
    partial = rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor"))
    if partial is not None and partial != 1:
        raise CheckpointError(f"{where}: partial_rotary_factor={partial} is not supported; "
                              "shardline rotates the whole head")
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type == "default":
        return theta, None
    if rope_type != "llama3":
        raise CheckpointError(f"{where}: RoPE type {rope_type!r} is not supported; "
                              "shardline reads 'default' and 'llama3' rotary embeddings")
    # transformers fills a missing original_max_position_embeddings from max_position_embeddings.
    rope.setdefault("original_max_position_embeddings", max_pos)
    pairs = tuple((key, _number(rope, key, where, float)) for key in _LLAMA3_KEYS)
    values = dict(pairs)
    if values["high_freq_factor"] <= values["low_freq_factor"] or values["factor"] <= 0:
        raise CheckpointError(f"{where}: llama3 RoPE needs factor > 0 and high_freq_factor > low_freq_factor, "
                              f"got {values}")
    return theta, pairs


def read_hf_config(path: str | os.PathLike) -> ModelArgs:
    """ModelArgs of the HF Llama folder `path`, read from its config.json."""
    folder = _hf_folder(path)
    where = folder / CONFIG_NAME
    if not where.is_file():
        raise CheckpointError(f"{folder} has no {CONFIG_NAME}; it is not a Hugging Face model folder")
    cfg = _load_json(where)
    if not isinstance(cfg, dict):
        raise CheckpointError(f"{where} does not hold a JSON object")
    if cfg.get("model_type") != "llama":
        raise CheckpointError(f"{where}: model_type={cfg.get('model_type')!r}; only Llama folders "
                              "(model_type 'llama') can be read")
    for key in ("attention_bias", "mlp_bias"):
        if cfg.get(key):
            raise CheckpointError(f"{where}: {key}=true is not supported; shardline's Llama has no bias terms")
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise CheckpointError(f"{where}: hidden_act={act!r} is not supported; shardline's Llama uses silu")

    dim = _number(cfg, "hidden_size", where, int)
    n_heads = _number(cfg, "num_attention_heads", where, int)
    n_kv_heads = _number(cfg, "num_key_value_heads", where, int, default=n_heads)
    head_dim = _number(cfg, "head_dim", where, int, default=-1)
    if head_dim == -1 or (n_heads > 0 and dim % n_heads == 0 and head_dim == dim // n_heads):
        head_dim = None  # the default, dim // n_heads
    max_pos = _number(cfg, "max_position_embeddings", where, int, default=2048)
    theta, scaling = _read_rope(cfg, where, max_pos)
    tie = cfg.get("tie_word_embeddings", False)
    if not isinstance(tie, bool):
        raise CheckpointError(f"{where}: tie_word_embeddings={tie!r} is not true or false")

    args = ModelArgs(
        dim=dim,
        n_layers=_number(cfg, "num_hidden_layers", where, int),
        n_heads=n_heads,
        vocab_size=_number(cfg, "vocab_size", where, int),
        n_kv_heads=None if n_kv_heads == n_heads else n_kv_heads,
        head_dim=head_dim,
        ffn_dim=_number(cfg, "intermediate_size", where, int),
        norm_eps=_number(cfg, "rms_norm_eps", where, float, default=1e-6),
        rope_theta=theta,
        rope_scaling=scaling,
        max_seq_len=max_pos,
        tie_embeddings=tie,
    )
    problems = args.validate()
    if problems:
        raise CheckpointError(f"{where} describes an unusable Llama shape: {'; '.join(problems)}")
    return args



def hf_config_dict(args: ModelArgs, tied: bool, dtype: torch.dtype,
               bos_token_id: int | None, eos_token_id: int | list[int] | None) -> dict[str, Any]:
    dtype_name = str(dtype).removeprefix("torch.")
    scaling = None
    if args.rope_scaling is not None:
        scaling = {"rope_type": "llama3"}
        for key, value in args.rope_scaling:
            scaling[key] = int(value) if key == "original_max_position_embeddings" else float(value)
    rope_parameters = {"rope_type": "default", "rope_theta": float(args.rope_theta), **(scaling or {})}
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": args.dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.kv_heads,
        "head_dim": args.head_size,
        "intermediate_size": args.ffn_dim,
        "vocab_size": args.vocab_size,
        "rms_norm_eps": args.norm_eps,
        "max_position_embeddings": args.max_seq_len,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "pretraining_tp": 1,
        "use_cache": True,
        "tie_word_embeddings": tied,
        # transformers < 5 reads these two ...
        "rope_theta": float(args.rope_theta),
        "rope_scaling": scaling,
        # ... transformers 5 this one (it would also convert the two above).
        "rope_parameters": rope_parameters,
        "bos_token_id": bos_token_id,
        "eos_token_id": eos_token_id,
        "pad_token_id": None,
        "dtype": dtype_name,  # transformers >= 4.56
        "torch_dtype": dtype_name,  # older transformers
    }
