"""A chat record's conversation as the chat path reads it: `{"messages": [{"role", "content"}, ...]}`,
or ShareGPT's layout, `{"conversations": [{"from", "value"}, ...]}`, read as the same messages
(human -> user, gpt -> assistant; any other `from` is kept as the role, where the reply checks
judge it), or a prompt/completion pair (OpenAI's and TRL's layout: `{"prompt", "completion"}`, two
strings read as a user turn and the assistant's reply, or two lists of messages, TRL's conversational
pairs, read one after the other, the prompt's replies given weight 0), so the loss is on the
completion. A message's `weight` of 0 leaves a reply out of the loss (encode.trained). A record that
is none of these is a DataError naming the line."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from shardline.errors import DataError

CHAT_FIELD = "messages"  # what data.format = "chat" reads from each record
SHAREGPT_FIELD = "conversations"  # ShareGPT's name for it, each message {"from", "value"}
SHAREGPT_ROLES = {"human": "user", "gpt": "assistant"}  # ("system" is the same name in both)
PAIR_FIELDS = ("prompt", "completion")  # a prompt/completion record's, read as a conversation


def record_messages(obj) -> object:
    """The record's messages (a JSON object's): ShareGPT's `conversations` where it has no `messages`, a
    prompt/completion pair's (pair_messages) where it has neither."""
    if not isinstance(obj, dict):
        return None
    if obj.get(CHAT_FIELD) is None and obj.get(SHAREGPT_FIELD) is None and all(k in obj for k in PAIR_FIELDS):
        return pair_messages(obj["prompt"], obj["completion"])  # (a merged set's null messages: its pair)
    return obj.get(CHAT_FIELD) if CHAT_FIELD in obj or SHAREGPT_FIELD not in obj else obj[SHAREGPT_FIELD]


def pair_messages(prompt, completion) -> object:
    """A prompt/completion pair as messages: two strings as a user turn and the assistant's reply, two lists
    of messages (TRL's conversational pairs) one after the other, the prompt's replies marked weight 0 (not
    trained: the loss is on the completion alone, as TRL's); None for anything else (the record's error
    then names what it holds)."""
    if isinstance(prompt, str) and isinstance(completion, str):
        return [{"role": "user", "content": prompt}, {"role": "assistant", "content": completion}]
    if isinstance(prompt, list) and isinstance(completion, list):  # (the prompt's replies are context: weight 0)
        return [{**m, "weight": 0} if isinstance(m, dict) and m.get("role") == "assistant" else m
                for m in prompt] + completion
    return None


def record_hint(obj) -> str:
    """What a JSON record that holds neither the text field nor a conversation does hold, for its error:
    prompt/completion pairs (OpenAI's and TRL's layout) with their conversion to chat, else its keys."""
    if not isinstance(obj, dict) or not obj:
        return ""
    kinds = {k: "null" if obj.get(k) is None else type(obj[k]).__name__ for k in PAIR_FIELDS if k in obj}
    if len(kinds) == 2:
        return (f"; it holds \"prompt\" and \"completion\" ({kinds['prompt']} and {kinds['completion']}): "
                "data.format=chat (prepare: --format chat) reads them where both are strings or both lists of "
                "messages, its loss on the completion alone")
    if kinds:  # (one of the pair: the other missing)
        has, lacks = (PAIR_FIELDS if "prompt" in kinds else PAIR_FIELDS[::-1])
        return f"; it holds \"{has}\" without \"{lacks}\" (a prompt/completion pair needs both)"
    return f"; its keys: {', '.join(map(str, list(obj)[:8]))}{', ...' * (len(obj) > 8)}"


def conversation(f: Path, where: str, value, hint: str = "") -> list[dict]:
    """A chat record's messages, each with a string role and content, or a DataError naming the line
    (`hint`: record_hint's, where the record is at hand)."""
    if not isinstance(value, list) and '"prompt"' in hint:  # (a pair that is not one: said first, then why)
        raise DataError(f"data file {f} {where}: a prompt/completion record the chat format cannot read{hint}")
    if not isinstance(value, list):
        held = f"'s 'messages' is a {type(value).__name__}, not a list" if value is not None else \
            " has no list field 'messages'"
        raise DataError(f"data file {f} {where}{held} (the chat format reads "
                        "{\"messages\": [{\"role\": ..., \"content\": ...}, ...]}, or ShareGPT's {\"conversations\": "
                        "[{\"from\": ..., \"value\": ...}, ...]}; text is read with data.format=text, or in data.mix "
                        f"the source's format = \"text\"; prepare: --format text){hint}")
    out = []
    for i, m in enumerate(value):
        if isinstance(m, dict) and m.get("role") is None and isinstance(m.get("from"), str):  # (a table's null role)
            m = {**{k: v for k, v in m.items() if k not in ("from", "value", "role", "content")},
                 "role": SHAREGPT_ROLES.get(m["from"], m["from"]), "content": m.get("value")}
        calls = isinstance(m, dict) and bool(m.get("tool_calls"))  # a reply that calls tools may hold no text
        if not (isinstance(m, dict) and isinstance(m.get("role"), str)
                and (isinstance(m.get("content"), str) or calls and m.get("content") is None)):
            raise DataError(f"data file {f} {where}: messages[{i}] needs string fields 'role' and 'content' "
                            "(ShareGPT's: 'from' and 'value')")
        # Every other field goes to the chat template as transformers passes it (tool_calls, name,
        # reasoning_content, ...); a table's unset struct fields are None there, as absent.
        out.append({**{k: v for k, v in m.items() if v is not None}, "content": m.get("content") or ""})
    return out


def strings(value) -> Iterator[str]:
    """Every string in a JSON value, keys included."""
    if isinstance(value, str):
        yield value
    for item in value.items() if isinstance(value, dict) else value if isinstance(value, list) else ():
        yield from strings(list(item) if isinstance(value, dict) else item)
