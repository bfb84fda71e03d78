"""A fine-tune whose tokenizer has tokens added (chat markers, say): a model.vocab_size above the
starting weights' rows adds rows at the mean of theirs, as transformers' resize_token_embeddings
does; checked against transformers' own resize, through training and the export."""

from __future__ import annotations

import json

import pytest
import torch

from shardline.cli import main
from shardline.data.sources import read_documents
from shardline.data.tokenizer import train_bpe
from shardline.errors import CheckpointError, ConfigError
from shardline.trainer import Trainer
from tests.conftest import no_group_left

transformers = pytest.importorskip("transformers")

ADDED = ["<|im_start|>", "<|im_end|>", "<|tool|>"]


@pytest.fixture(scope="module")
def start(tmp_path_factory, small_corpus):
    """HF folders (untied, tied) whose rows are their tokenizer's tokens, that tokenizer with three
    tokens added, and text that holds them."""
    root = tmp_path_factory.mktemp("grow")
    tok = train_bpe(read_documents(str(small_corpus)), 300)
    rows = tok.get_vocab_size()
    for tied in (False, True):
        folder = root / f"hf_tied{int(tied)}"
        cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, vocab_size=rows,
                                       tie_word_embeddings=tied)
        torch.manual_seed(tied)
        transformers.LlamaForCausalLM(cfg).save_pretrained(folder)
        tok.save(str(folder / "tokenizer.json"))
    tok.add_special_tokens(ADDED)
    (root / "added").mkdir()
    tok.save(str(root / "added" / "tokenizer.json"))
    lines = [json.loads(line)["text"] for line in small_corpus.read_text().splitlines()[:60]]
    (root / "chat.jsonl").write_text("".join(
        json.dumps({"text": f"{ADDED[0]}{t[:400]}{ADDED[1]}{ADDED[2]}"}) + "\n" for t in lines))
    return root, rows


def _resized_reference(folder, rows: int):
    """transformers' model resized to `rows`, its new embedding and head rows set to the mean of the old."""
    hf = transformers.LlamaForCausalLM.from_pretrained(folder).eval()
    old = hf.get_input_embeddings().weight.detach().clone(), hf.get_output_embeddings().weight.detach().clone()
    hf.resize_token_embeddings(rows, mean_resizing=False)
    with torch.no_grad():
        for weight, before in zip((hf.get_input_embeddings().weight, hf.get_output_embeddings().weight), old):
            weight[len(before):] = before.mean(0)
    return hf


def _config(tiny_config, start, *extra):
    root, _ = start
    return tiny_config("train.steps=2", "train.eval_interval=0", "checkpoint.interval=2",
                       f"data.path={root / 'chat.jsonl'}", f"data.tokenizer={root / 'added' / 'tokenizer.json'}",
                       *extra)


@pytest.mark.parametrize("source, tied, sharded", [("hf", False, False), ("hf", True, True),
                                                    ("checkpoint", False, False), ("checkpoint", True, True)])
def test_added_rows_start_at_the_mean_as_transformers_resize_does(tiny_config, start, tmp_path, source, tied,
                                                                  sharded):
    """From an HF folder or a checkpoint, in place or (under CPU offload, FSDP2 on a one-rank mesh)
    sharded: the grown model's logits equal transformers' resized model's, the added tokens' too;
    it trains on the added tokens and exports with the larger vocabulary."""
    root, rows = start
    folder = root / f"hf_tied{int(tied)}"
    key = f"model.hf_path={folder}"
    if source == "checkpoint":
        assert main(["convert", "from-hf", str(folder), str(tmp_path / "ckpt")]) == 0
        key = f"model.init_from={tmp_path / 'ckpt'}"
    grown = rows + len(ADDED) + 3  # rows no token uses yet too (a multiple of 8 for the kernels, say)
    extra = ["memory.cpu_offload=true"] if sharded else []
    with no_group_left():
        trainer = Trainer(_config(tiny_config, start, key, f"model.vocab_size={grown}", *extra)).build()
        assert (trainer.dims.mesh is not None) == sharded and trainer.model_args.vocab_size == grown
        hf = _resized_reference(folder, grown)
        ids = torch.tensor([[5, rows, 17, rows + 1, rows + 2, grown - 1, 9, 3]])
        with torch.no_grad():
            torch.testing.assert_close(trainer.model.eval()(ids), hf(ids).logits, rtol=0, atol=1e-5)
        trainer.model.train()
        trainer.train()
    assert main(["convert", "to-hf", str(tmp_path / "run"), str(tmp_path / "out")]) == 0
    out = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert out.config.vocab_size == grown and out.config.tie_word_embeddings == tied
    assert all(token in (tmp_path / "out" / "tokenizer.json").read_text() for token in ADDED)  # the run's tokenizer
    embed = out.get_input_embeddings().weight
    assert not torch.equal(embed[rows], embed[rows + 1])  # trained apart: the text holds both tokens
    with torch.no_grad():
        torch.testing.assert_close(out(ids).logits, trainer.model.eval()(ids).float(), rtol=0, atol=1e-5)
    events = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [e["rows"] for e in events if e.get("event") == "vocab_grown"] == [f"{rows} -> {grown}"]
    if not sharded:  # the run resumes its grown weights (the shape check takes them), and says nothing again
        assert main(["train", f"--run.dir={tmp_path / 'run'}", "--train.steps=3"]) == 0
        events = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
        assert [e.get("step") for e in events if e.get("event") == "resume"] == [2]
        assert len([e for e in events if e.get("event") == "vocab_grown"]) == 1


def test_a_tokenizer_larger_than_the_rows_names_the_setting_and_fewer_rows_are_refused(tiny_config, start):
    root, rows = start
    folder = root / "hf_tied0"
    with pytest.raises(ConfigError, match=f"set model.vocab_size={rows + len(ADDED)} \\(or more\\) to add rows"):
        Trainer(_config(tiny_config, start, f"model.hf_path={folder}")).build()
    with pytest.raises(ConfigError, match=f"model.vocab_size={rows - 1} is below the {rows} vocabulary rows"):
        Trainer(_config(tiny_config, start, f"model.hf_path={folder}", f"model.vocab_size={rows - 1}",
                        f"data.tokenizer={folder / 'tokenizer.json'}")).build()


def test_the_launch_says_the_rows_it_adds_and_not_that_the_tokenizer_is_anothers(start):
    """Theirs with tokens added is not "another tokenizer" (that note stays for one that moves their ids)."""
    from shardline.config import load_config
    from shardline.interop.model_shape import model_shape
    from shardline.launch_notes import launch_notes

    root, rows = start
    cfg = load_config(None, [f"model.hf_path={root / 'hf_tied0'}", f"model.vocab_size={rows + 8}",
                             f"data.tokenizer={root / 'added' / 'tokenizer.json'}"])
    model = model_shape(cfg.model, rows + len(ADDED), cfg.moe)
    notes = dict(launch_notes(cfg, "cuda", 989.0, 1, model=model))
    assert notes["vocab_grown"]["rows"] == f"{rows} -> {rows + 8}" and "tokenizer_not_the_weights" not in notes
    assert "vocab_grown" not in dict(launch_notes(cfg, "cuda", 989.0, 1, model=model, resumed=True))
    moved = json.loads((root / "added" / "tokenizer.json").read_text())
    vocab = moved["model"]["vocab"]
    first, second = sorted(vocab, key=vocab.get)[:2]
    vocab[first], vocab[second] = vocab[second], vocab[first]  # two of their tokens swap ids
    (root / "moved.json").write_text(json.dumps(moved))
    cfg.data.tokenizer = str(root / "moved.json")
    assert "tokenizer_not_the_weights" in dict(launch_notes(cfg, "cuda", 989.0, 1, model=model))


def test_the_dry_run_says_the_rows_it_would_add(start, tmp_path, capsys):
    root, rows = start
    args = ["train", "--dry-run", f"--run.dir={tmp_path / 'run'}", f"--model.hf_path={root / 'hf_tied1'}",
            f"--data.path={root / 'chat.jsonl'}", f"--data.tokenizer={root / 'added' / 'tokenizer.json'}",
            "--optim.lr=2e-5"]
    assert main([*args, f"--model.vocab_size={rows + 5}"]) == 0
    assert f"notes     5 vocabulary rows added to the starting weights' {rows} (the embedding's and the output's, " \
           "at the mean of theirs); 2 rows no token of the tokenizer uses" in capsys.readouterr().out
    assert main([*args, f"--model.vocab_size={rows}"]) == 2  # the tokenizer's 3 added tokens need rows
    assert f"model.vocab_size={rows} is smaller than the tokenizer's {rows + 3} tokens; set model.vocab_size >= " \
           f"{rows + 3}" in capsys.readouterr().err
    assert main(args) == 2  # not set: it may be another model's tokenizer, or theirs grown
    assert f"set model.vocab_size={rows + 3} (or more)" in capsys.readouterr().err


@pytest.mark.parametrize("grow", [False, True])
def test_a_checkpoint_start_is_hashed_no_more_for_the_rows(tiny_config, tmp_path, monkeypatch, grow):
    """Hashing a 70B checkpoint takes minutes: its shape and rows are read from meta.json alone, and
    its load verifies it once (a start hashed it five times: the input checks twice, the loader's
    row count, the launch notes, the load)."""
    from shardline.resilience import checkpoint

    Trainer(tiny_config("train.steps=2", "checkpoint.interval=2", "train.eval_interval=0")).build().train()
    start = tmp_path / "run" / "checkpoints" / "step-000002"
    hashed, sha256 = [], checkpoint._sha256
    monkeypatch.setattr(checkpoint, "_sha256", lambda path: hashed.append(path.name) or sha256(path))
    extra = ["model.vocab_size=520"] if grow else []
    Trainer(tiny_config("train.steps=3", "train.eval_interval=0", f"model.init_from={start}", *extra,
                        run_dir=tmp_path / "tuned")).build().close()
    assert hashed.count("meta.json") == 1  # the load's (the input checks and the shape read meta.json alone)


def test_the_dry_run_still_verifies_a_checkpoint_to_start_from(tiny_config, tmp_path, capsys):
    import shutil

    Trainer(tiny_config("train.steps=2", "checkpoint.interval=2", "train.eval_interval=0")).build().train()
    damaged = tmp_path / "damaged"
    shutil.copytree(tmp_path / "run" / "checkpoints" / "step-000002", damaged)
    shard = max((damaged / "state").iterdir(), key=lambda f: f.stat().st_size)
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    args = ["train", "--dry-run", f"--run.dir={tmp_path / 'tuned'}", f"--model.init_from={damaged}",
            f"--data.path={tiny_config().data.path}", f"--data.tokenizer={tmp_path / 'run' / 'tokenizer.json'}",
            "--optim.lr=2e-5"]
    assert main(args) == 2
    assert str(shard.name) in capsys.readouterr().err
    with pytest.raises(CheckpointError, match=shard.name):  # and the launch, every rank agreeing, before the lock
        Trainer(tiny_config(f"model.init_from={damaged}", f"data.tokenizer={tmp_path / 'run' / 'tokenizer.json'}",
                            run_dir=tmp_path / "tuned")).build()
    assert not (tmp_path / "tuned" / ".lock").exists()


def test_rows_added_to_bf16_weights_are_their_fp32_mean_not_rounded_again(tiny_config, start, tmp_path):
    """The mean is taken, and kept, in the parameters' dtype: a bf16 folder and its fp32 convert start alike."""
    root, rows = start
    hf = transformers.LlamaForCausalLM.from_pretrained(root / "hf_tied0").to(torch.bfloat16)
    hf.save_pretrained(tmp_path / "bf16")
    (tmp_path / "bf16" / "tokenizer.json").write_text((root / "hf_tied0" / "tokenizer.json").read_text())
    trainer = Trainer(_config(tiny_config, start, f"model.hf_path={tmp_path / 'bf16'}",
                              f"model.vocab_size={rows + 4}")).build()
    stored = hf.get_input_embeddings().weight.detach().float()
    added = trainer.model.tok_embeddings.weight.detach()[rows:]
    torch.testing.assert_close(added, stored.mean(0).expand(4, -1), rtol=0, atol=1e-7)
    assert not torch.equal(added[0], stored.mean(0).bfloat16().float())


def test_theirs_with_another_normalizer_is_still_named_as_another_tokenizer(start, tmp_path):
    from tokenizers import normalizers

    from shardline.config import load_config
    from shardline.data.tokenizer import load_tokenizer
    from shardline.interop.model_shape import model_shape
    from shardline.launch_notes import launch_notes

    root, rows = start
    tok = load_tokenizer(str(root / "added" / "tokenizer.json"))
    tok.normalizer = normalizers.Lowercase()  # the same ids, other tokens for the same text
    tok.save(str(tmp_path / "lower.json"))
    cfg = load_config(None, [f"model.hf_path={root / 'hf_tied0'}", f"model.vocab_size={rows + 8}",
                             f"data.tokenizer={tmp_path / 'lower.json'}"])
    notes = dict(launch_notes(cfg, "cuda", 989.0, 1, model=model_shape(cfg.model, rows + len(ADDED), cfg.moe)))
    assert "tokenizer_not_the_weights" in notes and "vocab_grown" in notes


def test_a_folder_prepared_with_theirs_extended_trains_and_a_chat_export_stops_at_the_turn_end(tiny_config, start,
                                                                                              tmp_path):
    """The folder's tokenizer is theirs with tokens added: the run takes it (the weights' own would not
    fit the folder's ids). The chat template beside it ends a turn with <|tool|>: the export's
    generation_config.json stops there too, as `shardline generate --chat` does."""
    root, rows = start
    template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|tool|>\n{% endfor %}"
                "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    tok = tmp_path / "tok"
    tok.mkdir()
    (tok / "tokenizer.json").write_text((root / "added" / "tokenizer.json").read_text())
    (tok / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    lines = [json.loads(line)["text"] for line in (root / "chat.jsonl").read_text().splitlines()]
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps({"messages": [
        {"role": "user", "content": t[:12]}, {"role": "assistant", "content": t[12:200]}]}) + "\n" for t in lines))
    prepared = tmp_path / "prepared"
    assert main(["prepare", str(tmp_path / "chat.jsonl"), "--out", str(prepared), "--format", "chat",
                 "--tokenizer", str(tok / "tokenizer.json")]) == 0
    cfg = ["train.steps=2", "train.eval_interval=0", "checkpoint.interval=2", "data.format=chat", "train.seq_len=128",
           f"data.path={prepared}", f"model.hf_path={root / 'hf_tied0'}"]
    with pytest.raises(ConfigError, match=f"set model.vocab_size={rows + len(ADDED)} \\(or more\\)"):
        Trainer(tiny_config(*cfg)).build()
    trainer = Trainer(tiny_config(*cfg, f"model.vocab_size={rows + len(ADDED)}"))
    trainer.build().train()
    assert trainer.data.vocab_size == rows + len(ADDED)
    assert main(["convert", "to-hf", str(tmp_path / "run"), str(tmp_path / "out")]) == 0
    generation = json.loads((tmp_path / "out" / "generation_config.json").read_text())
    assert rows + ADDED.index("<|tool|>") in generation["eos_token_id"]


def test_theirs_extended_by_transformers_save_pretrained_counts_as_theirs(start, tmp_path):
    """transformers writes its tokenizer back with the padding and truncation of its last call."""
    from shardline.data.tokenizer import extends, load_tokenizer

    root, _ = start
    theirs = transformers.PreTrainedTokenizerFast(tokenizer_file=str(root / "hf_tied0" / "tokenizer.json"))
    theirs.add_special_tokens({"pad_token": "<pad>", "additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    theirs(["In the beginning", "God"], padding=True, truncation=True, max_length=8)
    theirs.save_pretrained(tmp_path / "saved")
    own = load_tokenizer(str(root / "hf_tied0" / "tokenizer.json"))
    assert extends(load_tokenizer(str(tmp_path / "saved" / "tokenizer.json")), own)
    assert not extends(own, own)  # nothing added
    from tokenizers import processors

    ending = load_tokenizer(str(tmp_path / "saved" / "tokenizer.json"))  # ... but it ends a text with <pad>
    ending.post_processor = processors.TemplateProcessing(single="$A <pad>", special_tokens=[("<pad>", 300)])
    assert not extends(ending, own)


def test_a_turn_end_that_is_the_eos_writes_no_generation_config(tmp_path, start):
    from shardline.interop.hf_files import _stop_where_the_run_did

    root, rows = start
    end = rows + ADDED.index("<|im_end|>")
    _stop_where_the_run_did(tmp_path, root / "added" / "tokenizer.json", {"eos_token_id": end}, "<|im_end|>", end)
    assert not (tmp_path / "generation_config.json").exists()  # (transformers takes config.json's then)
    _stop_where_the_run_did(tmp_path, root / "added" / "tokenizer.json", {"eos_token_id": 0}, "<|im_end|>", None)
    assert json.loads((tmp_path / "generation_config.json").read_text())["eos_token_id"] == [0, end]
