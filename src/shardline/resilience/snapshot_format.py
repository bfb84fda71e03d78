"""A flat file format for in-memory snapshots: a small header, then raw tensor bytes.

`torch.save` runs a zip writer over every tensor (under 1 GB/s here); a snapshot on
the training path wants memcpy speed. The file is:

    8 bytes   header length (little endian)
    header    pickle of (tree with tensors replaced by TensorRef, [(dtype, shape, offset)])
    data      each tensor's bytes, 64-byte aligned

Reading copies each tensor out of the bytes (which may be a mapped file that is about to
be removed or overwritten). The header is unpickled with
a loader that admits no class but TensorRef, so a foreign file cannot run code.
"""

from __future__ import annotations

import io
import pickle
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

ALIGN = 64


@dataclass(frozen=True)
class TensorRef:
    index: int


def _strip(obj: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(obj, torch.Tensor):
        tensors.append(obj.detach().contiguous())
        return TensorRef(len(tensors) - 1)
    if isinstance(obj, dict):
        return {k: _strip(v, tensors) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_strip(v, tensors) for v in obj)
    return obj


def _bytes(t: torch.Tensor) -> memoryview:
    return t.reshape(-1).view(torch.uint8).numpy().data if t.numel() else memoryview(b"")


def write(path: Path, tree: Any) -> None:
    tensors: list[torch.Tensor] = []
    skeleton = _strip(tree, tensors)
    layout, offset = [], 0
    for t in tensors:
        layout.append((str(t.dtype).removeprefix("torch."), tuple(t.shape), offset))
        offset += -(-t.numel() * t.element_size() // ALIGN) * ALIGN
    header = pickle.dumps((skeleton, layout))
    start = -(-(8 + len(header)) // ALIGN) * ALIGN
    with open(path, "wb") as f:
        f.write(len(header).to_bytes(8, "little"))
        f.write(header)
        for t, (_, _, off) in zip(tensors, layout):
            f.seek(start + off)
            f.write(_bytes(t))
        f.truncate(start + offset)


class _HeaderLoader(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) == (TensorRef.__module__, TensorRef.__name__):
            return TensorRef
        raise pickle.UnpicklingError(f"snapshot header refers to {module}.{name}; not a shardline snapshot")


def read(data: torch.Tensor) -> Any:
    """The tree back from a snapshot's bytes (a uint8 tensor), every tensor in memory of its own."""
    n = int.from_bytes(data[:8].numpy().tobytes(), "little")
    skeleton, layout = _HeaderLoader(io.BytesIO(data[8: 8 + n].numpy().tobytes())).load()
    start = -(-(8 + n) // ALIGN) * ALIGN
    tensors = []
    for dtype_name, shape, off in layout:
        dtype = getattr(torch, dtype_name)
        count = 1
        for s in shape:
            count *= s
        nbytes = count * torch.empty((), dtype=dtype).element_size()
        raw = data[start + off: start + off + nbytes]
        tensors.append(raw.view(dtype).reshape(shape).clone() if count else torch.empty(shape, dtype=dtype))
    return _fill(skeleton, tensors)


def _fill(obj: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(obj, TensorRef):
        return tensors[obj.index]
    if isinstance(obj, dict):
        return {k: _fill(v, tensors) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_fill(v, tensors) for v in obj)
    return obj
