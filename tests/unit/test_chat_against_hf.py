"""Chat fine-tuning data against an independent implementation: the token ids a conversation is
rendered to and the tokens it trains on (assistant-only loss) are those of transformers'
`apply_chat_template(tokenize=True, return_dict=True, return_assistant_tokens_mask=True)` under a
template that wraps each reply and its turn end in {% generation %} ... {% endgeneration %}.

Compared on token positions (shardline's label at position t is token t + 1). Where the two differ
by shardline's documented rules, the test pins the difference to those tokens alone:
- a whitespace token that begins in the reply's header and runs into the reply ("\\n" + the
  reply's leading " " or "\\n") goes by its first character, the header's, so it is not a target
  (encode._segment_mask); transformers marks every token a generation block overlaps;
- a reply's segment is all its message adds to the rendering (encode._template_segments),
  whatever a template's {% generation %} block wraps (they render as their body,
  chat_template._GenerationBlock): a block that leaves out the newline after <|im_end|> leaves it
  a target here;
- the training stream closes a conversation with the end-of-text token, a target after a final
  reply (encode.encode_documents, packing.pack_lists); transformers' rendering has no such token.
"""

from __future__ import annotations

import functools
import gzip
import json

import numpy as np
import pytest

transformers = pytest.importorskip("transformers")

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: E402

from shardline.data.chat_template import chat_template_for  # noqa: E402
from shardline.data.encode import encode_chat, encode_documents, render_chat  # noqa: E402
from shardline.data.packing import PackedSequences  # noqa: E402
from shardline.data.sources import shipped_corpus  # noqa: E402
from shardline.data.tokenizer import eos_id  # noqa: E402
from shardline.models.loss import IGNORE_INDEX  # noqa: E402

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|begin_of_text|>", "<|start_header_id|>",
            "<|end_header_id|>", "<|eot_id|>"]

# ChatML, each reply with its turn end and the newline after it marked as transformers' docs do.
CHATML_TAGGED = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endgeneration %}{% else %}{{ message['content'] + '<|im_end|>' + '\\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
# The same rendering, the generation block ending at <|im_end|> (the newline after it left out).
CHATML_TAGGED_NO_NEWLINE = CHATML_TAGGED.replace(
    "{% generation %}{{ message['content'] + '<|im_end|>' + '\\n' }}{% endgeneration %}",
    "{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\\n' }}")
# Llama 3's template (content trimmed), each reply and its <|eot_id|> marked.
LLAMA3_TAGGED = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}"
    "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] | trim + '<|eot_id|>' }}"
    "{% endgeneration %}{% else %}{{ message['content'] | trim + '<|eot_id|>' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}")

CONVERSATIONS = {
    "system, user, reply": [{"role": "system", "content": "You are brief."},
                            {"role": "user", "content": "Who made the light?"},
                            {"role": "assistant", "content": "God said, Let there be light."}],
    "two turns": [{"role": "user", "content": "one?"}, {"role": "assistant", "content": "It is 1."},
                  {"role": "user", "content": "two?"}, {"role": "assistant", "content": "It is 2."}],
    "reply with one newline each side": [{"role": "user", "content": "hi"},
                                         {"role": "assistant", "content": "\nAnswer\n"}],
    "non-ASCII": [{"role": "user", "content": "Café?"}, {"role": "assistant", "content": "Naïve café — 日本語 🙂"}],
    "an empty reply": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": ""},
                       {"role": "user", "content": "again"}, {"role": "assistant", "content": "ok"}],
    "ends with a user turn": [{"role": "system", "content": "Be kind."}, {"role": "user", "content": "hi"},
                              {"role": "assistant", "content": "ok"}, {"role": "user", "content": "bye"}],
}
# Replies whose leading blanks the byte-level BPE merges with the header's newline into one token.
STRADDLING = {
    "reply with leading and trailing spaces": [{"role": "user", "content": " hi "},
                                               {"role": "assistant", "content": "  leading and trailing  "}],
    "reply with blank lines each side": [{"role": "user", "content": "hi"},
                                         {"role": "assistant", "content": "\n\nAnswer\n\n"}],
}
ALL = {**CONVERSATIONS, **STRADDLING}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """A byte-level BPE with the ChatML and Llama 3 markers as special tokens, saved twice: beside
    chat_template.jinja (ChatML) and beside a tokenizer_config.json naming the template (Llama 3)."""
    with gzip.open(shipped_corpus(), "rt", encoding="utf-8") as f:
        docs = [json.loads(line)["text"] for _, line in zip(range(40), f)]
    docs += [render_chat(m) for m in ALL.values()] * 20
    docs += ["a\n\nb\n\n\nc\n  d\n   e\n\n  f  \n\n"] * 200  # so that "\n\n", "\n " and "  " are tokens
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(docs, trainers.BpeTrainer(vocab_size=900, special_tokens=SPECIALS, show_progress=False,
                                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    assert {"ĊĊ", "ĊĠ", "ĠĠ"} <= set(tok.get_vocab())
    out = {}
    for name, template, config in [("chatml", CHATML_TAGGED, {}),
                                   ("chatml_no_newline", CHATML_TAGGED_NO_NEWLINE, {}),
                                   ("llama3", LLAMA3_TAGGED, {"bos_token": "<|begin_of_text|>",
                                                              "eos_token": "<|eot_id|>"})]:
        folder = tmp_path_factory.mktemp(name)
        tok.save(str(folder / "tokenizer.json"))
        settings = {"tokenizer_class": "PreTrainedTokenizerFast", **config}
        settings["chat_template"] = template  # (transformers before ~4.50 reads it here only)
        if name != "llama3":  # ... and the file, which shardline and later transformers read first
            (folder / "chat_template.jinja").write_text(template, encoding="utf-8")
        (folder / "tokenizer_config.json").write_text(json.dumps(settings), encoding="utf-8")
        out[name] = folder
    return tok, out


@functools.lru_cache(maxsize=8)
def hf_tokenizer(folder: str):
    return transformers.PreTrainedTokenizerFast.from_pretrained(folder)


def hf_render(folder, messages) -> tuple[list[int], list[int]]:
    """transformers' ids and assistant mask of the conversation, with the folder's own template."""
    hf = hf_tokenizer(str(folder))
    out = hf.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    return list(out["input_ids"]), list(out["assistant_masks"])


def ours(tok, folder, messages, builtin=False) -> tuple[list[int], list[int]]:
    template = None if builtin else chat_template_for(str(folder / "tokenizer.json"))
    assert builtin or template is not None
    return encode_chat(tok, messages, template)


def straddling_tokens(tok, messages, builtin_header="<|im_start|>assistant\n") -> list[int]:
    """Positions of the tokens that hold the end of a reply's header and the start of the reply
    (the one documented difference of the mask on these templates): found by character offsets."""
    text = render_chat(messages)
    ends = {i + len(builtin_header) for i in range(len(text)) if text.startswith(builtin_header, i)}
    offsets = tok.encode(text, add_special_tokens=False).offsets
    return [t for t, (start, end) in enumerate(offsets) if any(start < k < end for k in ends)]


CASES = [("chatml", False), ("chatml", True), ("llama3", False)]  # True: shardline's ChatML, no template


@pytest.mark.parametrize("name,builtin", CASES, ids=["chatml-template", "chatml-builtin", "llama3"])
@pytest.mark.parametrize("conversation", list(ALL))
def test_token_ids_are_transformers(folders, name, builtin, conversation):
    tok, folder = folders
    messages = ALL[conversation]
    hf_ids, _ = hf_render(folder[name], messages)
    ids, _ = ours(tok, folder[name], messages, builtin)
    assert ids == hf_ids, (tok.decode(ids, skip_special_tokens=False), tok.decode(hf_ids, skip_special_tokens=False))


@pytest.mark.parametrize("name,builtin", CASES, ids=["chatml-template", "chatml-builtin", "llama3"])
@pytest.mark.parametrize("conversation", list(CONVERSATIONS))
def test_targets_are_transformers_assistant_masks(folders, name, builtin, conversation):
    """Each reply, its turn end (and ChatML's newline after it) are targets; system prompts, user
    turns and reply headers are not, on both sides, token for token."""
    tok, folder = folders
    messages = CONVERSATIONS[conversation]
    hf_ids, hf_mask = hf_render(folder[name], messages)
    ids, mask = ours(tok, folder[name], messages, builtin)
    assert ids == hf_ids
    assert sum(hf_mask) > 0
    assert mask == hf_mask, [(tok.id_to_token(t), a, b) for t, a, b in zip(ids, mask, hf_mask) if a != b]


@pytest.mark.parametrize("name,builtin", CASES[:2], ids=["chatml-template", "chatml-builtin"])
@pytest.mark.parametrize("conversation", list(STRADDLING))
def test_a_blank_token_across_the_header_and_reply_is_the_headers(folders, name, builtin, conversation):
    """Documented (encode._segment_mask: a whitespace token goes by its first character): the token
    "\\n " or "\\n\\n" that holds the header's newline and the reply's first blank is not a target;
    transformers marks it (it overlaps the generation block). Every other token agrees."""
    tok, folder = folders
    messages = STRADDLING[conversation]
    hf_ids, hf_mask = hf_render(folder[name], messages)
    ids, mask = ours(tok, folder[name], messages, builtin)
    assert ids == hf_ids
    differ = [i for i, (a, b) in enumerate(zip(mask, hf_mask)) if a != b]
    assert differ == straddling_tokens(tok, messages) and len(differ) == 1
    assert not tok.decode([ids[differ[0]]]).strip()  # a blank token
    assert (mask[differ[0]], hf_mask[differ[0]]) == (0, 1)
    assert mask[differ[0] + 1] == 1  # the reply's next token is a target on both sides


def test_a_generation_block_that_leaves_out_the_newline_after_the_turn_end_is_not_followed(folders):
    """Documented (README, Data: {% generation %} blocks render as their body; a reply's segment is
    all its message adds): the newline after <|im_end|> is a target whatever the block wraps."""
    tok, folder = folders
    for messages in CONVERSATIONS.values():
        hf_ids, hf_mask = hf_render(folder["chatml_no_newline"], messages)
        ids, mask = ours(tok, folder["chatml_no_newline"], messages)
        assert ids == hf_ids
        after_turn_end = [i for i in range(1, len(ids)) if tok.id_to_token(ids[i - 1]) == "<|im_end|>"
                          and hf_mask[i - 1] == 1]
        assert [i for i, (a, b) in enumerate(zip(mask, hf_mask)) if a != b] == after_turn_end
        assert all(mask[i] == 1 and tok.id_to_token(ids[i]) == "Ċ" for i in after_turn_end)


@pytest.mark.parametrize("name,builtin", CASES, ids=["chatml-template", "chatml-builtin", "llama3"])
def test_the_labels_a_run_trains_on_are_the_next_tokens_transformers_marks(folders, name, builtin):
    """Through the training path (encode_documents, packed rows, batch labels): the label at
    position t is token t + 1 where transformers marks token t + 1 (documented differences aside),
    and the end-of-text after a conversation is a target where it closes a reply."""
    tok, folder = folders
    template = None if builtin else chat_template_for(str(folder[name] / "tokenizer.json"))
    eos = eos_id(tok, str(folder[name] / "tokenizer.json"))
    assert tok.id_to_token(eos) == "<|endoftext|>"
    for conversation, messages in ALL.items():
        hf_ids, hf_mask = hf_render(folder[name], messages)
        tokens, lengths, mask = encode_documents(tok, [messages], eos, template, chat=True)
        n = len(hf_ids)
        assert tokens.tolist() == [*hf_ids, eos] and lengths.tolist() == [n + 1]
        seqs = PackedSequences.from_stream(tokens, np.array([0]), n, mask)  # the row: the conversation and its eos
        batch = seqs.batch([0])
        labels, inputs = batch["labels"][0].tolist(), batch["input_ids"][0].tolist()
        assert inputs == hf_ids
        expected = [*hf_mask, hf_mask[-1]]  # transformers' targets, then the end-of-text after a final reply
        for i in straddling_tokens(tok, messages) if name != "llama3" else []:
            expected[i] = 0
        targets = [t + 1 for t, label in enumerate(labels) if label != IGNORE_INDEX]
        assert targets == [i for i, m in enumerate(expected) if m], conversation
        assert all(labels[t - 1] == [*hf_ids, eos][t] for t in targets)
        assert (labels[-1] != IGNORE_INDEX) == (messages[-1]["role"] == "assistant")
