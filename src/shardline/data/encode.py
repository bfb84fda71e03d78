"""Documents to token ids: plain text, or chat conversations with an assistant-only loss mask.

One function (`encode_documents`) serves the raw-text path at start-up and the worker
processes of `shardline prepare`, which is what makes both give the same tokens.

Chat rendering: a conversation is a list of {"role", "content"} messages. When the
tokenizer's folder has a chat template (chat_template.jinja, or tokenizer_config.json's
`chat_template`), that template renders it; otherwise the documented default, ChatML:

    <|im_start|>{role}\\n{content}<|im_end|>\\n        (for every message)

Each message becomes segments of the rendering, which is tokenized whole (as the model's own
chat pipeline does); a token is a loss target when its first character that is not whitespace
lies in a target segment. Under ChatML an assistant's content and end marker are targets (its
header is not), all others are not. With a template, segment i is all that message i adds to
the rendering of the messages before it (a template that renders earlier turns otherwise once
later ones follow, as Qwen3's does with reasoning, is cut from the whole rendering instead:
_whole_segments). An assistant's segment is a target but for its header: what the template's
generation prompt (`add_generation_prompt`, the text a chat model is given to start a reply)
adds to the messages before it, when the reply's rendering starts with it; when the prompt adds
more than the reply shows (an opened reasoning block, say), the lines both begin with. A
template without a generation prompt gives no header to take out, so its whole assistant
segment is a target. Templates render as transformers renders them (chat_template.py).
"""

from __future__ import annotations

import difflib
import os
from itertools import chain

import numpy as np
from tokenizers import Tokenizer

from shardline.data.chat_template import ChatTemplate, as_template, opening, render_template
from shardline.errors import DataError

CHAT_START, CHAT_END = "<|im_start|>", "<|im_end|>"
# The same rendering as a chat template, for an HF export of a run that chatted in ChatML.
CHATML_TEMPLATE = ("{% for message in messages %}{{ '" + CHAT_START + "' + message['role'] + '\\n' + "
                   "message['content'] + '" + CHAT_END + "' + '\\n' }}{% endfor %}{% if add_generation_prompt %}"
                   "{{ '" + CHAT_START + "assistant\\n' }}{% endif %}")
# Which tokens of a conversation are targets changed with this number (2: a reply's header
# under a template is not one; 3: a message's fields beyond role and content, such as
# tool_calls, reach the template; 4: a conversation is tokenized whole, not segment by segment):
# `shardline prepare` starts a chat folder over when it differs. (Cutting replies from the whole
# rendering of a template that rewrites earlier turns, Qwen3's, took conversations refused before: no new number.)
CHAT_MASK_RULE = 4


def encode_documents(tok: Tokenizer, docs: list, eos: int | None, chat_template: ChatTemplate | str | None = None,
                     chat: bool = False, bos: list[int] = ()) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """(tokens, lengths, mask or None) of `docs` concatenated, each followed by eos when there is one
    (unless it ends with eos already, as a template that writes {{ eos_token }} after a reply makes it)
    and each text document preceded by `bos` (tokenizer.bos_prefix; a chat template writes its own).

    Documents that encode to nothing are dropped (they would hold no token to train on).
    Mask rules: a document's first token is never a target (nothing precedes it in its
    document); the eos after a reply is one when the reply's last token is.
    """
    if chat:
        segments = [chat_segments(messages, chat_template) for messages in docs]
        texts = ["".join(text for text, _ in s) for s in segments]
        encoded = _encode_batch(tok, texts, offsets=True)
        ids = [e.ids for e in encoded]
        masks = [_segment_mask(text, e.offsets, s) for text, e, s in zip(texts, encoded, segments)]
    else:
        ids, masks = [with_bos(e.ids, bos) for e in _encode_batch(tok, docs)], None
    keep = [i for i, x in enumerate(ids) if x]
    closed = {i for i in keep if eos is not None and ids[i][-1] != eos}
    lengths = np.array([len(ids[i]) + (i in closed) for i in keep], dtype=np.int64)
    total = int(lengths.sum())
    tokens = np.fromiter(chain.from_iterable(_closed(ids, keep, lambda i: (eos,) if i in closed else ())),
                         np.int64, total)
    if masks is None:
        return tokens, lengths, None
    close = lambda i: (masks[i][-1],) if i in closed else ()  # noqa: E731
    mask = np.fromiter(chain.from_iterable(_closed(masks, keep, close)), np.uint8, total)
    mask[np.cumsum(lengths) - lengths] = 0
    return tokens, lengths, mask


def with_bos(ids: list[int], bos: list[int]) -> list[int]:
    """`ids` after the BOS tokens, unless they start with them already (text written with its
    special tokens) or are empty (a document that encodes to nothing stays nothing)."""
    return ids if not ids or ids[:len(bos)] == list(bos) else [*bos, *ids]


def _closed(rows: list, keep: list[int], close):
    """The kept rows, each followed by what `close(i)` gives (its eos, or nothing)."""
    for i in keep:
        yield rows[i]
        yield close(i)


def _encode_batch(tok: Tokenizer, texts: list[str], offsets: bool = False) -> list:
    """encode_batch, without character offsets unless asked (the same ids, less work). A tokenizer
    that cannot encode the text (a closed vocabulary without an unknown token) is one line."""
    fast = None if offsets else getattr(tok, "encode_batch_fast", None)  # tokenizers >= 0.20
    try:
        return fast(texts, add_special_tokens=False) if fast else tok.encode_batch(texts, add_special_tokens=False)
    except Exception as e:  # tokenizers raises a bare Exception
        raise DataError(f"the tokenizer cannot encode this data: {e} (a vocabulary without an unknown token "
                        "takes only text made of its own tokens)") from None


def note_roles(roles: dict[str, str], messages: list[dict]) -> None:
    """Add the roles of one conversation to `roles`, each with the opening words of its first message
    (where an error about it points, in data of millions: a conversation's first message is often
    the same system prompt in all of them)."""
    for m in messages:
        if m["role"] not in roles:
            roles[m["role"]] = opening([m])
    if not any(m["role"] == "assistant" for m in messages):  # another dataset's reply role in its place?
        for m in messages:
            if m["role"].lower() in OTHER_REPLY_ROLES and m["role"] + REPLYLESS not in roles:
                roles[m["role"] + REPLYLESS] = opening([m])


def roles_of(conversations) -> dict[str, str]:
    roles: dict[str, str] = {}
    for messages in conversations:
        note_roles(roles, messages)
    return roles


OTHER_REPLY_ROLES = ("gpt", "model", "bot", "chatbot")  # ShareGPT's, Gemini's and others' name for "assistant"
REPLYLESS = "\0 with no assistant"  # note_roles' key for such a role in a conversation with no 'assistant' message


def check_replies(where: str, roles: dict[str, str]) -> None:
    """Chat data trains on the replies, the messages of role "assistant": data with none of them
    (ShareGPT's "gpt", Gemini's "model") would train on nothing, every loss 0. `roles`: note_roles'."""
    found = ", ".join(sorted(r for r in roles if REPLYLESS not in r)) or "none"
    if "assistant" not in roles:
        raise DataError(f"{where} has no message of role 'assistant' (the replies the loss is on); roles found: "
                        f"{found}; rename the reply role to 'assistant'")
    # A role a letter or two off "assistant" ("assitant", "Assistant") is a typo: those replies would
    # train on nothing, in silence. (Other roles render as context whatever their spelling, and
    # "assistant_1" or "assistantB" name agents: left as they are.)
    # Another dataset's reply role (ShareGPT's "gpt", Gemini's "model") in conversations with no 'assistant'
    # beside ones that have it (a merged subset) is the same silence, for those conversations alone; beside
    # 'assistant' in one conversation it may be context (a third party): taken as it is.
    # Another dataset's name for the user's turns ("human", as ShareGPT's `from` has it) where no message
    # is 'user's: the template renders it as written, and `generate --chat` prompts as 'user' (train and use differ).
    other_user = [r for r in roles if REPLYLESS not in r and r.lower() in ("human", "user", "usr")]
    if "user" not in roles and other_user:
        raise DataError(f"{where} has messages of role {other_user[0]!r}, the first {roles[other_user[0]]}, and none "
                        f"of role 'user', the name chat templates and `generate --chat` give the user's turns (roles "
                        f"found: {found}); rename those messages' role to 'user'")
    for role in sorted(r for r in roles if r != "assistant" and REPLYLESS not in r):
        typo = not role.startswith("assistant") and difflib.get_close_matches(role.lower(), ["assistant"], cutoff=0.8)
        if typo or role + REPLYLESS in roles:
            raise DataError(f"{where} has messages of role {role!r}, the first "
                            + (f"{roles[role]}: a typo of 'assistant'?" if typo else
                               f"{roles[role + REPLYLESS]}, in conversations with no 'assistant': another dataset's "
                               "reply role?")
                            + f" Their replies would train on nothing (roles found: {found}); fix those messages' role")


def trained(message: dict) -> bool:
    """Whether a message's text is a target: an assistant's reply, unless its `weight` is 0 (axolotl's key;
    a prompt/completion pair's earlier replies, conversation.pair_messages), which leaves it as context."""
    return message["role"] == "assistant" and message.get("weight", 1) != 0


def chat_segments(messages: list[dict], template: ChatTemplate | str | None = None) -> list[tuple[str, bool]]:
    """(text, is_target) pieces of one conversation, in order."""
    template = as_template(template)
    if template and template.source:
        return _template_segments(messages, template)
    out = []
    for m in messages:
        if m.get("tool_calls"):
            raise DataError(f"chat data with tool_calls (a conversation {opening(messages)}) needs a chat template "
                            "that renders them (ChatML, used without one beside data.tokenizer, has no way to): set "
                            "data.tokenizer to a tokenizer.json whose folder has one (model.hf_path's is taken by "
                            "default)")
        out.append((f"{CHAT_START}{m['role']}\n", False))
        out.append((f"{m['content']}{CHAT_END}\n", trained(m)))
    return out


def render_chat(messages: list[dict], template: ChatTemplate | str | None = None) -> str:
    """The whole conversation as text (what a trained BPE learns from)."""
    return "".join(text for text, _ in chat_segments(messages, template))


def reply_prompt(messages: list[dict], template: ChatTemplate | str | None = None) -> str:
    """The conversation as text followed by the header of the assistant's reply: what a chat
    model trained on such renderings is given to write that reply (the template's generation
    prompt; under ChatML, the assistant's opening line)."""
    template = as_template(template)
    if template and template.source:
        return render_template(template, messages, generation_prompt=True)
    return render_chat(messages) + f"{CHAT_START}assistant\n"


def encode_reply_prompt(tok: Tokenizer, messages: list[dict], template: ChatTemplate | str | None = None) -> list[int]:
    """reply_prompt's ids, tokenized whole as chat training tokenizes a conversation (encode_chat)."""
    return tok.encode(reply_prompt(messages, template), add_special_tokens=False).ids


_REPLY_PROBE = "\u2063shardline-reply\u2063"  # a reply no template rewrites


def turn_end_text(template: ChatTemplate | str | None = None) -> str:
    """What the rendering puts right after every assistant reply, blanks stripped: the end of its
    turn as the model learned to write it (Llama 3's <|eot_id|>, ChatML's <|im_end|>), which a
    base model's eos (<|end_of_text|>) is not. A template may write more after the last reply
    than after one another message follows (Phi-3: "<|end|>\n<|endoftext|>" against
    "<|end|>\n<|user|>..."): then only what the two begin with, cut after its last blank or
    marker close (">"). "" when the template writes nothing there or cannot render such a
    conversation."""
    template = as_template(template)
    last = _after_reply(template, [])
    if not last:
        return ""
    more = _after_reply(template, [{"role": "user", "content": "hi"}])
    if more and not more.startswith(last):
        common = os.path.commonprefix([last, more])
        cut = max((i for i, c in enumerate(common) if c == ">" or c.isspace()), default=-1)
        last = common[: cut + 1]
    return last.strip()


def _after_reply(template: ChatTemplate | None, then: list[dict]) -> str:
    """The rendered text after an assistant's reply when the messages `then` follow it; "" if the
    template cannot render that conversation."""
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": _REPLY_PROBE}, *then]
    try:
        text = render_template(template, messages) if template and template.source else render_chat(messages)
    except DataError:
        return ""
    return text.split(_REPLY_PROBE, 1)[1] if _REPLY_PROBE in text else ""


def encode_chat(tok: Tokenizer, messages: list[dict],
                template: ChatTemplate | str | None = None) -> tuple[list[int], list[int]]:
    """Token ids of a conversation and its loss mask (1 on assistant tokens): the rendering is
    tokenized whole, as a chat model's own pipeline tokenizes it (apply_chat_template), and a
    token is a target when it starts, whitespace aside, in an assistant's segment. Tokenized
    segment by segment, a SentencePiece tokenizer (Llama 2, Mistral) began every segment with its own
    "▁", a space the model never saw there, and pieces could not merge across a boundary."""
    segments = chat_segments(messages, template)
    text = "".join(piece for piece, _ in segments)
    encoded = tok.encode(text, add_special_tokens=False)
    return encoded.ids, _segment_mask(text, encoded.offsets, segments)


def _segment_mask(text: str, offsets: list[tuple[int, int]], segments: list[tuple[str, bool]]) -> list[int]:
    """1 for each token (its character `offsets` in `text`, the joined segments) whose first
    character that is not whitespace lies in a target segment: a SentencePiece "▁It" holds the
    space a template wrote before a reply and is the reply's first word (left out, it would never
    be learnt), while a header token that takes in the whitespace after it (an added token with
    rstrip, Phi-3's <|assistant|>) is still the header's. A whitespace token goes by its first
    character, one whose offsets a post-processor trimmed to nothing by the character before."""
    if not offsets:
        return []
    at = [start + len(span) - len(span.lstrip()) if (span := text[start:end]).strip()
          else start if end > start else max(start - 1, 0) for start, end in offsets]
    ends = np.cumsum([len(piece) for piece, _ in segments])
    targets = np.array([target for _, target in segments], dtype=np.int64)
    segment = np.minimum(np.searchsorted(ends, np.array(at), side="right"), len(segments) - 1)
    return targets[segment].tolist()


def _template_segments(messages: list[dict], template: ChatTemplate) -> list[tuple[str, bool]]:
    """(text, is_target) pieces of one conversation by rendering each prefix of it. A template may
    close a whole conversation with its eos token (and blanks after it), which more messages
    replace (Phi-3's): that closing is taken off a prefix's last piece when the next message's
    rendering goes on before it, so it ends the last piece only (a reply's there: the model learns
    to end the conversation)."""
    out, before = [], ""
    for i, m in enumerate(messages):
        text = render_template(template, messages[: i + 1])
        eos, body = template.eos_token or "", out[-1][0].rstrip() if out else ""
        closing = out[-1][0][len(body) - len(eos):] if eos and body.endswith(eos) else ""
        if closing and not text.startswith(before) and text.startswith(before[:-len(closing)]):
            before, out[-1] = before[:-len(closing)], (out[-1][0][:-len(closing)], out[-1][1])
        if not text.startswith(before):  # earlier turns rendered otherwise once this one follows (Qwen3's)
            return _whole_segments(messages, template, i)
        if m["role"] == "assistant":
            header = _reply_header(template, messages[:i], before, text)
            if header:
                out.append((header, False))
                before += header
        out.append((text[len(before):], trained(m)))
        before = text
    return out


def _whole_segments(messages: list[dict], template: ChatTemplate, changed: int) -> list[tuple[str, bool]]:
    """(text, is_target) pieces cut from the whole conversation's rendering, for a template that
    renders earlier turns otherwise once later ones follow (Qwen3's drops an earlier reply's
    reasoning block) from message `changed` on. That rendering is what the model sees at inference
    as long as each reply's prompt (the messages before it, with the generation prompt) begins it:
    a reply's target starts where its prompt ends (the whole lines they share, as _reply_header
    takes them) and runs through the template's turn end (turn_end_text), or to the end of the
    conversation for a last reply. Refused in one line where the messages before a reply or its
    prompt are not where the whole rendering starts (no target may reach into earlier messages),
    or the template writes no turn end to find a reply's by. (A reply whose own text holds the
    turn end is cut there.)"""
    whole, mark, out, at = render_template(template, messages), turn_end_text(template), [], 0
    for i, m in enumerate(messages):
        if not trained(m):
            continue
        try:  # the messages before it as the whole rendering has them, then its prompt
            before = render_template(template, messages[:i])
            prompt = render_template(template, messages[:i], generation_prompt=True)
        except DataError:
            before = prompt = ""
        shared = prompt if whole.startswith(prompt) else os.path.commonprefix([prompt, whole])
        start = len(shared) if shared == prompt else shared.rfind("\n") + 1
        end = len(whole) if i == len(messages) - 1 else whole.find(mark, start) if mark else -1
        if not prompt or not whole.startswith(before) or start < len(before) or start <= at or end < 0:
            raise DataError(f"the tokenizer's chat_template renders the first {changed} messages of a conversation "
                            f"{opening(messages)} differently once message {changed + 1} follows, and its reply "
                            f"(message {i + 1}) is not found in the whole rendering by its prompt and turn end; use a "
                            "template that only appends, or one whose prompts begin its renderings")
        if i < len(messages) - 1:  # the turn end and the blanks after it, as a reply's own piece holds them
            end += len(mark)
            while end < len(whole) and whole[end].isspace():
                end += 1
        out += [(whole[at:start], False), (whole[start:end], True)]
        at = end
    return [piece for piece in [*out, (whole[at:], False)] if piece[0]]


def _reply_header(template: ChatTemplate, earlier: list[dict], before: str, text: str) -> str:
    """The assistant header of the reply rendered as `text` after `before` (the rendering of
    `earlier`): what the model is given at inference, so it must not learn to write it.

    That is what the generation prompt adds after `before` when the reply begins with it;
    when the prompt adds more (e.g. an opened reasoning block the reply does not show), the
    whole lines both begin with (never a cut inside a line, which could split a special
    token). Empty when the template has no such prompt, shares no whole line with the reply,
    or fails on these messages (a template may refuse an empty conversation): then the whole
    reply segment stays a target."""
    try:
        prompt = render_template(template, earlier, generation_prompt=True)
    except DataError:
        return ""
    if not prompt.startswith(before):
        return ""
    added, reply = prompt[len(before):], text[len(before):]
    if reply.startswith(added):
        return added
    shared = os.path.commonprefix([added, reply])
    return shared[: shared.rfind("\n") + 1]
