"""The files of a Hugging Face model folder: finding and opening its safetensors weights,
and writing a whole folder atomically. Knows file names and formats, not models: mapping
tensors to a shardline model's parameters is hf.py's job.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import uuid
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from shardline.data.tokenizer import TOKENIZER_SIDE_FILES, side_file_held
from shardline.errors import CheckpointError, DataError
from shardline.interop.hf_config import CONFIG_NAME, _load_json

WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
TOKENIZER_NAME = "tokenizer.json"
# The files beside a tokenizer.json that travel with it: its settings and chat template (without
# them transformers loads a bare tokenizer: no special tokens, no template) and the generation
# settings. from-hf copies them into the checkpoint, a run into its run dir, to-hf into the export.
GENERATION_NAME = "generation_config.json"
SIDE_FILES = (*TOKENIZER_SIDE_FILES, GENERATION_NAME)
# Written into every export: a folder holding it may be replaced by the next export; another HF
# folder (the one a run started from, say) is refused, since replacing it would delete its other files.
EXPORT_MARK = "shardline_export.json"
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


def check_parents(dest: Path) -> None:
    """Every existing folder above `dest` is a folder (a file there fails the write midway)."""
    for parent in Path(os.path.abspath(dest)).parents:
        if parent.exists():
            if not parent.is_dir():
                raise CheckpointError(f"{dest} cannot be written: {parent} is a file, not a folder")
            return


def _check_destination(dest: Path) -> None:
    check_parents(dest)
    here = Path.cwd()
    if dest.resolve() in (here, *here.parents):
        raise CheckpointError(f"{dest} is the current folder or holds it; export to a folder of its own")
    if not dest.exists():
        return
    if not dest.is_dir():
        raise CheckpointError(f"{dest} exists and is not a folder; choose another destination")
    if not any(dest.iterdir()):
        return
    if (dest / EXPORT_MARK).is_file():
        other = next((p.name for p in sorted(dest.iterdir()) if p.is_dir() or not _export_file(p.name)), None)
        if other is None:
            return
        raise CheckpointError(f"{dest} is an earlier export but also holds {other}, which no export writes; replacing "
                              "the export would delete it: move it out first, or choose another destination")
    if _is_hf_folder(dest):
        raise CheckpointError(f"{dest} is a Hugging Face model folder without {EXPORT_MARK} (not marked as an "
                              "export: maybe the folder a run started from, or an export by a shardline from before "
                              "2026-12-03, which wrote no mark); replacing it would delete its other files: choose "
                              "another destination, or delete it first")
    raise CheckpointError(f"{dest} exists, is not empty and is not a Hugging Face model folder; "
                          "refusing to overwrite it (choose another destination or empty it)")


def _export_file(name: str) -> bool:
    """A file an export writes (and the next export may replace)."""
    return (name in (WEIGHTS_NAME, INDEX_NAME, CONFIG_NAME, TOKENIZER_NAME, EXPORT_MARK, *SIDE_FILES)
            or re.fullmatch(r"model-\d{5}-of-\d{5}\.safetensors", name) is not None)


def copy_tokenizer_files(tokenizer: Path, folder: Path) -> None:
    """The tokenizer.json `tokenizer` and the side files beside it into `folder`."""
    shutil.copyfile(tokenizer, folder / TOKENIZER_NAME)
    copy_side_files(tokenizer.parent, folder)


def copy_side_files(source: Path, folder: Path, names: tuple[str, ...] = SIDE_FILES) -> None:
    """The side files `names` (default: all of SIDE_FILES) that `source` holds into `folder`.
    GENERATION_NAME alone: the generation settings of the weights there (their end tokens,
    sampling defaults), which go with the weights whichever tokenizer travels with them."""
    for name in names:
        if side_file_held(source, name) and (source / name).resolve() != (folder / name).resolve():
            shutil.copyfile(source / name, folder / name)


def tokenizer_file(tokenizer_path: str | os.PathLike) -> Path:
    file = Path(tokenizer_path)
    if file.is_dir():
        file = file / TOKENIZER_NAME
    if not file.is_file():
        raise DataError(f"tokenizer file {file} does not exist")
    return file


def _write_tokenizer_settings(folder: Path, tokenizer: Path, config: dict[str, Any], chat_template: str) -> None:
    """tokenizer_config.json for a tokenizer that came without one (the BPE a run trained): its
    bos and eos tokens by name, which transformers' tokenizer otherwise lacks (eos_token None,
    no special tokens). A run that learned ChatML ends a reply with <|im_end|>: that is the eos
    transformers stops a chat at, there and in generation_config.json (HF's chat models' way)."""
    from tokenizers import Tokenizer

    from shardline.data.encode import CHAT_END

    try:
        tok = Tokenizer.from_file(str(tokenizer))
    except Exception:  # (tokenizers raises a bare Exception) what the export copies, the user's to fix: no settings
        return
    named = {key: tok.id_to_token(config[f"{key}_id"]) for key in ("bos_token", "eos_token")
             if isinstance(config.get(f"{key}_id"), int) and tok.id_to_token(config[f"{key}_id"]) is not None}
    if chat_template and tok.token_to_id(CHAT_END) is not None:
        named["eos_token"] = CHAT_END
    _write_json(folder / "tokenizer_config.json", {"tokenizer_class": "PreTrainedTokenizerFast", **named})


def _stop_where_the_run_did(folder: Path, tokenizer: Path, config: dict[str, Any], turn_end: str,
                            doc_end: int | None) -> None:
    """generation_config.json (the one the export carries, or a new one) stops transformers' generate
    where `shardline generate` stops: at a chat run's turn end (ChatML's <|im_end|>, Llama 3's <|eot_id|>)
    where it is one token, and at the end-of-document token the run put after each document where HF's
    eos is another (a tokenizer holding <|end_of_text|> whose eos_token is <|im_end|>); else generate on the
    export ran on past what the run learned to end with."""
    from tokenizers import Tokenizer

    ends = {doc_end} if doc_end is not None else set()
    if turn_end:
        try:
            end = Tokenizer.from_file(str(tokenizer)).token_to_id(turn_end)
        except Exception:  # (tokenizers raises a bare Exception) the copied file is the user's to fix
            end = None
        ends |= {end} if end is not None else set()  # (none: the marker is pieces of text in this vocabulary)
    path = folder / GENERATION_NAME
    try:
        generation = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    except ValueError:
        generation = {}
    generation = generation if isinstance(generation, dict) else {}
    if ends <= _token_ids(generation.get("eos_token_id") if generation else config.get("eos_token_id")):
        return  # it stops there already (a turn end that is the eos: Llama 2's </s>): no file to write
    ends |= _token_ids(generation.get("eos_token_id")) | _token_ids(config.get("eos_token_id"))
    _write_json(path, {**generation, "eos_token_id": sorted(ends)})


def _token_ids(found) -> set[int]:
    """An eos_token_id as HF writes it (an id, a list of them, or none) as a set."""
    if isinstance(found, int):
        return {found}
    return {i for i in found if isinstance(i, int)} if isinstance(found, list) else set()


def _add_chat_template(settings_path: Path, template: str) -> None:
    """tokenizer_config.json (the tokenizer's, copied, or a new one) with `template` as its chat_template."""
    try:
        settings = json.loads(settings_path.read_text(encoding="utf-8")) if settings_path.is_file() else {}
    except ValueError:
        settings = {}
    _write_json(settings_path, {**(settings if isinstance(settings, dict) else {}), "chat_template": template})


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
    old = dest.parent / f".shardline-old-{os.getpid()}-{uuid.uuid4().hex[:8]}"
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
        for name, source in (tensors[j] for j in shard):  # as cast: past float16's range became inf (in a tmp folder)
            if chunk[name].is_floating_point() and not bool(torch.isfinite(chunk[name]).all()):
                past = dtype == torch.float16 and bool(torch.isfinite(source).all())
                raise CheckpointError(f"{name} is not finite as {str(dtype).removeprefix('torch.')}: " + (
                    "its values pass float16's range (65504); export with --dtype bfloat16 or float32" if past else
                    "the weights themselves hold NaN or inf (a diverged run: export an earlier checkpoint)"))
        try:
            save_file(chunk, str(folder / file), metadata={"format": "pt"})
        except Exception as e:  # safetensors reports the OS's refusal (a full disk) as its own error: "(os error 28)"
            code = re.search(r"\(os error (\d+)\)", str(e))
            if isinstance(e, OSError) or code is None:
                raise
            raise OSError(int(code.group(1)), f"{os.strerror(int(code.group(1)))}: writing {folder / file}") from e
        os.chmod(folder / file, _file_mode())  # safetensors writes owner-only; exports are shared
        for name, t in chunk.items():
            weight_map[name] = file
            total += t.numel() * t.element_size()
        del chunk
    if len(shards) > 1:
        _write_json(folder / INDEX_NAME, {"metadata": {"total_size": total},
                                          "weight_map": dict(sorted(weight_map.items()))})


def _write_hf_folder(dest: Path, tensors: list[tuple[str, torch.Tensor]], dtype: torch.dtype,
                     max_shard_size_bytes: int, config: dict[str, Any], side: dict[str, Path | None],
                     provenance: dict[str, Any]) -> None:
    """Write weights, config.json, the side files (`side`: the tokenizer.json whose files come
    along, a generation_config.json; None where absent) and the export mark (with
    `provenance`) into a temporary sibling of `dest`, then swap it into place, so a failed
    export leaves neither a half folder nor a lost old one."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    shards = _plan_shards(tensors, itemsize, max_shard_size_bytes)
    dest = dest.resolve() if dest.is_symlink() else dest  # a link to the folder: its target is replaced, not it
    made = [p for p in (dest.parent, *dest.parent.parents) if not p.exists()]  # (a failed export removes them too)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.parent / f".shardline-export-{os.getpid()}-{uuid.uuid4().hex[:8]}"  # (no longer than a name allows)
    tmp.mkdir()
    try:
        _write_weights(tmp, tensors, shards, dtype)
        _write_json(tmp / CONFIG_NAME, config)
        if side.get("tokenizer") is not None:
            copy_tokenizer_files(side["tokenizer"], tmp)
            if not (tmp / "tokenizer_config.json").is_file():  # a tokenizer of our own: no settings came with it
                _write_tokenizer_settings(tmp, side["tokenizer"], config, side.get("chat_template", ""))
        if side.get("generation_config") is not None:
            copy_side_files(side["generation_config"].parent, tmp, names=(GENERATION_NAME,))
        if side.get("chat_template"):
            _add_chat_template(tmp / "tokenizer_config.json", side["chat_template"])
        if side.get("tokenizer") is not None:
            _stop_where_the_run_did(tmp, side["tokenizer"], config, side.get("turn_end") or "", side.get("doc_end"))
        _write_json(tmp / EXPORT_MARK, {"written_by": "shardline", **provenance})
        _swap_into_place(tmp, dest)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        for folder in made:  # (innermost first; one not empty, another's since, stays)
            with contextlib.suppress(OSError):
                folder.rmdir()
        if isinstance(e, OSError) and not e.filename and "writing" not in str(e):  # (a write names no file)
            raise OSError(e.errno, f"{e.strerror or e}: writing the export into {dest}") from e
        raise
