"""Checks of chat data as a run opens it: replies inside its sequences, one chat template for the
data and the run, and a dry run's rendering of raw conversations (data/loader.py calls them)."""

from __future__ import annotations

import os
from pathlib import Path


from shardline.config import Config
from shardline.data.chat_template import chat_template_for, template_sha256
from shardline.data.encode import chat_segments, check_replies, render_chat, reply_prompt, roles_of
from shardline.data.packing import PackedSequences
from shardline.data.sampler import eval_sequences
from shardline.data.shards import TOKENIZER, is_prepared, read_manifest, tokenizer_file
from shardline.errors import DataError


REPLY_SAMPLE = 256  # chat sequences a start looks at for replies (rows come shuffled: a fair sample)


def without_replies(seqs: PackedSequences) -> float:
    """The share of a sample of chat sequences that hold no reply token to learn (worked out once)."""
    if seqs.without_replies is None:
        n = min(len(seqs), REPLY_SAMPLE)
        seqs.without_replies = sum(seqs.count_labels([i]) == 0 for i in range(n)) / n if n else 0.0
    return seqs.without_replies


def check_replies_fit(sources: list[tuple[str, PackedSequences]], val, cfg: Config) -> None:
    """Chat: the sequences hold reply tokens to learn. A train.seq_len shorter than the prompts cuts
    every conversation before its reply: the run would learn nothing (weight decay alone moving the
    weights), and an evaluation of no targets would log a loss of 0. Refused where no source's
    sample holds a reply, or the held-out sequences an evaluation reads hold none."""
    chat = [(where or "data.path", p) for where, p in sources if p.rows is not None]
    t = cfg.train
    if not chat:
        return
    if all(without_replies(p) == 1 for _, p in chat):
        cut, total = sum(p.rows.truncated for _, p in chat), sum(p.num_documents for _, p in chat)
        why = (f"{cut:,} of its {total:,} training conversations are longer than a sequence, each cut before its "
               "reply; raise train.seq_len" if cut else "none is cut: the chat template marks no reply; check it")
        looked = sum(min(len(p), REPLY_SAMPLE) for _, p in chat)
        raise DataError(f"{', '.join(w for w, _ in chat)}: none of {looked} sequences of train.seq_len={t.seq_len} "
                        f"holds a reply token to learn ({why})")
    if t.eval_interval and len(val):
        read = eval_sequences(val, t.eval_batches * t.global_batch_size)
        if val.count_labels(read) == 0:
            raise DataError(f"{', '.join(w for w, _ in chat)}: the held-out sequences an evaluation reads hold no "
                            f"reply token at train.seq_len={t.seq_len} (their conversations are cut before it), so "
                            "it would log a loss of 0; raise train.seq_len, or set train.eval_interval=0")


def check_folder_template(path: str, manifest: dict, tokenizer_path: str) -> None:
    """A prepared chat folder was rendered with one template; a run writes, exports and generates
    with the one beside the tokenizer it takes (data.tokenizer, or its starting weights'): they must
    render alike. Another file that renders the same (a ChatML folder fine-tuned from its own HF
    export, whose tokenizer_config.json spells ChatML out) passes."""
    recorded = _recorded(path, manifest)
    if not tokenizer_path or recorded is None:  # (prepared before templates were recorded: not known)
        return
    given = chat_template_for(tokenizer_path)
    if _alike(recorded, given):
        return
    folder_tokenizer = os.path.join(path, TOKENIZER)
    raise DataError(f"{path} was rendered with {_named(recorded)}, but the tokenizer this run takes "
                    f"({tokenizer_path}) carries {_named(given)}, which renders otherwise: the run would train on the "
                    "folder's rendering and write, export and generate with the other; prepare it again with "
                    f"--overwrite --tokenizer {tokenizer_path}, or set data.tokenizer={folder_tokenizer}")


def check_one_chat_template(cfg: Config) -> None:
    """Every chat source of a mixture rendered with one template (alike, as check_folder_template
    tells), the one beside the run's tokenizer too (tokenizer_file: data.tokenizer, else the first
    prepared folder's, a text folder's maybe), which the run copies, exports and generates with. A
    raw source is rendered with that one (ChatML without one); a prepared folder was, with its own."""
    run_tokenizer = tokenizer_file(cfg.data)
    used = {f"{run_tokenizer} (the run's tokenizer)": chat_template_for(run_tokenizer)} if run_tokenizer else {}
    for source in (s for s, fmt in zip(cfg.data.mix, cfg.data.formats()) if fmt == "chat"):
        if is_prepared(source.path):
            recorded = _recorded(source.path, read_manifest(Path(source.path)))
            if recorded is not None:
                used[source.path] = recorded
        else:
            used[source.path] = chat_template_for(run_tokenizer)
    first = next(iter(used.values()), None)
    if any(not _alike(first, other) for other in used.values()):
        raise DataError("data.mix renders its chat sources with different templates ("
                        + "; ".join(f"{p}: {_named(t)}" for p, t in used.items())
                        + "): the run would train on one rendering and export and generate with another; set "
                        "data.tokenizer to the tokenizer.json whose template the chat sources should render with (the "
                        "run's is data.tokenizer, else the first prepared folder's), and prepare every chat source "
                        "with it")


def rendering(cfg: Config) -> str:
    """The chat template a chat run renders with (and exports and generates with), in words: its hash
    and file, or ChatML; the `data` event says it, so a run's log tells what it trained on."""
    template = chat_template_for(tokenizer_file(cfg.data))
    return f"{_named(template)} ({template.where})" if template else _named(template)


class _Recorded:
    """A prepared folder's chat template as its manifest recorded it: the template itself where the
    file kept beside the folder's tokenizer is that one, else its hash alone."""

    def __init__(self, sha: str | None, template):
        self.sha, self.template = sha, template


def _recorded(path: str, manifest: dict) -> _Recorded | None:
    chat = manifest.get("request", {}).get("chat") if manifest.get("format") == "chat" else None
    if not isinstance(chat, dict):
        return None
    own = chat_template_for(os.path.join(path, TOKENIZER))  # (prepare keeps the template beside its tokenizer)
    sha = chat.get("template_sha256")
    return _Recorded(sha, own if template_sha256(own) == sha else _UNKNOWN)


_UNKNOWN = object()  # a folder whose template file is gone or was changed since: known by its hash only


def _alike(a, b) -> bool:
    """Whether two templates (a folder's `_Recorded`, or a template, None: ChatML) render alike: the
    same hash, or the same text of every PROBES conversation and its reply prompt."""
    sha = [x.sha if isinstance(x, _Recorded) else template_sha256(x) for x in (a, b)]
    if sha[0] == sha[1]:
        return True
    a, b = (x.template if isinstance(x, _Recorded) else x for x in (a, b))
    return _UNKNOWN not in (a, b) and _renders_alike(a, b)


def _named(template) -> str:
    sha = template.sha if isinstance(template, _Recorded) else template_sha256(template)
    return f"chat template {sha[:12]}" if sha else "ChatML (no chat template)"


# Conversations two templates render, to tell whether their files mean the same: with and without a
# system prompt (a template may add a default one), one turn and two, contents with spaces and newlines.
PROBES = [
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi?"},
     {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye?"},
     {"role": "assistant", "content": "Goodbye."}],
    [{"role": "user", "content": " What is 2 + 2?\n"}, {"role": "assistant", "content": "\n4 \n"}],
]


def _renders_alike(a, b) -> bool:
    """Whether templates a and b (None: ChatML) render every probe alike, and its reply prompt; a probe
    both refuse (a template that takes no system prompt) tells nothing, one refused by one of them
    tells they differ, and at least one must render."""
    rendered = 0
    for probe in PROBES:
        sides = []
        for template in (a, b):
            try:
                sides.append((render_chat(probe, template), reply_prompt(probe[:-1], template)))
            except DataError:
                sides.append(None)
        if sides[0] != sides[1]:
            return False
        rendered += sides[0] is not None
    return rendered > 0


DRY_RUN_RENDERS = 100  # conversations a dry run renders: a template that fails on most fails on the first


def chat_checked(where: str, conversations: list, tokenizer: str) -> str:
    """A dry run's look at raw chat data as a launch would take it: the reply role is there, and the
    first conversations render with the template the run would use; in words, which one."""
    check_replies(where, roles_of(conversations))
    template = chat_template_for(tokenizer)
    for messages in conversations[:DRY_RUN_RENDERS]:
        chat_segments(messages, template)
    named = f"the chat template of {template.where}" if template else "ChatML (no chat template beside the tokenizer)"
    tried = "each" if len(conversations) <= DRY_RUN_RENDERS else f"the first {DRY_RUN_RENDERS}"
    return f"conversations (rendered with {named}; this dry run rendered {tried})"
