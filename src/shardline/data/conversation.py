"""A chat record's conversation as the chat path reads it: `{"messages": [{"role", "content"}, ...]}`,
or ShareGPT's layout, `{"conversations": [{"from", "value"}, ...]}`, read as the same messages
(human -> user, gpt -> assistant; any other `from` is kept as the role, where the reply checks
judge it). A record that is neither is a DataError naming the line."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from shardline.errors import DataError

CHAT_FIELD = "messages"  # what data.format = "chat" reads from each record
SHAREGPT_FIELD = "conversations"  # ShareGPT's name for it, each message {"from", "value"}
SHAREGPT_ROLES = {"human": "user", "gpt": "assistant"}  # ("system" is the same name in both)


def record_messages(obj) -> object:
    """The record's messages (a JSON object's), ShareGPT's `conversations` where it has no `messages`."""
    if not isinstance(obj, dict):
        return None
    return obj.get(CHAT_FIELD) if CHAT_FIELD in obj or SHAREGPT_FIELD not in obj else obj[SHAREGPT_FIELD]


def record_hint(obj) -> str:
    """What a JSON record that holds neither the text field nor a conversation does hold, for its error:
    prompt/completion pairs (OpenAI's and TRL's layout) with their conversion to chat, else its keys."""
    if not isinstance(obj, dict) or not obj:
        return ""
    if all(isinstance(obj.get(k), str) for k in ("prompt", "completion")):
        return ("; it holds \"prompt\" and \"completion\", which shardline does not read: write each record as "
                "{\"messages\": [{\"role\": \"user\", \"content\": PROMPT}, {\"role\": \"assistant\", \"content\": "
                "COMPLETION}]} and train with data.format=chat, whose loss is on the completion alone")
    return f"; its keys: {', '.join(map(str, list(obj)[:8]))}{', ...' * (len(obj) > 8)}"


def conversation(f: Path, where: str, value, hint: str = "") -> list[dict]:
    """A chat record's messages, each with a string role and content, or a DataError naming the line
    (`hint`: record_hint's, where the record is at hand)."""
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
