"""`shardline generate`: text from a checkpoint, to read what a run has learned.

A look at a checkpoint, not a serving path: one process, one prompt, and the whole
sequence run again for every new token (no KV cache), which suits the short samples a
practitioner reads during training. The checkpoint may come from any layout (it holds
full tensors by name); its tokenizer is the one beside it or in the run dir that saved
it, as `convert to-hf` finds it.

The prompt is encoded as the data pipeline encodes a document (no special tokens
added) and is a document of its own, at positions from 0; a checkpoint converted from
an HF model that was pretrained with a BOS token samples better with `--bos`. The
context is the last `train.seq_len` tokens the run trained on. Generation stops at any
end token: the tokenizer's end-of-document token (what training put after each
document) and the HF folder's `eos_token_id`s (config and generation_config.json). A
mixture of experts runs dropless here whatever its `capacity_factor`: with capacity,
the newest token, last in each expert's queue, would be the one dropped. For a chat
run, pass the prompt rendered with its template. For serving, `convert to-hf` and an
inference engine.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from shardline.errors import CheckpointError, ConfigError

DTYPES = ("float32", "bfloat16")


@dataclass(frozen=True)
class SampleOptions:
    max_new_tokens: int = 64
    temperature: float = 0.8  # 0: greedy (the most likely token each time)
    top_k: int = 50  # sample among the k most likely tokens; 0: among all
    seed: int = 0

    def check(self) -> None:
        """A ConfigError naming the flag and its valid values."""
        if self.max_new_tokens < 1:
            raise ConfigError(f"--max-new-tokens={self.max_new_tokens} is invalid: must be >= 1")
        if not self.temperature >= 0:  # (NaN too)
            raise ConfigError(f"--temperature={self.temperature} is invalid: must be >= 0 (0 = greedy)")
        if self.top_k < 0:
            raise ConfigError(f"--top-k={self.top_k} is invalid: must be >= 0 (0 = all tokens)")


@dataclass
class Generator:
    """A checkpoint's model in eval mode, with what sampling needs from its run."""

    model: torch.nn.Module
    tokenizer: object
    stop: frozenset[int]  # end tokens
    context: int  # tokens the model sees: the run's train.seq_len
    device: torch.device
    bos: int | None = None  # prepended to a prompt with --bos

    def sample(self, prompt_ids: list[int], opts: SampleOptions) -> list[int]:
        """The new token ids after `prompt_ids` (without them), the end token included when one
        ends them. Seeded: the same options give the same tokens on the same device."""
        if not prompt_ids:
            raise ConfigError("--prompt encodes to no token: give some text")
        ids, new = list(prompt_ids), []
        draw = torch.Generator().manual_seed(opts.seed)  # on the host: the same draws on any device
        for _ in range(opts.max_new_tokens):
            window = torch.tensor([ids[-self.context:]], device=self.device)
            with torch.no_grad():
                logits = self.model(window)[0, -1].float().cpu()
            token = next_token(logits, opts, draw)
            ids.append(token)
            new.append(token)
            if token in self.stop:
                break
        return new

    def encode(self, prompt: str, bos: bool = False) -> list[int]:
        ids = self.tokenizer.encode(prompt, add_special_tokens=False).ids
        if bos:
            if self.bos is None:
                raise ConfigError("--bos: this checkpoint's tokenizer has no BOS token")
            ids = [self.bos, *ids]
        return ids

    def complete(self, prompt: str, opts: SampleOptions, bos: bool = False) -> str:
        """The text generated after `prompt` (end tokens left out). Decoded with the prompt and
        cut after it: decoded alone, a SentencePiece continuation loses its leading space."""
        prompt_ids = self.encode(prompt, bos)
        new = [t for t in self.sample(prompt_ids, opts) if t not in self.stop]
        head, whole = self.tokenizer.decode(prompt_ids), self.tokenizer.decode(prompt_ids + new)
        return whole[len(head):] if whole.startswith(head) else self.tokenizer.decode(new)


def next_token(logits: torch.Tensor, opts: SampleOptions, draw: torch.Generator) -> int:
    """One token from a vector of fp32 logits: the argmax at temperature 0, else a draw from the
    softmax of logits / temperature over the top_k most likely (all with top_k 0)."""
    if opts.temperature == 0:
        return int(logits.argmax())
    scaled = logits / opts.temperature
    if 0 < opts.top_k < scaled.numel():
        kth = torch.topk(scaled, opts.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    return int(torch.multinomial(torch.softmax(scaled, dim=-1), 1, generator=draw))


def load_generator(src: str | Path, device: str = "auto", dtype: str = "float32") -> Generator:
    """The newest valid checkpoint of a run dir (or a checkpoint folder), ready to sample;
    its files hashed once."""
    from shardline.data.tokenizer import eos_id, load_tokenizer
    from shardline.interop.convert import beside_checkpoint, checkpoint_tokenizer, resolve_checkpoint
    from shardline.interop.hf import empty_model
    from shardline.interop.hf_files import GENERATION_NAME
    from shardline.models.factory import args_from_json
    from shardline.resilience.checkpoint import load_weights, verify

    if dtype not in DTYPES:
        raise ConfigError(f"--dtype={dtype!r} is invalid: one of {', '.join(DTYPES)}")
    dev = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device=cuda: no CUDA device here; use --device=cpu or auto")
    ckpt = resolve_checkpoint(Path(src))  # a run dir's newest valid one: verified there
    if ckpt == Path(src):
        verify(ckpt)
    meta = json.loads((ckpt / "meta.json").read_text())
    tok_path = checkpoint_tokenizer(ckpt)
    if tok_path is None:
        raise CheckpointError(f"{ckpt}: no tokenizer.json beside it or in the run dir that saved it; copy the "
                              "run's tokenizer.json into the checkpoint folder")
    tokenizer = load_tokenizer(str(tok_path))
    args = args_from_json(meta["model_args"])
    if args.moe is not None:  # dropless (module doc); the weights do not depend on it
        args = dataclasses.replace(args, moe=dataclasses.replace(args.moe, capacity_factor=0.0))
    model = empty_model(args, getattr(torch, dtype), dev)
    load_weights(ckpt, model, verified=True)
    hf = meta.get("hf", {})
    generation = beside_checkpoint(ckpt, GENERATION_NAME)
    stop = _ids(eos_id(tokenizer), hf.get("eos_token_id"),
                json.loads(generation.read_text()).get("eos_token_id") if generation else None)
    seq_len = meta.get("config", {}).get("train", {}).get("seq_len") or args.max_seq_len
    return Generator(model.eval(), tokenizer, frozenset(stop), int(seq_len), dev, hf.get("bos_token_id"))


def _ids(*found) -> set[int]:
    """The token ids among ints, lists of ints and Nones."""
    out = set()
    for x in found:
        out.update(x if isinstance(x, list) else [] if x is None else [x])
    return out


def generate(src: str | Path, prompt: str, opts: SampleOptions, device: str = "auto", as_json: bool = False,
             dtype: str = "float32", bos: bool = False) -> str:
    """`shardline generate`'s output: the prompt and its continuation, or one JSON object."""
    opts.check()
    gen = load_generator(src, device, dtype)
    text = gen.complete(prompt, opts, bos)
    if as_json:
        return json.dumps({"prompt": prompt, "completion": text, **vars(opts), "stop_ids": sorted(gen.stop)})
    return prompt + text


def register(sub) -> None:
    """The `generate` subcommand (cli.py's feature commands)."""
    p = sub.add_parser("generate", help="sample text from a checkpoint (or a run dir's newest) to read what it learned",
                       epilog="one process, no KV cache: a look at a checkpoint; for serving, convert to-hf")
    p.add_argument("src", help="a run dir (its newest valid checkpoint) or a checkpoint folder")
    p.add_argument("--prompt", default="The", help="the text to continue (default 'The')")
    p.add_argument("--max-new-tokens", type=int, default=SampleOptions.max_new_tokens,
                   help=f"tokens to add at most (default {SampleOptions.max_new_tokens}; an end token stops sooner)")
    p.add_argument("--temperature", type=float, default=SampleOptions.temperature,
                   help=f"softmax temperature (default {SampleOptions.temperature}; 0 = greedy)")
    p.add_argument("--top-k", type=int, default=SampleOptions.top_k,
                   help=f"sample among the k most likely tokens (default {SampleOptions.top_k}; 0 = all)")
    p.add_argument("--seed", type=int, default=0, help="the sampling seed (default 0)")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"], help="default: cuda if present")
    p.add_argument("--dtype", default="float32", help=f"the weights' dtype in memory, one of {', '.join(DTYPES)} "
                                                      "(default float32; bfloat16 halves the memory)")
    p.add_argument("--bos", action="store_true", help="start the prompt with the BOS token of an HF model's "
                                                       "tokenizer (for a checkpoint pretrained with one)")
    p.add_argument("--json", action="store_true", help="print one JSON object: prompt, completion, options")
    p.set_defaults(func=_command)


def _command(args, overrides: list[str]) -> int:
    if overrides:
        raise ConfigError(f"generate takes no config overrides, got {' '.join(overrides)}")
    opts = SampleOptions(args.max_new_tokens, args.temperature, args.top_k, args.seed)
    print(generate(args.src, args.prompt, opts, args.device, args.json, args.dtype, args.bos))
    return 0
