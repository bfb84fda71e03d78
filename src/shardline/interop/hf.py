"""Hugging Face Llama, Mixtral and Qwen3-MoE folders <-> shardline models, without importing transformers.

An HF folder is `config.json` plus safetensors weights: one `model.safetensors`, or
shards listed in `model.safetensors.index.json`. Tensor names map through the model
family's adapter: one to one for Llama (models/llama/hf_adapter.py), and for the MoE
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

import functools
import json
import os
import shutil
import uuid
import warnings
from contextlib import ExitStack
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from shardline.errors import CheckpointError, DataError
from shardline.interop.hf_config import (
    CONFIG_NAME,
    _hf_folder,
    _load_json,
    hf_config_dict,
    read_hf_config,
)
from shardline.models.factory import build_meta_model
from shardline.models.llama import Llama, ModelArgs, rope_frequencies
from shardline.models.llama.hf_adapter import hf_param_name
from shardline.models.moe.hf_adapter import hf_family, hf_param_names
from shardline.models.moe.layer import moe_layers

WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
TOKENIZER_NAME = "tokenizer.json"
DEFAULT_MAX_SHARD_SIZE = 5_000_000_000  # bytes; transformers' long-standing "5GB" default

_FLOAT_DTYPES = {"F64", "F32", "F16", "BF16"}

def _unwrap(model: nn.Module) -> Llama:
    while hasattr(model, "_orig_mod"):  # torch.compile wrapper
        model = model._orig_mod
    if not isinstance(model, Llama):
        raise TypeError(f"expected a shardline Llama model, got {type(model).__name__}")
    return model


def _weight_files(folder: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file that holds it (as listed, not yet verified)."""
    single, index = folder / WEIGHTS_NAME, folder / INDEX_NAME
    if single.is_file():  # transformers also prefers the single file when both exist
        with _open_safetensors(single) as f:
            return {name: single for name in f.keys()}
    if index.is_file():
        data = _load_json(index)
        weight_map = data.get("weight_map") if isinstance(data, dict) else None
        if not isinstance(weight_map, dict) or not all(
                isinstance(k, str) and isinstance(v, str) and Path(v).name == v for k, v in weight_map.items()):
            raise CheckpointError(f"{index} has no valid weight_map (tensor name -> shard file name)")
        files = {name: folder / shard for name, shard in weight_map.items()}
        for shard in sorted(set(files.values())):
            if not shard.is_file():
                raise CheckpointError(f"{index} lists shard {shard.name}, which is missing from {folder}")
        return files
    hint = ""
    if any(folder.glob("*.bin")) or any(folder.glob("*.pth")):
        hint = " (it holds PyTorch pickle weights, which shardline does not read; re-save them as safetensors)"
    raise CheckpointError(f"{folder} holds neither {WEIGHTS_NAME} nor {INDEX_NAME}{hint}")


def _hf_slots(model: Llama, skip_output: bool) -> dict[str, tuple[str, nn.Parameter, int | None]]:
    """HF tensor name -> (parameter name, parameter, expert index or None: the whole parameter).

    The family's adapter names each parameter; a stacked experts parameter is n_experts
    HF tensors, expert j being its slice [j].
    """
    args = model.args
    names = hf_param_name
    if args.moe is not None:
        names = functools.partial(hf_param_names, family=hf_family(args), n_experts=args.moe.n_experts)
    slots = {}
    for name, param in model.named_parameters():
        if skip_output and name == "output.weight":
            continue
        hf = names(name)
        if isinstance(hf, str):
            slots[hf] = (name, param, None)
        else:
            slots.update((h, (name, param, j)) for j, h in enumerate(hf))
    return slots


def _open_safetensors(file: Path):
    try:
        return safe_open(str(file), framework="pt", device="cpu")
    except Exception as e:  # SafetensorError, OSError: a truncated or foreign file
        raise CheckpointError(f"{file} cannot be read as safetensors: {e}") from None


def _describe(names: list[str]) -> str:
    more = f" (and {len(names) - 1} more)" if len(names) > 1 else ""
    return f"{names[0]}{more}"


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
    files = _weight_files(folder)

    embed, output = model.tok_embeddings.weight, model.output.weight
    tied = output is embed or model.args.tie_embeddings
    expected = _hf_slots(model, skip_output=tied)  # a tied output is filled from the embedding below

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

    with ExitStack() as stack:
        handles = {f: stack.enter_context(_open_safetensors(f)) for f in sorted(set(files.values()))}
        keys = {f: set(h.keys()) for f, h in handles.items()}
        for hf_name in sorted(allowed & files.keys()):
            file = files[hf_name]
            if hf_name not in keys[file]:
                raise CheckpointError(f"{folder / INDEX_NAME} places tensor {hf_name} in {file.name}, "
                                      "which does not hold it")
            info = handles[file].get_slice(hf_name)
            if info.get_dtype() not in _FLOAT_DTYPES:
                raise CheckpointError(f"tensor {hf_name} in {file} has dtype {info.get_dtype()}; only "
                                      "unquantized float weights (F32, F16, BF16) can be loaded")
            shape = tuple(info.get_shape())
            _, param, index = expected.get(hf_name) or ("", embed, None)
            want = tuple(param.shape[1:] if index is not None else param.shape)
            if shape != want:
                raise CheckpointError(f"tensor {hf_name} in {file} has shape {list(shape)} but the model "
                                      f"expects {list(want)}; the folder does not match the model's shape")
        if tied and "lm_head.weight" in files:
            head = handles[files["lm_head.weight"]].get_tensor("lm_head.weight")
            emb = handles[files["model.embed_tokens.weight"]].get_tensor("model.embed_tokens.weight")
            if not torch.equal(head, emb):
                raise CheckpointError(f"{folder} holds an lm_head.weight that differs from embed_tokens, "
                                      "but the model ties its output to the embedding")
            del head, emb
        for hf_name, (_, param, index) in expected.items():
            (param if index is None else param[index]).copy_(handles[files[hf_name]].get_tensor(hf_name))
        if tied and output is not embed:  # a tie lost (e.g. to to_empty): keep the values equal
            output.copy_(embed)
        for layer in moe_layers(model):
            layer.router.expert_bias.zero_()


def from_hf_pretrained(path: str | os.PathLike, device: str | torch.device = "cpu") -> tuple[Llama, ModelArgs]:
    """Build a shardline model (fp32, on `device`) holding the weights of HF folder `path`."""
    args = read_hf_config(path)
    _weight_files(_hf_folder(path))  # fail on a folder without weights before allocating anything
    model = build_meta_model(args)
    model.to_empty(device=device)  # every parameter is overwritten by load_hf_weights
    if args.tie_embeddings:
        model.output.weight = model.tok_embeddings.weight  # to_empty gives each module its own tensor
    model.inv_freq = rope_frequencies(args).to(model.tok_embeddings.weight.device)
    for layer in moe_layers(model):  # to_empty left the routers' bookkeeping uninitialised
        for buffer in layer.buffers():
            buffer.zero_()
    load_hf_weights(model, path)
    return model, args


# ---- model -> HF folder ---------------------------------------------------------------------


def _is_hf_folder(folder: Path) -> bool:
    config = folder / CONFIG_NAME
    if not config.is_file():
        return False
    try:
        cfg = json.loads(config.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return False
    return isinstance(cfg, dict) and "model_type" in cfg


def _check_destination(dest: Path) -> None:
    if not dest.exists():
        return
    if not dest.is_dir():
        raise CheckpointError(f"{dest} exists and is not a folder; choose another destination")
    if any(dest.iterdir()) and not _is_hf_folder(dest):
        raise CheckpointError(f"{dest} exists, is not empty and is not a Hugging Face model folder; "
                              "refusing to overwrite it (choose another destination or empty it)")


def _tokenizer_file(tokenizer_path: str | os.PathLike) -> Path:
    file = Path(tokenizer_path)
    if file.is_dir():
        file = file / TOKENIZER_NAME
    if not file.is_file():
        raise DataError(f"tokenizer file {file} does not exist")
    return file


def _plan_shards(tensors: list[tuple[str, torch.Tensor]], itemsize: int, max_bytes: int) -> list[list[int]]:
    """Greedy split (in order) into shards of at most max_bytes; a bigger tensor gets its own shard."""
    shards: list[list[int]] = [[]]
    size = 0
    for i, (_, t) in enumerate(tensors):
        nbytes = t.numel() * itemsize
        if shards[-1] and size + nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(i)
        size += nbytes
    return shards


def _file_mode() -> int:
    """The mode a plain new file gets under this process's umask (e.g. 0o644)."""
    mask = os.umask(0)
    os.umask(mask)
    return 0o666 & ~mask


def _swap_into_place(tmp: Path, dest: Path) -> None:
    if not dest.exists():
        os.replace(tmp, dest)
        return
    if not any(dest.iterdir()):
        dest.rmdir()
        os.replace(tmp, dest)
        return
    old = dest.parent / f".{dest.name}.old-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    os.replace(dest, old)
    try:
        os.replace(tmp, dest)
    except BaseException:
        os.replace(old, dest)
        raise
    shutil.rmtree(old, ignore_errors=True)


def _warn_moe_differences(model: Llama) -> None:
    """Say where the exported HF model will compute other outputs than the shardline one."""
    layers = moe_layers(model)
    if layers and layers[0].moe.capacity_factor:
        warnings.warn(f"moe capacity_factor={layers[0].moe.capacity_factor} drops overflow tokens; the HF model "
                      "is dropless, so its outputs differ where the shardline model drops", stacklevel=3)
    if any(bool(layer.router.expert_bias.any()) for layer in layers):
        warnings.warn("the routers' balancing bias (moe.bias_update_rate) is not zero; HF models have no such "
                      "bias, so the exported model may choose other experts", stacklevel=3)


@torch.no_grad()
def to_hf_pretrained(model: nn.Module, path: str | os.PathLike,
                     max_shard_size_bytes: int = DEFAULT_MAX_SHARD_SIZE, *,
                     tokenizer_path: str | os.PathLike | None = None,
                     dtype: torch.dtype | None = None,
                     bos_token_id: int | None = None,
                     eos_token_id: int | list[int] | None = None) -> Path:
    """Write `model` as an HF folder at `path` that transformers' LlamaForCausalLM,
    MixtralForCausalLM or Qwen3MoeForCausalLM (by the model's shape) loads.

    Writes config.json, the weights (one model.safetensors, or shards of at most
    max_shard_size_bytes each plus model.safetensors.index.json) and, when tokenizer_path
    (a tokenizer.json, or a folder holding one) is given, tokenizer.json. dtype: the
    weights' dtype on disk (default: the parameters' own). Everything is written to a
    temporary sibling folder first and renamed into place; an existing HF folder at
    `path` is replaced as a whole, any other non-empty folder is refused.
    """
    model = _unwrap(model)
    args = model.args
    dest = Path(path)
    if max_shard_size_bytes <= 0:
        raise ValueError(f"max_shard_size_bytes must be > 0, got {max_shard_size_bytes}")
    _check_destination(dest)
    tokenizer = _tokenizer_file(tokenizer_path) if tokenizer_path is not None else None

    embed, output = model.tok_embeddings.weight, model.output.weight
    tied = output is embed
    if not tied and args.tie_embeddings:
        tied = torch.equal(output.detach().to(embed.device), embed.detach())
        if not tied:
            warnings.warn("the model's args tie the embeddings but its output and embedding weights differ; "
                          "writing an untied HF model (tie_word_embeddings=false) with its own lm_head.weight",
                          stacklevel=2)

    for name, param in model.named_parameters():
        if param.is_meta:
            raise ValueError(f"parameter {name} is on the meta device; materialize the model first")
    _warn_moe_differences(model)
    tensors = [(hf, param.detach() if index is None else param.detach()[index])
               for hf, (_, param, index) in _hf_slots(model, skip_output=tied).items()]
    if dtype is None:
        dtype = tensors[0][1].dtype
    itemsize = torch.empty((), dtype=dtype).element_size()
    shards = _plan_shards(tensors, itemsize, max_shard_size_bytes)

    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.parent / f".{dest.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        weight_map: dict[str, str] = {}
        total = 0
        for i, shard in enumerate(shards):
            file = WEIGHTS_NAME if len(shards) == 1 else f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            # Copy into fresh CPU tensors one shard at a time: no views or shared storage
            # (safetensors refuses them) and host memory bounded by the shard size.
            chunk = {tensors[j][0]: tensors[j][1].to("cpu", dtype).contiguous().clone() for j in shard}
            save_file(chunk, str(tmp / file), metadata={"format": "pt"})
            os.chmod(tmp / file, _file_mode())  # safetensors writes owner-only; exports are shared
            for name, t in chunk.items():
                weight_map[name] = file
                total += t.numel() * t.element_size()
            del chunk
        if len(shards) > 1:
            index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
            (tmp / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
        config = hf_config_dict(args, tied, dtype, bos_token_id, eos_token_id)
        (tmp / CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
        if tokenizer is not None:
            shutil.copyfile(tokenizer, tmp / TOKENIZER_NAME)
        _swap_into_place(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dest
