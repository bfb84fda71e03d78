"""`shardline generate`: text from a checkpoint, to read what a run has learned.

A look at a checkpoint, not a serving path: one process, one prompt. Each block keeps the keys and values of the
tokens run so far (KVCache), so a new token runs through the model alone. The checkpoint may come from any
layout (it holds full tensors by name); its tokenizer is the one beside it or in the run dir that saved it, as
`convert to-hf` finds it.

The prompt is encoded as the data pipeline encodes a document and is a document of its own, at positions from 0:
after the tokenizer's BOS tokens when the run trained with them (data.add_bos for text; for chat data, where the
chat template writes them at each conversation's start), and for a checkpoint converted from an HF model, which
has no run config to say so, as HF's tokenizer starts a text; `--bos` adds them to any other. With `--chat` the
prompt is a user's message instead (after `--system`'s, if given), rendered as chat training renders a
conversation (the chat template beside the tokenizer, else ChatML) and followed by the header of the assistant's
reply; the reply ends at the end of its turn. The context is the last `train.seq_len` tokens the run trained on
(`--context` sets another, up to the model's recorded maximum: a fine-tune of a long-context model at short
sequences still has the base model's reach); past it the window slides, and each token runs the whole window
again (its positions start at 0, as in training, so the cached keys no longer fit). Generation stops at any end
token: the tokenizer's end-of-document token (what training put after each document) and the HF folder's
`eos_token_id`s (config and generation_config.json). A mixture of experts runs dropless here whatever its
`capacity_factor`: with capacity, the newest token, last in each expert's queue, would be the one dropped.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from shardline.data.chat_template import ChatTemplate, chat_template_for
from shardline.data.encode import CHAT_END, encode_reply_prompt, reply_prompt, turn_end_text, with_bos
from shardline.config import DTYPE_NAMES, saved_formats
from shardline.errors import CheckpointError, ConfigError, DataError
from shardline.models.llama.kv_cache import KVCache
from shardline.models.sampling import SampleOptions, check_options, next_token

DTYPES = ("float32", "bfloat16")


@dataclass
class Generator:
    """A checkpoint's model in eval mode, with what sampling needs from its run."""

    model: torch.nn.Module
    tokenizer: object
    stop: frozenset[int]  # end tokens
    context: int  # tokens the model sees: the run's train.seq_len, or --context
    device: torch.device
    bos: list[int] = dataclasses.field(default_factory=list)  # prepended to a prompt with --bos
    trained_bos: bool = False  # the run put `bos` before each text document: a prompt starts with it too
    template: ChatTemplate | None = None  # --chat's rendering; None: ChatML
    template_error: str = ""  # why the template beside the tokenizer cannot render: --chat alone fails on it
    checkpoint: str = ""  # the folder sampled (a run dir's newest valid one)
    run_format: str = ""  # the run's data.format ("text", "chat"; "mixed": a mixture of both); "": not known (from HF)
    prompt_tokens: int = 0  # the last prompt's, as the model was given it
    document_end: int | None = None  # the end of text a text run put between documents: one starts after it

    def sample(self, prompt_ids: list[int], opts: SampleOptions, stop: frozenset[int] | None = None,
               stop_text: str = "") -> list[int]:
        """The new token ids after `prompt_ids` (without them), the end token included when one
        ends them; also ended once their text holds `stop_text` (an end marker that is no single
        token). Seeded: the same options give the same tokens on the same device."""
        if not prompt_ids:
            raise ConfigError("--prompt encodes to no token: give some text" + (
                " (or --bos, to start from the BOS token)" if self.bos else " (this model has no BOS token to start "
                                                                            "from)"))
        stop = self.stop if stop is None else stop
        rows = self.model.tok_embeddings.num_embeddings
        past = [t for t in prompt_ids if t >= rows]  # (an IndexError; a device assert on CUDA)
        if past:
            raise CheckpointError(f"the prompt holds token id {past[0]}, past the model's {rows} embedding rows: "
                                  "that tokenizer is not its model's (--tokenizer names the one it trained with)")
        ids, new = list(prompt_ids), []
        draw = torch.Generator().manual_seed(opts.seed)  # on the host: the same draws on any device
        # Ids past the tokenizer's are rows a vocabulary padded for speed (Qwen's 151,936 for
        # ~151,665 tokens): drawn, they would decode to nothing.
        no_token = min(max(self.tokenizer.get_vocab().values()) + 1, rows)
        with torch.no_grad(), KVCache(self.model, self.device, self.model.args.sliding_window) as cache:
            for _ in range(opts.max_new_tokens):
                if len(ids) > self.context:  # the window slides: its positions start at 0 again
                    cache.clear()
                logits = cache.next_logits(ids[-self.context:]).float().cpu()
                token = next_token(logits.index_fill_(0, torch.arange(no_token, len(logits)), float("-inf")),
                                   opts, draw)
                ids.append(token)
                new.append(token)
                if token in stop or (stop_text and stop_text in self.tokenizer.decode(new)):
                    break
        return new

    def encode(self, prompt: str, bos: bool = False) -> list[int]:
        """The prompt's ids as training saw a document's: after the BOS tokens when the run
        trained with them or `bos` asks for them."""
        try:
            ids = self.tokenizer.encode(prompt, add_special_tokens=False).ids
        except Exception as e:  # tokenizers raises a bare Exception (a vocabulary without an unknown token)
            _check_utf8(prompt)
            raise DataError(f"the tokenizer cannot encode the prompt: {e}") from None
        if bos and not self.bos:
            raise ConfigError("--bos: this checkpoint's tokenizer has no BOS token")
        if not ids and (bos or self.trained_bos):  # an empty prompt: sampled from the start of a document
            return list(self.bos)
        if not ids and self.document_end is not None:  # (no BOS: a document starts after another's end)
            return [self.document_end]
        return with_bos(ids, self.bos) if bos or self.trained_bos else ids

    def chat_prompt(self, prompt: str, system: str | None = None) -> str:
        """The user's message `prompt` (after the system's, if any) as chat training renders a
        conversation, then the header of the assistant's reply."""
        self._check_template()
        return reply_prompt(_messages(prompt, system), self.template)

    def _check_template(self) -> None:
        if self.template_error:
            raise DataError(self.template_error)

    def chat_ids(self, prompt: str, system: str | None = None) -> list[int]:
        """chat_prompt's ids, encoded a message at a time as chat training encodes them."""
        self._check_template()
        _check_utf8(prompt, system or "")
        return encode_reply_prompt(self.tokenizer, _messages(prompt, system), self.template)

    def turn_end(self) -> tuple[frozenset[int], str]:
        """What ends a chat reply besides the end tokens: the end of an assistant's turn in the
        template's rendering (else ChatML's <|im_end|>), as a token when it is one, else as
        text; and the template's eos token."""
        marker = turn_end_text(self.template)
        ends = {self.tokenizer.token_to_id(t) for t in (marker, self.template.eos_token if self.template else "") if t}
        stop = self.stop | (ends - {None})
        return stop, marker if marker and self.tokenizer.token_to_id(marker) is None else ""

    def complete(self, prompt: str, opts: SampleOptions | None = None, bos: bool = False, chat: bool = False,
                 system: str | None = None) -> str:
        """The text generated after `prompt` (end tokens and markers left out; `opts` None: the defaults).
        Decoded with the prompt and cut after it: decoded alone, a SentencePiece continuation loses its
        leading space."""
        opts = SampleOptions() if opts is None else opts
        if not isinstance(opts, SampleOptions) or not isinstance(prompt, str):
            raise ConfigError(f"complete(prompt, opts) takes a string and a SampleOptions (SampleOptions(**a_dict) "
                              f"from a dict), not {type(prompt).__name__} and {type(opts).__name__}")
        check_chat_flags(bos, chat, system)
        prompt_ids = self.chat_ids(prompt, system) if chat else self.encode(prompt, bos)
        self.prompt_tokens = len(prompt_ids)
        if chat and self.run_format == "text":
            say(f"{self.checkpoint} was trained on text, not conversations: its replies follow the chat template "
                "only as far as that text taught it")
        if not chat and self.run_format == "chat":  # (and HF's tokenizer on the export starts a text with any BOS)
            bare = " with no BOS (--bos adds it, as HF's tokenizer does)" * bool(bare_of_bos(self, bos))
            say(f"{self.checkpoint} was trained on conversations: the prompt is plain text{bare}; --chat renders it "
                "as a user's message")
        if len(prompt_ids) > self.context:
            say(f"the prompt is {len(prompt_ids):,} tokens and the model sees the last {self.context:,} "
                "(--context sets that, up to the model's max_seq_len)")
        stop, stop_text = self.turn_end() if chat else (self.stop, "")
        drawn = self.sample(prompt_ids, opts, stop, stop_text)
        if len(prompt_ids) <= self.context < len(prompt_ids) + len(drawn) - 1:  # (the last token was seen by none)
            say(f"the text grew past the context of {self.context:,} tokens after "
                f"{self.context - len(prompt_ids) + 1:,} new ones: from there the model saw the last {self.context:,} "
                "(a model without that limit, such as the HF export's, continues otherwise; --context sets it, up to "
                "the model's max_seq_len)")
        text = self._decoded(prompt_ids, new := [t for t in drawn if t not in stop])
        if stop_text and stop_text in text:
            return text.split(stop_text)[0]
        return self._without_cut_character(prompt_ids, new, text)

    def _decoded(self, prompt_ids: list[int], new: list[int]) -> str:
        """`new`'s text, decoded with the prompt and cut after it (alone, SentencePiece drops a leading space)."""
        head, whole = self.tokenizer.decode(prompt_ids), self.tokenizer.decode(prompt_ids + new)
        return whole[len(head):] if whole.startswith(head) else self.tokenizer.decode(new)

    def _without_cut_character(self, prompt_ids: list[int], new: list[int], text: str) -> str:
        """`text` less the U+FFFD it ends with where that is a character the tokens stop inside (a
        byte-level BPE writes one in up to 4 byte tokens, and the length limit may fall in it): a
        U+FFFD that a shorter decode has not. Said where left out."""
        if not text.endswith("\ufffd"):
            return text
        if any(not self._decoded(prompt_ids, new[:-cut]).endswith("\ufffd") for cut in range(1, min(len(new), 4) + 1)):
            say("the text ends inside a character (its last bytes were not written): left out")
            return text.rstrip("\ufffd")
        return text


def bare_of_bos(gen: Generator, bos: bool) -> bool:
    """Whether a plain prompt goes in without the BOS its tokenizer puts before a text (HF's does)."""
    from shardline.data.tokenizer import bos_prefix

    return not bos and not gen.trained_bos and bool(bos_prefix(gen.tokenizer))


def _check_utf8(*texts: str) -> None:
    """A prompt (or system message) with bytes argv could not decode, kept as lone surrogates: one line,
    where tokenizers raised "TextInputSequence must be str"."""
    if any(t.encode("utf-8", "replace").decode() != t for t in texts):
        raise DataError("the prompt is not UTF-8 text (a terminal or file in another encoding?): give it as UTF-8")


def _messages(prompt: str, system: str | None = None) -> list[dict]:
    head = [] if system is None else [{"role": "system", "content": system}]  # "": one (no template default)
    return [*head, {"role": "user", "content": prompt}]


def check_chat_flags(bos: bool, chat: bool, system: str | None) -> None:
    """A ConfigError for flags that do not go together."""
    if chat and bos:
        raise ConfigError("--bos with --chat: the chat template writes the start of the conversation itself")
    if system and not chat:  # ("": nothing to put anywhere)
        raise ConfigError("--system needs --chat: a plain prompt is continued as a document")


def load_generator(src: str | Path, device: str = "auto", dtype: str = "float32", context: int = 0,
                   tokenizer: str = "") -> Generator:
    """The newest valid checkpoint of a run dir (or a checkpoint folder), ready to sample;
    its files hashed once. `context` (0: the run's train.seq_len): the tokens the model sees;
    `tokenizer` (a tokenizer.json or its folder; "": the one beside it or in its run dir)."""
    from shardline.data.tokenizer import bos_prefix, eos_id, load_tokenizer
    from shardline.interop.convert import beside_checkpoint, checkpoint_tokenizer, given_tokenizer, resolve_checkpoint
    from shardline.interop.hf import empty_model
    from shardline.interop.hf_files import GENERATION_NAME, tokenizer_file
    from shardline.models.factory import args_from_json
    from shardline.resilience.checkpoint import load_weights, verify

    if DTYPE_NAMES.get(dtype, dtype) not in DTYPES:
        raise ConfigError(f"dtype={dtype!r} is invalid: one of {', '.join(DTYPES)}")
    if context < 0:
        raise ConfigError(f"context={context} is invalid: a number of tokens, or 0 for the run's train.seq_len")
    if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", device):
        raise ConfigError(f"device={device!r} is invalid: auto, cpu, cuda or cuda:N")
    dev = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device)
    if dev.type == "cuda" and (dev.index or 0) >= torch.cuda.device_count():
        raise ConfigError(f"device={device}: no such CUDA device here ({torch.cuda.device_count()}); use "
                          "device=cpu or auto")
    ckpt = resolve_checkpoint(Path(src))  # a run dir's newest valid one: verified there
    if ckpt == Path(src):
        verify(ckpt)
    meta = json.loads((ckpt / "meta.json").read_text(encoding="utf-8"))
    tok_path = tokenizer_file(tokenizer) if tokenizer else checkpoint_tokenizer(ckpt)
    if tok_path is None:
        raise CheckpointError(f"{ckpt}: no tokenizer.json beside it or in the run dir that saved it; give "
                              "--tokenizer (the run's tokenizer.json), or copy it into the checkpoint folder")
    args = args_from_json(meta["model_args"])
    tokenizer, other = (given_tokenizer(ckpt, tok_path, args.vocab_size, "--tokenizer") if tokenizer  # (refused
                        else (load_tokenizer(str(tok_path), key=""), ""))  # past the model's rows; another: said)
    say(other and f"note: {other}")
    if args.moe is not None:  # dropless (module doc); the weights do not depend on it
        args = dataclasses.replace(args, moe=dataclasses.replace(args.moe, capacity_factor=0.0))
    model = empty_model(args, getattr(torch, DTYPE_NAMES.get(dtype, dtype)), dev)
    load_weights(ckpt, model, verified=True)
    hf = meta.get("hf", {})
    generation = beside_checkpoint(ckpt, GENERATION_NAME)
    stop = _ids(eos_id(tokenizer, tok_path), hf.get("eos_token_id"),
                _generation_eos(generation) if generation else None)
    run = meta.get("config", {})  # the run's config; none in a checkpoint converted from HF
    if context > args.max_seq_len:
        raise ConfigError(f"context={context} is past this model's maximum of {args.max_seq_len} positions "
                          "(what it was trained and scaled for): give at most that")
    seq_len = context or run.get("train", {}).get("seq_len") or args.max_seq_len
    bos = bos_prefix(tokenizer) or sorted(_ids(hf.get("bos_token_id")))  # what --bos puts first
    data = run.get("data", {})
    formats = saved_formats(data)  # each source's ("text", "chat"); [] for weights converted from HF
    run_format = "mixed" if len(set(formats)) > 1 else formats[0] if formats else ""
    # A run's own setting; weights converted from HF (no run) were pretrained as their tokenizer starts a text
    trained_bos = bool(bos_prefix(tokenizer)) and (data.get("add_bos", False) and "text" in formats
                                                   if run else True)
    try:
        template, problem = chat_template_for(str(tok_path)), ""
    except DataError as e:  # (a plain prompt needs no template)
        template, problem = None, str(e)
    own = checkpoint_tokenizer(ckpt) if "chat" in formats else None  # (another one given: its template said)
    _say_other_template(own if own and Path(own).resolve() != Path(tok_path).resolve() else None, template)
    chat_only = bool(formats) and "text" not in formats
    if chat_only and template is not None and bos_prefix(tokenizer):  # the template wrote the
        try:  # BOS each conversation starts with (one that cannot render this: --chat says so, a plain prompt not)
            head = encode_reply_prompt(tokenizer, _messages("x", ""), template)
            trained_bos = head[:len(bos_prefix(tokenizer))] == bos_prefix(tokenizer)
        except DataError:
            pass
    return Generator(model.eval(), tokenizer, frozenset(stop), int(seq_len), dev, bos, trained_bos, template, problem,
                     str(ckpt), run_format, document_end=eos_id(tokenizer, tok_path) if "text" in formats else None)


def _say_other_template(own, given) -> None:
    """--tokenizer, on a chat run, with a chat template other than the one it trained with (`own`: the
    run's tokenizer.json; falsy: nothing to compare): --chat renders what the run never saw."""
    try:
        theirs = chat_template_for(str(own)) if own else given
    except DataError:
        return
    if _renders(theirs) != _renders(given):
        say(f"--tokenizer's chat template is not the one the run trained with ({'ChatML' if theirs is None else own}'s)"
            ": --chat renders conversations as the run never saw them")


def _renders(template) -> tuple | None:
    """What a template renders by: its source, and the bos/eos tokens it writes (only where it names them)."""
    if template is None:
        return None
    return (template.source, template.bos_token * ("bos_token" in template.source),
            template.eos_token * ("eos_token" in template.source))


def say(line: str) -> None:
    """A note on stderr, apart from the text on stdout ("": none)."""
    if line:
        print(f"shardline: {line}", file=sys.stderr)


def _generation_eos(path: Path):
    """generation_config.json's eos_token_id (an int, a list or None), or its one-line error."""
    try:
        settings = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path} cannot be read as JSON ({type(e).__name__}); fix or remove it") from None
    if not isinstance(settings, dict):
        raise CheckpointError(f"{path} does not hold a JSON object; fix or remove it")
    return settings.get("eos_token_id")


def _ids(*found) -> set[int]:
    """The token ids among ints, lists of ints and Nones."""
    out = set()
    for x in found:
        out.update(x if isinstance(x, list) else [] if x is None else [x])
    return out


def generate(src: str | Path, prompt: str, opts: SampleOptions, device: str = "auto", as_json: bool = False,
             dtype: str = "float32", bos: bool = False, chat: bool = False, system: str | None = None, context: int = 0,
             tokenizer: str = "") -> str:
    """`shardline generate`'s output: the prompt and its continuation (with --chat, the reply
    alone), or one JSON object (with --chat, the rendered prompt the model was given too)."""
    check_chat_flags(bos, chat, system)  # before the weights are read
    gen = load_generator(src, device, dtype, context, tokenizer)
    text = gen.complete(prompt, opts, bos, chat, system)
    if Path(gen.checkpoint) != Path(src):  # a run dir: which of its checkpoints spoke
        say(f"sampled {gen.checkpoint}")
    if not text.strip():  # (a blank line alone reads as a failure to run)
        split = chat and gen.template is None and gen.tokenizer.token_to_id(CHAT_END) is None  # (ChatML in pieces)
        say("the model's " + ("reply" if chat else "continuation") + " is blank: it ended at once, or wrote only "
            "whitespace or tokens that decode to nothing (common after little training" + (
                f"; and ChatML's {CHAT_END} is no token of this vocabulary: the model learned turn ends in pieces, "
                "and may take a reply's header for one" if split else "") + ")")
    if as_json:
        stop, stop_text = gen.turn_end() if chat else (gen.stop, "")
        shown = {"chat_prompt": gen.chat_prompt(prompt, system), "stop_text": stop_text} if chat else {}
        return json.dumps({"prompt": prompt, **shown, "completion": text, **vars(opts), "stop_ids": sorted(stop),
                           "checkpoint": gen.checkpoint, "prompt_tokens": gen.prompt_tokens, "context": gen.context})
    return text if chat else prompt + text


def register(sub) -> None:
    """The `generate` subcommand (cli.py's feature commands)."""
    p = sub.add_parser("generate", epilog="one process, one prompt: a look at a checkpoint; for serving, convert to-hf")
    p.add_argument("src", type=os.path.expanduser,
                   help="a run dir (its newest valid checkpoint) or a checkpoint folder")
    p.add_argument("--prompt", default="The", help="the text to continue (default 'The'); with --chat, the user's "
                                                   "message")
    p.add_argument("--max-new-tokens", type=int, default=SampleOptions.max_new_tokens,
                   help=f"tokens to add at most (default {SampleOptions.max_new_tokens}; an end token stops sooner)")
    p.add_argument("--temperature", type=float, default=SampleOptions.temperature,
                   help=f"softmax temperature (default {SampleOptions.temperature}; 0 = greedy)")
    p.add_argument("--top-k", type=int, default=SampleOptions.top_k,
                   help=f"sample among the k most likely tokens (default {SampleOptions.top_k}; 0 = all)")
    p.add_argument("--top-p", type=float, default=SampleOptions.top_p,
                   help="then among the fewest likeliest whose probabilities sum to p (default 1 = all)")
    p.add_argument("--seed", type=int, default=0, help="the sampling seed (default 0)")
    p.add_argument("--chat", action="store_true", help="the prompt is a user's message: rendered with the chat "
                                                       "template beside the tokenizer (else ChatML), the reply printed")
    p.add_argument("--system", help="with --chat, a system message before the user's (\"\": an empty one)")
    p.add_argument("--device", default="auto", help="auto (cuda if present), cpu, cuda or cuda:N")
    p.add_argument("--dtype", default="float32", help=f"the weights' dtype in memory, one of {', '.join(DTYPES)} "
                                                      "(or bf16; default float32; bfloat16 halves the memory)")
    p.add_argument("--bos", action="store_true", help="start the prompt with the tokenizer's BOS token(s) (it has "
                                                       "them already where the run trained with them, or from HF)")
    p.add_argument("--context", type=int, default=0, help="tokens the model sees at most (default: the run's "
                                                           "train.seq_len; up to the model's max_seq_len)")
    p.add_argument("--tokenizer", type=os.path.expanduser, default="",
                   help="the tokenizer.json (or its folder) the checkpoint was trained with (default: the one "
                        "beside it, else its run dir's)")
    p.add_argument("--best", action="store_true", help="a run dir's checkpoint of the lowest eval loss "
                                                       "(checkpoint.keep_best), not its newest")
    p.add_argument("--json", action="store_true", help="print one JSON object: prompt, completion, options")
    p.set_defaults(func=_command)


def _command(args, overrides: list[str]) -> int:
    if overrides:
        raise ConfigError(f"generate takes no config overrides, got {' '.join(overrides)}")
    values = {name: getattr(args, name) for name in ("max_new_tokens", "temperature", "top_k", "top_p", "seed")}
    check_options(values, flags=True)  # (said as the flags the user typed)
    from shardline.interop.convert import best_checkpoint
    src = best_checkpoint(Path(args.src)) if args.best else args.src
    say(f"sampling {src}, the best checkpoint" if args.best else "")  # (a folder given is not named: this one is)
    print(generate(src, args.prompt, SampleOptions(**values), args.device, args.json, args.dtype, args.bos, args.chat,
                   args.system, args.context, args.tokenizer), flush=True)
    return 0
