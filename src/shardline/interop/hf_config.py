"""HF config.json <-> ModelArgs for Llama, Mistral, Qwen2, Qwen3, Phi-3, Mixtral and Qwen3-MoE, in transformers < 5
and >= 5 layouts.

transformers < 5 writes `rope_theta` at the top level and the scaling dict (or null) under `rope_scaling`;
transformers 5 writes a single `rope_parameters` dict holding `rope_type`, `rope_theta` and the scaling
keys. Both are read, and both are written. The two MoE families share Llama's fields and add the
routed feed-forward's; each has its own defaults for the keys a config leaves out (as its transformers class).
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

import torch

from shardline.errors import CheckpointError
from shardline.interop.hub import hub_hint
from shardline.models.llama import ModelArgs
from shardline.models.moe import MoEArgs
from shardline.models.moe.args import balance_coef_to_hf
from shardline.models.moe.hf_adapter import hf_family

CONFIG_NAME = "config.json"
_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def _hf_folder(path: str | os.PathLike) -> Path:
    folder = Path(path)
    if not folder.exists():
        raise CheckpointError(f"Hugging Face folder {folder} does not exist{hub_hint(str(path))}")
    if not folder.is_dir():
        raise CheckpointError(f"{folder} is not a folder; expected a Hugging Face model folder holding {CONFIG_NAME}")
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
            raise CheckpointError(f"{where} lacks {key!r}, which shardline needs to build the model")
        return default
    bound = 2**31 if kind is int else 1e300  # (JSON's NaN and Infinity, 10**400: no size, no theta)
    number = isinstance(value, (int, float)) and not isinstance(value, bool) and abs(value) < bound
    if not number or (kind is int and value != int(value)):
        raise CheckpointError(f"{where}: {key}={value!r:.40} is not {'an integer' if kind is int else 'finite'}")
    return kind(value)


def _read_rope(cfg: dict, where: Path, max_pos: int,
               default_theta: float = 10000.0) -> tuple[float, tuple[tuple[str, float], ...] | None]:
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
                    float, default=default_theta)
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


# Per family: what its transformers config class assumes for a key config.json leaves out
# (rope_theta, rms_norm_eps, max_position_embeddings, num_key_value_heads; None: n_heads).
# Mistral is Llama's math and tensor names (a sliding window: ModelArgs); Qwen2 is Llama with bias
# terms on the query, key and value projections; Qwen3 is Llama with a norm on each query and
# key head; Phi-3 (and Phi-4) is Llama's math with q/k/v and gate/up each stored as one tensor.
_DEFAULTS = {
    "llama": (10000.0, 1e-6, 2048, None),
    "mistral": (10000.0, 1e-6, 4096 * 32, 8),
    "qwen2": (10000.0, 1e-6, 32768, 32),
    "qwen3": (10000.0, 1e-6, 32768, 32),
    "phi3": (10000.0, 1e-5, 4096, None),
    "mixtral": (1e6, 1e-5, 4096 * 32, 8),
    "qwen3_moe": (10000.0, 1e-6, 32768, 4),
}
_DENSE = ("llama", "mistral", "qwen2", "qwen3", "phi3")
_QWEN3_HEAD_DIM = 128  # Qwen3Config's head_dim when config.json leaves it out (not hidden / heads)
_DISPLAY = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2", "qwen3": "Qwen3", "phi3": "Phi-3",
            "mixtral": "Mixtral", "qwen3_moe": "Qwen3-MoE"}


EXPORT_DTYPES = ("float32", "bfloat16", "float16")  # what to-hf writes on request


# config.json keys the shardline model does not determine, written back as the source folder had them.
KEPT_FIELDS = ("pad_token_id", "router_aux_loss_coef", "initializer_range", "sliding_window", "max_window_layers")


def read_hf_fields(path: str | os.PathLike) -> dict[str, Any]:
    """What an HF folder's config.json says beyond the model's shape and a checkpoint keeps
    for the way back: the weights' dtype, the special tokens and KEPT_FIELDS (keys absent
    when unset)."""
    cfg = _load_json(_hf_folder(path) / CONFIG_NAME)
    cfg = cfg if isinstance(cfg, dict) else {}
    dtype = cfg.get("dtype") or cfg.get("torch_dtype")
    fields = {"dtype": dtype if dtype in EXPORT_DTYPES else None,
              "bos_token_id": cfg.get("bos_token_id"), "eos_token_id": cfg.get("eos_token_id"),
              **{key: cfg.get(key) for key in KEPT_FIELDS}}
    return {key: value for key, value in fields.items() if value is not None}


def read_hf_config(path: str | os.PathLike) -> ModelArgs:
    """ModelArgs of the HF Llama, Mistral, Qwen2, Qwen3, Phi-3, Mixtral or Qwen3-MoE folder `path`,
    read from its config.json. (Dropout keys are not read: shardline trains without dropout, as
    every release of these families is configured.)"""
    where = (folder := _hf_folder(path)) / CONFIG_NAME
    if not where.is_file():  # (a shardline checkpoint's or run dir's own key said: a swap of the two is common)
        ours = (folder / "meta.json").is_file() or (folder / "checkpoints").is_dir()
        raise CheckpointError(f"{folder} has no {CONFIG_NAME}; it is not a Hugging Face model folder" + (
            ": a shardline checkpoint or run dir (a run starts from it with model.init_from; to-hf exports it)" * ours))
    cfg = _load_json(where)
    if not isinstance(cfg, dict):
        raise CheckpointError(f"{where} does not hold a JSON object")
    family = cfg.get("model_type")
    if family not in _DEFAULTS:
        raise CheckpointError(f"{where}: model_type={family!r}; only {', '.join(_DISPLAY.values())} folders "
                              f"(model_type {', '.join(map(repr, _DEFAULTS))}) can be read")
    quantized = cfg.get("quantization_config")
    if quantized:  # its tensors (qweight, weight_scale_inv, absmax) would fail later, as a shape mismatch
        method = quantized.get("quant_method", "?") if isinstance(quantized, dict) else "?"
        raise CheckpointError(f"{where}: a quantized model (quant_method={method!r}); shardline reads unquantized "
                              "float weights: start from the unquantized release, or dequantize it first")
    args = _dense_args(cfg, where, family)
    _check_layer_types(cfg, where)
    if family in ("mistral", "mixtral", "phi3"):
        window = _window(cfg, where, args.max_seq_len, default=4096 if family == "mistral" else None)
        if window is not None and family == "mixtral" and window < args.max_seq_len:
            raise CheckpointError(f"{where}: sliding_window={window} is not supported for Mixtral; shardline "
                                  "attends to the whole sequence (null, or >= max_position_embeddings, is valid)")
        args = dataclasses.replace(args, sliding_window=None if family == "mixtral" else window)
    if family == "phi3" and args.rope_scaling is not None:  # (Phi3Config itself refuses it)
        raise CheckpointError(f"{where}: a Phi-3 config with llama3 RoPE scaling is not one transformers reads "
                              "(Phi-3 takes default or longrope RoPE)")
    if family in ("qwen2", "qwen3", "qwen3_moe"):
        _check_qwen_attention(cfg, where, family)
        args = dataclasses.replace(args, **({"qkv_bias": True} if family == "qwen2" else {"qk_norm": True}))
    if family not in _DENSE:
        args = _with_moe(args, cfg, where, family)
    problems = args.validate()
    if problems:
        raise CheckpointError(f"{where} describes an unusable model shape: {'; '.join(problems)}")
    return args


def _dense_args(cfg: dict, where: Path, family: str) -> ModelArgs:
    """The fields every family shares with Llama: attention, norms, rotary, vocabulary."""
    for key in ("attention_bias", "mlp_bias"):
        if cfg.get(key):
            raise CheckpointError(f"{where}: {key}=true is not supported; shardline's models have bias terms on "
                                  "q, k and v alone (Qwen2's), none on the output or the MLP")
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise CheckpointError(f"{where}: hidden_act={act!r} is not supported; shardline's models use silu")
    default_theta, default_eps, default_max_pos, default_kv = _DEFAULTS[family]
    dim = _number(cfg, "hidden_size", where, int)
    n_heads = _number(cfg, "num_attention_heads", where, int)
    n_kv_heads = _number(cfg, "num_key_value_heads", where, int, default=default_kv or n_heads)
    head_dim = _number(cfg, "head_dim", where, int, default=_QWEN3_HEAD_DIM if family == "qwen3" else -1)
    max_pos = _number(cfg, "max_position_embeddings", where, int, default=default_max_pos)
    for key, value in (("hidden_size", dim), ("num_attention_heads", n_heads), ("num_key_value_heads", n_kv_heads),
                       ("max_position_embeddings", max_pos)):
        if value < 1:  # (a 0 divided by later, or taken for "not set"; a model of no positions)
            raise CheckpointError(f"{where}: {key}={value} must be >= 1")
    if head_dim == 0 or head_dim < -1:
        raise CheckpointError(f"{where}: head_dim={head_dim} must be >= 1")
    if head_dim == -1 or (n_heads > 0 and dim % n_heads == 0 and head_dim == dim // n_heads):
        head_dim = None  # the default, dim // n_heads
    theta, scaling = _read_rope(cfg, where, max_pos, default_theta)
    tie = cfg.get("tie_word_embeddings", False)
    if not isinstance(tie, bool):
        raise CheckpointError(f"{where}: tie_word_embeddings={tie!r} is not true or false")
    return ModelArgs(
        dim=dim,
        n_layers=_number(cfg, "num_hidden_layers", where, int),
        n_heads=n_heads,
        vocab_size=_number(cfg, "vocab_size", where, int),
        n_kv_heads=None if n_kv_heads == n_heads else n_kv_heads,
        head_dim=head_dim,
        ffn_dim=_number(cfg, "intermediate_size", where, int),
        norm_eps=_number(cfg, "rms_norm_eps", where, float, default=default_eps),
        rope_theta=theta, rope_scaling=scaling,
        max_seq_len=max_pos, tie_embeddings=tie,
    )


def _with_moe(args: ModelArgs, cfg: dict, where: Path, family: str) -> ModelArgs:
    """Add the routed feed-forward of a Mixtral or Qwen3-MoE config (softmax top-k, dropless as HF).

    The balance loss starts off (aux_loss_coef 0): HF's router_aux_loss_coef weighs a loss
    of another normalisation and applies only with output_router_logits; set moe.aux_loss_coef.
    """
    experts_key = "num_local_experts" if "num_local_experts" in cfg else "num_experts"
    n_experts = _number(cfg, experts_key, where, int)
    top_k = _number(cfg, "num_experts_per_tok", where, int)
    if family == "mixtral":
        jitter = _number(cfg, "router_jitter_noise", where, float, default=0.0)
        if jitter:
            raise CheckpointError(f"{where}: router_jitter_noise={jitter} is not supported; shardline's router "
                                  "has no input jitter (set it to 0)")
        moe = MoEArgs(n_experts=n_experts, top_k=top_k, expert_ffn_dim=args.ffn_dim)
        return dataclasses.replace(args, moe=moe)
    norm_topk = cfg.get("norm_topk_prob", False)
    if not isinstance(norm_topk, bool):
        raise CheckpointError(f"{where}: norm_topk_prob={norm_topk!r} is not true or false")
    moe = MoEArgs(n_experts=n_experts, top_k=top_k, norm_topk=norm_topk,
                  expert_ffn_dim=_number(cfg, "moe_intermediate_size", where, int),
                  first_dense_layers=_qwen3_dense_prefix(cfg, where, args.n_layers))
    return dataclasses.replace(args, moe=moe)


def _window(cfg: dict, where: Path, max_pos: int, default: int | None) -> int | None:
    """Mistral's, Mixtral's and Phi-3's sliding window, or None (`default`: the config class's window
    when config.json leaves the key out). A token attends to itself and the window - 1 before it, so
    sequences of at most the window's length see what the whole sequence gives them: the launch
    holds train.seq_len to it (a window as long as the context too: a run past the context would
    pass it). Mixtral's, where shorter than the context, is refused by the caller."""
    window = cfg.get("sliding_window", default)
    if window is None:
        return None
    window = _number({"sliding_window": window}, "sliding_window", where, int)
    if window < 1:
        raise CheckpointError(f"{where}: sliding_window={window} must be >= 1 (or null)")
    return window


def _check_qwen_attention(cfg: dict, where: Path, family: str) -> None:
    """Windowed attention (not built), where asked for: Qwen3-MoE's in every layer, Qwen2's and Qwen3's
    from layer max_window_layers (28) on, or where layer_types (checked apart) says."""
    first = cfg.get("max_window_layers", 28) if isinstance(cfg.get("max_window_layers", 28), int) else 0
    if not cfg.get("use_sliding_window") or not cfg.get("sliding_window", 4096) or family != "qwen3_moe" and (
            isinstance(cfg.get("layer_types"), list) or first >= _number(cfg, "num_hidden_layers", where, int)):
        return
    raise CheckpointError(f"{where}: use_sliding_window=true is not supported; shardline attends to the "
                          "whole sequence (false, or Qwen2/Qwen3's max_window_layers >= num_hidden_layers, is valid)")


def _check_layer_types(cfg: dict, where: Path) -> None:
    """Per-layer attention kinds (sliding layers between full ones) are not built."""
    types = cfg.get("layer_types") or []
    if not isinstance(types, list) or any(t != "full_attention" for t in types):
        shown = types if not isinstance(types, list) or len(types) <= 4 else [*types[:4], "..."]
        raise CheckpointError(f"{where}: layer_types={shown!r} is not supported; shardline attends to the whole "
                              "sequence in every layer (full_attention)")


def _qwen3_dense_prefix(cfg: dict, where: Path, n_layers: int) -> int:
    """How many first layers are dense; Qwen3-MoE may place dense layers anywhere, shardline only first.

    transformers makes layer i sparse unless i is in mlp_only_layers or (i + 1) is not a
    multiple of decoder_sparse_step.
    """
    step = _number(cfg, "decoder_sparse_step", where, int, default=1)
    only = cfg.get("mlp_only_layers") or []
    if step < 1 or not isinstance(only, list) or not all(isinstance(i, int) for i in only):
        raise CheckpointError(f"{where}: decoder_sparse_step={step!r}, mlp_only_layers={only!r} must be an "
                              "integer >= 1 and a list of layer indices")
    dense = [i for i in range(n_layers) if i in only or (i + 1) % step]
    if dense != list(range(len(dense))):
        raise CheckpointError(f"{where}: dense layers {dense} (from decoder_sparse_step={step}, mlp_only_layers="
                              f"{only}) are not supported; shardline keeps dense layers only first, as "
                              "mlp_only_layers=[0, ..., k-1] with decoder_sparse_step=1")
    return len(dense)


def hf_config_dict(args: ModelArgs, tied: bool, dtype: torch.dtype,
               bos_token_id: int | None, eos_token_id: int | list[int] | None) -> dict[str, Any]:
    dtype_name = str(dtype).removeprefix("torch.")
    scaling = None
    if args.rope_scaling is not None:
        scaling = {"rope_type": "llama3"}
        for key, value in args.rope_scaling:
            scaling[key] = int(value) if key == "original_max_position_embeddings" else float(value)
    rope_parameters = {"rope_type": "default", "rope_theta": float(args.rope_theta), **(scaling or {})}
    config = {
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
    problem = hf_export_problem(args)
    if problem:
        raise CheckpointError(f"{problem}; this model cannot be written as an HF folder")
    if args.moe is not None:
        return _moe_config_dict(args, config)
    if args.qkv_bias:  # Qwen2: Llama's keys but the bias flags, plus its (unused) window
        config = {k: v for k, v in config.items() if k not in ("attention_bias", "mlp_bias", "pretraining_tp")}
        config.update(architectures=["Qwen2ForCausalLM"], model_type="qwen2", use_sliding_window=False,
                      sliding_window=None, max_window_layers=args.n_layers,
                      layer_types=["full_attention"] * args.n_layers)
    if args.sliding_window is not None:  # Mistral: Llama's math and names, with the window the weights had
        config = {k: v for k, v in config.items() if k not in ("attention_bias", "mlp_bias", "pretraining_tp")}
        config.update(architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=args.sliding_window)
    if args.qk_norm:  # Qwen3: Llama's keys but the MLP bias flags, plus its (unused) window
        config = {k: v for k, v in config.items() if k not in ("mlp_bias", "pretraining_tp")}
        config.update(architectures=["Qwen3ForCausalLM"], model_type="qwen3", use_sliding_window=False,
                      sliding_window=None, max_window_layers=args.n_layers,
                      layer_types=["full_attention"] * args.n_layers)
    return config


def hf_export_problem(args: ModelArgs) -> str | None:
    """Why no Hugging Face family holds this shape (the export refuses it; a launch says so as
    it starts), or None."""
    if args.sliding_window is not None and (args.qkv_bias or args.qk_norm or args.moe is not None):
        return ("no Hugging Face family this exporter writes has a sliding window together with "
                f"{'q/k/v biases' if args.qkv_bias else 'per-head q/k norms' if args.qk_norm else 'routed experts'}")
    if args.qkv_bias and (args.qk_norm or args.moe is not None):
        return ("no Hugging Face family has bias terms on q, k and v (Qwen2's) together with "
                f"{'a norm on each query and key head' if args.qk_norm else 'routed experts'}")
    if args.moe is not None:
        try:
            hf_family(args)
        except CheckpointError as e:
            return str(e)
    return None


def hf_balance_coef(args: ModelArgs) -> float:
    """moe.aux_loss_coef as HF's router_aux_loss_coef (see models/moe/args.py)."""
    return balance_coef_to_hf(args.moe.aux_loss_coef, args.moe.top_k, args.n_moe_layers)


def _moe_config_dict(args: ModelArgs, llama: dict[str, Any]) -> dict[str, Any]:
    """The Mixtral or Qwen3-MoE config.json of an MoE shape: Llama's keys plus the experts'.

    Keys are the hub's spellings (Qwen3-MoE: num_experts), which transformers 4 reads as
    they are and transformers 5 maps onto its own attribute names.
    """
    family = hf_family(args)
    m = args.moe
    config = {k: v for k, v in llama.items() if k not in ("mlp_bias", "pretraining_tp")}
    config.update(model_type=family, num_experts_per_tok=m.top_k, output_router_logits=False,
                  router_aux_loss_coef=hf_balance_coef(args), sliding_window=None)
    if family == "mixtral":
        del config["attention_bias"]
        config.update(architectures=["MixtralForCausalLM"], intermediate_size=m.expert_ffn_dim,
                      num_local_experts=m.n_experts, router_jitter_noise=0.0)
    else:
        config.update(architectures=["Qwen3MoeForCausalLM"], moe_intermediate_size=m.expert_ffn_dim,
                      num_experts=m.n_experts, norm_topk_prob=m.norm_topk, decoder_sparse_step=1,
                      mlp_only_layers=list(range(m.first_dense_layers)), use_sliding_window=False)
    return config
