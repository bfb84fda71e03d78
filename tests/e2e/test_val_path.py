"""data.val_path: a dataset's own validation file evaluated on whole, during training and by
`shardline eval`, while the training data holds nothing out."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from shardline.cli import main
from shardline.config import load_config
from shardline.data import build_data
from shardline.data.prepare import PrepareOptions, prepare
from shardline.errors import CheckpointError, DataError
from shardline.launch_notes import unused_settings
from shardline.trainer import Trainer
from tests.conftest import tiny_overrides


@pytest.fixture(scope="module")
def split(tmp_path_factory, small_corpus, small_prepared):
    """The small corpus cut into train.jsonl and validation.jsonl (a dataset's two files), and the tokenizer."""
    root = tmp_path_factory.mktemp("valpath")
    lines = small_corpus.read_text().splitlines()
    (root / "train.jsonl").write_text("\n".join(lines[:120]) + "\n")
    (root / "validation.jsonl").write_text("\n".join(lines[120:126]) + "\n")
    return root, str(small_prepared / "tokenizer.json")


def _cfg(tmp_path, data: str, tokenizer: str, *extra: str):
    return load_config(None, tiny_overrides(tmp_path / "run", data, f"data.tokenizer={tokenizer}", *extra))


def _tokens(seqs) -> np.ndarray:
    return np.concatenate([seqs.batch([i])["input_ids"].numpy().ravel() for i in range(len(seqs))])


def test_the_validation_file_is_read_whole_and_the_training_file_holds_nothing_out(split, tmp_path):
    root, tok = split
    data = build_data(_cfg(tmp_path, root / "train.jsonl", tok, f"data.val_path={root / 'validation.jsonl'}"))
    alone = build_data(_cfg(tmp_path, root / "validation.jsonl", tok, "data.val_fraction=0", "train.eval_interval=0"))
    whole = build_data(_cfg(tmp_path, root / "train.jsonl", tok, "data.val_fraction=0", "train.eval_interval=0"))
    held = build_data(_cfg(tmp_path, root / "train.jsonl", tok))
    assert np.array_equal(_tokens(data.val), _tokens(alone.train))  # all of it, packed as a training file is
    assert len(data.train) == len(whole.train) > len(held.train)  # every training document trains
    assert data.describe(4)["held_out_sequences"] == len(alone.train)


def test_a_prepared_validation_folder_is_read_whole_and_must_share_the_tokenizer(split, tmp_path):
    root, tok = split
    folder = tmp_path / "val_prepared"
    prepare(PrepareOptions(inputs=[str(root / "validation.jsonl")], out=str(folder), tokenizer=tok,
                           val_fraction=0.2, progress=False))  # (both of its splits are evaluated on)
    data = build_data(_cfg(tmp_path, root / "train.jsonl", tok, f"data.val_path={folder}"))
    raw = build_data(_cfg(tmp_path, root / "train.jsonl", tok, f"data.val_path={root / 'validation.jsonl'}"))
    assert sum(p.num_documents for p in data.val.sources) == 6
    assert sum(p.num_tokens for p in data.val.sources) == raw.val.num_tokens
    other = tmp_path / "other_prepared"
    prepare(PrepareOptions(inputs=[str(root / "validation.jsonl")], out=str(other), vocab_size=300, progress=False))
    with pytest.raises(DataError, match="data.val_path=.* was prepared with another tokenizer than the run's"):
        build_data(_cfg(tmp_path, root / "train.jsonl", tok, f"data.val_path={other}"))


def test_mistakes_name_data_val_path(split, tmp_path):
    root, tok = split
    (tmp_path / "tiny.jsonl").write_text(json.dumps({"text": "too short"}) + "\n")
    with pytest.raises(DataError, match=r"data.val_path=.*tiny.jsonl' holds \d+ tokens: too few for one sequence"):
        build_data(_cfg(tmp_path, root / "train.jsonl", tok, f"data.val_path={tmp_path / 'tiny.jsonl'}"))
    with pytest.raises(DataError, match="data.val_path='.*nowhere.jsonl'"):
        build_data(_cfg(tmp_path, root / "train.jsonl", tok, f"data.val_path={tmp_path / 'nowhere.jsonl'}"))
    ds = tmp_path / "ds"
    (ds / "train").mkdir(parents=True), (ds / "validation").mkdir(), (ds / "dataset_dict.json").write_text("{}")
    with pytest.raises(DataError, match=f"is a datasets DatasetDict: name the folder of its split to evaluate on "
                                        f"\\({ds}/validation\\)"):
        build_data(_cfg(tmp_path, root / "train.jsonl", tok, f"data.val_path={ds}"))
    cfg = _cfg(tmp_path, root / "train.jsonl", tok, f"data.val_path={root / 'validation.jsonl'}",
               "data.val_fraction=0.1")
    assert "data.val_fraction" in unused_settings(cfg)


def test_a_run_evaluates_on_it_and_eval_gives_the_logged_loss(split, tmp_path, capsys):
    """The logged eval loss is the validation file's (equal to eval's), and eval takes another
    validation file for a run that held out a share (no "data changed" warning: the held-out data
    is the file's, not cut from the run's data)."""
    root, tok = split
    val = f"data.val_path={root / 'validation.jsonl'}"
    Trainer(_cfg(tmp_path, root / "train.jsonl", tok, val, "train.steps=2", "train.eval_interval=2",
                 "checkpoint.interval=2", "train.eval_batches=100")).build().train()
    logged = next(json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
                  if json.loads(line)["kind"] == "eval")
    alone = build_data(_cfg(tmp_path, root / "validation.jsonl", tok, "data.val_fraction=0", "train.eval_interval=0"))
    assert logged["eval_sequences"] == len(alone.train)  # the whole file (100 batches ask for more)
    assert main(["eval", str(tmp_path / "run"), "--json"]) == 0
    got = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert got["loss"] == pytest.approx(logged["eval_loss"], rel=1e-6) and got["data"] == str(root / "validation.jsonl")

    train = _eval_json(capsys, str(tmp_path / "run"), f"--data.path={root / 'train.jsonl'}")
    assert train["data"] == str(root / "train.jsonl")  # other data given: its held-out split, not the run's file

    other = tmp_path / "other"
    Trainer(_cfg(other, root / "train.jsonl", tok, "train.steps=2", "train.eval_interval=0",
                 "checkpoint.interval=2")).build().train()
    assert main(["eval", str(other / "run"), f"--{val}", "--batches", "0", "--json"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out.strip().splitlines()[-1])["sequences"] == len(alone.train) and "changed" not in err


def test_eval_on_a_validation_file_alone_needs_no_training_data(split, tmp_path, capsys, monkeypatch):
    """The run's training file gone (another machine, another directory): --data.val_path suffices."""
    root, tok = split
    train = tmp_path / "train.jsonl"
    train.write_text((root / "train.jsonl").read_text())
    Trainer(_cfg(tmp_path, train, tok, "train.steps=2", "train.eval_interval=2", "checkpoint.interval=2",
                 f"data.val_path={root / 'validation.jsonl'}")).build().train()
    logged = next(json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
                  if json.loads(line)["kind"] == "eval")
    train.unlink()
    from shardline.data import loader

    reads, read_documents = [], loader.read_documents
    monkeypatch.setattr(loader, "read_documents", lambda path, *a, **k: reads.append(path) or read_documents(
        path, *a, **k))
    got = _eval_json(capsys, str(tmp_path / "run"), f"--data.val_path={root / 'validation.jsonl'}")
    assert got["loss"] == pytest.approx(logged["eval_loss"], rel=1e-6) and got["data"] == str(root / "validation.jsonl")
    assert reads == [str(root / "validation.jsonl")]  # read and tokenized once (it was twice: as stand-in data too)
    short = tmp_path / "short.jsonl"
    short.write_text(json.dumps({"text": "a few words"}) + "\n", encoding="utf-8")
    assert main(["eval", str(tmp_path / "run"), f"--data.val_path={short}"]) == 2
    assert f"data.val_path={str(short)!r} holds" in capsys.readouterr().err  # (not "training tokens")


def test_the_dry_run_refuses_a_folder_prepared_with_another_tokenizer_and_unused_is_said(split, tmp_path, capsys):
    root, tok = split
    other = tmp_path / "other_prepared"
    prepare(PrepareOptions(inputs=[str(root / "validation.jsonl")], out=str(other), vocab_size=300, progress=False))
    assert main(["train", "--dry-run", f"--run.dir={tmp_path / 'run'}", f"--data.path={root / 'train.jsonl'}",
                 f"--data.tokenizer={tok}", f"--data.val_path={other}"]) == 2
    assert "was prepared with another tokenizer than the run's" in capsys.readouterr().err
    cfg = _cfg(tmp_path, root / "train.jsonl", tok, f"data.val_path={root / 'validation.jsonl'}",
               "train.eval_interval=0")
    assert len(build_data(cfg).val) == 0  # not read (not "unused": the training data still holds nothing out)
    assert "data.val_path" not in unused_settings(cfg)
    assert main(["train", "--dry-run", f"--run.dir={tmp_path / 'run'}", f"--data.path={root / 'train.jsonl'}",
                 f"--data.tokenizer={tok}", f"--data.val_path={other}", "--train.eval_interval=0"]) == 0  # nor here


def _eval_json(capsys, *args: str) -> dict:
    assert main(["eval", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_a_chat_mixture_reads_it_as_chat_and_a_folder_of_both_kinds_is_named(split, tmp_path, capsys):
    """Every source of a mixture sets format chat (data.format left at text): the validation file is
    chat too. A val folder holding training files beside its held-out ones is refused as such."""
    root, tok = split
    texts = [json.loads(line)["text"] for line in (root / "train.jsonl").read_text().splitlines()]
    for name, part in (("a", texts[:40]), ("b", texts[40:80]), ("val", texts[80:90])):
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps({"messages": [
            {"role": "user", "content": t[:20]}, {"role": "assistant", "content": t[20:120]}]}) + "\n" for t in part))
    mix = ['data.mix=[{path="%s", format="chat"}, {path="%s", format="chat"}]' % (tmp_path / "a.jsonl",
                                                                               tmp_path / "b.jsonl")]
    cfg = load_config(None, [*tiny_overrides(tmp_path / "run", "", f"data.tokenizer={tok}", "train.seq_len=64",
                                             f"data.val_path={tmp_path / 'val.jsonl'}"), *mix])
    cfg.data.path = ""
    data = build_data(cfg)
    assert data.val.count_labels(np.arange(len(data.val))) < len(data.val) * 64 * 0.9  # replies only: chat
    run = [*tiny_overrides(tmp_path / "run", "", f"data.tokenizer={tok}", "train.seq_len=64", "train.steps=2",
                           f"data.val_path={tmp_path / 'val.jsonl'}", "train.eval_interval=2", "checkpoint.interval=2")]
    Trainer(load_config(None, [*run, *mix])).build().train()
    logged = next(json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
                  if json.loads(line)["kind"] == "eval")
    got = _eval_json(capsys, str(tmp_path / "run"), f"--data.val_path={tmp_path / 'val.jsonl'}")  # read as chat
    assert got["loss"] == pytest.approx(logged["eval_loss"], rel=1e-6)
    assert main(["eval", str(tmp_path / "run"), "--data.val_path="]) == 2
    assert "--data.val_path= is empty: omit it" in capsys.readouterr().err
    folder = tmp_path / "valdir"
    folder.mkdir()
    (folder / "train.jsonl").write_text((root / "train.jsonl").read_text())
    (folder / "validation.jsonl").write_text((root / "validation.jsonl").read_text())
    with pytest.raises(DataError, match="holds training files beside its held-out files .* every file of a folder is "
                                        "evaluated on"):
        build_data(_cfg(tmp_path, root / "train.jsonl", tok, f"data.val_path={folder}"))


def test_a_validation_file_inside_the_training_data_is_said(split, tmp_path, capsys):
    from shardline.launch_notes import launch_notes

    root, tok = split
    cfg = _cfg(tmp_path, root, tok, f"data.val_path={root / 'validation.jsonl'}")
    assert dict(launch_notes(cfg, "cpu", 1.0, 1))["evaluates_on_training_data"]["inside"] == f"data.path={root}"
    assert main(["train", "--dry-run", f"--run.dir={tmp_path / 'dry'}", f"--data.path={root / 'train.jsonl'}",
                 f"--data.tokenizer={tok}", f"--data.val_path={root / 'train.jsonl'}"]) == 0  # the dry run says it
    assert f"is (inside) data.path={root / 'train.jsonl'}: the eval loss is a training loss" in capsys.readouterr().out
    assert "evaluates_on_training_data" not in dict(launch_notes(
        _cfg(tmp_path, root / "train.jsonl", tok, f"data.val_path={root / 'validation.jsonl'}"), "cpu", 1.0, 1))
    glob = _cfg(tmp_path, f"{root}/*.jsonl", tok, f"data.val_path={root / 'validation.jsonl'}")
    inside = dict(launch_notes(glob, "cpu", 1.0, 1))["evaluates_on_training_data"]["inside"]
    assert inside == f"data.path={root}/*.jsonl"
    glob.train.eval_interval = 0  # nothing evaluated: nothing to say
    assert "evaluates_on_training_data" not in dict(launch_notes(glob, "cpu", 1.0, 1))
    ds = tmp_path / "ds"  # a DatasetDict's validation split beside the train split the run reads
    (ds / "train").mkdir(parents=True), (ds / "validation").mkdir(), (ds / "dataset_dict.json").write_text("{}")
    (ds / "train" / "t.jsonl").write_text((root / "train.jsonl").read_text())
    (ds / "validation" / "v.jsonl").write_text((root / "validation.jsonl").read_text())
    split_dd = _cfg(tmp_path, ds, tok, f"data.val_path={ds / 'validation'}")
    assert "evaluates_on_training_data" not in dict(launch_notes(split_dd, "cpu", 1.0, 1))


def test_adding_it_to_a_run_that_held_out_a_share_is_refused_naming_it(split, tmp_path, capsys):
    """Its training documents would change under the saved data position (the held-out share would train)."""
    root, tok = split
    Trainer(_cfg(tmp_path, root / "train.jsonl", tok, "train.steps=2", "train.eval_interval=0",
                 "checkpoint.interval=2")).build().train()
    val = root / "validation.jsonl"
    said = (r"trained holding out data.val_fraction=0.01 of its documents; with data.val_path those would train .*"
            rf"`shardline eval RUN --data.val_path={val}`")
    with pytest.raises(CheckpointError, match=said):
        Trainer(_cfg(tmp_path, root / "train.jsonl", tok, "train.steps=4", "train.eval_interval=0",
                     f"data.val_path={val}")).build()
    # ... with the BPE trained on the training documents (no data.tokenizer): named as such, not as another
    # tokenizer (the documents that would train make another BPE); the dry run says so too
    bpe = tmp_path / "bpe"
    given = [f"--data.path={root / 'train.jsonl'}", "--data.vocab_size=300", "--train.eval_interval=0",
             "--checkpoint.interval=2", "--model.preset=tiny", "--train.seq_len=32", "--train.global_batch_size=4",
             "--train.micro_batch_size=4", f"--run.dir={bpe}"]
    assert main(["train", *given, "--train.steps=2"]) == 0
    for dry in ([], ["--dry-run"]):
        assert main(["train", *given, "--train.steps=4", f"--data.val_path={val}", *dry]) == 2
        assert "trained holding out data.val_fraction=0.01" in capsys.readouterr().err
    # A run that evaluated on it, relaunched without it: part of its training data would be held out
    assert main(["train", *given, f"--run.dir={tmp_path / 'with'}", "--train.steps=2", f"--data.val_path={val}",
                 "--train.eval_interval=2"]) == 0
    assert main(["train", *given, f"--run.dir={tmp_path / 'with'}", "--train.steps=4", "--data.val_path="]) == 2
    assert "give data.val_path again (any file" in capsys.readouterr().err
    assert main(["train", *given, f"--run.dir={tmp_path / 'with'}", "--train.steps=4",
                 f"--data.val_path={root / 'train.jsonl'}", "--train.eval_interval=2"]) == 0  # another file: fine
    # A prepared folder's split is prepare's, which data.val_fraction never cuts: adding it changes no training data
    folder = tmp_path / "folder"
    prepared = str(Path(tok).parent)
    first = _cfg(folder, prepared, tok, "train.steps=2", "train.eval_interval=0", "checkpoint.interval=2")
    Trainer(first).build().train()
    resumed = Trainer(_cfg(folder, prepared, tok, "train.steps=4", "train.eval_interval=2", f"data.val_path={val}"))
    assert resumed.build().step == 2
    resumed.close()


def test_the_dry_run_says_what_it_evaluates_on(split, tmp_path, capsys):
    root, tok = split
    assert main(["train", "--dry-run", f"--run.dir={tmp_path / 'run'}", f"--data.path={root / 'train.jsonl'}",
                 f"--data.tokenizer={tok}", f"--data.val_path={root / 'validation.jsonl'}"]) == 0
    out = capsys.readouterr().out
    assert f"evaluates on {root / 'validation.jsonl'}: 6 documents" in out and "held out" not in out
    # (the training file holds nothing out then; without it, the dry run counts what the launch holds out)
    assert main(["train", "--dry-run", f"--run.dir={tmp_path / 'run'}", f"--data.path={root / 'train.jsonl'}",
                 f"--data.tokenizer={tok}"]) == 0
    out = capsys.readouterr().out
    documents = len((root / "train.jsonl").read_text().splitlines())
    assert f"{root / 'train.jsonl'}: {documents:,} documents ({max(1, round(documents * 0.01))} of them held out" in out


def test_a_prepared_folder_overlaps_the_files_it_was_prepared_from_and_a_folder_prepared_alike(split, tmp_path):
    """A prepared folder beside a file it was prepared from, or beside a copy of itself, or evaluated on that
    file: its held-out documents were trained on, or everything read twice, and no note said so."""
    from shardline.launch_notes import launch_notes

    root, tok = split
    lines = (root / "train.jsonl").read_text().splitlines(keepends=True)
    (tmp_path / "a.jsonl").write_text("".join(lines[::2]))
    (tmp_path / "b.jsonl").write_text("".join(lines[1::2]))
    for out, inputs in (("prep", ["a.jsonl"]), ("copy", ["a.jsonl"]), ("more", ["a.jsonl", "b.jsonl"])):
        prepare(PrepareOptions(inputs=[str(tmp_path / i) for i in inputs], out=str(tmp_path / out), tokenizer=str(tok),
                               progress=False))

    def noted(*overrides: str) -> dict:
        return dict(launch_notes(load_config(None, [*overrides, f"data.tokenizer={tok}"]), "cpu", 1.0, 1))

    prep, copy, more, a, b = (tmp_path / n for n in ("prep", "copy", "more", "a.jsonl", "b.jsonl"))
    said = noted(f'data.mix=[{{path="{prep}"}}, {{path="{a}"}}]')["mixture_sources_overlap"]
    assert said["sources"] == f"data.mix[0].path={prep} and data.mix[1].path={a}"
    alike = "their files are read by each: sampled more than the weights say"  # (the same files at one share:
    assert said["why"] == alike                                                # one split, the same held out)
    said = noted(f'data.mix=[{{path="{prep}"}}, {{path="{copy}"}}]')["mixture_sources_overlap"]
    assert said["why"] == alike
    said = noted(f'data.mix=[{{path="{prep}"}}, {{path="{more}"}}]')["mixture_sources_overlap"]  # (files added: by
    assert said["why"] == alike                                              # content, the shared ones held out alike)
    said = noted(f'data.mix=[{{path="{prep}"}}, {{path="{a}"}}]', "data.val_fraction=0.2")["mixture_sources_overlap"]
    assert said["why"].endswith("so one may evaluate on what another trains on")  # (the raw file at another share)
    assert "mixture_sources_overlap" not in noted(f'data.mix=[{{path="{prep}"}}, {{path="{b}"}}]')
    inside = noted(f"data.path={prep}", f"data.val_path={a}")["evaluates_on_training_data"]["inside"]
    assert inside == f"data.path={prep}"
    assert "evaluates_on_training_data" not in noted(f"data.path={prep}", f"data.val_path={b}")


def test_mixture_sources_that_read_the_same_files_are_said(split, tmp_path, capsys):
    """A folder and a file inside it as two sources: the file was sampled by both, in silence (and, held out
    by position, each source held out its own documents: one evaluated on what the other trained on)."""
    from shardline.launch_notes import launch_notes

    root, tok = split
    web = tmp_path / "web"
    web.mkdir()
    lines = (root / "train.jsonl").read_text().splitlines(keepends=True)
    (web / "a.jsonl").write_text("".join(lines[::2]))
    (web / "b.jsonl").write_text("".join(lines[1::2]))
    both = f'data.mix=[{{path="{web}"}}, {{path="{web / "b.jsonl"}"}}]'
    noted = dict(launch_notes(load_config(None, [both, f"data.tokenizer={tok}"]), "cpu", 1.0, 1))
    said = noted["mixture_sources_overlap"]["sources"]
    assert said == f"data.mix[0].path={web} and data.mix[1].path={web / 'b.jsonl'}"
    # (split by content at one share: a document both read is held out by both, or by neither)
    assert noted["mixture_sources_overlap"]["why"] == "their files are read by each: sampled more than the weights say"
    assert main(["train", "--dry-run", f"--run.dir={tmp_path / 'dry'}", f"--{both}", f"--data.tokenizer={tok}"]) == 0
    assert (f"notes     two sources overlap, data.mix[0].path={web} and data.mix[1].path={web / 'b.jsonl'}: their "
            "files are read by each: sampled more than the weights say") in capsys.readouterr().out
    (tmp_path / "linked").symlink_to(web)  # a pattern through a link, beside the folder itself
    linked = f'data.mix=[{{path="{web}"}}, {{path="{tmp_path / "linked"}/*.jsonl"}}]'
    assert "mixture_sources_overlap" in dict(launch_notes(load_config(None, [linked, f"data.tokenizer={tok}"]),
                                                          "cpu", 1.0, 1))
    (tmp_path / "weblink").symlink_to(web)  # a link to the folder beside the folder
    twice = f'data.mix=[{{path="{web}"}}, {{path="{tmp_path / "weblink"}"}}]'
    assert "mixture_sources_overlap" in dict(launch_notes(load_config(None, [twice, f"data.tokenizer={tok}"]),
                                                          "cpu", 1.0, 1))
    fields = f'data.mix=[{{path="{web}"}}, {{path="{web / "b.jsonl"}", text_field="title"}}]'  # other documents
    assert "mixture_sources_overlap" not in dict(launch_notes(load_config(None, [fields, f"data.tokenizer={tok}"]),
                                                              "cpu", 1.0, 1))
    apart = f'data.mix=[{{path="{web / "a.jsonl"}"}}, {{path="{web / "b.jsonl"}"}}]'
    assert "mixture_sources_overlap" not in dict(launch_notes(load_config(None, [apart, f"data.tokenizer={tok}"]),
                                                              "cpu", 1.0, 1))
