"""The state a checkpoint or an in-memory snapshot holds: model and optimizer state dicts
keyed by parameter name, as DCP saves them, so any layout can load them.

Three things beyond torch's state-dict helpers: ZeRO-1 keys its sharded states itself; a
tied output head held as a copy of the embedding on another pipeline stage has its optimizer
state saved once, under the embedding's name; and tensors held in a subclass (torchao's
float8-gathered FSDP weights and their optimizer moments) are saved as the plain tensors they
wrap.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_map
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from shardline.errors import CheckpointError
from shardline.parallel.pipeline import tied_copy
from shardline.parallel.zero1 import no_update_yet


def capture_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    """Model (and optimizer) state keyed by parameter name, as DCP saves it."""
    if optimizer is None:
        return tree_map(_plain, {"model": get_model_state_dict(model)})
    if hasattr(optimizer, "checkpoint_state"):  # ZeRO-1 keys its sharded states itself
        model_sd, optim_sd = get_model_state_dict(model), optimizer.checkpoint_state()
    else:
        fresh = not optimizer.state  # torch makes the states by an update of lr 0, counted 1
        model_sd, optim_sd = get_state_dict(model, optimizer)
        if fresh:
            no_update_yet(optimizer)
            model_sd, optim_sd = get_state_dict(model, optimizer)
    if tied_copy(model) is not None:
        optim_sd = _fold_tied_copy(optim_sd, embedding_here=model.tok_embeddings is not None)
    return tree_map(_plain, {"model": model_sd, "optim": optim_sd})


def _plain(value: Any) -> Any:
    """A tensor (or a DTensor's local shard) held in a wrapper subclass, as the plain tensor
    of its shape it wraps (a wrapper with none, or several, is refused: CheckpointError),
    sharing its storage (so a load into it still lands in the model). DCP
    pickles each tensor with its class: a subclass would make the checkpoint readable only
    where its library is imported (not by `convert`, nor by a resume without fp8)."""
    local = value._local_tensor if isinstance(value, DTensor) else value
    if not isinstance(local, torch.Tensor) or type(local) in (torch.Tensor, torch.nn.Parameter) or \
            not hasattr(local, "__tensor_flatten__"):
        return value
    names, _ = local.__tensor_flatten__()
    # The one inner tensor of the wrapper's shape holds its data (torchao's float8 weight also
    # lists a precomputed scale, a scalar, while its next scale waits to be used).
    data = [getattr(local, name) for name in names if getattr(local, name).shape == local.shape]
    if len(data) != 1:
        raise CheckpointError(f"cannot save a {type(local).__name__} tensor: no single inner tensor of "
                              f"its shape (it lists {', '.join(names)})")
    inner = data[0]
    if not isinstance(value, DTensor):
        return inner
    return DTensor.from_local(inner, value.device_mesh, value.placements, run_check=False,
                              shape=value.shape, stride=value.stride())


def restore_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """Put a loaded capture_state() tree back into the model and optimizer."""
    optim_sd = state["optim"]
    if tied_copy(model) is not None:
        optim_sd = _unfold_tied_copy(optim_sd, embedding_here=model.tok_embeddings is not None)
    if hasattr(optimizer, "load_checkpoint_state"):
        set_model_state_dict(model, state["model"])
        optimizer.load_checkpoint_state(optim_sd)
        return
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=optim_sd)


# A tied output head held as a copy of the embedding (parallel/pipeline.py's tied_copy)
# has the embedding's optimizer state (equal gradients give equal moments), so it is
# saved once, under the embedding's name: the checkpoint holds one tied weight's state,
# as a single process saves it, and any layout can load it. (Model weights keep both
# names, as a tied single-process model's state dict does.)
_COPY, _EMBEDDING = "output.weight", "tok_embeddings.weight"


def _fold_tied_copy(optim_sd: dict[str, Any], embedding_here: bool) -> dict[str, Any]:
    """The copy's state under the embedding's name (dropped where the embedding is here too)."""
    if embedding_here:
        state = {k: v for k, v in optim_sd["state"].items() if k != _COPY}
        groups = [{**g, "params": [n for n in g["params"] if n != _COPY]} for g in optim_sd["param_groups"]]
        return {**optim_sd, "state": state, "param_groups": groups}
    return _rename_optim_key(optim_sd, _COPY, _EMBEDDING)


def _unfold_tied_copy(optim_sd: dict[str, Any], embedding_here: bool) -> dict[str, Any]:
    """The inverse of _fold_tied_copy, for a model holding the copy (and the embedding, or not)."""
    if not embedding_here:
        return _rename_optim_key(optim_sd, _EMBEDDING, _COPY)
    # The copy gets tensors of its own: the optimizer updates its states in place.
    copied = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in optim_sd["state"][_EMBEDDING].items()}
    groups = [{**g, "params": [*g["params"], _COPY] if _EMBEDDING in g["params"] else g["params"]}
              for g in optim_sd["param_groups"]]
    return {**optim_sd, "state": {**optim_sd["state"], _COPY: copied}, "param_groups": groups}


def _rename_optim_key(optim_sd: dict[str, Any], old: str, new: str) -> dict[str, Any]:
    state = {new if k == old else k: v for k, v in optim_sd["state"].items()}
    groups = [{**g, "params": [new if n == old else n for n in g["params"]]} for g in optim_sd["param_groups"]]
    return {**optim_sd, "state": state, "param_groups": groups}


def keep_own_group_names(optim_sd: dict[str, Any], own: list[list[str]]) -> None:
    """Put this rank's parameter names back into the loaded optimizer groups (in place).

    A checkpoint stores one copy of the groups (their hyperparameters and parameter
    names), written by one rank; where ranks hold different parameters (pipeline
    stages) a rank would load another's names, and torch's loader then matches none of
    its parameters and drops the group's hyperparameters. The hyperparameters are the
    same on every rank, and the groups are built alike on every rank (optim.py)."""
    loaded = optim_sd["param_groups"]
    if len(loaded) != len(own):
        raise CheckpointError(f"the checkpoint's optimizer has {len(loaded)} parameter groups, this one {len(own)}")
    optim_sd["param_groups"] = [{**g, "params": names} for g, names in zip(loaded, own)]
