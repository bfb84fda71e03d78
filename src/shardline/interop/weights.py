"""Starting weights: the one loader for a run that begins from existing weights.

`model.hf_path` names an HF Llama, Mistral, Qwen2, Qwen3, Phi-3, Mixtral or Qwen3-MoE folder,
`model.init_from` a shardline checkpoint; a larger `model.vocab_size` adds vocabulary rows to
either, for tokens added to their tokenizer.
The model arrives laid out (sharded, split into pipeline stages) and initialised; the
loader overwrites its weights, each rank keeping only its own shard. Parallelization
knows nothing of where weights come from.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
from torch.distributed.tensor import DTensor, distribute_tensor

from shardline.config import ModelConfig
from shardline.interop.hf import check_finite, hf_state_dict_chunks, load_hf_weights, plain_name
from shardline.interop.convert import beside_checkpoint
from shardline.interop.hf_config import read_hf_fields
from shardline.interop.hf_files import GENERATION_NAME, SIDE_FILES, copy_side_files
from shardline.parallel.distributed import agreed
from shardline.interop.model_shape import starting_rows
from shardline.resilience.checkpoint import load_weights, verify
from shardline.resilience.safe_load import load_state


def load_starting_weights(m: ModelConfig, model: nn.Module, sharded: bool, verified: bool = False) -> None:
    """Load model.hf_path or model.init_from (if set) into the laid-out `model`; weights holding NaN
    or inf are refused on every rank (each checks its own part). A model.vocab_size above their
    rows (model_shape allows no other change) adds rows at the mean of theirs (grow_rows).
    `verified`: every rank verified init_from already (eval chose a run dir's newest valid one)."""
    stored = starting_rows(m) if m.vocab_size else 0  # (nothing hashed: the load verifies a checkpoint)
    grown = 0 < stored < m.vocab_size  # (the same on every rank: from the config and files)
    world = dist.get_world_size() if dist.is_initialized() else 1
    if m.hf_path:
        _load_hf(model, m.hf_path, sharded or grown)
    if m.init_from:  # verified on every rank first, a refusal agreed (one node's damaged copy, not a hang)
        if not verified:
            agreed(lambda: verify(Path(m.init_from)), world)
        if grown:
            _load_checkpoint_grown(model, Path(m.init_from), stored)
        else:
            load_weights(Path(m.init_from), model, verified=True)  # DCP reshards to any layout
    if m.hf_path or m.init_from:
        key, value = ("model.init_from", m.init_from) if m.init_from else ("model.hf_path", m.hf_path)
        hf = Path(m.hf_path) if m.hf_path and not m.init_from else None  # (init_from wins, as above)
        agreed(lambda: check_finite(model, f"{key}={value!r}", hf), world)


def copy_starting_files(m: ModelConfig, tokenizer: str, run_dir: Path) -> None:
    """Into a run dir, for `convert to-hf` to write back: the settings and chat template beside
    the tokenizer the run uses, then the generation settings of the weights it starts from (they
    describe the weights, so a data.tokenizer from another folder does not replace them)."""
    from_weights = bool(m.hf_path or m.init_from)
    if tokenizer:  # a run from weights takes generation settings from the weights alone
        names = tuple(n for n in SIDE_FILES if not (from_weights and n == GENERATION_NAME))
        copy_side_files(Path(tokenizer).parent, run_dir, names=names)
    if m.hf_path:
        copy_side_files(Path(m.hf_path), run_dir, names=(GENERATION_NAME,))
    elif m.init_from and (found := beside_checkpoint(Path(m.init_from), GENERATION_NAME)) is not None:
        copy_side_files(found.parent, run_dir, names=(GENERATION_NAME,))


def starting_hf_fields(m: ModelConfig, stand_in: Path | None = None) -> dict:
    """The HF fields (dtype, special tokens) of the folder a run's weights came from, which its
    checkpoints carry so that `convert to-hf` writes them back; {} for a run from scratch.
    `stand_in`: a checkpoint of the run that carries them, when that folder is gone since."""
    if m.hf_path and stand_in is None:
        return read_hf_fields(m.hf_path)
    if m.init_from or stand_in is not None:  # meta.json alone: loading verifies the checkpoint (hashing every file)
        try:
            return json.loads((Path(stand_in or m.init_from) / "meta.json").read_text(encoding="utf-8")).get("hf", {})
        except (OSError, ValueError, AttributeError):
            return {}
    return {}


def _load_hf(model: nn.Module, path: str, chunked: bool) -> None:
    if not chunked:  # one process, the folder's shapes: in place, tensor by tensor
        load_hf_weights(model, path)
        return
    # Each rank reads the tensors of the parameters it holds, a chunk at a time, and copies
    # its own shard of each in, without a collective: host memory holds a chunk per rank, not
    # a copy of the model (8 fp32 copies of a 70B model would not fit a node). Every rank
    # reads from storage (the page cache serves a node's ranks).
    params = {plain_name(name): p for name, p in model.named_parameters(remove_duplicate=False)}
    for chunk in hf_state_dict_chunks(path, set(params), max_bytes=HF_CHUNK_BYTES):
        for name, full in chunk.items():  # (grown in the parameter's dtype: the same rows from a bf16 folder)
            _copy_full(params[name], grow_rows(full.to(params[name].dtype), params[name].shape[0])
                       if name in VOCAB_ROWS else full)
    for name, buffer in model.named_buffers():
        if name.endswith("router.expert_bias"):  # HF models have no balancing bias: route as they do
            buffer.zero_()


HF_CHUNK_BYTES = 1 << 30  # what a sharded load reads before copying it in
VOCAB_ROWS = ("tok_embeddings.weight", "output.weight")  # a row per token: what a larger vocab_size grows


def grow_rows(full: torch.Tensor, rows: int) -> torch.Tensor:
    """`full` with rows added up to `rows`, each the mean of its rows (in fp32): a token added to
    the tokenizer starts where the average token is, so its logit starts near the average one and
    the model's predictions barely move (transformers' resize_token_embeddings does the same, and
    adds noise of 1e-9 times the rows' covariance). Every rank computes it from the whole tensor,
    so the rows are the same in any layout."""
    if rows <= len(full):
        return full
    mean = full.mean(0, keepdim=True, dtype=torch.float32).to(full.dtype)
    return torch.cat([full, mean.expand(rows - len(full), *full.shape[1:])])


def _load_checkpoint_grown(model: nn.Module, path: Path, stored: int) -> None:
    """load_weights, but for a model with more vocabulary rows than checkpoint `path`: its
    embedding and output are read whole (every rank: one tensor each, a tied one once) and grown.
    The caller has verified it."""
    state = get_model_state_dict(model)
    vocab = {k: torch.empty((stored, *v.shape[1:]), dtype=v.dtype) for k, v in state.items()
             if plain_name(k) in VOCAB_ROWS}
    rest = {k: v for k, v in state.items() if k not in vocab}
    load_state(path, {"model": {**rest, **vocab}})
    set_model_state_dict(model, rest, options=StateDictOptions(strict=False))
    params = {plain_name(n): p for n, p in model.named_parameters(remove_duplicate=False)}
    filled: set[int] = set()
    with torch.no_grad():
        for key in list(vocab):
            full, param = vocab.pop(key), params[plain_name(key)]  # (each let go once copied)
            if id(param) not in filled:  # a tied weight under both names: once
                _copy_full(param, grow_rows(full.to(param.dtype), param.shape[0]))
                filled.add(id(param))


@torch.no_grad()
def _copy_full(param: nn.Parameter, full: torch.Tensor) -> None:
    """Copy this rank's part of the whole tensor `full` into `param` (a DTensor's local shard,
    cut as its placements cut it: src_data_rank=None takes every rank's own copy, no scatter).
    Under CPU offload the shard lives on the host and the mesh on the GPU: copy_ crosses."""
    if isinstance(param, DTensor):
        mine = distribute_tensor(full.to(param.dtype), param.device_mesh, param.placements, src_data_rank=None)
        param.to_local().copy_(mine.to_local())
    else:
        param.copy_(full)


