"""`shardline convert` both ways, and runs that start from converted weights."""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch

from shardline.cli import main
from shardline.config import load_config
from shardline.data.prepare import PrepareOptions, prepare
from shardline.data.tokenizer import eos_id, load_tokenizer, train_bpe
from shardline.errors import CheckpointError, ConfigError
from shardline.models.factory import args_from_json
from shardline.interop.model_shape import model_shape
from shardline.preflight import use_model_tokenizer
from shardline.resilience.checkpoint import read_meta
from shardline.trainer import Trainer
from tests.conftest import no_group_left, tiny_overrides

transformers = pytest.importorskip("transformers")


def test_checkpoint_to_hf_and_back(tiny_config, tmp_path, monkeypatch, capsys):
    trainer = Trainer(tiny_config("train.steps=6", "train.eval_interval=0")).build()
    trainer.train()
    hf_dir, back = tmp_path / "hf", tmp_path / "back"
    from shardline.resilience import checkpoint

    hashed, sha256 = [], checkpoint._sha256
    monkeypatch.setattr(checkpoint, "_sha256", lambda path: hashed.append(path.name) or sha256(path))
    assert main(["convert", "to-hf", str(tmp_path / "run"), str(hf_dir)]) == 0
    assert hashed.count("meta.json") == 1  # the checkpoint's files hashed once (three times: minutes at 70B)
    # which checkpoint of the run dir it exported (its newest valid one)
    newest = (tmp_path / "run" / "checkpoints" / "step-000006").resolve()
    assert f"(an HF LlamaForCausalLM folder of {newest})" in capsys.readouterr().out
    monkeypatch.undo()
    # a checkpoint folder named directly is checked too (a run dir's newest is checked as it is chosen)
    named = tmp_path / "named"
    shutil.copytree(tmp_path / "run" / "checkpoints" / "step-000006", named)
    (named / "meta.json").write_text((named / "meta.json").read_text() + " ")
    assert main(["convert", "to-hf", str(named), str(tmp_path / "hf-named")]) == 2
    assert not (tmp_path / "hf-named").exists()
    assert (hf_dir / "tokenizer.json").is_file()
    hf = transformers.LlamaForCausalLM.from_pretrained(hf_dir).eval()
    ids = torch.randint(0, trainer.data.vocab_size, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, trainer.model.eval()(ids), rtol=1e-4, atol=1e-4)

    assert main(["convert", "from-hf", str(hf_dir), str(back)]) == 0
    assert read_meta(back)["model_args"] == json.loads(json.dumps(read_meta(
        tmp_path / "run" / "checkpoints" / "step-000006")["model_args"]))
    assert args_from_json(read_meta(back)["model_args"]) == trainer.model_args

    # A new run starts from the converted weights: its first loss equals the trained
    # model's loss on that batch, far below the loss of a fresh init.
    fresh = Trainer(tiny_config("train.steps=1", run_dir=tmp_path / "fresh")).build()
    tuned = Trainer(tiny_config("train.steps=1", f"model.init_from={back}", run_dir=tmp_path / "tuned")).build()
    batch = tuned.data.train.batch([0, 1])
    for name, p in tuned.model.state_dict().items():
        torch.testing.assert_close(p, trainer.model.state_dict()[name])
    assert tuned.runner.loss_sum(batch) < fresh.runner.loss_sum(batch)


def test_a_checkpoint_moved_from_its_run_exports_with_a_given_tokenizer_and_its_bos(tiny_config, tmp_path, capsys,
                                                                                     small_corpus):
    """Away from its run dir a checkpoint has no tokenizer: the export says so, and --tokenizer
    gives one; a tokenizer that starts texts with one BOS token gives config.json its id."""
    import shutil

    from tokenizers import processors

    from shardline.data.sources import read_documents

    Trainer(tiny_config("train.steps=2", "train.eval_interval=0", "checkpoint.interval=2")).build().train()
    moved = tmp_path / "moved"
    shutil.copytree(tmp_path / "run" / "checkpoints" / "step-000002", moved)
    assert main(["convert", "to-hf", str(moved), str(tmp_path / "bare")]) == 0
    assert "without a tokenizer: none beside the checkpoint or in its run dir; give --tokenizer" in (
        capsys.readouterr().out)
    assert not (tmp_path / "bare" / "tokenizer.json").exists()

    tok = train_bpe(read_documents(str(small_corpus)), 300)
    tok.add_special_tokens(["<|begin_of_text|>"])
    bos = tok.token_to_id("<|begin_of_text|>")
    tok.post_processor = processors.TemplateProcessing(single="<|begin_of_text|> $A",
                                                       special_tokens=[("<|begin_of_text|>", bos)])
    (tmp_path / "tok").mkdir()
    tok.save(str(tmp_path / "tok" / "tokenizer.json"))
    assert main(["convert", "to-hf", str(moved), str(tmp_path / "hf"), "--tokenizer", str(tmp_path / "tok")]) == 0
    assert "without a tokenizer" not in capsys.readouterr().out
    assert (tmp_path / "hf" / "tokenizer.json").read_text() == (tmp_path / "tok" / "tokenizer.json").read_text()
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["bos_token_id"] == bos
    assert main(["convert", "to-hf", str(moved), str(tmp_path / "x"), "--tokenizer", str(tmp_path / "no.json")]) == 2
    assert "tokenizer file" in capsys.readouterr().err and not (tmp_path / "x").exists()
    assert main(["convert", "from-hf", str(tmp_path / "hf"), str(tmp_path / "y"), "--tokenizer", "t.json"]) == 2
    assert "--tokenizer applies to to-hf only" in capsys.readouterr().err


@pytest.mark.parametrize("tied, sharded", [(False, False), (False, True), (True, True)])
def test_train_from_hf_folder(tiny_config, small_prepared, tmp_path, monkeypatch, tied, sharded):
    """In place on one process, or (under CPU offload, FSDP2 on a one-rank mesh) streamed in
    chunks (small ones here: many) into sharded parameters, the tied output filled from the embedding."""
    monkeypatch.setattr("shardline.interop.weights.HF_CHUNK_BYTES", 20_000)
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=600,
                                   tie_word_embeddings=tied)
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(cfg).eval()
    hf.save_pretrained(tmp_path / "hf")
    extra = ["memory.cpu_offload=true"] if sharded else []
    with no_group_left():
        trainer = Trainer(tiny_config("train.steps=2", f"model.hf_path={tmp_path / 'hf'}", *extra,
                                      _data_tokenizer(small_prepared))).build()
        assert (trainer.dims.mesh is not None) == sharded
        assert trainer.model_args.vocab_size == 600
        ids = torch.randint(0, 600, (2, 16), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():  # the run starts from the folder's weights, not a fresh init
            torch.testing.assert_close(trainer.model.eval()(ids), hf(ids).logits, rtol=0, atol=1e-4)
        trainer.model.train()
        trainer.train()


def test_a_resume_does_not_read_the_hf_weights_again(tiny_config, small_prepared, tmp_path):
    """The checkpoint holds every weight: a resumed run restores it without reading the HF
    folder's weights (minutes at 70B on every rank), so a folder whose weights are gone since
    (its config and tokenizer kept) still resumes, from the trained weights."""
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=600)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path / "hf")
    start = ("train.eval_interval=0", f"model.hf_path={tmp_path / 'hf'}", _data_tokenizer(small_prepared))
    first = Trainer(tiny_config("train.steps=2", *start)).build()
    first.train()
    (tmp_path / "hf" / "model.safetensors").unlink()
    resumed = Trainer(tiny_config("train.steps=3", *start)).build()
    assert resumed.step == 2
    for name, p in resumed.model.state_dict().items():
        torch.testing.assert_close(p, first.model.state_dict()[name], rtol=0, atol=0)


def test_a_resume_goes_on_when_the_hf_folder_is_gone(tiny_config, small_prepared, tmp_path, capsys):
    """The folder a run started from moved or was deleted since (a hub cache cleaned, a run dir
    taken to another cluster): a resume reads only its shape, HF fields and tokenizer, which the
    run dir keeps, so it goes on and says so (a relaunch naming only the run dir, whose saved
    config names the folder and its tokenizer); the saved [model] still names the folder. A
    mistyped folder on a reused run dir, and a fresh start, still fail in one line."""
    from shardline.dry_run import dry_run

    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=600)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path / "hf")
    (tmp_path / "hf" / "tokenizer.json").write_bytes((small_prepared / "tokenizer.json").read_bytes())
    start = ("train.eval_interval=0", "checkpoint.interval=1", f"model.hf_path={tmp_path / 'hf'}")
    first = Trainer(tiny_config("train.steps=2", *start)).build()
    first.train()
    hf_fields = read_meta(tmp_path / "run" / "checkpoints" / "step-000002")["hf"]
    (tmp_path / "hf").rename(tmp_path / "moved")
    run = tmp_path / "run"
    report, _ = dry_run(tiny_config("train.steps=3", *start), 1)
    assert f"resumes from {run / 'checkpoints' / 'step-000002'}" in report and "is gone; the run resumes" in report
    resumed = Trainer(tiny_config("train.steps=3", *start)).build()
    assert resumed.step == 2 and resumed.cfg.model.hf_path == str(tmp_path / "hf")
    assert resumed.cfg.data.tokenizer == str(run / "tokenizer.json") and resumed.hf_fields == hf_fields
    for name, p in resumed.model.state_dict().items():
        torch.testing.assert_close(p, first.model.state_dict()[name], rtol=0, atol=0)
    resumed.metrics.close()
    resumed.guard.stop_watching()
    resumed.lock.release()
    # As a user relaunches it: the saved config.toml names the gone folder and its tokenizer.
    assert main(["train", f"--run.dir={run}", "--train.steps=3"]) == 0, capsys.readouterr().err
    events = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [e for e in events if e.get("event") == "starting_weights_gone"]
    assert f'hf_path = "{tmp_path / "hf"}"' in (run / "config.toml").read_text()
    assert read_meta(run / "checkpoints" / "step-000003")["hf"] == hf_fields  # export still writes them
    with pytest.raises(ConfigError, match="does not exist or is not a folder"):  # no checkpoint here is from it
        Trainer(tiny_config("train.steps=4", *start[:-1], f"model.hf_path={tmp_path / 'typo'}")).build()
    with pytest.raises(ConfigError, match="does not exist or is not a folder"):  # nothing to resume
        Trainer(tiny_config("train.steps=3", *start, run_dir=tmp_path / "fresh")).build()


def test_convert_errors_exit_2(tmp_path, capsys, small_prepared):
    assert main(["convert", "to-hf", str(small_prepared), str(tmp_path / "out")]) == 2  # ("malformed manifest")
    assert f"{small_prepared} is a prepared data folder (shardline prepare), not a checkpoint" in \
        capsys.readouterr().err
    assert main(["convert", "to-hf", str(tmp_path / "nothing"), str(tmp_path / "out")]) == 2
    assert f"{tmp_path / 'nothing'} does not exist: give a run dir or a checkpoint folder" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert main(["convert", "to-hf", str(tmp_path / "empty"), str(tmp_path / "out")]) == 2
    assert "neither a checkpoint folder nor a run dir" in capsys.readouterr().err
    (tmp_path / "empty" / "config.json").write_text("{}")  # an HF folder: the command that makes a checkpoint of it
    assert main(["convert", "to-hf", str(tmp_path / "empty"), str(tmp_path / "out")]) == 2
    assert "is a Hugging Face folder, not a checkpoint: `shardline convert from-hf" in capsys.readouterr().err
    assert main(["convert", "from-hf", str(tmp_path / "nothing"), str(tmp_path / "out")]) == 2
    capsys.readouterr()
    hf = _bf16_hf_folder(tmp_path / "hf")
    (tmp_path / "a-file").write_text("x")
    assert main(["convert", "from-hf", str(hf), str(tmp_path / "a-file" / "ck")]) == 2  # not a traceback
    last = capsys.readouterr().err.splitlines()[-1]  # (torchao may log its own lines first)
    assert last.startswith("shardline: error:") and f"{tmp_path / 'a-file'} is a file, not a folder" in last
    assert main(["convert", "from-hf", str(hf), str(tmp_path / "ck")]) == 0
    assert f"wrote {tmp_path / 'ck'}" in capsys.readouterr().out
    assert main(["convert", "to-hf", str(tmp_path / "ck"), str(tmp_path / "a-file" / "out")]) == 2
    assert "is a file, not a folder" in capsys.readouterr().err
    whole = (hf / "tokenizer.json").read_bytes()  # a download cut short: said now, not at the run's first eval
    (hf / "tokenizer.json").write_bytes(whole[: len(whole) // 2])
    assert main(["convert", "from-hf", str(hf), str(tmp_path / "ck2")]) == 2 and not (tmp_path / "ck2").exists()
    last = capsys.readouterr().err.splitlines()[-1]
    assert f"the tokenizer {hf / 'tokenizer.json'} cannot be read as a tokenizer.json" in last, last
    assert last.endswith("to convert the weights alone: a run from them then needs data.tokenizer)"), last
    (hf / "tokenizer.json").write_bytes(whole)
    config = (hf / "config.json").read_text()  # JSON's NaN and Infinity, a negative theta: a traceback, or NaN losses
    for bad, says in [('"num_hidden_layers": NaN', "num_hidden_layers=nan is not an integer"),
                      ('"rope_theta": Infinity', "rope_theta=inf is not finite"),
                      ('"rope_theta": -5.0', "rope_theta=-5.0 must be > 0"),
                      ('"num_hidden_layers": 1' + "0" * 400, "num_hidden_layers=1000000000"),  # (a traceback)
                      ('"rms_norm_eps": -1', "norm_eps=-1.0 must be > 0 (rms_norm_eps in HF's config.json)")]:
        key = bad.split(":")[0]
        (hf / "config.json").write_text(re.sub(key + r": [^,}]+", bad, config))
        assert main(["convert", "from-hf", str(hf), str(tmp_path / "ck2")]) == 2 and not (tmp_path / "ck2").exists()
        assert says in capsys.readouterr().err, bad
    (hf / "config.json").write_text(config)
    (hf / "tokenizer.json").unlink()  # an HF cache's link whose blob is gone: was converted without a tokenizer
    (hf / "tokenizer.json").symlink_to(tmp_path / "blobs" / "gone")
    assert main(["convert", "from-hf", str(hf), str(tmp_path / "ck2")]) == 2 and not (tmp_path / "ck2").exists()
    assert "is a link to a file that is not there (fetch it again" in capsys.readouterr().err


def _data_tokenizer(prepared) -> str:
    """The prepared folder's own tokenizer, named for an HF folder of random weights that has
    none: a run from weights refuses a tokenizer prepare trained unless the user names it."""
    return f"data.tokenizer={prepared / 'tokenizer.json'}"


def _bf16_hf_folder(folder):
    """A bf16 HF Llama folder with its special tokens and a tokenizer.json, of tiny_config's shape."""
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=600, bos_token_id=1, eos_token_id=2,
                                   pad_token_id=0, initializer_range=0.01)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(folder)
    train_bpe(["in the beginning was the word"] * 4, 300).save(str(folder / "tokenizer.json"))
    return folder


def test_hf_to_checkpoint_and_back_keeps_dtype_special_tokens_and_tokenizer(tmp_path, monkeypatch, capsys):
    """from-hf then to-hf by relative paths (a checkpoint outside any run dir) gives the folder
    back: the same bf16 tensors bit for bit, its bos/eos ids and its tokenizer.json."""
    from safetensors.torch import load_file

    from shardline.interop import convert

    _bf16_hf_folder(tmp_path / "hf")
    monkeypatch.chdir(tmp_path)
    assert main(["convert", "from-hf", "hf", "ck"]) == 0
    held = []  # the model the export holds: in the export dtype (half of fp32's memory), not fp32
    write = convert.to_hf_pretrained
    monkeypatch.setattr(convert, "to_hf_pretrained", lambda model, *a, **k: held.append(
        {p.dtype for p in model.parameters()}) or write(model, *a, **k))
    assert main(["convert", "to-hf", "ck", "out"]) == 0
    assert held == [{torch.bfloat16}]
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert (config["dtype"], config["bos_token_id"], config["eos_token_id"]) == ("bfloat16", 1, 2)
    assert (config["pad_token_id"], config["initializer_range"]) == (0, 0.01)  # kept, not the defaults
    assert (tmp_path / "out" / "tokenizer.json").read_bytes() == (tmp_path / "hf" / "tokenizer.json").read_bytes()
    source, back = load_file(tmp_path / "hf" / "model.safetensors"), load_file(tmp_path / "out" / "model.safetensors")
    assert source.keys() == back.keys() and all(torch.equal(source[k], back[k]) for k in source)
    assert main(["convert", "to-hf", "ck", "out32", "--dtype", "fp32"]) == 0  # (train.precision's name too)
    assert json.loads((tmp_path / "out32" / "config.json").read_text())["dtype"] == "float32"
    assert main(["convert", "to-hf", "ck", "out8", "--dtype", "int8"]) == 2 and not (tmp_path / "out8").exists()
    assert "dtype='int8' is invalid: one of float32, bfloat16, float16 (or fp32, bf16" in capsys.readouterr().err

    (tmp_path / "a-file").write_text("x")
    assert main(["convert", "from-hf", "hf", "a-file"]) == 2
    assert "a-file exists and is not an empty folder" in capsys.readouterr().err


@pytest.mark.parametrize("override, change", [("model.n_layers=3", "n_layers=2 -> 3"),
                                              ("model.tie_embeddings=1", "tie_embeddings=False -> True")])
def test_overrides_that_reshape_the_starting_weights_are_refused(tmp_path, override, change):
    """An override the weights cannot fill would leave tensors random under a sharded load (but for
    more vocabulary rows, which the load adds: tests/e2e/test_vocab_growth.py)."""
    hf = _bf16_hf_folder(tmp_path / "hf")
    cfg = load_config(None, [f"model.hf_path={hf}", override])
    with pytest.raises(ConfigError, match=f"holds weights of another shape than the overrides ask for .*{change}"):
        model_shape(cfg.model, 600, cfg.moe)
    same = load_config(None, [f"model.hf_path={hf}", "model.n_layers=2", "model.head_dim=16", "model.n_kv_heads=2",
                              "model.rope_theta=50000"])  # head_dim 16 = 64 / 4 heads: the folder's own
    assert model_shape(same.model, 600, same.moe).rope_theta == 50000  # the same shape, other frequencies
    grown = load_config(None, [f"model.hf_path={hf}", "model.vocab_size=640"])
    assert model_shape(grown.model, 600, grown.moe).vocab_size == 640


def test_a_run_from_converted_weights_tokenizes_with_their_tokenizer_and_exports_its_files(tmp_path, small_corpus):
    """from-hf keeps the HF folder's tokenizer with its settings and generation config; a run
    from that checkpoint on raw text tokenizes with it (not with a newly trained tokenizer, whose
    ids would mean nothing to the weights), keeps the files in its run dir, and to-hf writes them
    back; exporting over the folder the weights came from is refused, and it keeps its files."""
    hf = _bf16_hf_folder(tmp_path / "hf")
    side = {"tokenizer_config.json": {"chat_template": "{% for m in messages %}{{ m['content'] }}{% endfor %}"},
            "generation_config.json": {"eos_token_id": 2, "temperature": 0.6}}
    for name, content in side.items():
        (hf / name).write_text(json.dumps(content))
    # The slow tokenizer's files (Qwen2Tokenizer's; other tools read them): they travel as well
    side |= {"vocab.json": {"a": 0}, "merges.txt": "#version: 0.2\na b"}
    (hf / "vocab.json").write_text(json.dumps(side["vocab.json"]))
    (hf / "merges.txt").write_text(side["merges.txt"])
    assert main(["convert", "from-hf", str(hf), str(tmp_path / "ck")]) == 0
    run = tmp_path / "run"
    trainer = Trainer(load_config(None, tiny_overrides(run, small_corpus, "train.steps=1", "train.eval_interval=0",
                                                       f"model.init_from={tmp_path / 'ck'}"))).build()
    assert trainer.data.tokenizer.to_str() == load_tokenizer(str(hf / "tokenizer.json")).to_str()
    trainer.train()
    out = tmp_path / "out"
    assert main(["convert", "to-hf", str(run), str(out)]) == 0
    assert load_tokenizer(str(out / "tokenizer.json")).to_str() == trainer.data.tokenizer.to_str()
    for name in set(side) - {"generation_config.json"}:
        assert (out / name).read_bytes() == (hf / name).read_bytes(), name
    # its settings kept, and a stop at the end-of-document token the run trained its texts to end with
    doc_end = eos_id(trainer.data.tokenizer)
    assert doc_end != 2 and json.loads((out / "generation_config.json").read_text()) == {
        "eos_token_id": sorted([2, doc_end]), "temperature": 0.6}
    assert main(["convert", "to-hf", str(tmp_path / "ck"), str(tmp_path / "back")]) == 0  # no run: as it came
    assert (tmp_path / "back" / "generation_config.json").read_bytes() == (hf / "generation_config.json").read_bytes()
    assert main(["convert", "to-hf", str(run), str(hf)]) == 2
    assert sorted(p.name for p in hf.iterdir()) == sorted(["config.json", "model.safetensors", "tokenizer.json", *side])


def test_generation_settings_come_with_the_weights_not_with_a_tokenizer_from_elsewhere(tmp_path, small_corpus):
    """generation_config.json describes the weights (their end tokens, sampling defaults): from-hf
    keeps it without a tokenizer.json and to-hf writes it back; a run from those weights (HF
    folder or converted checkpoint) keeps theirs, never the one beside a data.tokenizer named
    from another folder (not even when the weights have none)."""
    hf = _bf16_hf_folder(tmp_path / "hf")
    (hf / "generation_config.json").write_text(json.dumps({"eos_token_id": 2, "temperature": 0.6}))
    other = tmp_path / "tok"
    other.mkdir()
    (hf / "tokenizer.json").rename(other / "tokenizer.json")
    (other / "generation_config.json").write_text(json.dumps({"temperature": 1.0}))
    assert main(["convert", "from-hf", str(hf), str(tmp_path / "ck")]) == 0
    assert (tmp_path / "ck" / "generation_config.json").read_bytes() == (hf / "generation_config.json").read_bytes()
    assert main(["convert", "to-hf", str(tmp_path / "ck"), str(tmp_path / "back")]) == 0
    assert (tmp_path / "back" / "generation_config.json").read_bytes() == (hf / "generation_config.json").read_bytes()
    for name, start in (("a", f"model.hf_path={hf}"), ("b", f"model.init_from={tmp_path / 'ck'}")):
        Trainer(load_config(None, tiny_overrides(tmp_path / name, small_corpus, "train.steps=1", start,
                                                 f"data.tokenizer={other / 'tokenizer.json'}"))).build()
        written = tmp_path / name / "generation_config.json"
        assert written.read_bytes() == (hf / "generation_config.json").read_bytes(), start
    (hf / "generation_config.json").unlink()
    Trainer(load_config(None, tiny_overrides(tmp_path / "c", small_corpus, "train.steps=1", f"model.hf_path={hf}",
                                             f"data.tokenizer={other / 'tokenizer.json'}"))).build()
    assert not (tmp_path / "c" / "generation_config.json").exists()


def test_weights_without_a_tokenizer_refuse_a_new_one_for_raw_text(tmp_path, small_corpus, small_prepared, capsys):
    """Starting weights with no tokenizer.json: raw text would get a newly trained tokenizer, so
    the run is refused in one line, and so is a folder prepared with a BPE trained on its text,
    unless data.tokenizer names one or the folder was prepared with a tokenizer its preparer
    chose."""
    hf = _bf16_hf_folder(tmp_path / "hf")
    (hf / "tokenizer.json").rename(tmp_path / "tokenizer.json")
    assert main(["convert", "from-hf", str(hf), str(tmp_path / "ck")]) == 0
    assert "the HF folder holds no tokenizer.json, so give that run data.tokenizer" in capsys.readouterr().out
    from shardline.preflight import _converted_from_hf

    assert _converted_from_hf(str(tmp_path / "ck")) == str(hf)  # (a training checkpoint is not: test_checkpoint)
    (hf / "tokenizer.model").write_bytes(b"")  # a SentencePiece model, which shardline does not read
    chosen = tmp_path / "prepared"  # with the weights' tokenizer, as their user would
    prepare(PrepareOptions(inputs=[str(small_corpus)], out=str(chosen), tokenizer=str(tmp_path / "tokenizer.json"),
                           progress=False))
    for start, hint in ((f"model.hf_path={hf}", "its tokenizer.model is not read"),
                        (f"model.init_from={tmp_path / 'ck'}", f"converted from {hf}, which holds no")):
        cfg = load_config(None, [start, f"data.path={small_corpus}"])
        with pytest.raises(ConfigError, match=f"has no tokenizer.json.*{hint}.*set data.tokenizer"):
            use_model_tokenizer(cfg)
        given = load_config(None, [start, f"data.path={small_corpus}", f"data.tokenizer={tmp_path / 'tokenizer.json'}"])
        use_model_tokenizer(given)
        assert given.data.tokenizer == str(tmp_path / "tokenizer.json")
        own_bpe = load_config(None, [start, f"data.path={small_prepared}"])
        with pytest.raises(ConfigError, match=f"has no tokenizer.json.*{hint}.*prepared with a BPE trained on its "
                                              "own text.*prepare it again with --overwrite --tokenizer"):
            use_model_tokenizer(own_bpe)
        prepared = load_config(None, [start, f"data.path={chosen}"])
        use_model_tokenizer(prepared)
        assert prepared.data.tokenizer == ""
    # As a convert before 2026-12-03 left one: no tokenizer in the checkpoint, one in its HF folder
    (tmp_path / "tokenizer.json").rename(hf / "tokenizer.json")
    with pytest.raises(ConfigError, match=f"the HF folder it was converted from holds {hf / 'tokenizer.json'}"):
        use_model_tokenizer(load_config(None, [f"model.init_from={tmp_path / 'ck'}", f"data.path={small_corpus}"]))


def test_init_from_naming_an_hf_folder_or_a_run_dir_says_which_key_or_path_takes_it(tiny_config, tmp_path):
    """Both read as a damaged checkpoint before ("is incomplete: no manifest.json")."""
    from shardline.preflight import check_config

    hf = _bf16_hf_folder(tmp_path / "hf")
    with pytest.raises(ConfigError, match=rf"model.init_from='{hf}' is a Hugging Face folder: give it as "
                                          r"model.hf_path"):
        check_config(tiny_config(f"model.init_from={hf}"))
    Trainer(tiny_config("train.steps=6", "train.eval_interval=0")).build().train()
    run = tmp_path / "run"
    with pytest.raises(ConfigError, match=rf"is a run dir: name one of its checkpoints, e.g. "
                                          rf"{run / 'checkpoints' / 'step-000006'}"):
        check_config(tiny_config(f"model.init_from={run}", run_dir=tmp_path / "other"))
    check_config(tiny_config(f"model.init_from={run / 'checkpoints' / 'step-000006'}", run_dir=tmp_path / "other"))


def test_a_tokenizer_larger_than_the_starting_weights_names_both_readings(tiny_config, tmp_path, capsys):
    """It may be another model's tokenizer, or theirs with tokens added: the line says which setting
    serves the second (model.vocab_size, which the weights once refused: a circle)."""
    from tokenizers import Tokenizer, models

    hf = _bf16_hf_folder(tmp_path / "hf")  # 600 rows
    big = tmp_path / "big.json"
    Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1, "b": 999}, unk_token="[UNK]")).save(str(big))
    assert main(["train", "--dry-run", f"--run.dir={tmp_path / 'run'}", f"--model.hf_path={hf}",
                 f"--data.tokenizer={big}"]) == 2
    last = capsys.readouterr().err.splitlines()[-1]  # (torchao and the HF folder's writer may log lines first)
    assert last.startswith("shardline: error: the starting weights have 600 vocabulary rows, fewer than the "
                           "tokenizer's 1000 tokens: if that tokenizer (data.tokenizer, or the prepared data's) is "
                           "theirs with tokens added, set model.vocab_size=1000 (or more) to add rows, which start "
                           "at the mean of theirs; else use the tokenizer.json they came with"), last


def test_a_chatml_run_exports_the_chatml_template_transformers_renders_as_it_trained(tiny_config, tmp_path,
                                                                                    small_prepared):
    """Chat data without a template renders as ChatML: the export carries that template, so
    apply_chat_template gives the text the run trained on (it had none: a ValueError)."""
    from shardline.data.encode import render_chat, reply_prompt

    chats = tmp_path / "chats.jsonl"
    chats.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"tell me of the city {i}"},
                                                      {"role": "assistant", "content": "the river " * 8}]}) + "\n"
                             for i in range(300)))
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(small_prepared / "tokenizer.json"))  # the run's BPE, with ChatML's markers
    tok.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    tok.save(str(tmp_path / "tokenizer.json"))
    Trainer(tiny_config(f"data.path={chats}", "data.format=chat", f"data.tokenizer={tmp_path / 'tokenizer.json'}",
                        "train.steps=2", "train.eval_interval=0")).build().train()
    assert main(["convert", "to-hf", str(tmp_path / "run"), str(tmp_path / "hf")]) == 0
    hf_tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    talk = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    assert hf_tok.apply_chat_template(talk, tokenize=False) == render_chat(talk, None)
    assert hf_tok.apply_chat_template(talk[:1], tokenize=False, add_generation_prompt=True) == \
        reply_prompt(talk[:1], None)
    # A reply ends at <|im_end|> for transformers too (its tokenizer had no special tokens; generate ran past it)
    end = tok.token_to_id("<|im_end|>")
    assert hf_tok.eos_token == "<|im_end|>" and hf_tok.eos_token_id == end
    generation = json.loads((tmp_path / "hf" / "generation_config.json").read_text())
    assert generation["eos_token_id"] == sorted({end, tok.token_to_id("<|endoftext|>")})
    # A base model's tokenizer (its own settings, no template): the export's generate stops at <|im_end|> too
    base = tmp_path / "base"
    base.mkdir()
    tok.save(str(base / "tokenizer.json"))
    (base / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    Trainer(tiny_config(f"data.path={chats}", "data.format=chat", f"data.tokenizer={base / 'tokenizer.json'}",
                        "train.steps=2", "train.eval_interval=0", run_dir=tmp_path / "run2")).build().train()
    assert main(["convert", "to-hf", str(tmp_path / "run2"), str(tmp_path / "hf2")]) == 0
    generation = json.loads((tmp_path / "hf2" / "generation_config.json").read_text())
    assert generation["eos_token_id"] == sorted({end, tok.token_to_id("<|endoftext|>")})
    # A vocabulary without ChatML's markers as tokens (text pieces): no stop token to list, and no stop_strings
    # (transformers' generate raises on them unless given the tokenizer): the README says how to pass it one
    Trainer(tiny_config(f"data.path={chats}", "data.format=chat", f"data.tokenizer={small_prepared / 'tokenizer.json'}",
                        "train.steps=2", "train.eval_interval=0", "train.seq_len=128", run_dir=tmp_path / "run3")
            ).build().train()
    assert main(["convert", "to-hf", str(tmp_path / "run3"), str(tmp_path / "hf3")]) == 0
    generation = tmp_path / "hf3" / "generation_config.json"
    assert not generation.exists() or "stop_strings" not in json.loads(generation.read_text())


def test_an_export_of_a_run_from_scratch_names_its_special_tokens(tiny_config, tmp_path):
    """The BPE a run trains comes without tokenizer_config.json: transformers' tokenizer had no eos."""
    Trainer(tiny_config("train.steps=1", "train.eval_interval=0")).build().train()
    assert main(["convert", "to-hf", str(tmp_path / "run"), str(tmp_path / "hf")]) == 0
    hf_tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert hf_tok.eos_token == "<|endoftext|>" and hf_tok.eos_token_id == config["eos_token_id"]
    assert not (tmp_path / "hf" / "generation_config.json").exists()


def test_a_seq_len_past_the_starting_weights_positions_is_named_at_the_start(tmp_path):
    """Allowed (a context extension), but it was silent, and the export raised the recorded maximum."""
    from shardline.config import load_config
    from shardline.launch_notes import launch_notes

    hf = _bf16_hf_folder(tmp_path / "hf")
    trained = json.loads((hf / "config.json").read_text())["max_position_embeddings"]
    longer = dict(launch_notes(load_config(None, [f"model.hf_path={hf}", f"train.seq_len={2 * trained}"]), "cuda",
                               989.0, 1))
    assert longer["context_extended"]["trained_positions"] == trained
    assert longer["context_extended"]["seq_len"] == 2 * trained
    assert "a higher model.rope_theta raises its base frequency" in longer["context_extended"]["note"]
    theta = json.loads((hf / "config.json").read_text()).get("rope_theta", 10000.0)
    for given, said in ((4 * theta, f"model.rope_theta={4 * theta:g} raises RoPE's base frequency (theirs: {theta:g})"),
                        (theta / 2, f"model.rope_theta={theta / 2:g} sets RoPE's base frequency (theirs: {theta:g})")):
        noted = dict(launch_notes(load_config(None, [f"model.hf_path={hf}", f"train.seq_len={2 * trained}",
                                                     f"model.rope_theta={given}"]), "cuda", 989.0, 1))
        assert said in noted["context_extended"]["note"]
    within = load_config(None, [f"model.hf_path={hf}", f"train.seq_len={trained}"])
    assert "context_extended" not in dict(launch_notes(within, "cuda", 989.0, 1))
    # a checkpoint: the seq_len its run trained at (not the preset's maximum), read from meta.json alone
    ckpt = tmp_path / "ckpt"
    assert main(["convert", "from-hf", str(hf), str(ckpt)]) == 0
    meta = json.loads((ckpt / "meta.json").read_text())
    run = tmp_path / "run"
    Trainer(load_config(None, ["train.steps=2", "train.eval_interval=0", "train.seq_len=32",
                               f"run.dir={run}"])).build().train()
    saved = run / "checkpoints" / "step-000002"
    assert json.loads((saved / "meta.json").read_text())["model_args"]["max_seq_len"] > 64  # the preset's
    notes = dict(launch_notes(load_config(None, [f"model.init_from={saved}", "train.seq_len=64"]), "cuda", 989.0, 1))
    assert notes["context_extended"]["trained_positions"] == 32
    from shardline.dry_run import dry_run  # the dry run says it too (it said nothing of the positions)

    report, _ = dry_run(load_config(None, [f"model.init_from={saved}", "train.seq_len=64", "run.device=cpu",
                                           f"run.dir={tmp_path / 'longer'}"]), 1)
    assert ("notes     train.seq_len=64 is past the positions the starting weights were trained for; RoPE as the "
            "weights had it") in report and "(trained for 32)" in report
    assert meta["model_args"]["max_seq_len"] == trained  # (from-hf keeps the folder's positions)
    from_hf = dict(launch_notes(load_config(None, [f"model.init_from={ckpt}", f"train.seq_len={2 * trained}"]),
                                "cuda", 989.0, 1))
    assert from_hf["context_extended"]["trained_positions"] == trained  # (no run config: its recorded positions)


def test_a_tokenizer_other_than_the_starting_weights_own_is_named(tmp_path):
    """A smaller tokenizer trained on other text fine-tuned an HF model in silence (its ids name
    other embedding rows); the weights' own one, or a copy of it saved again, is not named."""
    from tokenizers import Tokenizer, models

    from shardline.config import load_config
    from shardline.launch_notes import launch_notes

    hf = _bf16_hf_folder(tmp_path / "hf")
    other = tmp_path / "other.json"
    Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1}, unk_token="[UNK]")).save(str(other))
    notes = dict(launch_notes(load_config(None, [f"model.hf_path={hf}", f"data.tokenizer={other}"]), "cuda", 989.0, 1))
    assert notes["tokenizer_not_the_weights"]["theirs"] == str(hf / "tokenizer.json")
    copy = tmp_path / "copy.json"
    copy.write_text(json.dumps(json.loads((hf / "tokenizer.json").read_text()), indent=4))  # the same, laid out anew
    same = load_config(None, [f"model.hf_path={hf}", f"data.tokenizer={copy}"])
    assert "tokenizer_not_the_weights" not in dict(launch_notes(same, "cuda", 989.0, 1))


def test_a_broken_chat_template_is_named_by_its_file_and_a_run_tokenizer_not_as_data_tokenizer(tiny_config, tmp_path,
                                                                                               capsys):
    """A chat_template.jinja that fails was blamed on tokenizer_config.json and exported in silence;
    a damaged run tokenizer was named data.tokenizer, which the user had not set."""
    Trainer(tiny_config("train.steps=1", "train.eval_interval=0")).build().train()
    (tmp_path / "run" / "chat_template.jinja").write_text("{% for m in messages %}{{ m.nope() }}{% endfor %}")
    assert main(["convert", "to-hf", str(tmp_path / "run"), str(tmp_path / "hf")]) == 0
    err = capsys.readouterr().err
    assert (f"shardline: warning: exported as it is: the tokenizer's chat template "
            f"({tmp_path / 'run' / 'chat_template.jinja'}) fails on a conversation") in err, err
    (tmp_path / "run" / "tokenizer.json").write_text('{"truncated": ')
    assert main(["convert", "to-hf", str(tmp_path / "run"), str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err
    assert f"the tokenizer {tmp_path / 'run' / 'tokenizer.json'} cannot be read as a tokenizer.json" in err, err
    assert "data.tokenizer" not in err


def test_a_chatml_exports_generation_config_keeps_its_keys_and_adds_the_turn_end(tmp_path, small_prepared):
    """The export's generation_config.json (a starting model's, copied) keeps its keys and eos ids
    (an int or a list) and gains <|im_end|>; a vocabulary without it as one token is left as it was.
    The end-of-document token the run trained with is a stop too where HF's eos is another (a tokenizer
    holding <|end_of_text|> whose eos_token is <|im_end|>: generate stopped there, HF's ran on)."""
    from tokenizers import Tokenizer

    from shardline.interop.hf_files import _stop_where_the_run_did as stops

    tok = Tokenizer.from_file(str(small_prepared / "tokenizer.json"))
    plain = tmp_path / "plain.json"
    tok.save(str(plain))
    tok.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    chatml = tmp_path / "chatml.json"
    tok.save(str(chatml))
    written = {"eos_token_id": [5, 9], "temperature": 0.6, "top_p": 0.9}
    (tmp_path / "generation_config.json").write_text(json.dumps(written))
    stops(tmp_path, plain, {"eos_token_id": 7}, "<|im_end|>", 9)
    assert json.loads((tmp_path / "generation_config.json").read_text()) == written
    stops(tmp_path, chatml, {"eos_token_id": 7}, "<|im_end|>", 9)
    end = tok.token_to_id("<|im_end|>")
    assert json.loads((tmp_path / "generation_config.json").read_text()) == {**written,
                                                                             "eos_token_id": sorted({5, 9, 7, end})}
    (tmp_path / "generation_config.json").unlink()
    stops(tmp_path, plain, {"eos_token_id": 7}, "", 7)  # the run's document end is HF's eos: no file
    assert not (tmp_path / "generation_config.json").exists()
    stops(tmp_path, plain, {"eos_token_id": 7}, "", 2)  # another: both
    assert json.loads((tmp_path / "generation_config.json").read_text()) == {"eos_token_id": [2, 7]}


def test_the_dry_run_checks_the_hf_folders_weights_as_the_launch_reads_them(tmp_path, capsys):
    """A folder with config and tokenizer but no weights passed the dry run (exit 0), and the launch
    then refused it: a script's `--dry-run && torchrun ...` went on. A tensor of another shape too."""
    from safetensors.torch import load_file, save_file

    hf = _bf16_hf_folder(tmp_path / "hf")
    dry = ["train", "--dry-run", f"--run.dir={tmp_path / 'run'}", f"--model.hf_path={hf}"]
    assert main(dry) == 0
    out = capsys.readouterr().out  # (the default lr, 3e-3: the launch's lr_high_for_trained_weights, said here too)
    assert f"notes     optim.lr=0.003 on trained weights ({hf}): a pretraining lr, which undoes what they" in out
    assert main([*dry, "--optim.lr=5e-5"]) == 0 and "on trained weights" not in capsys.readouterr().out
    tensors = load_file(hf / "model.safetensors")
    tensors["model.layers.1.mlp.up_proj.weight"] = tensors["model.layers.1.mlp.up_proj.weight"][:64]
    save_file(tensors, hf / "model.safetensors", metadata={"format": "pt"})
    capsys.readouterr()
    assert main(dry) == 2
    assert "model.layers.1.mlp.up_proj.weight" in capsys.readouterr().err.splitlines()[-1]
    (hf / "model.safetensors").unlink()
    assert main(dry) == 2
    assert f"{hf} holds neither model.safetensors nor" in capsys.readouterr().err.splitlines()[-1]


def test_starting_weights_holding_nan_are_refused_at_launch(tiny_config, small_prepared, tmp_path):
    """An HF folder (or a checkpoint) with a NaN trained with every step skipped as an anomaly and
    exited 0: the launch refuses it, naming the parameter and the setting."""
    from safetensors.torch import load_file, save_file

    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=600)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path / "hf")
    tensors = load_file(tmp_path / "hf" / "model.safetensors")
    tensors["model.layers.1.mlp.up_proj.weight"][3, 5] = float("inf")
    save_file(tensors, tmp_path / "hf" / "model.safetensors", metadata={"format": "pt"})
    start = ("train.eval_interval=0", f"model.hf_path={tmp_path / 'hf'}", _data_tokenizer(small_prepared))
    with pytest.raises(CheckpointError, match=rf"model.hf_path='{tmp_path / 'hf'}': parameter "
                                              r"layers\.1\.feed_forward\.w3\.weight \(read from tensor "
                                              r"model\.layers\.1\.mlp\.up_proj\.weight\) holds NaN or inf values"):
        Trainer(tiny_config("train.steps=2", *start)).build()
    assert not (tmp_path / "run").exists() or not any((tmp_path / "run").iterdir())  # (before the run dir)
