"""Hugging Face Llama, Mistral, Qwen2, Qwen3, Phi-3, Mixtral and Qwen3-MoE folders <-> shardline models,
without importing transformers.

An HF folder is `config.json` plus safetensors weights: one `model.safetensors`, or
shards listed in `model.safetensors.index.json`. Tensor names map through the model
family's adapter: one to one for Llama (models/llama/hf_adapter.py; Phi-3's fused q/k/v and
gate/up tensors are read as those parts, fused.py), and for the MoE
families (models/moe/hf_adapter.py) one stacked experts parameter to one HF tensor per
expert. Llama's names:

    tok_embeddings.weight                  model.embed_tokens.weight
    layers.{i}.attention_norm.weight       model.layers.{i}.input_layernorm.weight
    layers.{i}.attention.w{q,k,v,o}.weight model.layers.{i}.self_attn.{q,k,v,o}_proj.weight
    layers.{i}.ffn_norm.weight             model.layers.{i}.post_attention_layernorm.weight
    layers.{i}.feed_forward.w1.weight      model.layers.{i}.mlp.gate_proj.weight
    layers.{i}.feed_forward.w3.weight      model.layers.{i}.mlp.up_proj.weight
    layers.{i}.feed_forward.w2.weight      model.layers.{i}.mlp.down_proj.weight
    norm.weight                            model.norm.weight
    output.weight                          lm_head.weight (absent when embeddings are tied)

config.json is read and written by hf_config.py.
"""

from __future__ import annotations

import os
import warnings
from contextlib import ExitStack, contextmanager
from pathlib import Path

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset as local_offset

from shardline.errors import CheckpointError
from shardline.interop.fused import fused_name, split_view, stores_fused
from shardline.interop.hf_config import CONFIG_NAME, _hf_folder, hf_config_dict, read_hf_config
from shardline.interop.hf_files import (
    DEFAULT_MAX_SHARD_SIZE,
    INDEX_NAME,
    TOKENIZER_NAME,
    WEIGHTS_NAME,
    _check_destination,
    _open_safetensors,
    _weight_files,
    _write_hf_folder,
    tokenizer_file,
)
from shardline.models.factory import build_meta_model
from shardline.models.llama import Llama, ModelArgs, rope_frequencies
from shardline.models.llama.hf_adapter import hf_param_name
from shardline.models.moe.hf_adapter import hf_family, hf_param_names
from shardline.models.moe.layer import moe_layers

__all__ = ["CONFIG_NAME", "DEFAULT_MAX_SHARD_SIZE", "INDEX_NAME", "TOKENIZER_NAME", "WEIGHTS_NAME",
           "from_hf_pretrained", "load_hf_weights", "read_hf_config", "to_hf_pretrained"]

_FLOAT_DTYPES = {"F64", "F32", "F16", "BF16"}  # safetensors' names of what load_hf_weights reads
_EXPORT_DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16)  # the same, as torch dtypes

_Slots = dict[str, tuple[str, nn.Parameter, int | None]]  # see _hf_slots



def _unwrap(model: nn.Module) -> Llama:
    while hasattr(model, "_orig_mod"):  # torch.compile wrapper
        model = model._orig_mod
    if not isinstance(model, Llama):
        raise TypeError(f"expected a shardline Llama model, got {type(model).__name__}")
    return model


def _hf_slots(model: Llama, skip_output: bool) -> _Slots:
    """HF tensor name -> (parameter name, parameter, expert index or None: the whole parameter).

    The family's adapter names each parameter; a stacked experts parameter is n_experts
    HF tensors, expert j being its slice [j].
    """
    slots = {}
    for name, param in model.named_parameters():
        if skip_output and name == "output.weight":
            continue
        hf = _hf_names(model.args, name)
        if isinstance(hf, str):
            slots[hf] = (name, param, None)
        else:
            slots.update((h, (name, param, j)) for j, h in enumerate(hf))
    return slots


def _hf_names(args: ModelArgs, name: str) -> str | list[str]:
    """The HF tensor name of parameter `name`, or one per expert of a stacked experts parameter."""
    if args.moe is None:
        return hf_param_name(name)
    return hf_param_names(name, family=hf_family(args), n_experts=args.moe.n_experts)


def plain_name(name: str) -> str:
    """A parameter's name without the wrappers' parts (torch.compile, activation checkpointing)."""
    return ".".join(part for part in name.split(".") if part not in _WRAPPER_PARTS)


_WRAPPER_PARTS = ("_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module")


def _describe(names: list[str]) -> str:
    more = f" (and {len(names) - 1} more)" if len(names) > 1 else ""
    return f"{names[0]}{more}"


# ---- HF folder -> model ---------------------------------------------------------------------


def _match_names(folder: Path, files: dict[str, Path], expected: _Slots, tied: bool) -> list[str]:
    """Check the folder's tensor names against the model's slots; return the names to read.

    A tied model also takes an lm_head.weight (checked against the embedding later); old
    transformers' rotary inv_freq buffers are skipped.
    """
    fused = sorted(n for n in files if n.endswith(".experts.gate_up_proj"))
    if fused:
        raise CheckpointError(f"{folder} holds {_describe(fused)}, transformers 5's fused in-memory experts; "
                              "save the model with save_pretrained, which writes the hub's one tensor per expert")
    missing = sorted(set(expected) - set(files))
    if missing:
        name, _, index = expected[missing[0]]
        raise CheckpointError(f"{folder} lacks tensor {_describe(missing)}, which the model needs "
                              f"(as {name if index is None else f'expert {index} of {name}'})")
    allowed = set(expected) | ({"lm_head.weight"} if tied else set())
    extra = sorted(n for n in files if n not in allowed and not n.endswith(".rotary_emb.inv_freq"))
    if extra:
        raise CheckpointError(f"{folder} holds tensor {_describe(extra)}, which the model has no place for; "
                              "the folder does not match the model's shape")
    return sorted(allowed & files.keys())


def _check_headers(folder: Path, files: dict[str, Path], handles: dict, names: list[str],
                   expected: _Slots, embed: nn.Parameter) -> None:
    """Check each tensor's file, dtype and shape from the headers alone, before anything is copied."""
    keys = {f: set(h.keys()) for f, h in handles.items()}
    for hf_name in names:
        file = files[hf_name]
        if hf_name not in keys[file]:
            raise CheckpointError(f"{folder / INDEX_NAME} places tensor {hf_name} in {file.name}, "
                                  "which does not hold it")
        info = handles[file].get_slice(hf_name)
        if info.get_dtype() not in _FLOAT_DTYPES:
            raise CheckpointError(f"tensor {hf_name} in {file} has dtype {info.get_dtype()}; only unquantized "
                                  f"float weights ({', '.join(sorted(_FLOAT_DTYPES))}) can be loaded")
        shape = tuple(info.get_shape())
        _, param, index = expected.get(hf_name) or ("", embed, None)  # a tied lm_head: the embedding's
        want = tuple(param.shape[1:] if index is not None else param.shape)
        if shape != want:
            raise CheckpointError(f"tensor {hf_name} in {file} has shape {list(shape)} but the model "
                                  f"expects {list(want)}; the folder does not match the model's shape")


def _check_tied_head(folder: Path, files: dict[str, Path], handles: dict) -> None:
    """A tied model has one tensor for both ends: an lm_head.weight saved with it must equal it."""
    head = handles[files["lm_head.weight"]].get_tensor("lm_head.weight")
    emb = handles[files["model.embed_tokens.weight"]].get_tensor("model.embed_tokens.weight")
    if not torch.equal(head, emb):
        raise CheckpointError(f"{folder} holds an lm_head.weight that differs from embed_tokens, "
                              "but the model ties its output to the embedding")


def check_finite(model: nn.Module, source: str, hf_folder: Path | None = None) -> None:
    """Starting weights holding NaN or inf, refused naming a parameter (and, read from HF folder
    `hf_folder`, the tensor there): a run from them skipped every step as an anomaly and exited 0.
    Each rank checks the part it holds, where it holds it."""
    model = _unwrap(model)
    for name, param in model.named_parameters():
        held = param.to_local() if isinstance(param, DTensor) else param
        if held.is_floating_point() and not bool(torch.isfinite(held).all()):
            name = plain_name(name)
            origin = f" (read from {_hf_origin(model.args, name, hf_folder, param)})" if hf_folder else ""
            raise CheckpointError(f"{source}: parameter {name}{origin} holds NaN or inf values; these weights "
                                  "cannot be trained or converted (re-save them from a healthy copy)")


def _hf_origin(args: ModelArgs, name: str, folder: Path, param: torch.Tensor) -> str:
    """The HF tensor `name` was read from, for a message (of experts, the first this rank holds with NaN or inf)."""
    try:
        hf = _hf_names(args, name)
    except CheckpointError:  # (a name no adapter knows: the parameter's own name says it)
        return "the folder"
    fused = stores_fused(folder)  # Phi-3's q/k/v and gate/up are parts of one tensor each
    hf = [fused_name(h) if fused else h for h in ([hf] if isinstance(hf, str) else hf)]
    if len(hf) == 1:
        return f"tensor {hf[0]}"
    held, first = param, 0
    if isinstance(param, DTensor):  # (under ep, or FSDP, a rank holds some of the experts: the first of them)
        held, first = param.to_local(), local_offset(param.shape, param.device_mesh, param.placements)[1][0]
    return f"tensor {hf[first + int((~torch.isfinite(held)).reshape(len(held), -1).any(1).nonzero()[0])]}"


def _copy_weights(model: Llama, files: dict[str, Path], handles: dict, expected: _Slots, tied: bool) -> None:
    """Copy every slot's tensor in; then restore what the HF folder cannot hold (see load_hf_weights)."""
    for hf_name, (_, param, index) in expected.items():
        (param if index is None else param[index]).copy_(handles[files[hf_name]].get_tensor(hf_name))
    embed, output = model.tok_embeddings.weight, model.output.weight
    if tied and output is not embed:  # a tie lost (e.g. to to_empty): keep the values equal
        output.copy_(embed)
    for layer in moe_layers(model):
        layer.router.expert_bias.zero_()


@torch.no_grad()
def load_hf_weights(model: nn.Module, path: str | os.PathLike) -> None:
    """Copy the weights of HF folder `path` into the materialized shardline `model`.

    Every model parameter must be present with the same shape (each expert's tensor for
    stacked experts); a tensor the model has no place for is an error too (except rotary
    inv_freq buffers old transformers saved). Values are cast to each parameter's dtype
    and device. Nothing is copied unless the whole folder checks out. The MoE routers'
    balancing bias, which HF models do not have, is reset to zero so the model routes
    as the HF one does.
    """
    model = _unwrap(model)
    folder = _hf_folder(path)
    if any(p.is_meta for p in model.parameters()):
        raise ValueError("load_hf_weights needs a materialized model; call model.init_weights() first")
    tied = model.output.weight is model.tok_embeddings.weight or model.args.tie_embeddings
    with _checked_folder(folder, model, tied) as (files, handles, expected):
        _copy_weights(model, files, handles, expected, tied)


@contextmanager
def _checked_folder(folder: Path, model: Llama, tied: bool):
    """(files, open handles, slots) of an HF folder checked whole against `model` (any device,
    meta too): names, then each tensor's dtype and shape from the headers, a tied lm_head's values."""
    files = _weight_files(folder)
    expected = _hf_slots(model, skip_output=tied)  # a tied output is filled from the embedding
    with ExitStack() as stack:
        handles = {f: stack.enter_context(_open_safetensors(f)) for f in sorted(set(files.values()))}
        if stores_fused(folder):  # Phi-3: q/k/v and gate/up read as Llama's parts
            files, handles = split_view(files, handles, model.args, folder)
        names = _match_names(folder, files, expected, tied)
        _check_headers(folder, files, handles, names, expected, model.tok_embeddings.weight)
        if tied and "lm_head.weight" in files:
            _check_tied_head(folder, files, handles)
        yield files, handles, expected


def from_hf_pretrained(path: str | os.PathLike, device: str | torch.device = "cpu") -> tuple[Llama, ModelArgs]:
    """Build a shardline model (fp32, on `device`) holding the weights of HF folder `path`."""
    args = read_hf_config(path)
    _weight_files(_hf_folder(path))  # fail on a folder without weights before allocating anything
    model = empty_model(args, torch.float32, device)
    load_hf_weights(model, path)
    check_finite(model, str(path), _hf_folder(path))
    return model, args


def empty_model(args: ModelArgs, dtype: torch.dtype, device: str | torch.device = "cpu") -> Llama:
    """A model of `args` whose parameters (in `dtype`) are allocated but not initialised, for
    weights that are all loaded next: no random init to draw and throw away (tens of minutes
    at 405B), and an export in bf16 holds the model in bf16, not fp32."""
    model = build_meta_model(args).to(dtype)
    model.to_empty(device=device)
    if args.tie_embeddings:
        model.output.weight = model.tok_embeddings.weight  # to_empty gives each module its own tensor
    model.inv_freq = rope_frequencies(args).to(model.tok_embeddings.weight.device)
    for layer in moe_layers(model):  # to_empty left the routers' bookkeeping uninitialised
        for buffer in layer.buffers():
            buffer.zero_()
    return model


def check_hf_weights(path: str | os.PathLike) -> None:
    """The checks a launch's load makes before it copies a tensor (the files, the names, each
    tensor's dtype and shape from the headers, against the folder's own config): a dry run's."""
    args = read_hf_config(path)
    with _checked_folder(_hf_folder(path), build_meta_model(args), args.tie_embeddings):
        pass


def hf_state_dict_chunks(path: str | os.PathLike, wanted: set[str], max_bytes: int = 1 << 30):
    """The weights of HF folder `path` as shardline state-dict entries (full tensors in the
    folder's dtype), only the parameter names in `wanted`, in dicts of about `max_bytes`
    each: a sharded model loads one chunk at a time and keeps its shards, so host memory
    holds a chunk, not a copy of the model. The folder is checked whole first, as
    load_hf_weights checks it; a name in `wanted` the folder cannot fill is an error."""
    args = read_hf_config(path)
    folder = _hf_folder(path)
    model = build_meta_model(args)
    tied = args.tie_embeddings
    expected = _hf_slots(model, skip_output=tied)
    sources: dict[str, list[tuple[int | None, str]]] = {}  # parameter -> its HF tensors (index: expert)
    for hf_name, (name, _, index) in expected.items():
        sources.setdefault(name, []).append((index, hf_name))
    if tied:
        sources["output.weight"] = [(None, "model.embed_tokens.weight")]  # a held copy of the tied weight
    unfilled = sorted(wanted - sources.keys())
    if unfilled:
        raise CheckpointError(f"{folder} has no tensor for parameter {_describe(unfilled)}; the folder does not "
                              "match the model")
    with _checked_folder(folder, model, tied) as (files, handles, _):
        chunk, size = {}, 0
        for name, parts in sources.items():
            if name not in wanted:
                continue
            if parts[0][0] is None:  # one HF tensor for the parameter
                chunk[name] = handles[files[parts[0][1]]].get_tensor(parts[0][1])
            else:  # stacked experts, one HF tensor each
                chunk[name] = torch.stack([handles[files[h]].get_tensor(h) for _, h in sorted(parts)])
            size += chunk[name].nbytes
            if size >= max_bytes:
                yield chunk
                chunk, size = {}, 0
        if chunk:
            yield chunk


# ---- model -> HF folder ---------------------------------------------------------------------


def _export_tied(model: Llama) -> bool:
    """Whether to write a tied HF model: the output is the embedding, or equal to it where
    the args tie them (a tie lost to to_empty or a checkpoint round trip)."""
    embed, output = model.tok_embeddings.weight, model.output.weight
    if output is embed:
        return True
    if not model.args.tie_embeddings:
        return False
    if torch.equal(output.detach().to(embed.device), embed.detach()):
        return True
    warnings.warn("the model's args tie the embeddings but its output and embedding weights differ; "
                  "writing an untied HF model (tie_word_embeddings=false) with its own lm_head.weight",
                  stacklevel=3)
    return False


def _warn_moe_differences(model: Llama) -> None:
    """Say where the exported HF model will compute other outputs than the shardline one."""
    layers = moe_layers(model)
    if layers and layers[0].moe.capacity_factor:
        warnings.warn(f"moe capacity_factor={layers[0].moe.capacity_factor} drops overflow tokens; the HF model "
                      "is dropless, so its outputs differ where the shardline model drops", stacklevel=3)
    if any(bool(layer.router.expert_bias.any()) for layer in layers):
        warnings.warn("the routers' balancing bias (moe.bias_update_rate) is not zero; HF models have no such "
                      "bias, so the exported model may choose other experts", stacklevel=3)


def _export_tensors(model: Llama, tied: bool) -> list[tuple[str, torch.Tensor]]:
    """(HF name, tensor) for every slot, in the model's parameter order; experts are slices."""
    for name, param in model.named_parameters():
        if param.is_meta:
            raise ValueError(f"parameter {name} is on the meta device; materialize the model first")
    return [(hf, param.detach() if index is None else param.detach()[index])
            for hf, (_, param, index) in _hf_slots(model, skip_output=tied).items()]


@torch.no_grad()
def to_hf_pretrained(model: nn.Module, path: str | os.PathLike,
                     max_shard_size_bytes: int = DEFAULT_MAX_SHARD_SIZE, *,
                     tokenizer_path: str | os.PathLike | None = None,
                     dtype: torch.dtype | None = None,
                     bos_token_id: int | None = None,
                     eos_token_id: int | list[int] | None = None,
                     provenance: dict | None = None, kept_fields: dict | None = None,
                     generation_config: str | os.PathLike | None = None, chat_template: str = "",
                     turn_end: str = "", doc_end: int | None = None) -> Path:
    """Write `model` as an HF folder at `path` that transformers' LlamaForCausalLM,
    Qwen2ForCausalLM, Qwen3ForCausalLM, MixtralForCausalLM or Qwen3MoeForCausalLM (by the model's shape) loads.

    Writes config.json, the weights (one model.safetensors, or shards of at most
    max_shard_size_bytes each plus model.safetensors.index.json) and, when tokenizer_path
    (a tokenizer.json, or a folder holding one) is given, tokenizer.json and the files beside
    it (hf_files.SIDE_FILES). dtype: the weights' dtype on disk (default: the parameters' own).
    Everything is written to a temporary sibling folder first and renamed into place. An
    earlier export at `path` (it holds shardline_export.json, with `provenance`) is replaced
    as a whole; any other non-empty folder, an HF one included, is refused. `kept_fields`: config.json
    values of the folder the weights came from (hf_config.KEPT_FIELDS) replacing the written defaults.
    `generation_config`: a generation_config.json to write (it describes the weights: written with
    or without a tokenizer, over one beside the tokenizer). `chat_template`: one to write into the export's
    tokenizer_config.json (a run that chatted without one rendered ChatML); `turn_end`: the text a chat run's
    replies end with, and `doc_end` the end-of-document token it trained with: generation_config.json's stops."""
    model = _unwrap(model)
    dest = Path(path)
    if max_shard_size_bytes <= 0:
        raise ValueError(f"max_shard_size_bytes must be > 0, got {max_shard_size_bytes}")
    if dtype is not None and dtype not in _EXPORT_DTYPES:  # anything else is a folder nobody loads
        raise ValueError(f"dtype={dtype} cannot be exported; valid: {', '.join(map(str, _EXPORT_DTYPES))}")
    _check_destination(dest)
    tokenizer = tokenizer_file(tokenizer_path) if tokenizer_path is not None else None
    tied = _export_tied(model)
    tensors = _export_tensors(model, tied)
    _warn_moe_differences(model)
    dtype = tensors[0][1].dtype if dtype is None else dtype
    config = hf_config_dict(model.args, tied, dtype, bos_token_id, eos_token_id)
    kept = {key: value for key, value in (kept_fields or {}).items() if key in config}
    if config.get("router_aux_loss_coef"):  # the run trained with a balance loss of its own: its weight, converted
        kept.pop("router_aux_loss_coef", None)  # (else the starting folder's, which a run from it leaves at 0)
    config.update(kept)
    side = {"tokenizer": tokenizer, "generation_config": None if generation_config is None else Path(generation_config),
            "chat_template": chat_template or None, "turn_end": turn_end or None, "doc_end": doc_end}
    _write_hf_folder(dest, tensors, dtype, max_shard_size_bytes, config, side, provenance or {})
    return dest
