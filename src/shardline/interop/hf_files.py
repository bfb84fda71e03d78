"""The files of a Hugging Face model folder: finding and opening its safetensors weights,
and writing a whole folder atomically. Knows file names and formats, not models: mapping
tensors to a shardline model's parameters is hf.py's job.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from shardline.errors import CheckpointError, DataError
from shardline.interop.hf_config import CONFIG_NAME, _load_json

WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
TOKENIZER_NAME = "tokenizer.json"
DEFAULT_MAX_SHARD_SIZE = 5_000_000_000  # bytes; transformers' long-standing "5GB" default


# ---- reading -----------------------------------------------------------------------------------


def _open_safetensors(file: Path):
    try:
        return safe_open(str(file), framework="pt", device="cpu")
    except Exception as e:  # SafetensorError, OSError: a truncated or foreign file
        raise CheckpointError(f"{file} cannot be read as safetensors: {e}") from None


def _is_shard_name(name: object) -> bool:
    """A plain file name inside the folder: no path, and not "" or ".." (which name folders)."""
    return isinstance(name, str) and name not in ("", "..") and Path(name).name == name


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
                isinstance(k, str) and _is_shard_name(v) for k, v in weight_map.items()):
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


# ---- writing -----------------------------------------------------------------------------------


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


def _write_json(file: Path, data: Any) -> None:
    file.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")


def _write_weights(folder: Path, tensors: list[tuple[str, torch.Tensor]],
                   shards: list[list[int]], dtype: torch.dtype) -> None:
    """Write the planned shards (one model.safetensors, or numbered shards plus the index)."""
    weight_map: dict[str, str] = {}
    total = 0
    for i, shard in enumerate(shards):
        file = WEIGHTS_NAME if len(shards) == 1 else f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        # Copy into fresh CPU tensors one shard at a time: no views or shared storage
        # (safetensors refuses them) and host memory bounded by the shard size.
        chunk = {tensors[j][0]: tensors[j][1].to("cpu", dtype).contiguous().clone() for j in shard}
        save_file(chunk, str(folder / file), metadata={"format": "pt"})
        os.chmod(folder / file, _file_mode())  # safetensors writes owner-only; exports are shared
        for name, t in chunk.items():
            weight_map[name] = file
            total += t.numel() * t.element_size()
        del chunk
    if len(shards) > 1:
        _write_json(folder / INDEX_NAME, {"metadata": {"total_size": total},
                                          "weight_map": dict(sorted(weight_map.items()))})


def _write_hf_folder(dest: Path, tensors: list[tuple[str, torch.Tensor]], dtype: torch.dtype,
                     max_shard_size_bytes: int, config: dict[str, Any], tokenizer: Path | None) -> None:
    """Write weights, config.json and tokenizer.json into a temporary sibling of `dest`, then
    swap it into place, so a failed export leaves neither a half folder nor a lost old one."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    shards = _plan_shards(tensors, itemsize, max_shard_size_bytes)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.parent / f".{dest.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        _write_weights(tmp, tensors, shards, dtype)
        _write_json(tmp / CONFIG_NAME, config)
        if tokenizer is not None:
            shutil.copyfile(tokenizer, tmp / TOKENIZER_NAME)
        _swap_into_place(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
