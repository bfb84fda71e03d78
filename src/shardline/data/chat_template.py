"""A tokenizer's chat template: where it is found beside a tokenizer, and how it renders.

Templates render as transformers renders them: sandboxed (a template comes with downloaded files),
with the bos and eos tokens tokenizer_config.json names, loop controls, a plain tojson, and
{% generation %} blocks rendered as their body. Not `strftime_now`: a template that asks whether it
is defined writes its fixed fallback date, so that data renders the same on every day a run
resumes (transformers writes today's date at inference). What a rendering's tokens train on is
encode.py's (chat_segments).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

from jinja2.ext import Extension

from shardline.data.tokenizer import special_token
from shardline.errors import DataError


@dataclass(frozen=True)
class ChatTemplate:
    """A tokenizer's chat template (jinja) and the special tokens it may write, as transformers
    renders it: `{{ bos_token }}` and `{{ eos_token }}` from tokenizer_config.json (Mistral's and
    Llama 2's templates close every reply with the eos; rendered as "" it had no target)."""

    source: str
    bos_token: str = ""
    eos_token: str = ""
    where: str = field(default="tokenizer_config.json", compare=False)  # the file it came from, for errors


def as_template(template: ChatTemplate | str | None) -> ChatTemplate | None:
    return ChatTemplate(template) if isinstance(template, str) else template


def template_sha256(template: ChatTemplate | str | None) -> str | None:
    """What a prepared folder records of its chat template (None: ChatML), to tell templates apart
    (with its special tokens when it has any: they change what is rendered)."""
    template = as_template(template)
    if not template or not template.source:
        return None
    tokens = f"\0{template.bos_token}\0{template.eos_token}" if template.bos_token or template.eos_token else ""
    return hashlib.sha256((template.source + tokens).encode()).hexdigest()


def render_template(template: ChatTemplate, messages: list[dict], generation_prompt: bool = False) -> str:
    """The template applied to these messages; a template that fails is a DataError, not a traceback."""
    try:
        return _compiled(template.source)(messages=messages, add_generation_prompt=generation_prompt,
                                          bos_token=template.bos_token, eos_token=template.eos_token)
    except Exception as e:  # jinja2 raises many types (syntax, undefined, the template's own raise_exception)
        raise DataError(f"the tokenizer's chat template ({template.where}) fails on a conversation "
                        f"{opening(messages)}: {type(e).__name__}: {' '.join(str(e).split())}") from None


def opening(messages: list[dict]) -> str:
    """How an error points at a conversation among millions: its first words, to search the data for."""
    first = " ".join(str(messages[0].get("content", "")).split())[:48] if messages else ""
    return f"(opening {first!r})" if first else "(empty)"


@lru_cache(maxsize=4)
def _compiled(template: str):
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    # As transformers renders templates: sandboxed (a template comes with downloaded files, and
    # jinja's plain environment lets one reach Python's internals and run code), loop controls
    # ({% break %}), and a tojson that keeps characters as they are (jinja's own escapes <, >, &
    # and ' for HTML).
    # A {% generation %} block (which transformers uses to return an assistant mask) renders as its
    # body: the mask here comes from the rendered replies (chat_segments), the same either way.
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols", _GenerationBlock])
    env.globals["raise_exception"] = _raise
    env.filters["tojson"] = _tojson
    return env.from_string(template).render


class _GenerationBlock(Extension):
    """{% generation %}...{% endgeneration %}: its body, as if the tags were not there."""

    tags = {"generation"}

    def parse(self, parser):
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _raise(message: str):
    raise ValueError(message)


def _tojson(value, ensure_ascii: bool = False, indent=None, separators=None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def chat_template_for(tokenizer_path: str) -> ChatTemplate | None:
    """The chat template beside a tokenizer.json, if any: chat_template.jinja, which newer
    transformers write and prefer, else tokenizer_config.json's chat_template (of a list of named
    ones, "default", as transformers picks); with the bos and eos tokens tokenizer_config.json names."""
    if not tokenizer_path:
        return None
    folder = Path(tokenizer_path).parent
    try:
        settings = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
        settings = settings if isinstance(settings, dict) else {}
    except (OSError, ValueError):
        settings = {}
    where = folder / "chat_template.jinja"
    try:
        source = where.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        where = folder / "tokenizer_config.json"
        source = _named_template(settings.get("chat_template"), where)
    if not isinstance(source, str):
        return None
    return ChatTemplate(source, special_token(settings, "bos_token"), special_token(settings, "eos_token"),
                        str(where))


def _named_template(value, where: Path):
    """A chat_template entry: a template, or a list of {"name", "template"} of which "default" is
    the one a conversation renders with (the others, such as "tool_use", need arguments we do not give)."""
    if not isinstance(value, list):
        return value
    named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
    if not isinstance(named.get("default"), str):
        raise DataError(f"{where}: chat_template is a list of named templates without a \"default\" one "
                        f"(it has {sorted(map(str, named))}); write the one to train with to chat_template.jinja "
                        "beside it")
    return named["default"]
