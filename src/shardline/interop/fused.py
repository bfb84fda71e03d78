"""Phi-3's fused tensors read under Llama's names.

Phi-3 (and Phi-4, which keeps its model_type "phi3") is Llama's math with two projections
stored as one tensor each per layer:

    model.layers.{i}.self_attn.qkv_proj.weight  rows: q (heads x head_dim), k, v (kv heads x head_dim each)
    model.layers.{i}.mlp.gate_up_proj.weight     rows: gate (ffn), up (ffn)

The loader (hf.py) checks and copies tensors by their Llama names; `split_view` gives it the
folder as if each fused tensor were its parts: a part's header (dtype, shape) and its rows,
read from the file without reading the rest. Exports are written as Llama (or, with a sliding
window, Mistral): the same math and tensor names, which transformers and inference servers load.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from shardline.errors import CheckpointError
from shardline.interop.hf_config import CONFIG_NAME, _load_json
from shardline.models.llama import ModelArgs

_FUSED = re.compile(r"(model\.layers\.\d+\.)(self_attn\.qkv_proj|mlp\.gate_up_proj)\.weight")
_PARTS = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
          "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj")}


def stores_fused(folder: Path) -> bool:
    """Whether an HF folder's config.json names a family that stores q/k/v and gate/up fused
    (Phi-3's); False where it cannot be read (read_hf_config says why)."""
    try:
        cfg = _load_json(folder / CONFIG_NAME)
    except CheckpointError:
        return False
    return isinstance(cfg, dict) and cfg.get("model_type") == "phi3"


def fused_name(name: str) -> str:
    """The fused tensor a Llama-named part `name` lies in (`name` itself where it is no part)."""
    for kind, parts in _PARTS.items():
        for part in parts:
            if name.endswith(f".{part}.weight") and name.startswith("model.layers."):
                return name.removesuffix(f"{part}.weight") + f"{kind}.weight"
    return name


def split_view(files: dict[str, Path], handles: dict, args: ModelArgs, folder: Path) -> tuple[dict, dict]:
    """(files, handles) where each fused tensor of `files` is replaced by its parts under Llama's
    names, each part's rows taken from the fused tensor as `args` lays them out; a fused tensor
    whose rows do not add up to its parts is named."""
    rows = {"self_attn.qkv_proj": (args.n_heads * args.head_size, args.kv_heads * args.head_size,
                                   args.kv_heads * args.head_size),
            "mlp.gate_up_proj": (args.ffn_dim, args.ffn_dim)}
    for i in range(args.n_layers):  # named as the folder would hold them, not as their parts
        for kind, names in _PARTS.items():
            fused, split = f"model.layers.{i}.{kind}.weight", [f"model.layers.{i}.{p}.weight" for p in names]
            if fused not in files:
                raise CheckpointError(f"{folder} lacks tensor {fused}, which the model needs (its Phi-3 config "
                                      f"says {args.n_layers} layers)")
            found = [name for name in split if name in files]
            if found:
                raise CheckpointError(f"{folder} holds both {fused} and {found[0]}, one of its parts: a Phi-3 folder "
                                      "holds the fused tensor alone")
            if fused not in handles[files[fused]].keys():
                raise CheckpointError(f"{folder} places tensor {fused} in {files[fused].name}, which does not hold it")
    out_files, parts = {}, {}
    for name, file in files.items():
        match = _FUSED.fullmatch(name)
        if match is None:
            out_files[name] = file
            continue
        prefix, kind = match.groups()
        total = handles[file].get_slice(name).get_shape()[0]
        if total != sum(rows[kind]):
            raise CheckpointError(f"tensor {name} in {file} has {total} rows where the config's shape gives "
                                  f"{' + '.join(map(str, rows[kind]))} = {sum(rows[kind])}; the folder does not "
                                  f"match its config.json ({folder})")
        start = 0
        for part, count in zip(_PARTS[kind], rows[kind]):
            parts[f"{prefix}{part}.weight"] = (name, start, start + count)
            out_files[f"{prefix}{part}.weight"] = file
            start += count
    return out_files, {file: _SplitHandle(handle, parts) for file, handle in handles.items()}


class _SplitHandle:
    """A safetensors handle that also answers for the parts of the fused tensors it holds."""

    def __init__(self, handle, parts: dict[str, tuple[str, int, int]]):
        self._handle, held = handle, set(handle.keys())
        self._parts = {name: part for name, part in parts.items() if part[0] in held}
        self._keys = (held - {part[0] for part in self._parts.values()}) | set(self._parts)

    def keys(self):
        return self._keys

    def get_slice(self, name: str):
        if name not in self._parts:
            return self._handle.get_slice(name)
        source, start, stop = self._parts[name]
        return _PartHeader(self._handle.get_slice(source), stop - start)

    def get_tensor(self, name: str) -> torch.Tensor:
        if name not in self._parts:
            return self._handle.get_tensor(name)
        source, start, stop = self._parts[name]
        return self._handle.get_slice(source)[start:stop]  # these rows alone are read from the file


class _PartHeader:
    """A part's dtype and shape, as a safetensors slice reports them."""

    def __init__(self, whole, rows: int):
        self._whole, self._rows = whole, rows

    def get_dtype(self) -> str:
        return self._whole.get_dtype()

    def get_shape(self) -> list[int]:
        return [self._rows, *self._whole.get_shape()[1:]]
