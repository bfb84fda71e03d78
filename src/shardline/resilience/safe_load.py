"""Reading a checkpoint's tensors (torch DCP) so that a checkpoint someone else gave runs no code.

`--resume PATH`, `model.init_from`, `shardline eval` and `convert to-hf` read a folder that may
come from anyone. DCP reads the folder's `.metadata` with a plain pickle.load, and each of its
non-tensor items (the optimizer's hyper-parameters) with torch.load(weights_only=False): a
crafted checkpoint ran whatever it named, and its manifest's hashes, which its maker writes,
proved nothing. Here the metadata is unpickled first by an unpickler that builds DCP's own
metadata classes and torch's sizes, dtypes and layouts only, and each non-tensor item is first
read with weights_only=True; anything else is refused in one line before DCP reads it.
"""

from __future__ import annotations

import contextlib
import io
import pickle
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

from shardline.errors import CheckpointError, links_outside, outside_folder

# What a DCP .metadata file builds besides DCP's metadata classes (_dcp_class): sizes, dtypes and
# layouts, and the paths DCP records (Python 3.13 pickles a PosixPath as pathlib._local's).
_METADATA_GLOBALS = {("torch", "Size"), ("torch.serialization", "_get_layout"), ("collections", "OrderedDict"),
                     ("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("builtins", "set"),
                     ("builtins", "frozenset"), *((module, name) for module in ("pathlib", "pathlib._local")
                                                  for name in ("PosixPath", "PurePosixPath", "WindowsPath"))}
_DCP_METADATA = "torch.distributed.checkpoint.metadata"


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if "." not in name and (_dcp_class(module, name) or (module, name) in _METADATA_GLOBALS or (
                module == "torch" and isinstance(getattr(torch, name, None), torch.dtype))):
            return super().find_class(module, name)  # (a dotted name would reach through a module's imports)
        raise pickle.UnpicklingError(f"{module}.{name}")


def _dcp_class(module: str, name: str) -> bool:
    """A class DCP's metadata module defines itself (not one it imports)."""
    if module != _DCP_METADATA:
        return False
    import importlib

    found = getattr(importlib.import_module(module), name, None)
    return isinstance(found, type) and found.__module__ == module


def _check_metadata(path: Path) -> None:
    """A checkpoint's state/.metadata is DCP's Metadata and nothing that could run code, and places
    its data in files of the folder. DCP reads another metadata file where this one is missing or
    empty (a rank's `__N.metadata`), which no shardline checkpoint holds: refused too."""
    state = path / "state"
    file = state / ".metadata"
    try:
        with open(file, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
        others = sorted(p.name for p in state.glob("__*.metadata"))
    except pickle.UnpicklingError as e:
        raise CheckpointError(f"checkpoint {path}: {file.name} names {e}, which a checkpoint's metadata never "
                              "holds; not loaded (reading it would run code)") from None
    except Exception as e:  # (missing, truncated or garbled: said as the damage it is)
        raise CheckpointError(f"checkpoint {path}: {file.name} is missing or damaged ({type(e).__name__})") from None
    from torch.distributed.checkpoint.metadata import Metadata

    if others:
        raise CheckpointError(f"checkpoint {path}: {state.name}/{others[0]} is a file a checkpoint never holds "
                              "(DCP would read it, with plain pickle, where .metadata fails); not loaded")
    if type(metadata) is not Metadata or not isinstance(metadata.storage_data, dict):
        raise CheckpointError(f"checkpoint {path}: {file.name} is not the metadata DCP writes; not loaded")
    names = [getattr(info, "relative_path", None) for info in metadata.storage_data.values()]
    odd = [n for n in names if type(n) is not str]  # (a path object's parts could be set to anything)
    for name in odd[:1] + sorted(set(names) - set(odd) if not odd else []):  # (a few files, each once)
        if type(name) is not str or outside_folder(name) or links_outside(state, state / name):
            raise CheckpointError(f"checkpoint {path}: {file.name} names {name!r} as a data file, which is not a "
                                  "file of the checkpoint; not loaded")


class _CheckedPlanner(DefaultLoadPlanner):
    """DCP's planner, reading each non-tensor item with weights_only=True first."""

    refused: CheckpointError | None = None

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        try:
            torch.load(value, weights_only=True)
        except Exception as e:
            self.refused = CheckpointError(f"a checkpoint item ({read_item.dest_index.fqn}) holds more than data: "
                                           f"not loaded (reading it would run code): {type(e).__name__}")
            raise self.refused from None
        value.seek(0)
        super().load_bytes(read_item, value)


@contextlib.contextmanager
def single_process_ok():
    """DCP warns when no process group exists; one process is a supported layout here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def load_state(path: Path, state: dict[str, Any]) -> None:
    """Fill `state` (a state dict laid out as this rank holds it) from checkpoint folder `path`."""
    _check_metadata(path)
    planner = _CheckedPlanner()
    try:
        with single_process_ok():
            dcp.load(state, checkpoint_id=str(path / "state"), planner=planner)
    except (Exception, CheckpointException) as e:  # CheckpointException is a BaseException
        if planner.refused is not None:
            raise planner.refused from None
        if not (path / "manifest.json").is_file():  # gone while read: a run pruning it (checkpoint.keep), not damage
            raise removed_while_read(path) from None
        raise CheckpointError(f"checkpoint {path} does not match this model/optimizer: {_last_line(e)}") from None


def removed_while_read(path: Path) -> CheckpointError:
    """The error for checkpoint `path` gone while a command read it: a live run's prune, not damage."""
    return CheckpointError(f"checkpoint {path} was removed while it was read (a run pruning its older checkpoints, "
                           "checkpoint.keep?): run this again, or name a checkpoint the run keeps (or a copy of one)")


def _last_line(e: BaseException) -> str:
    """DCP wraps the real error (e.g. a size mismatch) in a multi-line report: keep its last line."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    return lines[-1] if lines else type(e).__name__
