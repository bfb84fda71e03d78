"""`shardline generate`: text from a trained run's checkpoint, checked against transformers."""

from __future__ import annotations

import dataclasses
import json
import math
import re
import shutil

import pytest
import torch

from shardline.cli import main
from shardline.config import load_config
from shardline.data.encode import encode_chat, reply_prompt
from shardline.data.tokenizer import eos_id
from shardline.generate import KVCache, SampleOptions, generate, load_generator, next_token
from shardline.models.llama.model import sdpa_attention
from shardline.trainer import Trainer
from tests.conftest import tiny_overrides

transformers = pytest.importorskip("transformers")

PROMPT = "The history of the"


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory, small_prepared):
    """A tiny run trained 12 steps (a checkpoint at 6 and 12), and its HF export."""
    run = tmp_path_factory.mktemp("generate") / "run"
    trainer = Trainer(load_config(None, tiny_overrides(run, small_prepared, "train.eval_interval=0"))).build()
    trainer.train()
    assert main(["convert", "to-hf", str(run), str(run.parent / "hf")]) == 0
    return run


def _generate(capsys, *argv: str) -> dict:
    assert main(["generate", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_greedy_tokens_are_the_most_likely_by_transformers(trained_run, capsys):
    """Each greedy token is the argmax of the exported model's next-token logits in transformers
    (to 1e-4: a near tie may go either way between two implementations)."""
    out = _generate(capsys, str(trained_run), "--prompt", PROMPT, "--temperature", "0", "--max-new-tokens", "12")
    gen = load_generator(trained_run, "cpu")
    prompt = gen.tokenizer.encode(PROMPT, add_special_tokens=False).ids
    new = gen.sample(prompt, SampleOptions(max_new_tokens=12, temperature=0))
    assert gen.tokenizer.decode([t for t in new if t not in gen.stop]) == out["completion"]
    assert out["stop_ids"] == sorted(gen.stop) and eos_id(gen.tokenizer) in gen.stop  # training's end of document
    hf = transformers.LlamaForCausalLM.from_pretrained(trained_run.parent / "hf").eval()
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + new])).logits[0]
    for i, token in enumerate(new):
        step = logits[len(prompt) - 1 + i]
        assert step[token] >= step.max() - 1e-4, (i, token, int(step.argmax()))


def test_sampling_is_seeded_and_the_seed_matters(trained_run, capsys):
    argv = [str(trained_run), "--prompt", PROMPT, "--temperature", "1.0", "--top-k", "0", "--max-new-tokens", "16"]
    first, again = (_generate(capsys, *argv, "--seed", "3")["completion"] for _ in range(2))
    other = _generate(capsys, *argv, "--seed", "4")["completion"]
    assert first == again and first != other


def test_a_checkpoint_folder_of_the_run_samples_its_own_weights(trained_run, capsys):
    """A checkpoint folder given directly (step 6, not the newest) finds the run's tokenizer and
    loads its own weights, not the newest's."""
    step6 = trained_run / "checkpoints" / "step-000006"
    out = _generate(capsys, str(step6), "--prompt", PROMPT, "--max-new-tokens", "8")
    assert out["completion"] and out["temperature"] == 0.8 and out["top_k"] == 50  # the defaults
    older, newest = load_generator(step6, "cpu"), load_generator(trained_run, "cpu")
    assert older.tokenizer.get_vocab() == newest.tokenizer.get_vocab()
    old, new = older.model.state_dict(), newest.model.state_dict()
    assert old.keys() == new.keys() and any(not torch.equal(old[k], new[k]) for k in old)


def test_top_k_and_temperature_choose_among_the_likeliest():
    logits = torch.tensor([0.0, 3.0, 2.9, -1.0, 2.8])
    draw = torch.Generator().manual_seed(0)
    two = {next_token(logits, SampleOptions(temperature=1.0, top_k=2), draw) for _ in range(300)}
    assert two == {1, 2}
    assert {next_token(logits, SampleOptions(temperature=5.0, top_k=1), draw) for _ in range(50)} == {1}
    assert next_token(logits, SampleOptions(temperature=0), draw) == 1
    cold = [next_token(logits, SampleOptions(temperature=0.01, top_k=0), draw) for _ in range(50)]
    assert set(cold) == {1}  # near 0 it is greedy too
    hot = {next_token(logits, SampleOptions(temperature=1.0, top_k=0), draw) for _ in range(5000)}
    assert hot == {0, 1, 2, 3, 4}


def test_top_p_samples_among_the_fewest_likeliest_holding_that_mass():
    """Probabilities 0.358, 0.324, 0.293, 0.018, 0.007 (tokens 1, 2, 4, 0, 3): p = 0.5 needs the
    first two, 0.3 the first alone, 0.99 all but the last."""
    logits = torch.tensor([0.0, 3.0, 2.9, -1.0, 2.8])
    draw = torch.Generator().manual_seed(0)
    for top_p, want in [(0.5, {1, 2}), (0.3, {1}), (0.99, {0, 1, 2, 4}), (1.0, {0, 1, 2, 3, 4})]:
        got = {next_token(logits, SampleOptions(temperature=1.0, top_k=0, top_p=top_p), draw) for _ in range(5000)}
        assert got == want, top_p
    both = {next_token(logits, SampleOptions(temperature=1.0, top_k=3, top_p=0.6), draw) for _ in range(2000)}
    assert both == {1, 2}  # within the top 3 (renormalised: 0.37, 0.34, 0.30): the first two hold 0.6


def test_the_kv_cache_gives_the_logits_of_whole_passes(trained_run):
    """Cached, each new token runs alone through the model, and its logits are those of the whole
    text run again (1e-5); past the 32-token window the window runs whole each time."""
    gen = load_generator(trained_run, "cpu")
    prompt = gen.encode(PROMPT)
    new = gen.sample(prompt, SampleOptions(max_new_tokens=40, temperature=0), stop=frozenset())
    text = prompt + new
    assert len(new) == 40 and len(prompt) < 32
    with torch.no_grad():
        whole = [gen.model(torch.tensor([text[:n][-32:]]))[0, -1] for n in range(len(prompt), len(text))]
        assert new == [int(logits.argmax()) for logits in whole]
        fed = []
        hook = gen.model.register_forward_pre_hook(lambda module, args: fed.append(args[0].shape[1]))
        try:
            with KVCache(gen.model, gen.device) as cache:
                cached = [cache.next_logits(text[:n]) for n in range(len(prompt), 33)]
        finally:
            hook.remove()
    assert fed == [len(prompt)] + [1] * (32 - len(prompt))
    for n, (got, want) in enumerate(zip(cached, whole)):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5, msg=lambda m, n=n: f"token {n}: {m}")
    assert gen.model.layers["0"].attention.core is sdpa_attention  # the model's own core is back
    assert isinstance(gen.model.output, torch.nn.Linear)  # and its output


def test_a_prompt_projects_its_last_position_only_and_padded_vocabulary_rows_are_never_drawn(trained_run):
    """A prompt's logits at every position ([tokens, vocab] in fp32: gigabytes for a long prompt
    and a 128k vocabulary) are not made; ids past the tokenizer's (a vocabulary padded for speed)
    are never drawn: they decode to nothing."""
    gen = load_generator(trained_run, "cpu")
    prompt, rows = gen.encode(PROMPT), []
    hook = gen.model.output.register_forward_pre_hook(lambda module, args: rows.append(args[0].shape[1]))
    try:
        gen.sample(prompt, SampleOptions(max_new_tokens=3, temperature=0), stop=frozenset())
    finally:
        hook.remove()
    assert rows == [1, 1, 1]

    class Fewer:  # the checkpoint's tokenizer, its ids cut to the first 64 (the model keeps its rows)
        def __init__(self, tokenizer):
            self.tokenizer = tokenizer

        def get_vocab(self):
            return {t: i for t, i in self.tokenizer.get_vocab().items() if i < 64}

        def decode(self, ids):
            return self.tokenizer.decode(ids)

    gen.tokenizer = Fewer(gen.tokenizer)
    assert gen.model.output.out_features > 64
    drawn = gen.sample(prompt, SampleOptions(max_new_tokens=60, temperature=3.0, top_k=0, seed=1), stop=frozenset())
    assert len(drawn) == 60 and max(drawn) < 64


def test_chat_renders_the_template_beside_the_tokenizer_and_stops_at_its_turn_end(trained_run, tmp_path, capsys,
                                                                                  monkeypatch):
    """--chat renders system and user messages with the run's chat template and its reply
    header; the reply ends at the template's end-of-turn token (here the token the model writes
    first, so the reply is empty)."""
    run = tmp_path / "run"
    shutil.copytree(trained_run, run)
    template = ("{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
                "{% if add_generation_prompt %}[assistant]{% endif %}")
    (run / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    gen = load_generator(run, "cpu")
    rendered = "[system] be brief\n[user] history\n[assistant]"
    assert gen.chat_prompt("history", "be brief") == rendered
    # An empty system message given is one: a template that writes a default without one is told none
    assert gen.chat_prompt("history", "") == "[system] \n[user] history\n[assistant]"
    assert gen.chat_prompt("history") == "[user] history\n[assistant]"
    first = gen.sample(gen.encode(rendered), SampleOptions(max_new_tokens=1, temperature=0), stop=frozenset())[0]
    assert first not in gen.stop
    argv = [str(run), "--chat", "--system", "be brief", "--prompt", "history", "--temperature", "0",
            "--max-new-tokens", "6"]
    out = _generate(capsys, *argv)
    assert out["chat_prompt"] == rendered and out["completion"]  # no turn end yet: six tokens of reply
    (run / "tokenizer_config.json").write_text(json.dumps({"chat_template": template,
                                                           "eos_token": gen.tokenizer.id_to_token(first)}))
    assert main(["generate", *argv]) == 0  # printed: a blank line, and on stderr why
    printed = capsys.readouterr()
    assert printed.out == "\n" and "the model's reply is blank: it ended at once" in printed.err
    assert "ChatML" not in printed.err  # (its own template's turn end)
    assert _generate(capsys, *argv)["completion"] == ""
    # Under ChatML, whose markers this vocabulary splits, a blank reply names that too (a newline, then the
    # end of text, closed every turn in training: the reply's header ends alike)
    chatml = gen.tokenizer.encode(reply_prompt([{"role": "user", "content": "history"}], None),
                                  add_special_tokens=False).ids
    (run / "tokenizer_config.json").unlink()
    plain = load_generator(run, "cpu")
    assert plain.template is None  # (ChatML)
    plain.stop = frozenset({*plain.stop, plain.sample(chatml, SampleOptions(max_new_tokens=1, temperature=0))[0]})
    import shardline.generate as generate_module

    monkeypatch.setattr(generate_module, "load_generator", lambda *args: plain)  # (its first reply token ends it)
    assert main(["generate", str(run), "--chat", "--prompt", "history", "--temperature", "0"]) == 0
    assert "and ChatML's <|im_end|> is no token of this vocabulary" in capsys.readouterr().err


def test_a_run_trained_with_bos_prompts_with_it(trained_run, tmp_path):
    """A run whose tokenizer starts a text with a BOS token put it before each document
    (data.add_bos): a prompt starts with it too, a chat rendering does not (its template's own),
    and a run without one gets none (here the run's end-of-document token plays the BOS)."""
    from tokenizers import Tokenizer, processors

    plain = load_generator(trained_run, "cpu")
    assert plain.encode(PROMPT) == plain.tokenizer.encode(PROMPT, add_special_tokens=False).ids
    run = tmp_path / "run"
    shutil.copytree(trained_run, run)
    tok = Tokenizer.from_file(str(run / "tokenizer.json"))
    eos = eos_id(tok)
    tok.post_processor = processors.TemplateProcessing(single="<|endoftext|> $A",
                                                       special_tokens=[("<|endoftext|>", eos)])
    tok.save(str(run / "tokenizer.json"))
    gen = load_generator(run, "cpu")
    assert gen.trained_bos and gen.encode(PROMPT) == [eos, *plain.encode(PROMPT)]
    assert gen.chat_ids("hi") == plain.chat_ids("hi") and gen.chat_ids("hi")[0] != eos
    assert gen.encode("") == [eos]  # an empty prompt samples from a document's start (it was refused)
    assert plain.encode("") == [eos]  # (no BOS: a document starts after another's end of text)
    fed = []
    hook = gen.model.register_forward_pre_hook(lambda module, args: fed.append(args[0][0].tolist()))
    try:
        gen.complete(PROMPT, SampleOptions(max_new_tokens=1, temperature=0))
    finally:
        hook.remove()
    assert fed == [[eos, *plain.encode(PROMPT)]]


def test_chat_ends_a_reply_where_the_template_ends_a_turn_and_encodes_it_as_training_does(trained_run, tmp_path):
    """The turn end is what the template writes after a reply (not its eos, which a base model's
    template may not close turns with): a token when the tokenizer has it as one, else text.
    The prompt is tokenized whole, as chat training tokenizes a conversation (encode_chat): the
    same ids as the conversation's up to the reply (here a message's last blank joins the next
    one's first word, which a message-at-a-time encoding split)."""
    run = tmp_path / "run"
    shutil.copytree(trained_run, run)
    plain = load_generator(run, "cpu")
    word = next(t for t in sorted(plain.tokenizer.get_vocab()) if t.isalpha() and len(t) >= 4)  # one token
    for end, as_token in ((word, True), ("<|turn_end|>", False)):
        template = ("{% for m in messages %}{{ m.role }}:{{ m.content }}" + end + " {% endfor %}"
                    "{% if add_generation_prompt %}assistant:{% endif %}")
        settings = {"chat_template": template, "eos_token": "<|endoftext|>"}
        (run / "tokenizer_config.json").write_text(json.dumps(settings))
        gen = load_generator(run, "cpu")
        stop, text = gen.turn_end()
        if as_token:
            assert stop == gen.stop | {gen.tokenizer.token_to_id(word)} and text == ""
        else:
            assert stop == gen.stop and text == "<|turn_end|>"
        pieces = [f"system:be brief{end} ", f"user:history{end} ", "assistant:"]
        assert gen.chat_prompt("history", "be brief") == "".join(pieces)
        whole = gen.tokenizer.encode("".join(pieces), add_special_tokens=False).ids
        assert gen.chat_ids("history", "be brief") == whole
        trained, _ = encode_chat(gen.tokenizer, [{"role": "system", "content": "be brief"},
                                                 {"role": "user", "content": "history"},
                                                 {"role": "assistant", "content": " reply"}], gen.template)
        assert trained[:len(whole)] == whole
        if as_token:  # by pieces, " user" was not one word
            by_piece = [i for piece in pieces for i in gen.tokenizer.encode(piece, add_special_tokens=False).ids]
            assert by_piece != whole


def test_a_template_that_cannot_render_fails_chat_only(trained_run, tmp_path, capsys):
    """A list of named templates without a "default" one: a plain prompt needs no template."""
    run = tmp_path / "run"
    shutil.copytree(trained_run, run)
    (run / "tokenizer_config.json").write_text(json.dumps({"chat_template": [{"name": "tool_use", "template": "T"}]}))
    assert main(["generate", str(run), "--prompt", PROMPT, "--max-new-tokens", "2"]) == 0
    capsys.readouterr()
    assert main(["generate", str(run), "--prompt", PROMPT, "--max-new-tokens", "2", "--chat"]) == 2
    assert 'without a "default" one' in capsys.readouterr().err


def test_chat_without_a_template_is_chatml_and_its_end_marker_ends_the_reply(trained_run):
    """With no template, ChatML as chat training renders it; this tokenizer splits <|im_end|>, so
    its text ends the reply (here a text the model writes instead, to see it stop)."""
    gen = load_generator(trained_run, "cpu")
    assert gen.template is None
    assert gen.chat_prompt("hi") == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    stop, marker = gen.turn_end()
    assert stop == gen.stop and marker == "<|im_end|>"
    prompt, greedy = gen.encode(gen.chat_prompt("hi")), SampleOptions(max_new_tokens=12, temperature=0)
    reply = gen.sample(prompt, greedy, stop=frozenset())
    said = gen.tokenizer.decode(reply[:5])  # the reply's text up to its fifth token
    assert said.strip() and said not in gen.tokenizer.decode(reply[:4])
    ended = gen.sample(prompt, greedy, stop=frozenset(), stop_text=said)
    assert ended == reply[:5]


def test_the_model_sees_the_last_train_seq_len_tokens(trained_run):
    """The run trained on 32-token sequences: a longer prompt is cut to its last 32 tokens, and
    generation past the window goes on sliding it."""
    gen = load_generator(trained_run, "cpu")
    assert gen.context == 32
    prompt = gen.encode(" ".join(["the history of the city"] * 12))
    assert len(prompt) > 40
    greedy = SampleOptions(max_new_tokens=40, temperature=0)
    seen = []
    hook = gen.model.register_forward_pre_hook(lambda module, args: seen.append(args[0][0].tolist()))
    try:
        new = gen.sample(prompt, greedy)
    finally:
        hook.remove()
    assert seen[0] == prompt[-32:] and all(len(window) == 32 for window in seen)
    assert seen[-1] == (prompt + new)[-33:-1]  # the last window: the 32 tokens before the last new one
    assert new == gen.sample(prompt[-32:], greedy)


def test_a_mixture_of_experts_samples_dropless(tmp_path, small_prepared):
    """Trained with expert capacity (tokens over it dropped), sampled without: the newest token,
    last in each expert's queue, would be the one dropped."""
    run = tmp_path / "moe"
    overrides = tiny_overrides(run, small_prepared, "model.preset=tiny-moe", "moe.capacity_factor=1.0",
                               "train.steps=2", "train.eval_interval=0", "checkpoint.interval=2")
    Trainer(load_config(None, overrides)).build().train()
    gen = load_generator(run, "cpu")
    assert gen.model.args.moe.capacity_factor == 0.0
    assert gen.sample(gen.encode(PROMPT), SampleOptions(max_new_tokens=3, temperature=0))


def test_an_empty_prompt_starts_after_a_documents_end_where_there_is_no_bos(trained_run, capsys):
    """The shipped BPE has no BOS, and an unconditional sample was refused ("--prompt encodes to no
    token"): training puts the end-of-text token between documents, so one starts after it."""
    gen = load_generator(trained_run, "cpu")
    assert not gen.bos and gen.encode("") == [gen.document_end] and gen.document_end in gen.stop
    assert main(["generate", str(trained_run), "--prompt", "", "--max-new-tokens", "5", "--temperature", "0"]) == 0
    assert capsys.readouterr().out.strip()


def test_bfloat16_weights_by_either_name(trained_run):
    """--dtype bfloat16 (or train.precision's bf16) holds the weights in bf16 and writes the same text."""
    texts = []
    for name in ("bfloat16", "bf16"):
        gen = load_generator(trained_run, "cpu", name)
        assert {p.dtype for p in gen.model.parameters()} == {torch.bfloat16}
        texts.append(gen.sample(gen.encode(PROMPT), SampleOptions(max_new_tokens=4, temperature=0)))
    assert texts[0] == texts[1] and texts[0]


@pytest.mark.parametrize(("argv", "message"), [
    (["--temperature", "-1"], "--temperature=-1.0 is invalid: must be a finite number >= 0 (0 = greedy)"),
    (["--top-k", "-2"], "--top-k=-2 is invalid: must be >= 0 (0 = all tokens)"),
    (["--max-new-tokens", "0"], "--max-new-tokens=0 is invalid: must be in [1, 2**20]"),
    (["--max-new-tokens", "99999999999999999999"], "--max-new-tokens=99999999999999999999 is invalid: must be in [1, "),
    (["--train.steps=3"], "generate takes no config overrides, got --train.steps=3"),
    (["--dtype", "float16"], "dtype='float16' is invalid: one of float32, bfloat16"),
    (["--dtype", "fp16"], "dtype='fp16' is invalid: one of float32, bfloat16"),
    (["--bos"], "--bos: this checkpoint's tokenizer has no BOS token"),
    (["--top-p", "0"], "--top-p=0.0 is invalid: must be in (0, 1] (1 = all tokens)"),
    (["--temperature", "inf"], "--temperature=inf is invalid: must be a finite number >= 0 (0 = greedy)"),
    (["--top-p", "1.5"], "--top-p=1.5 is invalid: must be in (0, 1] (1 = all tokens)"),
    (["--chat", "--bos"], "--bos with --chat: the chat template writes the start of the conversation itself"),
    (["--system", "be brief"], "--system needs --chat: a plain prompt is continued as a document"),
    (["--seed", str(2**70)], f"--seed={2**70} is invalid: must be in [-2**63, 2**64)"),  # (a traceback, late)
    (["--device", "gpu"], "device='gpu' is invalid: auto, cpu, cuda or cuda:N"),
    (["--prompt", "\udcff\udcfe"], "the prompt is not UTF-8 text"),  # (bytes argv could not decode)
    (["--chat", "--prompt", "\udcff"], "the prompt is not UTF-8 text"),  # (a traceback there)
    (["--chat", "--system", "\udcff"], "the prompt is not UTF-8 text"),
])
def test_bad_options_are_one_line_errors(trained_run, capsys, argv, message):
    assert main(["generate", str(trained_run), *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err


def test_the_python_entry_points_check_what_the_cli_checks(trained_run):
    """Called from Python, without the CLI's argument parsing in front: the same one-line errors,
    not a sampling kernel's RuntimeError or a from-hf conversion of a run dir."""
    from shardline.errors import ConfigError
    from shardline.interop.convert import convert

    with pytest.raises(ConfigError, match=re.escape("top_p=0.0 is invalid: must be in (0, 1]")):
        SampleOptions(top_p=0.0, temperature=1.0)  # where it is made, named as Python names it
    with pytest.raises(ConfigError, match="^max_new_tokens=0 is invalid"):
        SampleOptions(max_new_tokens=0)
    with pytest.raises(ConfigError, match="^temperature=nan is invalid"):
        dataclasses.replace(SampleOptions(), temperature=math.nan)
    with pytest.raises(ConfigError, match="convert direction 'tohf' is invalid: one of to-hf, from-hf"):
        convert("tohf", str(trained_run), str(trained_run.parent / "never"))
    assert not (trained_run.parent / "never").exists()


def test_a_prompt_the_tokenizer_cannot_encode_is_one_line(trained_run):
    """A closed vocabulary without an unknown token (a WordLevel tokenizer.json) fails on a word it
    lacks: a traceback at generate's prompt, where train and prepare say it in one line."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    from shardline.errors import DataError

    gen = load_generator(str(trained_run))
    gen.tokenizer = Tokenizer(models.WordLevel({"hello": 0}))
    gen.tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    assert gen.encode("hello hello") == [0, 0]
    with pytest.raises(DataError, match="^the tokenizer cannot encode the prompt: .*UNK"):
        gen.encode("hello there")


def test_a_tiny_temperature_samples_the_likeliest_token():
    """logits / 1e-45 overflowed to inf and the softmax to NaN (a multinomial traceback)."""
    logits = torch.tensor([1.0, 3.0, 2.0, float("-inf")])
    assert next_token(logits, SampleOptions(temperature=1e-45), torch.Generator().manual_seed(0)) == 1
    for tiny in (1e-46, 1e-300):  # (0 in float32: 0 / 0 was NaN, and a traceback)
        assert next_token(logits, SampleOptions(temperature=tiny), torch.Generator().manual_seed(0)) == 1


def test_a_bad_generation_config_or_another_models_tokenizer_is_one_line(trained_run, tmp_path, capsys):
    ckpt = sorted((trained_run / "checkpoints").iterdir())[-1]
    copy = tmp_path / "ckpt"
    shutil.copytree(ckpt, copy)
    shutil.copyfile(trained_run / "tokenizer.json", copy / "tokenizer.json")
    (copy / "generation_config.json").write_text("[1, 2]")
    assert main(["generate", str(copy), "--max-new-tokens", "2"]) == 2
    assert "generation_config.json does not hold a JSON object" in capsys.readouterr().err
    (copy / "generation_config.json").write_text("{not json")
    assert main(["generate", str(copy), "--max-new-tokens", "2"]) == 2
    assert "generation_config.json cannot be read as JSON" in capsys.readouterr().err
    (copy / "generation_config.json").unlink()
    tok = json.loads((copy / "tokenizer.json").read_text())
    tok["added_tokens"].append({**tok["added_tokens"][-1], "id": 70_000, "content": "<|far|>"})  # (numbered next)
    (copy / "tokenizer.json").write_text(json.dumps(tok))
    assert main(["generate", str(copy), "--max-new-tokens", "2"]) == 0  # an id past the rows, never drawn
    capsys.readouterr()
    assert main(["generate", str(copy), "--max-new-tokens", "2", "--prompt", "a <|far|> token"]) == 2
    err = capsys.readouterr().err
    assert re.search(r"the prompt holds token id \d+, past the model's 512 embedding rows: that tokenizer is not "
                     r"its model's \(--tokenizer names the one it trained with\)$", err), err


def test_a_folder_without_a_checkpoint_is_a_one_line_error(tmp_path, capsys):
    assert main(["generate", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "is neither a checkpoint folder nor a run dir holding a valid checkpoint" in err and err.count("\n") == 1
    assert main(["generate", str(tmp_path / "typo")]) == 2  # a path that is not there says so
    err = capsys.readouterr().err
    assert f"{tmp_path / 'typo'} does not exist: give a run dir or a checkpoint folder" in err and err.count("\n") == 1


def test_context_sets_the_window_up_to_the_models_maximum(trained_run, capsys):
    """--context widens the window train.seq_len sets (32 here): a long prompt is cut to its
    last 48 tokens; past the model's recorded maximum, or negative, it is one line."""
    from shardline.cli import main

    gen = load_generator(trained_run, "cpu", context=48)
    prompt = gen.encode(" ".join(["the history of the city"] * 12))
    seen = []
    hook = gen.model.register_forward_pre_hook(lambda module, args: seen.append(len(args[0][0])))
    try:
        gen.sample(prompt, SampleOptions(max_new_tokens=1, temperature=0))
    finally:
        hook.remove()
    assert len(prompt) > 48 and seen == [48]
    args = [str(trained_run), "--prompt", "the", "--max-new-tokens", "2", "--device", "cpu"]
    for bad, message in [("-1", "context=-1 is invalid"), ("1000000", "context=1000000 is past this model's")]:
        assert main(["generate", *args, "--context", bad]) == 2
        assert message in capsys.readouterr().err
    assert main(["generate", *args, "--context", "16"]) == 0


def test_a_checkpoint_moved_from_its_run_generates_with_a_given_tokenizer(trained_run, tmp_path, capsys):
    """Neither beside it nor in a run dir: the line names --tokenizer, which then gives the run's
    text (as convert's --tokenizer does)."""
    ckpt = sorted((trained_run / "checkpoints").iterdir())[-1]
    moved = tmp_path / "moved"
    shutil.copytree(ckpt, moved)
    args = ["generate", str(moved), "--max-new-tokens", "4", "--temperature", "0", "--device", "cpu"]
    assert main(args) == 2
    assert "give --tokenizer (the run's tokenizer.json)" in capsys.readouterr().err
    assert main([*args, "--tokenizer", str(trained_run)]) == 0  # its folder, or the file
    assert capsys.readouterr().out == generate(trained_run, "The", SampleOptions(max_new_tokens=4, temperature=0),
                                               "cpu") + "\n"


def test_a_chat_run_whose_template_writes_a_bos_prompts_with_it(trained_run, tmp_path, capsys):
    """Chat training takes the BOS from the template (data.add_bos is text's): a plain prompt to
    a run whose conversations each began with it starts with it too, as HF's tokenizer(text)
    does for such a model (without, generate and the export disagreed from the first token)."""
    from tokenizers import Tokenizer

    tok_dir = tmp_path / "tok"
    tok_dir.mkdir()
    shutil.copyfile(trained_run / "tokenizer.json", tok_dir / "tokenizer.json")
    bos = "<|endoftext|>"
    template = ("{{ bos_token }}{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
                "{% if add_generation_prompt %}assistant:{% endif %}")
    (tok_dir / "tokenizer_config.json").write_text(json.dumps({"chat_template": template, "bos_token": bos}))
    chats = tmp_path / "chats.jsonl"
    chats.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"tell me of the city {i}"},
                                                      {"role": "assistant", "content": "the history of the river "
                                                                                       * 3}]}) + "\n"
                             for i in range(300)))
    run = tmp_path / "chat_run"
    Trainer(load_config(None, tiny_overrides(run, chats, "data.format=chat", f"data.tokenizer={tok_dir}/tokenizer.json",
                                             "train.steps=2", "train.eval_interval=0"))).build().train()
    # the tokenizer starts a text with the BOS, as a Llama 3 tokenizer does
    from tokenizers import processors

    tok = Tokenizer.from_file(str(run / "tokenizer.json"))
    eos = eos_id(tok)
    tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", special_tokens=[(bos, eos)])
    tok.save(str(run / "tokenizer.json"))
    shutil.copyfile(tok_dir / "tokenizer_config.json", run / "tokenizer_config.json")
    gen = load_generator(run, "cpu")
    assert gen.trained_bos and gen.encode(PROMPT)[0] == eos
    # --tokenizer with another chat template: --chat would render what the run never saw (it did, in silence)
    other = tmp_path / "other_tok"
    other.mkdir()
    shutil.copyfile(run / "tokenizer.json", other / "tokenizer.json")
    hashes = "{% for m in messages %}### {{ m.role }}: {{ m.content }}{% endfor %}"
    (other / "tokenizer_config.json").write_text(json.dumps({"chat_template": hashes}))
    capsys.readouterr()
    load_generator(run, "cpu", tokenizer=str(other))
    assert "--tokenizer's chat template is not the one the run trained with" in capsys.readouterr().err
    load_generator(run, "cpu", tokenizer=str(run))
    assert "chat template is not" not in capsys.readouterr().err
    (run / "tokenizer_config.json").write_text(json.dumps({"chat_template": template.replace("{{ bos_token }}", ""),
                                                           "bos_token": bos}))
    bare = load_generator(run, "cpu")
    assert not bare.trained_bos  # a template that writes none: none
    capsys.readouterr()
    bare.complete(PROMPT, SampleOptions(max_new_tokens=1, temperature=0))  # a plain prompt to a chat run: said
    assert "was trained on conversations: the prompt is plain text with no BOS (--bos adds it, as HF's tokenizer " \
           "does); --chat renders it as a user's message" in capsys.readouterr().err
    gen.complete(PROMPT, SampleOptions(max_new_tokens=1, temperature=0), bos=False)
    err = capsys.readouterr().err  # (its BOS there: only the plain text said)
    assert "trained on conversations: the prompt is plain text; --chat" in err, err
    gen.complete(PROMPT, SampleOptions(max_new_tokens=1, temperature=0), chat=True)
    assert "trained on conversations" not in capsys.readouterr().err
    # one that cannot render a reply prompt: --chat's problem, not a plain prompt's
    (run / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{% if add_generation_prompt %}"
                                                                            "{{ no_such_function() }}{% endif %}",
                                                           "bos_token": bos}))
    broken = load_generator(run, "cpu")
    assert not broken.trained_bos
    assert isinstance(broken.complete(PROMPT, SampleOptions(max_new_tokens=1, temperature=0)), str)  # no DataError


def test_a_text_that_grows_past_the_context_says_so_once_at_the_token_it_did(trained_run, capsys):
    """Within the context the cache equals transformers; past it the window slides and the text
    parts from what the HF export (no such limit) continues with: it did so unsaid."""
    gen = load_generator(str(trained_run))
    gen.stop = frozenset()  # (no end token cuts it short)
    prompt = gen.encode(PROMPT)
    fits = gen.context - len(prompt) + 1  # the last token drawn from a whole window
    gen.complete(PROMPT, SampleOptions(max_new_tokens=fits, temperature=0))
    assert "grew past the context" not in capsys.readouterr().err
    gen.complete(PROMPT, SampleOptions(max_new_tokens=fits + 1, temperature=0))
    err = capsys.readouterr().err
    assert err.count("grew past the context") == 1
    assert f"the text grew past the context of 32 tokens after {fits} new ones" in err, err


def test_what_was_sampled_and_what_the_model_saw_are_said(trained_run, tmp_path, capsys):
    """A run dir's newest valid checkpoint was taken in silence (a corrupt newer one passed over
    unsaid; a run whose only checkpoint was corrupt read as one with none); a prompt longer than
    the context was cut unsaid; --chat on a model never trained on conversations said nothing."""
    import shutil

    run = tmp_path / "run"
    shutil.copytree(trained_run, run, ignore=shutil.ignore_patterns("tensorboard"))
    newest = run / "checkpoints" / "step-000012"
    shard = next((newest / "state").glob("*.distcp"))
    shard.write_bytes(b"\0" * shard.stat().st_size)
    assert main(["generate", str(run), "--max-new-tokens", "1", "--prompt", "word " * 300, "--json"]) == 0
    said = capsys.readouterr()
    out, err = json.loads(said.out), said.err
    assert "shardline: passed over step-000012: " in err and "; using step-000006" in err, err
    assert out["checkpoint"] == str(run / "checkpoints" / "step-000006") and f"sampled {out['checkpoint']}" in err
    assert out["context"] == 32 and out["prompt_tokens"] > 32  # the run's train.seq_len
    assert f"the prompt is {out['prompt_tokens']:,} tokens and the model sees the last 32" in err
    assert main(["generate", str(run), "--chat", "--prompt", "hi", "--max-new-tokens", "1"]) == 0
    assert "was trained on text, not conversations" in capsys.readouterr().err
    shutil.rmtree(run / "checkpoints" / "step-000006")
    assert main(["generate", str(run)]) == 2
    err = capsys.readouterr().err
    assert f"{run} holds no valid checkpoint (step-000012: " in err and err.count("\n") == 1, err


def test_weights_converted_from_hf_prompt_with_the_bos_their_tokenizer_starts_a_text_with(trained_run, tmp_path):
    """HF's tokenizer(text) starts with BOS (Llama 3's <|begin_of_text|>), as such a model was
    pretrained: a from-hf checkpoint (no run of ours, no data.add_bos) prompted without it."""
    from tokenizers import Tokenizer, processors

    hf = tmp_path / "hf"
    shutil.copytree(trained_run.parent / "hf", hf)
    tok = Tokenizer.from_file(str(hf / "tokenizer.json"))
    eos = eos_id(tok)
    tok.post_processor = processors.TemplateProcessing(single="<|endoftext|> $A",
                                                       special_tokens=[("<|endoftext|>", eos)])
    tok.save(str(hf / "tokenizer.json"))
    assert main(["convert", "from-hf", str(hf), str(tmp_path / "ckpt")]) == 0
    gen = load_generator(tmp_path / "ckpt", "cpu")
    assert gen.trained_bos and gen.encode(PROMPT) == tok.encode(PROMPT).ids  # as HF encodes it


def test_a_sliding_window_model_generates_as_transformers_windowed_attention_does(trained_run, tmp_path):
    """Weights with a sliding window (Mistral 7B v0.1's, Phi-3-mini's) attend, in every layer, to
    each token and the window - 1 before it: the cache keeps those alone, a prompt longer than the
    window is masked to it, and every next-token logit past the window equals transformers' (a
    deeper layer's early window tokens carry what came before them, which re-running the window
    afresh would lose: that cache's logits differ). From a short prompt too: a cache of more than half
    the window and less than all of it kept its last few keys alone (Mistral 7B from ~2k tokens)."""
    hf_dir = tmp_path / "windowed"
    shutil.copytree(trained_run.parent / "hf", hf_dir)
    config = json.loads((hf_dir / "config.json").read_text())
    config.update(model_type="mistral", architectures=["MistralForCausalLM"], sliding_window=8)
    (hf_dir / "config.json").write_text(json.dumps(config))
    assert main(["convert", "from-hf", str(hf_dir), str(tmp_path / "ck")]) == 0
    gen = load_generator(tmp_path / "ck", "cpu", tokenizer=str(hf_dir / "tokenizer.json"))
    assert gen.model.args.sliding_window == 8
    long = gen.tokenizer.encode(PROMPT + " earth and the heavens and", add_special_tokens=False).ids
    assert len(long) > 8  # the prompt alone is past the window
    hf = transformers.MistralForCausalLM.from_pretrained(hf_dir, attn_implementation="eager").eval()
    for prompt in (long, long[:2]):
        _same_as_windowed_transformers(gen, hf, prompt)
    with pytest.raises(ValueError, match="tokens are past this model's sliding window of 8: it attends to the whole"):
        gen.model(torch.tensor([long]))  # (outside the cache, which masks to the window: logits far from HF's)


def _same_as_windowed_transformers(gen, hf, prompt: list[int]) -> None:
    new = gen.sample(prompt, SampleOptions(max_new_tokens=10, temperature=0), stop=frozenset())
    ids = prompt + new
    with torch.no_grad():
        want = hf(torch.tensor([ids])).logits[0]
        with KVCache(gen.model, torch.device("cpu"), window=8) as cache:
            got = [cache.next_logits(ids[:t]) for t in range(len(prompt), len(ids) + 1)]
        wrong = {}
        with KVCache(gen.model, torch.device("cpu"), window=8) as afresh:  # the window re-run from scratch
            for t in range(max(len(prompt), 9), len(ids) + 1):  # (past the window)
                afresh.clear()
                wrong[t] = afresh.next_logits(ids[t - 8:t])
    for t, logits in zip(range(len(prompt), len(ids) + 1), got):
        torch.testing.assert_close(logits, want[t - 1], atol=1e-4, rtol=0)
    assert max((w - want[t - 1]).abs().max() for t, w in wrong.items()) > 1e-3


def test_a_character_the_last_tokens_end_inside_is_left_out_and_said(trained_run, capsys):
    """A byte-level BPE writes 字 in 3 byte tokens: stopped after 2 (--max-new-tokens), the text
    ended with U+FFFD; it ends before that character now (what came before it kept), said on stderr."""
    gen = load_generator(trained_run, "cpu")
    prompt, new = gen.encode("In the beginning"), gen.tokenizer.encode(" God 字", add_special_tokens=False).ids
    cut = gen._decoded(prompt, new[:-1])
    assert cut.endswith("\ufffd") and cut.startswith(" God ")  # (the premise: a cut character)
    capsys.readouterr()
    assert gen._without_cut_character(prompt, new[:-1], cut) == " God "
    assert "the text ends inside a character" in capsys.readouterr().err
    whole = gen._decoded(prompt, new)
    assert gen._without_cut_character(prompt, new, whole) == whole == " God 字" and not capsys.readouterr().err
    # --json escapes it (JSON in any locale's terminal), and reads back as written
    assert main(["generate", str(trained_run), "--prompt", "字", "--max-new-tokens", "1", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["prompt"] == "字"
