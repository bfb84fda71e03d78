"""`shardline convert`: shardline checkpoints <-> HF Llama, Qwen2, Qwen3, Mixtral and Qwen3-MoE
folders (a Mistral or Phi-3 folder comes back as Llama: the same model; with a sliding window, as Mistral).

to-hf:   a checkpoint folder (or a run dir: its newest valid checkpoint) -> an HF
         folder that transformers loads, with the checkpoint's tokenizer files (see
         checkpoint_tokenizer) when present.
from-hf: an HF folder -> a weights-only shardline checkpoint, which a run starts from
         with --model.init_from=DST (a run may also read the HF folder directly
         with --model.hf_path) and tokenizes with the tokenizer copied beside it. The
         folder's dtype, special tokens and tokenizer files are kept for the way back.
"""

from __future__ import annotations

import gzip
import json
import os
import sys
import warnings
from pathlib import Path

import torch

from shardline.config import DTYPE_NAMES, saved_formats
from shardline.data.chat_template import chat_template_for
from shardline.data.encode import CHATML_TEMPLATE, reply_prompt, turn_end_text
from shardline.data.shards import id_bound, is_prepared, tokenizer_hash
from shardline.data.sources import shipped_corpus
from shardline.data.tokenizer import bos_prefix, eos_id, extends_file, load_tokenizer
from shardline.errors import CheckpointError, ConfigError, DataError, ShardlineError
from shardline.interop.hf import empty_model, from_hf_pretrained, to_hf_pretrained
from shardline.interop.hf_config import EXPORT_DTYPES, KEPT_FIELDS, hf_export_problem, read_hf_fields
from shardline.interop.hf_files import (
    GENERATION_NAME,
    TOKENIZER_NAME,
    check_parents,
    copy_side_files,
    copy_tokenizer_files,
    tokenizer_file,
)
from shardline.models.factory import args_from_json, args_to_json
from shardline.models.moe.layer import choices_the_bias_changes, moe_layers
from shardline.resilience.checkpoint import Checkpointer, load_weights, step_dir_name, verify, write_checkpoint


DIRECTIONS = ("to-hf", "from-hf")


def convert(direction: str, src: str, dst: str, dtype: str = "", tokenizer: str = "",
            drop_router_bias: bool = False) -> Path:
    """`to-hf`: a run dir's newest valid checkpoint (or a checkpoint folder) as a Hugging Face folder;
    `from-hf`: a Hugging Face folder as a checkpoint. Returns the folder written."""
    if direction not in DIRECTIONS:
        raise ConfigError(f"convert direction {direction!r} is invalid: one of {', '.join(DIRECTIONS)}")
    if direction == "to-hf":
        return checkpoint_to_hf(Path(src), Path(dst), dtype, tokenizer, drop_router_bias)
    return hf_to_checkpoint(Path(src), Path(dst))


def resolve_checkpoint(src: Path) -> Path:
    """A checkpoint folder as given, or the newest valid checkpoint of a run dir."""
    # A prepared data folder holds a manifest.json too ("malformed manifest" said nothing of what it was)
    if is_prepared(str(src)) and (src / "train").is_dir() and not (src / "meta.json").is_file():
        raise CheckpointError(f"{src} is a prepared data folder (shardline prepare), not a checkpoint: give a run dir "
                              "or a checkpoint folder (RUN/checkpoints/step-N)")
    if (src / "manifest.json").is_file():
        return src
    if not src.exists():
        raise CheckpointError(f"{src} does not exist: give a run dir or a checkpoint folder (RUN/checkpoints/step-N)")
    for _ in range(3):  # a run saving and pruning meanwhile: folders gone while looked at are no damage
        passed, gone = [], []  # newer ones that fail verification: named, as a resume names them
        latest = Checkpointer(src, keep=1).latest_valid(on_invalid=lambda path, e: (
            gone if not path.exists() else passed).append(f"{path.name}: {e}"))
        if not gone:
            break
    if latest is None and (src / "config.json").is_file():
        raise CheckpointError(f"{src} is a Hugging Face folder, not a checkpoint: `shardline convert from-hf {src} "
                              "DIR` makes one (or train from it with model.hf_path)")
    if latest is None and passed:
        raise CheckpointError(f"{src} holds no valid checkpoint ({'; '.join(passed)})")
    if latest is None:
        raise CheckpointError(f"{src} is neither a checkpoint folder nor a run dir holding a valid checkpoint")
    for problem in passed:
        print(f"shardline: passed over {problem}; using {latest.name}", file=sys.stderr)
    return latest


def best_checkpoint(run_dir: Path) -> Path:
    """The folder of a run dir's lowest eval loss (checkpoint.keep_best), as its newest valid checkpoint
    records it: what `--best` gives eval, convert to-hf and generate, a fine-tune's best point where the
    newest checkpoint is past it."""
    if (run_dir / "manifest.json").is_file():
        raise CheckpointError(f"--best takes a run dir, not a checkpoint folder ({run_dir}): drop it to use that one")
    newest = resolve_checkpoint(run_dir)
    try:
        step = int(torch.load(newest / "trainer" / "rank0.pt", weights_only=True).get("best_eval", [0, 0])[1])
    except Exception as e:  # (a checkpoint converted from HF holds no trainer state)
        raise CheckpointError(f"{newest} records no best checkpoint ({type(e).__name__}): --best needs a run's "
                              "checkpoints") from None
    if not step:
        raise CheckpointError(f"{run_dir} kept no best checkpoint: its run had checkpoint.keep_best off, or no "
                              f"evaluation saved one by {newest.name}; drop --best for the newest")
    best = newest.parent / step_dir_name(step)
    if not (best / "manifest.json").is_file():
        raise CheckpointError(f"the best checkpoint {best} (named by {newest.name}) is gone; drop --best for the "
                              "newest")
    return best


def checkpoint_to_hf(src: Path, dst: Path, dtype: str = "", tokenizer: str = "",
                     drop_router_bias: bool = False) -> Path:
    """dtype: the weights' dtype on disk; "" keeps the HF folder's a checkpoint came from
    (from-hf records it), else the checkpoint's own (float32). tokenizer: a tokenizer.json (or
    its folder) to export with, for a checkpoint moved away from its run dir; "" finds its own.
    drop_router_bias: export a mixture of experts whose routers learned a balancing bias."""
    explicit = _export_dtype(dtype)  # a wrong --dtype fails before the checkpoint is read
    given = tokenizer_file(tokenizer) if tokenizer else None  # and a wrong --tokenizer
    ckpt = resolve_checkpoint(src)  # a run dir's newest valid one: verified there; its files hashed once
    if ckpt == src:
        verify(ckpt)
    meta = json.loads((ckpt / "meta.json").read_text(encoding="utf-8"))
    hf = meta.get("hf", {})
    dtype = explicit or _export_dtype(hf.get("dtype", "")) or torch.float32
    args = args_from_json(meta["model_args"])
    if hf_export_problem(args):  # (said before the weights are read, and before the balancing bias's refusal)
        raise CheckpointError(f"{hf_export_problem(args)}; this model cannot be written as an HF folder")
    other = given_tokenizer(ckpt, given, args.vocab_size, "--tokenizer")[1] if given is not None else ""
    if other:  # (one past the model's rows: refused)
        warnings.warn(f"exported with it: {other}", stacklevel=2)
    model = empty_model(args, dtype)  # the checkpoint casts as it loads
    load_weights(ckpt, model, verified=True)
    tokenizer = given or checkpoint_tokenizer(ckpt)
    if not drop_router_bias:
        _refuse_router_bias(ckpt, model, tokenizer)
    bos, eos, doc_end = hf.get("bos_token_id"), hf.get("eos_token_id"), None
    if tokenizer is not None:  # a run's own tokenizer: its end-of-document token, and the one BOS it starts texts with
        tok = load_tokenizer(str(tokenizer), key="")
        _check_template(tokenizer)
        own_end = eos_id(tok, tokenizer)
        doc_end = own_end if meta.get("config") else None  # (a run's: what it put after each document)
        eos = own_end if eos is None else eos
        prefix = bos_prefix(tok)
        bos = prefix[0] if bos is None and len(prefix) == 1 else bos
    # A run that trained on chat data without a chat template rendered it as ChatML: its export says so, so
    # transformers' apply_chat_template renders what it learned.
    chat = "chat" in saved_formats(meta.get("config", {}).get("data", {})) and tokenizer is not None
    template = chat_template_for(str(tokenizer)) if chat else None
    chatml = chat and template is None
    turn_end = turn_end_text(CHATML_TEMPLATE if chatml else template) if chat else ""  # (a stop of the export's)
    return to_hf_pretrained(model, dst, tokenizer_path=tokenizer, dtype=dtype,
                            bos_token_id=bos, eos_token_id=eos,
                            provenance={"checkpoint": str(ckpt.resolve())},
                            # (a Qwen folder's size of a window it leaves off, use_sliding_window false, is
                            # written back as it was; elsewhere a window is the weights' own: Mixtral's applies)
                            kept_fields={key: hf[key] for key in KEPT_FIELDS if key in hf and not (
                                key == "sliding_window" and (args.sliding_window is not None or not (
                                    args.qkv_bias or args.qk_norm)))},
                            generation_config=beside_checkpoint(ckpt, GENERATION_NAME),
                            chat_template=CHATML_TEMPLATE if chatml else "",
                            turn_end=turn_end, doc_end=doc_end)


def _refuse_router_bias(ckpt: Path, model: torch.nn.Module, tokenizer: Path | None) -> None:
    """A mixture of experts that balanced its load with a routing bias (moe.bias_update_rate) routes
    otherwise without it, and HF's MoE models have none: the export is another model, which a
    warning alone let through. Refused, with the share of a sample's tokens whose experts change
    (none in the sample: exported, with that warning). Not measured in float16, whose CPU forward
    may overflow."""
    if not any(layer.moe.bias_update_rate and bool(layer.router.expert_bias.any()) for layer in moe_layers(model)):
        return  # (a bias the run stopped updating is not added to the scores: it routes as HF's does)
    why = "; give --drop-router-bias to export it so"
    if next(model.parameters()).dtype == torch.float16:
        raise CheckpointError(f"{ckpt}: its routers learned a balancing bias (moe.bias_update_rate), which HF's MoE "
                              f"models have no place for: without it some tokens choose other experts{why}")
    tokens, sample = _sample_tokens(model.args, tokenizer)
    shares = choices_the_bias_changes(model, tokens)
    worst = max(range(len(shares)), key=shares.__getitem__)
    if shares[worst]:
        raise CheckpointError(f"{ckpt}: its routers learned a balancing bias (moe.bias_update_rate), which HF's MoE "
                              f"models have no place for: without it, {shares[worst]:.1%} of {sample} choose other "
                              f"experts in layer {model.args.moe.first_dense_layers + worst} "
                              f"({sum(shares) / len(shares):.1%} over all {len(shares)} MoE layers){why}")


def _sample_tokens(args, tokenizer: Path | None, n: int = 256) -> tuple[torch.Tensor, str]:
    """([1, n] token ids, what they are): the shipped corpus's opening text in the run's tokenizer,
    else (no tokenizer) seeded random ids; n at most the model's context."""
    n = min(n, args.max_seq_len)
    if tokenizer is not None:
        with gzip.open(shipped_corpus(), "rt", encoding="utf-8") as f:
            text = " ".join(json.loads(line)["text"] for line, _ in zip(f, range(64)))
        ids = [i for i in load_tokenizer(str(tokenizer), key="").encode(text).ids if i < args.vocab_size][:n]
        if len(ids) == n:
            return torch.tensor([ids]), f"{n} tokens of the shipped corpus"
    return torch.randint(args.vocab_size, (1, n), generator=torch.Generator().manual_seed(0)), f"{n} random tokens"


def _check_template(tokenizer: Path) -> None:
    """A warning (the export goes on) when the chat template exported beside the tokenizer cannot
    render a conversation: transformers' apply_chat_template would fail on it the same way."""
    try:
        template = chat_template_for(str(tokenizer))
        if template is not None:
            reply_prompt([{"role": "user", "content": "Hi"}], template)
    except DataError as e:
        warnings.warn(f"exported as it is: {e}", stacklevel=2)


def checkpoint_tokenizer(ckpt: Path) -> Path | None:
    """The tokenizer.json a checkpoint's weights were trained with: one beside its files (from-hf
    copies the HF folder's there), else the one of the run that saved it
    (<run_dir>/checkpoints/step-N, or checkpoints/set-aside/step-N); None when neither is there."""
    return beside_checkpoint(ckpt, TOKENIZER_NAME)


def given_tokenizer(ckpt: Path, path: Path, rows: int, key: str):
    """(the tokenizer given in place of checkpoint `ckpt`'s own, loaded; why it is not that one, or
    ""). Refused where it holds more tokens than the model's `rows`: an id past them names no row
    (an export's forward failed in transformers, a prompt's in generate). "" where it is the
    checkpoint's own, one that extends it (added tokens), or where the checkpoint keeps none."""
    tok = load_tokenizer(str(path), key=key)
    if (ids := id_bound(tok)) > rows:
        raise DataError(f"{key}={path}: ids up to {ids - 1:,}, past the model's {rows:,} vocabulary rows (such an id "
                        f"names no row): give the tokenizer {ckpt} was trained with")
    own = checkpoint_tokenizer(ckpt)
    if own is None or not other_tokenizer(own, path):
        return tok, ""
    return tok, (f"{key}={path} is not the tokenizer {ckpt} was trained with ({own}): its ids may name other "
                 "rows than the weights learned")


def other_tokenizer(own: Path, given: Path) -> bool:
    """Whether tokenizer file `given` holds another tokenizer than `own` (compared as this
    `tokenizers` writes them: a copy saved again, in another layout, is the same one), and not one
    that extends it (tokens added after its own). False where either cannot be read."""
    try:
        same = own.resolve() == given.resolve() or tokenizer_hash(load_tokenizer(str(own))) == \
            tokenizer_hash(load_tokenizer(str(given)))
    except (OSError, ShardlineError):
        return False
    return not same and not extends_file(given, own)


def beside_checkpoint(ckpt: Path, name: str) -> Path | None:
    """The file `name` beside a checkpoint's files, else in the run dir that saved it; None when neither.
    The run dir is looked for along the path as given and as resolved: `<run>/checkpoints` may be a
    link to another disk, whose resolved path has no run dir above it."""
    paths = [Path(os.path.abspath(ckpt)), ckpt.resolve()]
    runs = [folder.parent for path in paths for folder in path.parents[:2] if folder.name == "checkpoints"]
    return next((t for t in [paths[1] / name, *(r / name for r in runs)] if t.is_file()), None)


def _export_dtype(name: str) -> torch.dtype | None:
    if not name:
        return None
    if DTYPE_NAMES.get(name, name) not in EXPORT_DTYPES:
        raise CheckpointError(f"dtype={name!r} is invalid: one of {', '.join(EXPORT_DTYPES)} (or fp32, bf16, fp16)")
    return getattr(torch, DTYPE_NAMES.get(name, name))


def _check_hf_tokenizer(path: Path) -> None:
    """An HF folder's tokenizer.json is read before its weights are converted: a damaged one (a download
    cut short, a cache link whose blob is gone) is said now, not at the first evaluation of a run."""
    try:
        if path.is_symlink() and not path.exists():
            raise DataError(f"the tokenizer {path} is a link to a file that is not there")
        if path.is_file():
            load_tokenizer(str(path), key="")
    except DataError as e:
        raise DataError(f"{e} (fetch it again, or move it out of {path.parent} to convert the weights alone: a run "
                        "from them then needs data.tokenizer)") from None


def hf_to_checkpoint(src: Path, dst: Path) -> Path:
    check_parents(dst)
    if dst.exists() and (not dst.is_dir() or any(dst.iterdir())):
        raise CheckpointError(f"{dst} exists and is not an empty folder; choose another destination")
    _check_hf_tokenizer(src / TOKENIZER_NAME)
    model, args = from_hf_pretrained(src)
    meta = {"model_args": args_to_json(args), "source": str(src.resolve()), "hf": read_hf_fields(src)}
    write_checkpoint(dst, 0, model, None, None, meta)
    if (src / TOKENIZER_NAME).is_file():  # what a run from it tokenizes with, and kept for the way back
        copy_tokenizer_files(src / TOKENIZER_NAME, dst)
    copy_side_files(src, dst, names=(GENERATION_NAME,))  # it describes the weights, tokenizer or not
    return dst
