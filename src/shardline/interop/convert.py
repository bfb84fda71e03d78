"""`shardline convert`: shardline checkpoints <-> HF Llama, Mixtral and Qwen3-MoE folders.

to-hf:   a checkpoint folder (or a run dir: its newest valid checkpoint) -> an HF
         folder that transformers loads, with the run's tokenizer.json when present.
from-hf: an HF folder -> a weights-only shardline checkpoint, which a run starts from
         with --model.init_from=DST (a run may also read the HF folder directly
         with --model.hf_path).
"""

from __future__ import annotations

from pathlib import Path

from shardline.errors import CheckpointError
from shardline.interop.hf import from_hf_pretrained, to_hf_pretrained
from shardline.models.factory import args_from_json, args_to_json, build_meta_model
from shardline.resilience.checkpoint import (
    Checkpointer,
    load_weights,
    read_meta,
    write_checkpoint,
)


def convert(direction: str, src: str, dst: str) -> Path:
    if direction == "to-hf":
        return checkpoint_to_hf(Path(src), Path(dst))
    return hf_to_checkpoint(Path(src), Path(dst))


def resolve_checkpoint(src: Path) -> Path:
    """A checkpoint folder as given, or the newest valid checkpoint of a run dir."""
    if (src / "manifest.json").is_file():
        return src
    latest = Checkpointer(src, keep=1).latest_valid()
    if latest is None:
        raise CheckpointError(f"{src} is neither a checkpoint folder nor a run dir holding a valid checkpoint")
    return latest


def checkpoint_to_hf(src: Path, dst: Path) -> Path:
    ckpt = resolve_checkpoint(src)
    model = build_meta_model(args_from_json(read_meta(ckpt)["model_args"]))
    model.init_weights()  # materialize; every weight is then overwritten by the checkpoint
    load_weights(ckpt, model)
    tokenizer = ckpt.parents[1] / "tokenizer.json"  # <run_dir>/checkpoints/step-N
    return to_hf_pretrained(model, dst, tokenizer_path=tokenizer if tokenizer.is_file() else None)


def hf_to_checkpoint(src: Path, dst: Path) -> Path:
    if dst.exists() and any(dst.iterdir()):
        raise CheckpointError(f"{dst} exists and is not empty; choose another destination")
    model, args = from_hf_pretrained(src)
    write_checkpoint(dst, 0, model, None, None, {"model_args": args_to_json(args), "source": str(src)})
    return dst
