"""Prepared folders (`shardline prepare`), mixtures and chat data: same batches, restarts, clear errors."""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import re
import shutil
import signal
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc
import pyarrow.parquet as pq
import pytest
from tokenizers import Tokenizer

from shardline.config import load_config
from shardline.data import build_data
from shardline.data.mixture import MixedSequences
from shardline.data.packing import IGNORE_INDEX
from shardline.data.pool import EncodeJob, encode_chunk
from shardline.data.prepare import PrepareOptions, PrepareStopped, prepare
from shardline.data.shards import verify
from shardline.data.sources import read_documents, read_file
from shardline.errors import CheckpointError, ConfigError, DataError
from shardline.launch_notes import unused_settings
from shardline.preflight import check_config
from tests.conftest import resealed

SMALL = dict(vocab_size=512, progress=False, chunk_bytes=30_000)


@pytest.fixture(autouse=True)
def two_workers_run_as_two(monkeypatch):
    """The tests' workers=2 run two processes on any host (on one core, prepare would run one: a test that
    kills a worker then killed pytest)."""
    monkeypatch.setattr("shardline.data.pool.usable_cores", lambda: max(2, len(os.sched_getaffinity(0))))


def data(path, *extra, seq_len=64):
    return build_data(load_config(None, [f"data.path={path}", "data.vocab_size=512", f"train.seq_len={seq_len}",
                                         *extra]))


def assert_same_batches(a, b):
    """Every sequence of both splits, the label counts and the tokenizer are identical."""
    assert a.tokenizer.to_str() == b.tokenizer.to_str()
    for x, y in ((a.train, b.train), (a.val, b.val)):
        assert len(x) == len(y) > 0
        idx = np.arange(len(x))
        bx, by = x.batch(idx), y.batch(idx)
        for key in ("input_ids", "labels", "doc_ids"):
            assert bx[key].dtype == by[key].dtype and bx[key].equal(by[key]), key
        assert x.count_labels(idx) == y.count_labels(idx) == int((bx["labels"] != IGNORE_INDEX).sum())


@pytest.fixture(scope="module")
def mixed_folder(tmp_path_factory, small_corpus):
    """The small corpus as .jsonl.gz + .parquet + .txt + a datasets save_to_disk folder (.arrow)."""
    docs = read_documents(str(small_corpus))
    root = tmp_path_factory.mktemp("mixed")
    (root / "a.jsonl.gz").write_bytes(gzip.compress("".join(json.dumps({"text": d}) + "\n"
                                                            for d in docs[:40]).encode()))
    pq.write_table(pa.table({"text": docs[40:80]}), root / "b.parquet", row_group_size=7)
    (root / "c.txt").write_text("\n\n\n".join(d.replace("\n\n\n", "\n\n") for d in docs[80:100]))
    (root / "d" / "train").mkdir(parents=True)
    (root / "d" / "dataset_dict.json").write_text('{"splits": ["train"]}')
    table = pa.table({"text": docs[100:], "id": list(range(len(docs) - 100))})
    with ipc.new_stream(root / "d" / "train" / "data-00000-of-00001.arrow", table.schema) as w:
        w.write_table(table, max_chunksize=9)
    return root


def test_prepared_folder_gives_the_raw_paths_batches_bit_for_bit(tmp_path, mixed_folder):
    out = tmp_path / "prep"
    manifest = prepare(PrepareOptions([str(mixed_folder)], str(out), workers=2, shard_tokens=40_000, **SMALL))
    assert manifest["dtype"] == "uint16" and len(manifest["splits"]["train"]["shards"]) > 3  # windows cross shards
    assert manifest["input_documents"] == len(read_documents(str(mixed_folder)))
    raw, prepared = data(mixed_folder), data(out)
    assert_same_batches(raw, prepared)
    assert verify(out) == []
    # one fingerprint of the training tokens, read either way (a run may move from one to the other)
    assert raw.position_state()["content"] == prepared.position_state()["content"] == manifest["train_fingerprint"]


def test_a_deleted_shard_is_reported_by_verify_and_a_manifest_without_a_key_is_damaged(tmp_path, small_corpus):
    out = tmp_path / "prep"
    manifest = prepare(PrepareOptions([str(small_corpus)], str(out), **SMALL))
    shard = manifest["splits"]["val"]["shards"][0]["file"]
    (out / shard).unlink()
    assert verify(out) == [shard]  # listed as bad, not a traceback
    del manifest["dtype"]
    (out / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(DataError, match=r"manifest.json is damaged \(no dtype\); prepare the folder again"):
        data(out)
    # values a damaged (or hand-edited) manifest may hold: one line each, not a TypeError or a misread
    damage = {"dtype": ("int8", "dtype 'int8' is neither uint16 nor uint32"),
              "documents": ("12", "splits.val needs a document count and a list of shards"),
              "tokens": (None, r"splits.val.shards\[0\] needs file and a token count")}
    for key, (value, says) in damage.items():
        broken = json.loads(json.dumps({**manifest, "dtype": "uint16"}))
        if key == "dtype":
            broken["dtype"] = value
        elif key == "documents":
            broken["splits"]["val"]["documents"] = value
        else:
            del broken["splits"]["val"]["shards"][0]["tokens"]
        (out / "manifest.json").write_text(json.dumps(broken))
        with pytest.raises(DataError, match=f"manifest.json is damaged \\({says}\\); prepare the folder again"):
            data(out)


def test_a_token_id_past_the_shards_dtype_is_an_error_not_a_wrap(prepared):
    """The worker casts to the shards' dtype: an id that does not fit is refused before the cast."""
    job = EncodeJob(str(prepared / "tokenizer.json"), False, None, np.dtype(np.uint8))
    with pytest.raises(DataError, match="token id .* does not fit the folder's uint8 shards"):
        encode_chunk(job, [("train", "a few words of text, enough for ids past 255 " * 4)])


def test_a_single_document_is_split_by_characters_as_before(tmp_path, small_corpus, capsys):
    text = tmp_path / "one.txt"
    text.write_text(" ".join(read_documents(str(small_corpus))[:20]).replace("\n", " "))
    prepare(PrepareOptions([str(text)], str(tmp_path / "prep"), val_fraction=0.1, **{**SMALL, "progress": True}))
    assert_same_batches(data(text, "data.val_fraction=0.1"), data(tmp_path / "prep"))
    assert "2/2 documents" in capsys.readouterr().err  # its train and val pieces, never 2/1


def test_an_interrupted_prepare_resumes_and_never_leaves_a_manifest_behind(tmp_path, small_corpus, capsys):
    out, opts = tmp_path / "prep", dict(shard_tokens=30_000, **SMALL)
    with pytest.raises(PrepareStopped):
        prepare(PrepareOptions([str(small_corpus)], str(out), stop_after_shards=3, **opts))
    assert not (out / "manifest.json").exists()
    with pytest.raises(DataError, match="unfinished prepared folder"):
        data(out)
    kept = (out / "train" / "tokens-00000.bin").stat().st_mtime_ns
    (out / "train" / "tokens-00003.bin").write_bytes(b"half a shard")  # written after the last commit
    with open(out / "train" / "docs.idx", "ab") as f:
        f.write(b"\x00" * 24)
    progress = json.loads((out / "progress.json").read_text())
    assert 0 < progress["documents_done"] < 150
    prepare(PrepareOptions([str(small_corpus)], str(out), workers=2, **{**opts, "progress": True}))
    assert (out / "train" / "tokens-00000.bin").stat().st_mtime_ns == kept  # resumed, not redone
    err = capsys.readouterr().err
    assert f"resuming an interrupted prepare at document {progress['documents_done']:,}" in err
    # Its BPE is the one the interrupted prepare trained: not trained again (a pass over the corpus)
    assert "using the byte-level BPE the interrupted prepare trained" in err and "training a byte-level" not in err
    assert not (out / "progress.json").exists() and verify(out) == []
    fresh = tmp_path / "fresh"
    prepare(PrepareOptions([str(small_corpus)], str(fresh), **opts))
    assert (json.loads((out / "manifest.json").read_text())["splits"]
            == json.loads((fresh / "manifest.json").read_text())["splits"])
    assert (out / "tokenizer.json").read_bytes() == (fresh / "tokenizer.json").read_bytes()
    # The resumed prepare's last line counts the whole job's tokens, as its documents (not this session's)
    total = sum(shard["tokens"] for split in json.loads((out / "manifest.json").read_text())["splits"].values()
                for shard in split["shards"])
    assert f"documents, {total:,} tokens" in err.strip().splitlines()[-1], err


@pytest.fixture(scope="module")
def prepared(tmp_path_factory, small_corpus):
    out = tmp_path_factory.mktemp("p") / "prep"
    prepare(PrepareOptions([str(small_corpus)], str(out), shard_tokens=50_000, **SMALL))
    return out


def test_a_damaged_or_mismatched_folder_is_one_clear_error(tmp_path, prepared, small_corpus):
    bad = tmp_path / "bad"
    shutil.copytree(prepared, bad)
    shard = bad / "train" / "tokens-00001.bin"
    shard.write_bytes(shard.read_bytes()[:-2])
    with pytest.raises(DataError, match=r"train/tokens-00001.bin has \d+ bytes, its manifest says \d+"):
        data(bad)
    shard.unlink()
    with pytest.raises(DataError, match="is missing train/tokens-00001.bin"):
        data(bad)
    other = tmp_path / "other.json"
    data(small_corpus, "data.vocab_size=300").tokenizer.save(str(other))
    with pytest.raises(DataError, match="differs from the tokenizer .* was prepared with") as err:
        data(prepared, f"data.tokenizer={other}")
    assert "\n" not in str(err.value) and "set data.tokenizer=" not in str(err.value)  # (another BPE: re-prepare)
    # The folder's is the given one with tokens added (chat markers): its own offered first, as a
    # re-prepare with the given one would lose the added tokens.
    ext = Tokenizer.from_file(str(prepared / "tokenizer.json"))
    ext.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    ext.save(str(tmp_path / "ext.json"))
    extended = tmp_path / "extended"
    prepare(PrepareOptions([str(small_corpus)], str(extended), tokenizer=str(tmp_path / "ext.json"), **SMALL))
    with pytest.raises(DataError, match=re.escape(
            f"(512 tokens; the folder's 514); the folder's is this one with tokens added: to train with it, set "
            f"data.tokenizer={extended / 'tokenizer.json'}")):
        data(extended, f"data.tokenizer={prepared / 'tokenizer.json'}")
    # Tokens added to another framing (one starting a text with a BOS): re-preparing with the given one
    # would lose them; what differs is said (it was offered as the only way).
    from tokenizers import processors

    start = ext.token_to_id("<|im_start|>")
    ext.post_processor = processors.TemplateProcessing(single="<|im_start|> $A",
                                                       special_tokens=[("<|im_start|>", start)])
    ext.save(str(tmp_path / "framed.json"))
    framed = tmp_path / "framed"
    prepare(PrepareOptions([str(small_corpus)], str(framed), tokenizer=str(tmp_path / "framed.json"), **SMALL))
    with pytest.raises(DataError, match=re.escape(
            "the folder's is not this one with tokens added (it starts or ends a text with other special tokens (a "
            "BOS its post-processor adds, say)): add them to this one and prepare with that, or prepare the folder "
            f"again with --overwrite --tokenizer {prepared / 'tokenizer.json'}")):
        data(framed, f"data.tokenizer={prepared / 'tokenizer.json'}")
    from shardline.data.shards import _what_to_do  # another BPE with more tokens: nothing to add them to

    bigger = data(small_corpus, "data.vocab_size=600").tokenizer
    assert bigger.get_vocab_size() > 514
    assert _what_to_do(framed, bigger, Tokenizer.from_file(str(prepared / "tokenizer.json")), "t.json") == \
        "prepare the folder again with --overwrite --tokenizer t.json"
    with pytest.raises(DataError, match="data.format='chat' but .* was prepared as 'text'"):
        data(prepared, "data.format=chat")


def test_a_folder_prepared_under_another_tokenizers_version_still_opens(tmp_path, prepared, small_corpus):
    """An upgrade of `tokenizers` may write the same tokenizer as other text (a folder's manifest
    holds the hash of its file): the folder's file is checked by its bytes, and data.tokenizer
    or a mixture's first source compared with it as the installed version writes both."""
    older = tmp_path / "older"
    shutil.copytree(prepared, older)
    text = json.dumps(json.loads((older / "tokenizer.json").read_text()), indent=1)  # another version's writing
    (older / "tokenizer.json").write_text(text)
    manifest = json.loads((older / "manifest.json").read_text())
    manifest["tokenizer_sha256"] = hashlib.sha256(text.encode()).hexdigest()
    (older / "manifest.json").write_text(json.dumps(manifest))
    given = tmp_path / "given.json"
    shutil.copyfile(prepared / "tokenizer.json", given)
    assert_same_batches(data(older, f"data.tokenizer={given}"), data(prepared))
    mix = f'data.mix=[{{path = "{prepared}", weight = 0.5}}, {{path = "{older}", weight = 0.5}}]'
    build_data(load_config(None, [mix, "train.seq_len=64", "train.global_batch_size=32"]))
    (older / "tokenizer.json").write_text(text + " ")  # its bytes changed: damage
    with pytest.raises(DataError, match="does not match the manifest's tokenizer_sha256"):
        data(older)


def test_changed_inputs_start_over_and_same_inputs_do_nothing(tmp_path, small_corpus):
    corpus = tmp_path / "c.jsonl"
    corpus.write_text(small_corpus.read_text())
    first = prepare(PrepareOptions([str(corpus)], str(tmp_path / "prep"), **SMALL))
    written = {f: f.stat().st_mtime_ns for f in (tmp_path / "prep").rglob("*") if f.is_file()}
    assert prepare(PrepareOptions([str(corpus)], str(tmp_path / "prep"), **SMALL)) == first
    assert {f: f.stat().st_mtime_ns for f in written} == written  # nothing rewritten
    corpus.write_text("".join(small_corpus.read_text().splitlines(keepends=True)[:100]))
    with pytest.raises(DataError, match="holds a finished prepare of other inputs"):  # (a slip: refused)
        prepare(PrepareOptions([str(corpus)], str(tmp_path / "prep"), **SMALL))
    again = prepare(PrepareOptions([str(corpus)], str(tmp_path / "prep"), overwrite=True, **SMALL))
    assert again["input_documents"] == 100 and verify(tmp_path / "prep") == []


def test_mixture_follows_the_weights_deterministically(tmp_path, prepared, small_corpus):
    second = tmp_path / "second.jsonl"
    second.write_text("".join(json.dumps({"text": f"Record {i}: " + "numbers and words " * 40}) + "\n"
                              for i in range(300)))
    other = tmp_path / "other"
    prepare(PrepareOptions([str(second)], str(other), tokenizer=str(prepared / "tokenizer.json"), **SMALL))
    mix = (f'data.mix=[{{path = "{prepared}", weight = 0.25}}, {{path = "{other}", weight = 0.75}}]')
    cfg = load_config(None, [mix, "train.seq_len=64", "train.global_batch_size=32"])
    a, b = build_data(cfg), build_data(cfg)
    for step in range(4):
        idx = a.sampler.global_batch(step)
        assert a.train.batch(idx)["input_ids"].equal(b.train.batch(idx)["input_ids"])
    epoch = len(a.train) // 32  # steps in one pass over the mixture
    counts = sum(a.train.sequences_per_source(a.sampler.global_batch(step)) for step in range(epoch))
    assert abs(counts[1] / counts.sum() - 0.75) < 0.005
    a.log_fields(7)  # the log's running count, then further on: the same as counted at once
    assert list(a.log_fields(epoch)["tokens_by_source"].values()) == [int(c) * 64 for c in counts]
    assert b.log_fields(epoch) == a.log_fields(epoch)  # from the step alone, as after a resume
    # Skipped batches were never trained on: steps 0-3 with batch 2 skipped drew batches 0, 1, 3, 4.
    drawn = sum(a.train.sequences_per_source(a.sampler.global_batch(i)) for i in (0, 1, 3, 4))
    assert list(a.log_fields(4, [2])["tokens_by_source"].values()) == [int(c) * 64 for c in drawn]
    rows = a.train.batch(a.sampler.global_batch(0))
    kept = rows["labels"][:, :-1] != IGNORE_INDEX  # a label is the next token wherever one is kept
    assert kept.any() and rows["labels"][:, :-1][kept].equal(rows["input_ids"][:, 1:][kept])
    eval_sources = a.val.sequences_per_source(np.arange(8))
    assert eval_sources.min() >= 1  # the held-out mixture's first batches hold both sources


def test_a_source_with_no_sequences_has_no_block_in_a_mixture():
    """A held-out mixture of data.val_fraction=0: "held_out_sequences=2" said of none, and an index
    error where read; a held-out source of none beside one of some gave that one's reads to it."""
    from shardline.data.mixture import MixedSequences
    from shardline.data.packing import PackedSequences

    def source(n_sequences: int) -> PackedSequences:
        return PackedSequences([list(range(4 * n_sequences + 1))] if n_sequences else [], seq_len=4, eos_id=None)

    assert len(MixedSequences([source(0), source(0)], [0.7, 0.3], interleave=True)) == 0
    mix = MixedSequences([source(0), source(5)], [0.7, 0.3], interleave=True)
    assert list(mix.counts) == [0, 5]
    src, local = mix.locate(np.arange(len(mix)))
    assert set(src.tolist()) == {1} and sorted(local.tolist()) == [0, 1, 2, 3, 4]


def test_each_pass_draws_other_sequences_of_a_down_weighted_source_and_repeats_an_up_weighted_one_evenly():
    from shardline.data.mixture import MixedSequences
    from shardline.data.packing import PackedSequences

    def source(n_sequences: int) -> PackedSequences:
        return PackedSequences([list(range(4 * n_sequences + 1))], seq_len=4, eos_id=None)

    mix = MixedSequences([source(1000), source(1000)], [0.1, 0.9])
    assert len(source(1000)) == 1000 and list(mix.counts) == [200, 1800]
    seen = [np.zeros(1000, dtype=np.int64), np.zeros(1000, dtype=np.int64)]
    for p in range(5):  # five passes of 200 draws each cover the down-weighted source once
        src, local = mix.locate(np.arange(len(mix)) + p * len(mix))
        first = local[src == 0]
        assert len(set(first.tolist())) == 200 and (np.diff(np.sort(first)) == 5).all()  # distinct, evenly spread
        per_pass = np.bincount(local[src == 1], minlength=1000)
        assert set(per_pass.tolist()) == {1, 2}  # 1,800 draws of 1,000: each once or twice
        seen[0] += np.bincount(first, minlength=1000)
        seen[1] += per_pass
    assert (seen[0] == 1).all()  # every sequence once, none twice, over the five passes
    assert seen[1].max() - seen[1].min() <= 1  # the second draws rotate over the passes
    src, local = mix.locate(np.arange(200))  # the first pass (an index without a tag): every fifth sequence
    assert (src == 0).all() and (local == np.arange(200) * 5).all()


def test_mixture_errors(tmp_path, prepared, small_corpus):
    with pytest.raises(ConfigError, match="set data.path or data.mix, not both"):
        load_config(None, [f"data.path={prepared}", f'data.mix=[{{path = "{prepared}"}}]']).data.check()
    with pytest.raises(ConfigError, match=r"data.mix\[0\].weight"):
        load_config(None, [f'data.mix=[{{path = "{prepared}", weight = 0}}]']).data.check()
    other = tmp_path / "other"
    prepare(PrepareOptions([str(small_corpus)], str(other), **{**SMALL, "vocab_size": 300}))
    cfg = load_config(None, [f'data.mix=[{{path = "{prepared}"}}, {{path = "{other}"}}]', "train.seq_len=64"])
    with pytest.raises(DataError, match="prepared with another tokenizer"):
        build_data(cfg)
    tok = str(prepared / "tokenizer.json")
    missing = tmp_path / "missing.jsonl"  # a raw source's errors name its key, not data.path
    cfg = load_config(None, [f'data.mix=[{{path = "{prepared}"}}, {{path = "{missing}"}}]', "train.seq_len=64",
                             f"data.tokenizer={tok}"])
    with pytest.raises(DataError, match=r"^data.mix\[1\].path='.*missing.jsonl' does not exist.* or a folder made by"):
        build_data(cfg)
    (tmp_path / "blank.jsonl").write_text('{"text": " "}\n')
    cfg = load_config(None, [f'data.mix=[{{path = "{tmp_path / "blank.jsonl"}"}}]', f"data.tokenizer={tok}"])
    with pytest.raises(DataError, match=r"^data.mix\[0\].path=.* contains no text"):
        build_data(cfg)


def test_a_mixture_source_reads_its_own_text_field(tmp_path, prepared, small_corpus):
    """Sources written by different tools name their text differently ("text", "content"): one
    data.text_field for all refused the mixture. data.mix[i].text_field gives a source its own; the
    batches equal the same mixture with the field renamed; misnamed, the error points at it."""
    tok = str(prepared / "tokenizer.json")
    rows = [f"Record {i}: " + "numbers and words " * 20 for i in range(200)]
    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"text": r}) + "\n" for r in rows))
    (tmp_path / "b.jsonl").write_text("".join(json.dumps({"content": r[::-1]}) + "\n" for r in rows))
    (tmp_path / "b_text.jsonl").write_text("".join(json.dumps({"text": r[::-1]}) + "\n" for r in rows))
    common = ["train.seq_len=64", "train.global_batch_size=16", f"data.tokenizer={tok}"]
    mix = (f'data.mix=[{{path = "{tmp_path / "a.jsonl"}"}}, '
           f'{{path = "{tmp_path / "b.jsonl"}", text_field = "content", weight = 2}}]')
    same = f'data.mix=[{{path = "{tmp_path / "a.jsonl"}"}}, {{path = "{tmp_path / "b_text.jsonl"}", weight = 2}}]'
    own, renamed = build_data(load_config(None, [mix, *common])), build_data(load_config(None, [same, *common]))
    for step in range(3):
        idx = own.sampler.global_batch(step)
        assert own.train.batch(idx)["input_ids"].equal(renamed.train.batch(idx)["input_ids"])
    assert len(own.val) == len(renamed.val) > 0
    with pytest.raises(DataError, match=r"b.jsonl line 1 has no string field 'text' \(set data.text_field, or in "
                                        r"data.mix the source's text_field"):
        build_data(load_config(None, [mix.replace(', text_field = "content"', ""), *common]))
    with pytest.raises(ConfigError, match=r"data.mix\[1\].text_field='messages' is invalid: holds conversations"):
        load_config(None, [mix.replace('"content"', '"messages"'), *common]).check()
    assert unused_settings(load_config(None, [mix.replace(f'"{tmp_path / "a.jsonl"}"}}',
                                                          f'"{tmp_path / "a.jsonl"}", text_field = "text"}}'),
                                              *common, "data.text_field=body"]))["data.text_field"] == \
        "each text source of data.mix names its own text_field"
    assert "data.text_field" not in unused_settings(load_config(None, [mix, *common, "data.text_field=body"]))
    # a prepared folder's text was read by prepare: a text_field given for it reads nothing
    assert unused_settings(load_config(None, [f"data.path={prepared}", "data.text_field=body"]))["data.text_field"] \
        == "the data is prepared: `shardline prepare --text-field` read its text"
    with_raw = f'data.mix=[{{path = "{prepared}"}}, {{path = "{tmp_path / "a.jsonl"}"}}]'  # (the raw source reads it)
    assert "data.text_field" not in unused_settings(load_config(None, [with_raw, *common, "data.text_field=body"]))


def test_a_mixture_holds_chat_and_text_sources_each_in_its_own_format(tmp_path, prepared, small_corpus):
    """Chat fine-tuning with text replayed: data.mix[i].format gives a source its own format. Chat rows
    keep their prompts unlabelled, text rows label every token but a document's first, the mixture
    counts both alike, raw = prepared, and a source asked for in the wrong format is named."""
    tok = str(prepared / "tokenizer.json")
    path = tmp_path / "chat.jsonl"
    path.write_text(chat_records(60))
    prepare(PrepareOptions([str(path)], str(tmp_path / "chat"), format="chat", tokenizer=tok, workers=1, **SMALL))
    mix = f'data.mix=[{{path = "{tmp_path / "chat"}", format = "chat", weight = 0.5}}, {{path = "{prepared}"}}]'
    common = ["train.seq_len=256", "train.global_batch_size=16"]
    d = build_data(load_config(None, [mix, *common]))
    rows = np.arange(len(d.train))
    src, _ = d.train.locate(rows)
    batch = d.train.batch(rows)
    labelled = (batch["labels"] != IGNORE_INDEX).sum(dim=1).numpy()
    docs = batch["doc_ids"]
    starts = (docs[:, 1:] != docs[:, :-1]).sum(dim=1).numpy()  # text: a document's first token is not a target
    assert (src == 0).any() and (src == 1).any()
    assert (labelled[src == 0] < 0.6 * 256).all()  # prompts and system turns unlabelled
    gap = 256 - starts[src == 1] - labelled[src == 1]  # (1 where the next document opens at the last label)
    assert ((gap == 0) | (gap == 1)).all()
    assert d.train.count_labels(rows) == labelled.sum()
    event = d.describe(10)
    assert event["sequences_without_replies"] == 0 and event["conversations_cut"] == 0, event
    assert event["chat_template"] == "ChatML (no chat template)"  # what the run renders, exports and generates with
    chat, text = event["sources"].values()  # each source's share of the sequences and of the loss (labelled tokens)
    assert chat["sequences"] + text["sequences"] == pytest.approx(1, abs=1e-3)
    assert chat["loss"] + text["loss"] == pytest.approx(1, abs=1e-3) and text["loss"] > text["sequences"]
    assert chat["reads_per_pass"] == pytest.approx(int(d.train.counts[0]) / len(d.train.sources[0]), abs=1e-3)
    passes = 10 * 16 / len(d.train)  # (each source's own epochs over the run: its reads a pass x the passes)
    assert chat["epochs"] == pytest.approx(passes * chat["reads_per_pass"], rel=1e-2) and event["epochs"] > 0
    raw = f'data.mix=[{{path = "{path}", format = "chat", weight = 0.5}}, {{path = "{small_corpus}"}}]'
    assert_same_batches(d, build_data(load_config(None, [raw, *common, f"data.tokenizer={tok}"])))
    # data.format=chat with the text source's own format: the same mixture
    flipped = f'data.mix=[{{path = "{tmp_path / "chat"}", weight = 0.5}}, {{path = "{prepared}", format = "text"}}]'
    assert_same_batches(d, build_data(load_config(None, [flipped, "data.format=chat", *common])))
    wrong = f'data.mix=[{{path = "{tmp_path / "chat"}"}}, {{path = "{prepared}", format = "chat"}}]'
    with pytest.raises(DataError, match=r"^data.mix: data.format='text' but .*chat was prepared as 'chat' data; "
                                        r"data.mix\[1\].format='chat' but .*prep was prepared as 'text' data; set "
                                        r"each source's format"):
        build_data(load_config(None, [wrong, *common]))
    with pytest.raises(ConfigError, match=r"data.mix\[0\].format"):
        load_config(None, [f'data.mix=[{{path = "{prepared}", format = "json"}}]']).data.check()


def chat_records(n: int) -> str:
    rows = []
    for i in range(n):
        rows.append({"messages": [{"role": "system", "content": "You answer briefly."},
                                  {"role": "user", "content": f"What is {i} plus {i}?"},
                                  {"role": "assistant", "content": f"It is {2 * i}."},
                                  {"role": "user", "content": "Thanks!"},
                                  {"role": "assistant", "content": f"You are welcome, number {i}."}]})
    return "".join(json.dumps(r) + "\n" for r in rows)


def test_a_step_that_reads_more_sequences_than_the_data_holds_is_said(tmp_path, tiny_config, small_prepared):
    """A seq_len past the data's length left one sequence, read twice by every step, in silence."""
    from shardline.trainer import Trainer

    (tmp_path / "few.jsonl").write_text("".join(json.dumps({"text": f"a short document number {i}"}) + "\n"
                                                for i in range(6)))
    common = [f"data.path={tmp_path / 'few.jsonl'}", f"data.tokenizer={small_prepared / 'tokenizer.json'}",
              "train.steps=1", "train.eval_interval=0", "checkpoint.interval=0", "data.val_fraction=0",
              "train.micro_batch_size=2"]
    Trainer(tiny_config(*common, "train.seq_len=32", "train.global_batch_size=4")).build().train()
    said = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
            if "batch_repeats_data" in line]
    assert len(said) == 1 and said[0]["sequences"] < said[0]["global_batch_size"] == 4, said
    Trainer(tiny_config(*common, "train.seq_len=8", "train.global_batch_size=2", run_dir=tmp_path / "ok")).build()\
        .train()
    assert "batch_repeats_data" not in (tmp_path / "ok" / "metrics.jsonl").read_text()


def test_a_run_on_conversations_without_replies_says_so(tmp_path, tiny_config, small_prepared):
    """Half the conversations held no assistant turn: packed together, their rows trained nothing, said only
    as a share in the data event, which read as "cut before theirs"."""
    from shardline.trainer import Trainer

    records = [json.loads(line) for line in chat_records(60).splitlines()]
    for r in records[::2]:
        r["messages"] = r["messages"][:2]  # system and user alone
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    common = [f"data.path={tmp_path / 'chat.jsonl'}", "data.format=chat", "train.steps=1", "train.eval_interval=0",
              "train.seq_len=128",
              f"data.tokenizer={small_prepared / 'tokenizer.json'}", "checkpoint.interval=0"]
    Trainer(tiny_config(*common)).build().train()
    events = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    said = [e for e in events if e.get("event") == "replies_missing"]
    assert len(said) == 1 and said[0]["share"] >= 0.1 and "no assistant turn" in said[0]["why"], said
    # each train record says how many of the step's tokens were targets (replies alone, here under half)
    cfg = tiny_config(*common)
    trained = [e for e in events if e["kind"] == "train"]
    assert trained and all(0 < e["labelled_tokens"] < cfg.train.global_batch_size * cfg.train.seq_len / 2
                           for e in trained), trained
    (tmp_path / "chat.jsonl").write_text(chat_records(60))
    Trainer(tiny_config(*common, "train.seq_len=256", run_dir=tmp_path / "all")).build().train()
    assert "replies_missing" not in (tmp_path / "all" / "metrics.jsonl").read_text()
    assert "conversations_cut_many" not in (tmp_path / "all" / "metrics.jsonl").read_text()
    Trainer(tiny_config(*common, run_dir=tmp_path / "short")).build().train()  # (128: each cut, its first reply kept)
    cut = [json.loads(line) for line in (tmp_path / "short" / "metrics.jsonl").read_text().splitlines()
           if "conversations_cut_many" in line]
    assert len(cut) == 1 and cut[0]["cut"] >= 0.1 * cut[0]["of"], cut
    # Padding past 30% of each sequence (one conversation a sequence, the next not fitting) is said, with the way out
    for run in ("all", "short"):
        records = [json.loads(line) for line in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]
        padding = next(r["padding"] for r in records if r.get("event") == "data")
        said = [r for r in records if r.get("event") == "padding_high"]
        assert len(said) == (padding >= 0.3) and all("a longer train.seq_len" in r["why"] for r in said), (run, said)
        assert run != "all" or said, padding  # (conversations of ~150 tokens in 256: one a sequence)


def test_chat_loss_is_on_assistant_tokens_only(tmp_path):
    path = tmp_path / "chat.jsonl"
    path.write_text(chat_records(200))
    raw = data(path, "data.format=chat", "data.val_fraction=0.1", seq_len=256)
    seq = raw.train.batch([0])
    labels, docs = seq["labels"][0], seq["doc_ids"][0]
    first = docs == docs[0]  # the first conversation of the window (starts at token 0)
    targets = labels[first & (labels != IGNORE_INDEX)].tolist()
    text = raw.tokenizer.decode(targets[:-1])  # the last target is the eos after the last reply
    replies = re.fullmatch(r"It is (\d+)\.<\|im_end\|>\nYou are welcome, number (\d+)\.<\|im_end\|>\n", text)
    assert replies and int(replies[1]) == 2 * int(replies[2]), text
    assert targets[-1] == raw.tokenizer.token_to_id("<|endoftext|>")
    assert len(set(docs.tolist())) > 1  # conversations are packed together, kept apart by doc ids
    out = tmp_path / "prep"
    prepare(PrepareOptions([str(path)], str(out), format="chat", val_fraction=0.1, workers=2, **SMALL))
    assert_same_batches(raw, data(out, "data.format=chat", seq_len=256))


def _next_fit_rows(sizes, width: int) -> int:
    """How many rows packing in stream order needs: benchmarks/chat_packing.py's baseline, the one definition."""
    import importlib.util
    import sys

    folder = str(Path(__file__).parents[2] / "benchmarks")
    spec = importlib.util.spec_from_file_location("chat_packing", Path(folder) / "chat_packing.py")
    bench = importlib.util.module_from_spec(spec)
    sys.path.insert(0, folder)  # (its sibling _env, found as when the script runs)
    try:
        spec.loader.exec_module(bench)
    finally:
        sys.path.remove(folder)
    return bench.next_fit_rows(sizes, width)


def test_a_chat_sequence_holds_whole_conversations_and_a_long_one_is_cut_not_continued(tmp_path):
    """A reply learned without its prompt teaches nothing: every conversation is in exactly one
    row, whole and in stream order (the rest of the row is the stream after its last one, other
    documents without labels), packed best-fit into fewer rows than stream order needs; one longer
    than a row is a row of its own, cut, its rest not trained on and counted; the raw and prepared
    paths give the same rows."""
    rows = [json.loads(line) for line in chat_records(60).splitlines()]
    for i in range(1, 60, 2):  # short and long in turn: no two neighbours fit a row, two short ones do
        rows[i]["messages"] = rows[i]["messages"][:3]
    for i in range(0, 60, 7):  # every seventh conversation far longer than a row
        rows[i]["messages"][2]["content"] = " ".join(f"step {k} of {i}." for k in range(60))
    rows[5:5] = rows[40:40] = [{"messages": []}]  # empty: skipped alike by both paths (and counted)
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    raw = data(path, "data.format=chat", "data.val_fraction=0.1", seq_len=128)
    train = raw.train
    stream, packed = np.asarray(train.tokens), train.rows
    sizes = np.diff(np.append(train.doc_starts, train.num_tokens))
    long = int((sizes > 129).sum())
    assert long >= 5 and packed.truncated == long
    assert sorted(packed.docs.tolist()) == list(range(train.num_documents))  # each conversation once
    assert len(train) < _next_fit_rows(sizes.tolist(), 129)
    batch = train.batch(np.arange(len(train)))
    for row in range(len(train)):
        docs = packed.docs[packed.first[row]:packed.first[row + 1]]
        assert (np.diff(docs) > 0).all() and packed.lengths[row] <= 129
        assert len(docs) == 1 or (sizes[docs] < 129).all()  # whole, or one cut conversation alone
        held = int(packed.lengths[row])
        own = np.concatenate([stream[train.doc_starts[d]:train.doc_starts[d] + min(sizes[d], 129)] for d in docs])
        inputs, ids = batch["input_ids"][row].numpy(), batch["doc_ids"][row].numpy()
        labels = batch["labels"][row].numpy()
        assert (inputs[:min(held, 128)] == own[:128]).all() and (np.diff(ids) >= 0).all()
        assert (labels[held - 1:] == IGNORE_INDEX).all()  # the fill: no labels
        after = train.doc_starts[docs[-1]] + sizes[docs[-1]]
        if held < 128 and after + 128 - held <= len(stream):  # filled with the stream after its last conversation
            assert (inputs[held:] == stream[after:after + 128 - held]).all() and ids[held] > ids[held - 1]
    described = raw.describe(steps=10)
    assert described["conversations_cut"] == long and 0 < described["padding"] < 1
    # A chat checkpoint of another packing (cut from one stream, or next-fit) cannot go on: refused, naming why.
    from shardline.errors import CheckpointError
    from shardline.resilience.resume_checks import check_data_position

    position = raw.position_state()
    assert position["packing"] == "whole conversations, best fit"
    saved = {**position, "num_samples": len(train), "seed": 0, "global_batch_size": 8}
    check_data_position("ckpt", saved, len(train), 0, 8, position)
    with pytest.raises(CheckpointError, match=r"saved when its sequences were cut from one stream \(by an earlier "
                                              r"shardline\); this run packs .*: finish the run with the shardline "
                                              r"that saved it \(a checkout from before commit 3aba73f"):
        check_data_position("ckpt", {k: v for k, v in saved.items() if k != "packing"}, len(train), 0, 8, position)
    # A text checkpoint resumed as chat (data.format changed): that change is the reason, not a version
    with pytest.raises(CheckpointError, match=r"cut from one stream; this run packs them as whole conversations, best "
                                              r"fit, .*: the data settings changed since it \(data.format\): set "
                                              r"them back, or start a new run.dir"):
        check_data_position("ckpt", {k: v for k, v in saved.items() if k != "packing"}, len(train), 0, 8,
                            {"packing": position["packing"]}, changed="data.format")
    with pytest.raises(CheckpointError, match=r"\(by an earlier shardline\).*finish the run with"):
        check_data_position("ckpt", {k: v for k, v in saved.items() if k != "packing"}, len(train), 0, 8,
                            {"packing": position["packing"]}, changed="data.val_fraction=0.01 -> 0.1")  # (not why)
    with pytest.raises(CheckpointError, match=r"packed as 'whole conversations' \(by an earlier shardline\); "
                                              r"this run packs them as whole conv.*from commit 968f87f to adf1abc"):
        check_data_position("ckpt", {**saved, "packing": "whole conversations"}, len(train), 0, 8, position)
    with pytest.raises(CheckpointError) as newer:  # a packing this shardline does not know: no older checkout to name
        check_data_position("ckpt", {**saved, "packing": "a later packing"}, len(train), 0, 8, position)
    assert "earlier shardline" not in str(newer.value) and "start a new run.dir" in str(newer.value)
    out = tmp_path / "prep"
    prepare(PrepareOptions([str(path)], str(out), format="chat", val_fraction=0.1, workers=1, **SMALL))
    assert_same_batches(raw, data(out, "data.format=chat", seq_len=128))


def test_sharegpt_conversations_read_as_the_same_messages(tmp_path):
    """ShareGPT's layout ({"conversations": [{"from": "human"|"gpt"|"system", "value"}]}), as most
    published chat sets come, was refused as having no 'messages': read as the same conversations,
    raw (.jsonl, .parquet) and prepared."""
    records = [json.loads(line) for line in chat_records(30).splitlines()]
    names = {"user": "human", "assistant": "gpt", "system": "system"}
    shared = [{"conversations": [{"from": names[m["role"]], "value": m["content"]} for m in r["messages"]]}
              for r in records]
    (tmp_path / "chat.jsonl").write_text(chat_records(30))
    (tmp_path / "sharegpt.jsonl").write_text("".join(json.dumps(r) + "\n" for r in shared))
    pq.write_table(pa.Table.from_pylist(shared), tmp_path / "sharegpt.parquet")
    # Merged sets: rows of either layout in one table (the other column null), or turns of both in one list
    merged = [{"messages": None, **r} if i % 2 else {"messages": records[i]["messages"], "conversations": None}
              for i, r in enumerate(shared)]
    pq.write_table(pa.Table.from_pylist(merged), tmp_path / "merged.parquet")
    turns = [{"conversations": [*r["conversations"][:2], *records[i]["messages"][2:]]} for i, r in enumerate(shared)]
    table = pa.Table.from_pylist(turns)  # (its struct holds from, value, role and content, each null where unset)
    with pa.ipc.new_stream(tmp_path / "turns.arrow", table.schema) as out:
        out.write_table(table)
    plain = data(tmp_path / "chat.jsonl", "data.format=chat", seq_len=128)
    for name in ("sharegpt.jsonl", "sharegpt.parquet", "merged.parquet", "turns.arrow"):
        assert_same_batches(plain, data(tmp_path / name, "data.format=chat", seq_len=128))
    prepare(PrepareOptions([str(tmp_path / "sharegpt.jsonl")], str(tmp_path / "prep"), format="chat", workers=1,
                           **SMALL))
    raw = data(tmp_path / "sharegpt.jsonl", "data.format=chat", seq_len=128)
    assert_same_batches(raw, data(tmp_path / "prep", "data.format=chat", seq_len=128))


def test_prompt_completion_pairs_read_as_a_user_turn_and_its_reply(tmp_path):
    """OpenAI's and TRL's fine-tuning layout ({"prompt", "completion"}) was refused with a recipe to rewrite it
    as messages: read as those messages (two strings: a user turn and the assistant's reply; two lists of
    messages, TRL's conversational pairs, one after the other), raw (.jsonl, .parquet) and prepared, so the loss
    is on the completion alone."""
    records = [json.loads(line)["messages"] for line in chat_records(30).splitlines()]
    pairs = [{"prompt": r[1]["content"], "completion": r[2]["content"]} for r in records]  # (one exchange)
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps({"messages": r[1:3]}) + "\n" for r in records))
    (tmp_path / "pairs.jsonl").write_text("".join(json.dumps(p) + "\n" for p in pairs))
    pq.write_table(pa.Table.from_pylist(pairs), tmp_path / "pairs.parquet")
    (tmp_path / "merged.jsonl").write_text("".join(json.dumps({"messages": None, **p}) + "\n" for p in pairs))
    plain = data(tmp_path / "chat.jsonl", "data.format=chat", seq_len=128)
    for name in ("pairs.jsonl", "pairs.parquet", "merged.jsonl"):  # (merged: a set's null messages beside the pair)
        assert_same_batches(plain, data(tmp_path / name, "data.format=chat", seq_len=128))
    prepare(PrepareOptions([str(tmp_path / "pairs.jsonl")], str(tmp_path / "prep"), format="chat", workers=1,
                           **SMALL))
    assert_same_batches(plain, data(tmp_path / "prep", "data.format=chat", seq_len=128))
    # TRL's conversational pairs: the prompt's messages (a system turn and a reply too), then the completion's;
    # the loss on the completion alone: the prompt's reply is context, as a message of weight 0 is
    context = [[*r[:2], {**r[2], "weight": 0}, *r[3:]] for r in records]
    (tmp_path / "context.jsonl").write_text("".join(json.dumps({"messages": r}) + "\n" for r in context))
    (tmp_path / "conv.jsonl").write_text("".join(json.dumps({"prompt": r[:4], "completion": r[4:]}) + "\n"
                                                 for r in records))
    conv = data(tmp_path / "conv.jsonl", "data.format=chat", seq_len=128)
    assert_same_batches(data(tmp_path / "context.jsonl", "data.format=chat", seq_len=128), conv)
    labels = conv.train.batch(np.arange(len(conv.train)))["labels"]
    learned = conv.tokenizer.decode(labels[labels >= 0].tolist())  # (what the loss is on: the completions)
    assert "welcome" in learned and "It is" not in learned, learned[:200]
    # a table's half-null or mixed row is refused as a .jsonl line is (it read as an empty document)
    for rows in ([{"prompt": "2+2?", "completion": None}], [{"prompt": [records[0][1]], "completion": "4"}]):
        pq.write_table(pa.Table.from_pylist(pairs[:5] + rows if rows[0]["completion"] is None else rows),
                       tmp_path / "odd.parquet")
        with pytest.raises(DataError, match=r"a row: a prompt/completion record the chat format cannot read; it holds"):
            data(tmp_path / "odd.parquet", "data.format=chat", seq_len=128)
    with pytest.raises(DataError, match="it holds a conversation: read it as chat"):  # (as text: said so)
        data(tmp_path / "pairs.jsonl")


@pytest.mark.parametrize("record, message", [
    ({"text": "no messages"}, "has no list field 'messages'"),
    ({"messages": "hi"}, "line 4's 'messages' is a str, not a list"),  # (not "has no field": it has one)
    ({"prompt": "2+2?", "completion": ["4"]}, r"it holds \"prompt\" and \"completion\" \(str and list\): "
                                               r"data.format=chat \(prepare: --format chat\) reads them where both"),
    ({"prompt": "2+2?", "completion": None}, r"\(str and null\)"),
    ({"prompt": "2+2?"}, r"it holds \"prompt\" without \"completion\" \(a prompt/completion pair needs both\)"),
    ({"messages": [{"role": "user"}]}, r"messages\[0\] needs string fields 'role' and 'content'"),
])
def test_bad_chat_records_are_one_line(tmp_path, record, message):
    path = tmp_path / "chat.jsonl"
    path.write_text(chat_records(3) + json.dumps(record) + "\n")
    with pytest.raises(DataError, match=message) as err:
        data(path, "data.format=chat")
    assert "line 4" in str(err.value) and "\n" not in str(err.value)


def chat_with_templated_tokenizer(tmp_path) -> tuple[Path, Path]:
    """40 conversations and a tokenizer.json trained on them whose tokenizer_config.json has a
    chat template ("[role] content" lines)."""
    path = tmp_path / "chat.jsonl"
    path.write_text(chat_records(40))
    folder = tmp_path / "tok"
    folder.mkdir()
    data(path, "data.format=chat", "train.eval_interval=0", seq_len=128).tokenizer.save(str(folder / "tokenizer.json"))
    template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    return path, folder


def test_chat_sequences_too_short_for_any_reply_are_refused_and_the_share_without_one_said(tmp_path):
    """A seq_len shorter than the prompts cuts every conversation before its reply: the run learned
    nothing, logged a loss of 0 and evaluated a perfect model. Refused in one line, for the training
    split and for the held-out sequences an evaluation reads; a seq_len where some rows hold no reply
    says how many in the data event."""
    from shardline.data.chat_checks import check_replies_fit
    from shardline.data.packing import PackedSequences

    rows = [json.loads(line) for line in chat_records(60).splitlines()]
    for row in rows[::2]:  # every other one a short question and its answer, no system prompt
        row["messages"] = row["messages"][1:3]
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(DataError, match=r"none of \d+ sequences of train.seq_len=8 holds a reply token to learn "
                                        r"\(\d+ of its \d+ training conversations are longer than a sequence"):
        data(path, "data.format=chat", seq_len=8)
    some = data(path, "data.format=chat", "train.eval_interval=0", seq_len=32).describe(steps=1)
    assert 0 < some["sequences_without_replies"] < 1
    assert data(path, "data.format=chat", seq_len=128).describe(steps=1)["sequences_without_replies"] == 0
    cfg = load_config(None, ["train.seq_len=4"])
    replies = PackedSequences([[5, 6, 7, 8]] * 40, 4, 0, masks=[[0, 1, 1, 1]] * 40)
    late = PackedSequences([[5, 6, 7, 8, 9, 10, 11]] * 40, 4, 0, masks=[[0, 0, 0, 0, 0, 1, 1]] * 40)
    check_replies_fit([("d", replies)], replies, cfg)
    with pytest.raises(DataError, match="the held-out sequences an evaluation reads hold no reply token"):
        check_replies_fit([("d", replies)], late, cfg)
    check_replies_fit([("d", replies)], late, load_config(None, ["train.seq_len=4", "train.eval_interval=0"]))
    # A mixture learns while one source does; its evaluation is over the mixed held-out sequences.
    check_replies_fit([("a", late), ("b", replies)], MixedSequences([late, replies], [1, 1], interleave=True), cfg)
    with pytest.raises(DataError, match="a, b: none of 80 sequences of train.seq_len=4 holds a reply token"):
        check_replies_fit([("a", late), ("b", late)], replies, cfg)
    # The data event's share: a mixture's sources weighed by their shares (3:1 here).
    from shardline.data import GlobalBatchSampler
    from shardline.data.loader import DataBundle

    mixed = MixedSequences([late, replies], [3, 1])
    bundle = DataBundle(None, mixed, replies, GlobalBatchSampler(len(mixed), 8, 0), ["a", "b"])
    assert bundle.describe(steps=1)["sequences_without_replies"] == pytest.approx(0.75, abs=0.02)
    # The dry run refuses a prepared folder as the launch does (raw data it does not tokenize).
    from shardline.data.loader import data_summary

    prepare(PrepareOptions([str(path)], str(tmp_path / "prep"), format="chat", val_fraction=0.1, workers=1, **SMALL))
    with pytest.raises(DataError, match="holds a reply token to learn"):
        data_summary(load_config(None, [f"data.path={tmp_path / 'prep'}", "data.format=chat", "train.seq_len=8"]))


def test_a_prepared_chat_folder_refuses_a_tokenizer_with_another_template(tmp_path):
    """The run trains on the folder's rendering but writes, exports and generates with the template
    beside the tokenizer it takes: one beside data.tokenizer (or the starting weights') that differs
    is refused, by the launch and by the dry run; the folder's own tokenizer passes."""
    from shardline.data.loader import data_summary

    path, folder = chat_with_templated_tokenizer(tmp_path)
    out = tmp_path / "prep"
    prepare(PrepareOptions([str(path)], str(out), format="chat", val_fraction=0.1, workers=1,
                           tokenizer=str(folder / "tokenizer.json"), **SMALL))
    other = tmp_path / "other"
    other.mkdir()
    (other / "tokenizer.json").write_bytes((folder / "tokenizer.json").read_bytes())  # the same tokenizer
    (other / "chat_template.jinja").write_text("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}")
    for given in (other, out):
        overrides = [f"data.path={out}", "data.format=chat", f"data.tokenizer={given / 'tokenizer.json'}"]
        if given == other:
            for check in (lambda: build_data(load_config(None, overrides)),
                          lambda: data_summary(load_config(None, overrides))):
                with pytest.raises(DataError, match="was rendered with chat template [0-9a-f]{12}, but the "
                                                    "tokenizer this run takes .* carries chat template"):
                    check()
        else:
            assert len(build_data(load_config(None, overrides)).train) > 0
    # A ChatML folder (no template) and an HF export of a run on it, whose tokenizer_config.json spells
    # ChatML out (and names <|im_end|> its eos): they render alike, so a fine-tune from it passes.
    from shardline.data.encode import CHATML_TEMPLATE

    chatml, export = tmp_path / "chatml", tmp_path / "export"
    prepare(PrepareOptions([str(path)], str(chatml), format="chat", val_fraction=0.1, workers=1, **SMALL))
    export.mkdir()
    (export / "tokenizer.json").write_bytes((chatml / "tokenizer.json").read_bytes())
    (export / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHATML_TEMPLATE,
                                                              "eos_token": "<|im_end|>"}))
    spelled = [f"data.path={chatml}", "data.format=chat", f"data.tokenizer={export / 'tokenizer.json'}"]
    assert len(build_data(load_config(None, spelled)).train) > 0
    # Qwen's way: a default system prompt where a conversation has none. Alike on conversations with
    # one, not on those without: refused.
    qwen = ("{% if messages[0]['role'] != 'system' %}<|im_start|>system\\nYou are helpful.<|im_end|>\\n{% endif %}"
            + CHATML_TEMPLATE)
    (export / "tokenizer_config.json").write_text(json.dumps({"chat_template": qwen}))
    with pytest.raises(DataError, match="renders otherwise"):
        build_data(load_config(None, spelled))
    # A folder whose kept template file was changed since is known by its recorded hash alone: a template
    # that renders as the recorded one but is another file is then refused (as it passes while intact).
    (export / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHATML_TEMPLATE + "{# mine #}"}))
    assert len(build_data(load_config(None, spelled)).train) > 0
    (chatml / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ messages }}"}))
    with pytest.raises(DataError, match="renders otherwise"):
        build_data(load_config(None, spelled))
    (export / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHATML_TEMPLATE.replace("\\n", " ")}))
    with pytest.raises(DataError, match=r"rendered with ChatML \(no chat template\), but .* renders otherwise"):
        build_data(load_config(None, spelled))


def test_a_dry_run_renders_chat_data_as_the_launch_would_and_names_the_template(tmp_path):
    """The dry run passed chat data the launch then refused: a template that fails on it, data
    without the reply role. It now checks the roles and renders the first conversations."""
    from shardline.data.loader import data_summary

    path, folder = chat_with_templated_tokenizer(tmp_path)
    cfg = load_config(None, [f"data.path={path}", "data.format=chat", f"data.tokenizer={folder / 'tokenizer.json'}"])
    summary, _ = data_summary(cfg)
    assert summary.endswith(f"40 conversations (rendered with the chat template of {folder / 'tokenizer_config.json'}; "
                            "this dry run rendered each) (1 of them held out for evaluation)")
    (folder / "chat_template.jinja").write_text("{% for m in messages %}{{ m.content }{% endfor %}")
    with pytest.raises(DataError, match="chat template .* fails on a conversation .*TemplateSyntaxError"):
        data_summary(cfg)
    (folder / "chat_template.jinja").unlink()
    path.write_text(path.read_text().replace('"assistant"', '"gpt"'))
    with pytest.raises(DataError, match="has no message of role 'assistant'"):
        data_summary(cfg)


def test_a_chat_template_jinja_file_is_read_before_tokenizer_config(tmp_path):
    """Newer transformers save the template as chat_template.jinja, and prefer it."""
    from shardline.data import chat_template

    tok = str(tmp_path / "tokenizer.json")
    assert chat_template.chat_template_for(tok) is None
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "A", "eos_token": "</s>",
                                                                "bos_token": {"content": "<s>", "lstrip": False}}))
    assert chat_template.chat_template_for(tok) == chat_template.ChatTemplate("A", bos_token="<s>", eos_token="</s>")
    (tmp_path / "chat_template.jinja").write_text("B")
    assert chat_template.chat_template_for(tok) == chat_template.ChatTemplate("B", bos_token="<s>", eos_token="</s>")


MISTRAL_LIKE = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}[INST] {{ m['content'] }} [/INST]"
                "{% else %}{{ m['content'] }}{{ eos_token }}{% endif %}{% endfor %}")


def test_a_template_that_closes_every_reply_with_eos_trains_each_reply_to_stop(tmp_path):
    """Mistral's and Llama 2's templates write {{ eos_token }} after every reply: rendered as the
    tokenizer's eos (it was ""), each reply's eos is a target, and none is appended twice."""
    from shardline.data.chat_template import ChatTemplate
    from shardline.data.encode import encode_documents
    from shardline.data.tokenizer import EOS, eos_id

    path, _ = chat_with_templated_tokenizer(tmp_path)
    tok = data(path, "data.format=chat", "train.eval_interval=0", seq_len=128).tokenizer
    eos = eos_id(tok)
    chat = [{"role": "user", "content": "one?"}, {"role": "assistant", "content": "It is 1."},
            {"role": "user", "content": "two?"}, {"role": "assistant", "content": "It is 2."}]
    tokens, lengths, mask = encode_documents(tok, [chat], eos, ChatTemplate(MISTRAL_LIKE, eos_token=EOS), chat=True)
    at = [i for i, t in enumerate(tokens.tolist()) if t == eos]
    assert len(at) == 2 and at[-1] == len(tokens) - 1 == lengths[0] - 1  # one eos a reply, the last not doubled
    assert all(mask[i] == 1 for i in at)
    assert tok.decode(tokens[mask == 1].tolist(), skip_special_tokens=True) == "It is 1.It is 2."


PHI3_LIKE = ("{% for m in messages %}{{ '<|' + m['role'] + '|>\n' + m['content'] + '<|end|>' + SEP }}{% endfor %}"
             "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% else %}{{ eos_token }}{% endif %}")


def test_a_turn_end_is_what_every_reply_is_followed_by_not_the_last_ones_eos():
    """Phi-3 closes a turn with <|end|> and a conversation with eos: after the last reply comes
    "<|end|>\n<|endoftext|>", after another "<|end|>\n<|user|>". A reply ends at <|end|>, which a
    model writes after every reply (it once had to write the eos too, text it writes only last)."""
    from shardline.data.chat_template import ChatTemplate
    from shardline.data.encode import turn_end_text

    for sep in ("'\\n'", "''"):  # with a blank after the marker, and without
        template = ChatTemplate(PHI3_LIKE.replace("SEP", sep), eos_token="<|endoftext|>")
        assert turn_end_text(template) == "<|end|>"
    assert turn_end_text(ChatTemplate(LLAMA_LIKE)) == "<|eot|>"
    assert turn_end_text(ChatTemplate(MISTRAL_LIKE, eos_token="</s>")) == "</s>"
    assert turn_end_text(None) == "<|im_end|>"  # ChatML
    bare = "{% for m in messages %}{{ m['content'] }}{% if not loop.last %} | {% endif %}{% endfor %}{{ eos_token }}"
    assert turn_end_text(ChatTemplate(bare, eos_token="</s>")) == ""  # nothing every reply is followed by


def test_a_reply_that_calls_tools_reaches_the_template_whole_and_is_trained_on(tmp_path):
    """Function-calling data: an assistant message with tool_calls and no text. Only role and
    content once reached the template, so the call became an empty reply, trained as one."""
    from shardline.data.encode import chat_segments, render_chat

    template = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}{% if m.tool_calls %}"
                "{% for c in m.tool_calls %}CALL {{ c.function.name }}({{ c.function.arguments | tojson }}){% endfor %}"
                "{% endif %}</>{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}")
    call = {"type": "function", "function": {"name": "weather", "arguments": {"city": "Oslo"}}}
    record = {"messages": [{"role": "user", "content": "Oslo?"},
                           {"role": "assistant", "content": None, "tool_calls": [call]},
                           {"role": "tool", "content": "-3 C", "name": "weather"},
                           {"role": "assistant", "content": "Cold."}]}
    path = tmp_path / "tools.jsonl"
    path.write_text(json.dumps(record) + "\n")
    (messages,) = list(read_file(path, "messages"))
    assert messages[1] == {"role": "assistant", "content": "", "tool_calls": [call]}
    assert messages[2]["name"] == "weather"
    targets = [text for text, target in chat_segments(messages, template) if target]
    assert targets == ['CALL weather({"city": "Oslo"})</>', "Cold.</>"]
    with pytest.raises(DataError, match=r"tool_calls \(a conversation \(opening .*\)\) needs a chat template that"):
        render_chat(messages)


def test_templates_render_as_transformers_does_with_loop_controls_and_plain_json():
    from shardline.data.encode import render_chat

    template = ("{% for m in messages %}{% if loop.index > 2 %}{% break %}{% endif %}"
                "{{ m | tojson }}\n{% endfor %}")
    messages = [{"role": "user", "content": "a < b & 'c'"}, {"role": "assistant", "content": "é"},
                {"role": "user", "content": "never rendered"}]
    assert render_chat(messages, template) == (
        '{"role": "user", "content": "a < b & \'c\'"}\n{"role": "assistant", "content": "é"}\n')


def test_a_templates_generation_blocks_render_their_body_and_mask_as_without_them():
    """transformers' {% generation %} tags (its way to an assistant mask) render as their body: the
    same text and targets as the template without them."""
    from shardline.data.encode import chat_segments

    body = ("{% for m in messages %}<|{{ m.role }}|>\n{% if m.role == 'assistant' %}{{ OPEN }}{{ m.content }}<|end|>"
            "\n{{ CLOSE }}{% else %}{{ m.content }}<|end|>\n{% endif %}{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
    tagged = body.replace("{{ OPEN }}", "{% generation %}").replace("{{ CLOSE }}", "{% endgeneration %}")
    plain = body.replace("{{ OPEN }}", "").replace("{{ CLOSE }}", "")
    talk = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
            {"role": "user", "content": "more"}, {"role": "assistant", "content": "sure"}]
    segments = chat_segments(talk, tagged)
    assert segments == chat_segments(talk, plain)
    assert [text for text, target in segments if target] == ["hello<|end|>\n", "sure<|end|>\n"]


def test_a_tokenizers_own_chat_template_renders_and_masks(tmp_path):
    path, folder = chat_with_templated_tokenizer(tmp_path)
    d = data(path, "data.format=chat", f"data.tokenizer={folder / 'tokenizer.json'}", "train.eval_interval=0",
             seq_len=128)
    seq = d.train.batch([0])
    first = seq["doc_ids"][0] == seq["doc_ids"][0][0]  # the row's first conversation
    labels = seq["labels"][0][first]
    text = d.tokenizer.decode(labels[labels != IGNORE_INDEX].tolist()[:-1])
    assert re.fullmatch(r"\[assistant\] It is \d+\.\n\[assistant\] You are welcome, number \d+\.\n", text), text
    assert "[user]" in d.tokenizer.decode(seq["input_ids"][0][first].tolist())


def test_a_chat_mixture_renders_every_source_with_one_template(tmp_path):
    path, folder = chat_with_templated_tokenizer(tmp_path)
    prep = tmp_path / "prep"
    prepare(PrepareOptions([str(path)], str(prep), format="chat", tokenizer=str(folder / "tokenizer.json"), **SMALL))
    common = [f'data.mix=[{{path = "{prep}"}}, {{path = "{path}"}}]', "data.format=chat", "train.seq_len=128",
              "train.eval_interval=0"]
    given = [*common, f"data.tokenizer={folder / 'tokenizer.json'}"]
    # Without data.tokenizer the run takes the folder's tokenizer and its template, and renders the raw source with it
    assert_same_batches(build_data(load_config(None, common)), build_data(load_config(None, given)))
    # A text folder first, prepared with the same vocabulary but no template beside it: its tokenizer is the run's,
    # which would export and generate ChatML after training on the chat folder's template.
    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copy(folder / "tokenizer.json", bare / "tokenizer.json")
    (tmp_path / "text.txt").write_text("Plain text replayed beside the conversations. " * 400)
    prepare(PrepareOptions([str(tmp_path / "text.txt")], str(tmp_path / "text"), tokenizer=str(bare / "tokenizer.json"),
                           **SMALL))
    text_first = [f'data.mix=[{{path = "{tmp_path / "text"}", format = "text"}}, {{path = "{prep}"}}]',
                  "data.format=chat", "train.seq_len=128", "train.eval_interval=0"]
    with pytest.raises(DataError, match=r"different templates \(.*text.tokenizer.json \(the run's tokenizer\): ChatML "
                                        r"\(no chat template\); .*prep: chat template .*export and generate with "
                                        r"another"):
        build_data(load_config(None, text_first))
    assert len(build_data(load_config(None, [*text_first, f"data.tokenizer={folder / 'tokenizer.json'}"])).train)


def test_a_template_that_rewrites_earlier_turns_is_refused_not_duplicated(tmp_path):
    from shardline.data.encode import chat_segments

    rewrites = "{% for m in messages %}{{ m['content'] if loop.last else '...' }}\n{% endfor %}"
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    with pytest.raises(DataError, match=r"renders the first 1 messages of a conversation \(opening 'hi'\) differ"):
        chat_segments(messages, rewrites)


# Qwen3's way with reasoning, in short: a reply after the last user message shows its <think> block
# (an empty one where it has none), an earlier reply is rendered without it.
QWEN3_LIKE = ("{% set ns = namespace(last=0) %}{% for m in messages %}{% if m.role == 'user' %}"
              "{% set ns.last = loop.index0 %}{% endif %}{% endfor %}"
              "{% for m in messages %}{% set body = m.content %}{% set thought = '' %}"
              "{% if '</think>' in body %}{% set thought = body.split('</think>')[0].split('<think>')[-1].strip() %}"
              "{% set body = body.split('</think>')[-1].lstrip() %}{% endif %}"
              "{{ '<|im_start|>' + m.role + '\\n' }}"
              "{% if m.role == 'assistant' and loop.index0 > ns.last %}"
              "{{ '<think>\\n' + thought + '\\n</think>\\n\\n' }}{% endif %}{{ body + '<|im_end|>\\n' }}{% endfor %}"
              "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def test_a_template_that_drops_earlier_reasoning_trains_each_reply_of_its_whole_rendering():
    """Qwen3's template renders a reply's reasoning only while no user message follows it, so a
    conversation's prefixes are not the start of its rendering (it was refused). The whole
    rendering is what the model is given at inference (each reply's prompt begins it): each reply
    is a target from where its prompt ends through its turn end, the rest is not."""
    from shardline.data.chat_template import ChatTemplate, render_template
    from shardline.data.encode import chat_segments

    template = ChatTemplate(QWEN3_LIKE, eos_token="<|im_end|>")
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "<think>greet back</think>hello"}, {"role": "user", "content": "bye"},
                {"role": "assistant", "content": "farewell"}]
    pieces = chat_segments(messages, template)
    header = "<|im_start|>assistant\n"
    assert pieces == [("<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n" + header, False),
                      ("hello<|im_end|>\n", True), ("<|im_start|>user\nbye<|im_end|>\n" + header, False),
                      ("<think>\n\n</think>\n\nfarewell<|im_end|>\n", True)]
    assert "".join(text for text, _ in pieces) == render_template(template, messages)
    # One reply: its reasoning is rendered, and trained on (by prefixes, as before)
    single = chat_segments(messages[:3], template)
    assert [text for text, target in single if target] == ["<think>\ngreet back\n</think>\n\nhello<|im_end|>\n"]
    # A conversation that ends with a user message: its last piece is no target
    assert chat_segments(messages[:4], template)[-1] == ("<|im_start|>user\nbye<|im_end|>\n", False)
    # Turns without newlines (DeepSeek's way) and a prompt that opens more than a reply shows ("<A><think>"
    # against "<A>hello"): the lines they share end inside the system message, which no target may reach into
    opens = ChatTemplate(QWEN3_LIKE.replace("'<|im_start|>' + m.role + '\\n'", "'<|im_start|>' + m.role")
                         .replace("'<|im_end|>\\n'", "'<|im_end|>'")
                         .replace("'<|im_start|>assistant\\n'", "'<|im_start|>assistant<think>\\n'"))
    with pytest.raises(DataError, match=r"its reply \(message 3\) is not found in the whole rendering"):
        chat_segments([{"role": "system", "content": "be\nbrief"}, *messages[1:]], opens)
    # Without a generation prompt there is no header to take out (as by prefixes): the whole turn is a target
    bare = ChatTemplate(QWEN3_LIKE.split("{% if add_generation_prompt %}")[0], eos_token="<|im_end|>")
    assert [text for text, target in chat_segments(messages, bare) if target][0] == \
        "<|im_start|>assistant\nhello<|im_end|>\n"


LLAMA_LIKE = ("{% for m in messages %}<|start|>{{ m['role'] }}<|end|>\n{{ m['content'] }}<|eot|>{% endfor %}"
              "{% if add_generation_prompt %}<|start|>assistant<|end|>\n{% endif %}")


def test_a_templates_reply_header_is_not_a_target():
    from shardline.data.encode import chat_segments

    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "hello"}, {"role": "user", "content": "bye"},
                {"role": "assistant", "content": "farewell"}]
    assert chat_segments(messages, LLAMA_LIKE) == [
        ("<|start|>system<|end|>\nbe brief<|eot|>", False), ("<|start|>user<|end|>\nhi<|eot|>", False),
        ("<|start|>assistant<|end|>\n", False), ("hello<|eot|>", True),
        ("<|start|>user<|end|>\nbye<|eot|>", False),
        ("<|start|>assistant<|end|>\n", False), ("farewell<|eot|>", True)]


def test_a_prompt_that_opens_more_than_the_reply_shows_leaves_its_header_lines():
    from shardline.data.encode import chat_segments

    # The prompt opens a reasoning block the rendered reply does not have (as reasoning
    # models' templates do): the header is the whole line both begin with.
    template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}")
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    assert chat_segments(messages, template) == [("<|im_start|>user\nhi<|im_end|>\n", False),
                                                 ("<|im_start|>assistant\n", False), ("hello<|im_end|>\n", True)]


def test_a_chat_prepare_starts_over_when_its_template_or_mask_rule_changes(tmp_path):
    from shardline.data import encode
    from shardline.data.prepare import _request

    folder = tmp_path / "tok"
    folder.mkdir()
    (folder / "tokenizer.json").write_text("{}")
    inputs = tmp_path / "chat.jsonl"
    inputs.write_text(chat_records(2))
    opts = PrepareOptions([str(inputs)], str(tmp_path / "out"), tokenizer=str(folder / "tokenizer.json"),
                          format="chat")

    def request(template: str) -> dict:
        (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
        return _request(opts, [inputs])

    first = request(LLAMA_LIKE)
    assert first["chat"]["mask_rule"] == encode.CHAT_MASK_RULE and first["chat"]["template_sha256"]
    assert request(LLAMA_LIKE) == first and request(LLAMA_LIKE + " ") != first
    assert "chat" not in _request(PrepareOptions([str(inputs)], str(tmp_path / "out")), [inputs])  # text


@pytest.mark.parametrize("template", [
    # a generation prompt that is not how a rendered reply begins
    "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}[model] {% endif %}",
    # a template that refuses a conversation without messages (the reply comes first here)
    "{% if not messages %}{{ raise_exception('empty') }}{% endif %}"
    "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}[assistant] {% endif %}",
])
def test_a_reply_without_a_matching_generation_prompt_is_a_target_whole(template):
    from shardline.data.encode import chat_segments

    messages = [{"role": "assistant", "content": "hello"}, {"role": "user", "content": "hi"}]
    assert chat_segments(messages, template) == [("[assistant] hello\n", True), ("[user] hi\n", False)]


def test_chat_data_without_an_assistant_role_is_one_line_in_both_paths(tmp_path):
    """ShareGPT-style roles would train on nothing (every loss 0): refused, raw and prepared."""
    path = tmp_path / "sharegpt.jsonl"
    path.write_text(chat_records(4).replace('"assistant"', '"gpt"'))
    message = r"has no message of role 'assistant' .*roles found: gpt, system, user; rename"
    with pytest.raises(DataError, match=message):
        data(path, "data.format=chat")
    with pytest.raises(DataError, match=message):
        prepare(PrepareOptions([str(path)], str(tmp_path / "prep"), format="chat", **SMALL))
    assert not (tmp_path / "prep").exists()  # refused in the first pass, before the folder is made


def test_a_typo_of_the_assistant_role_is_one_line_in_both_paths(tmp_path):
    """One reply written "assitant" among good ones trained on nothing there, in silence."""
    path = tmp_path / "typo.jsonl"
    records = chat_records(4).splitlines()
    path.write_text("\n".join([*records[:-1], records[-1].replace('"assistant"', '"assitant"')]) + "\n")
    refused_in_both_paths(path, tmp_path, r"has messages of role 'assitant', the first \(opening 'It is 6.'\): a "
                                          r"typo of 'assistant'\? .*\(roles found: assistant, assitant")
    path.write_text("\n".join([*records[:-1], records[-1].replace('"assistant"', '"Assistant"')]) + "\n")
    with pytest.raises(DataError, match="has messages of role 'Assistant', the first .*: a typo of 'assistant'"):
        data(path, "data.format=chat")
    # A merged subset whose replies keep their own dataset's role (ShareGPT's gpt, Gemini's model); beside
    # an 'assistant' reply in the same conversation such a role is context (a third party): taken
    path.write_text("\n".join([*records[:-1], records[-1].replace('"assistant"', '"gpt"')]) + "\n")
    with pytest.raises(DataError, match="has messages of role 'gpt', the first .*, in conversations with no "
                                        "'assistant': another dataset's reply role\\? .*roles found: assistant, gpt, "):
        data(path, "data.format=chat")
    path.write_text("\n".join([*records[:-1], records[-1].replace('"user"', '"model"')]) + "\n")
    data(path, "data.format=chat")
    for role in ("ipython", "assistant_1", "System", "user2", "tools"):  # agents, context: taken as they are
        path.write_text("\n".join([*records[:-1], records[-1].replace('"user"', f'"{role}"')]) + "\n")
        data(path, "data.format=chat")
    # The user's turns under another dataset's name, and none under 'user': rendered "human", prompted "user"
    path.write_text("\n".join(r.replace('"user"', '"human"') for r in records) + "\n")
    refused_in_both_paths(path, tmp_path, r"has messages of role 'human', the first .*, and none of role 'user', the "
                                          r"name chat templates and `generate --chat` give the user's turns .*rename "
                                          r"those messages' role to 'user'$")


def refused_in_both_paths(path, tmp_path, message: str) -> None:
    """Chat data at `path` refused alike by a run's data and by prepare."""
    with pytest.raises(DataError, match=message):
        data(path, "data.format=chat")
    with pytest.raises(DataError, match=message):
        prepare(PrepareOptions([str(path)], str(tmp_path / "prep"), format="chat", **SMALL))


def test_chat_data_from_plain_text_is_one_line(tmp_path):
    (tmp_path / "notes.txt").write_text("user: hi\nassistant: hello\n")
    with pytest.raises(DataError, match="is plain text, but the chat format reads conversations"):
        data(tmp_path / "notes.txt", "data.format=chat")


def test_an_interrupted_prepare_of_other_options_is_said_as_it_is_started_over(tmp_path, small_corpus, capsys):
    """Hours of committed work went without a word where anything in the request differed."""
    out, opts = tmp_path / "prep", dict(shard_tokens=30_000, **SMALL)
    with pytest.raises(PrepareStopped):
        prepare(PrepareOptions([str(small_corpus)], str(out), stop_after_shards=2, **opts))
    done = json.loads((out / "progress.json").read_text())["documents_done"]
    prepare(PrepareOptions([str(small_corpus)], str(out), **{**opts, "vocab_size": 300, "progress": True}))
    assert (f"the interrupted prepare in {out} was of other inputs or options (tokenizer): starting over, its "
            f"{done:,} documents done dropped") in capsys.readouterr().err


def test_a_rerun_with_other_options_drops_the_manifest_before_any_shard(tmp_path, small_corpus, monkeypatch):
    """Stopped while it deletes the old shards, a rerun with other options leaves a folder no one
    takes as prepared (it once left the old manifest over missing shards: "nothing to do")."""
    out = tmp_path / "prep"
    prepare(PrepareOptions([str(small_corpus)], str(out), **SMALL))

    def stopped(*args, **kwargs):
        assert not (out / "manifest.json").exists()
        raise KeyboardInterrupt

    monkeypatch.setattr(shutil, "rmtree", stopped)
    with pytest.raises(KeyboardInterrupt):
        prepare(PrepareOptions([str(small_corpus)], str(out), overwrite=True, **{**SMALL, "vocab_size": 300}))
    with pytest.raises(DataError, match="unfinished prepared folder"):
        data(out)


def _killed(job, chunk):  # a worker the OOM killer takes
    os.kill(os.getpid(), signal.SIGKILL)


def test_a_worker_killed_mid_prepare_is_one_line_and_the_rerun_resumes(tmp_path, small_corpus, monkeypatch):
    """A multiprocessing Pool waited forever for a killed worker's chunk."""
    from shardline.data import pool

    out, opts = tmp_path / "prep", dict(shard_tokens=30_000, workers=2, **SMALL)
    with pytest.raises(PrepareStopped):
        prepare(PrepareOptions([str(small_corpus)], str(out), stop_after_shards=1, **opts))
    done = json.loads((out / "progress.json").read_text())["documents_done"]
    with monkeypatch.context() as m:
        m.setattr(pool, "encode_chunk", _killed)
        with pytest.raises(DataError, match="a tokenizing worker died .* what was committed is kept"):
            prepare(PrepareOptions([str(small_corpus)], str(out), **opts))
    assert json.loads((out / "progress.json").read_text())["documents_done"] == done
    prepare(PrepareOptions([str(small_corpus)], str(out), **opts))
    assert verify(out) == []


def test_inputs_named_twice_are_read_once_and_held_out_files_given_apart_are_refused(tmp_path, small_corpus):
    """A shell's `data/*.jsonl` passes a dataset's validation file as an input of its own."""
    folder = tmp_path / "data"
    folder.mkdir()
    shutil.copy(small_corpus, folder / "train.jsonl")
    once = prepare(PrepareOptions([str(folder)], str(tmp_path / "once"), **SMALL))
    twice = prepare(PrepareOptions([str(folder), str(folder / "train.jsonl")], str(tmp_path / "twice"), **SMALL))
    assert twice["input_documents"] == once["input_documents"]
    (folder / "validation.jsonl").write_text('{"text": "held out"}\n')
    with pytest.raises(DataError, match=r"INPUTs hold held-out files \(validation.jsonl\) beside the training"):
        prepare(PrepareOptions([str(folder / "train.jsonl"), str(folder / "validation.jsonl")], str(tmp_path / "p"),
                               **SMALL))
    assert not (tmp_path / "p").exists()
    # Judged by the names below each input, not below the inputs' common folder ("dev" here).
    (folder / "validation.jsonl").unlink()
    (tmp_path / "dev-docs").mkdir()
    shutil.copy(small_corpus, tmp_path / "dev-docs" / "notes.jsonl")
    both = prepare(PrepareOptions([str(folder), str(tmp_path / "dev-docs" / "notes.jsonl")], str(tmp_path / "p"),
                                  **SMALL))
    assert both["input_documents"] == 2 * once["input_documents"]


def test_a_lone_surrogate_escape_in_jsonl_is_one_line_naming_it(tmp_path):
    """JSON lets scraped text carry half an emoji ("\\ud83d"); no tokenizer encodes it."""
    good = '{"text": "a whole one \\ud83d\\ude00", "messages": [{"role": "user", "content": "ok"}]}\n'
    for record in ('{"text": "half \\ud83d of one"}\n', '{"messages": [{"role": "user", "content": "\\udc00"}]}\n',
                   '{"messages": [{"role": "assistant", "content": "", "tool_calls": [{"a": "\\ud83d"}]}]}\n'):
        path = tmp_path / "s.jsonl"
        path.write_text(good + record)
        field = "messages" if record.startswith('{"messages"') else "text"
        with pytest.raises(DataError, match=r"s.jsonl line 2 holds a lone surrogate escape \('\\ud"):
            list(read_file(path, field))
    path.write_text(good)
    assert list(read_file(path, "text")) == ["a whole one \U0001F600"]


def test_chat_templates_are_sandboxed_and_a_list_of_named_ones_gives_its_default(tmp_path):
    """A template comes with downloaded files: it may not reach Python's internals (transformers
    sandboxes them too). tokenizer_config.json may hold [{name, template}, ...]: "default" renders."""
    from shardline.data.chat_template import chat_template_for
    from shardline.data.encode import render_chat

    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    escape = "{{ messages.__class__.__mro__[1].__subclasses__() }}"
    with pytest.raises(DataError, match="fails on a conversation .*SecurityError"):
        render_chat(messages, escape)
    config, tok = tmp_path / "tokenizer_config.json", str(tmp_path / "tokenizer.json")
    named = [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "{{ messages[0].content }}!"}]
    config.write_text(json.dumps({"chat_template": named}))
    assert render_chat(messages, chat_template_for(tok)) == "hi!"
    config.write_text(json.dumps({"chat_template": named[:1]}))
    with pytest.raises(DataError, match=r"list of named templates without a \"default\" one \(it has \['tool_use'\]\)"):
        chat_template_for(tok)


def test_a_second_prepare_of_a_folder_waits_for_the_first_and_finds_it_done(tmp_path, small_corpus, capsys):
    """`srun shardline prepare` runs one on every task: they once wrote the same folder at once,
    deleting each other's uncommitted shards and appending twice to its document index."""
    import fcntl
    import threading

    out = tmp_path / "prep"
    out.mkdir()
    results = []
    with open(out / "prepare.lock", "a") as held:  # the first prepare, still writing
        fcntl.flock(held, fcntl.LOCK_EX)
        second = threading.Thread(target=lambda: results.append(
            prepare(PrepareOptions([str(small_corpus)], str(out), **{**SMALL, "progress": True}))))
        second.start()
        second.join(timeout=3)
        assert second.is_alive() and not (out / "progress.json").exists()  # it waits, writing nothing
        elsewhere = prepare(PrepareOptions([str(small_corpus)], str(tmp_path / "first"), **SMALL))
        shutil.copytree(tmp_path / "first", out, dirs_exist_ok=True)  # what the first one finished
    second.join(timeout=60)
    assert results == [elsewhere] and verify(out) == []
    assert "was prepared from these inputs meanwhile; nothing to do" in capsys.readouterr().err


def test_prepare_never_writes_over_a_folder_of_other_files(tmp_path, small_corpus):
    (tmp_path / "mine" / "train").mkdir(parents=True)
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(DataError, match="holds notes.txt, which a prepared folder does not"):
        prepare(PrepareOptions([str(small_corpus)], str(tmp_path / "mine"), **SMALL))
    assert (tmp_path / "mine" / "train").is_dir() and (tmp_path / "mine" / "notes.txt").is_file()


def test_prepare_never_deletes_a_dataset_laid_out_as_train_and_val(tmp_path, small_corpus):
    """train/ and val/ without a manifest or progress file are someone's data; a tokenizer.json
    alone is someone's tokenizer. Bad input or options leave no folder behind."""
    for name in ("train", "val"):
        (tmp_path / "dl" / name).mkdir(parents=True)
        (tmp_path / "dl" / name / "part-0001.jsonl").write_text('{"text": "precious"}\n')
    (tmp_path / "tok").mkdir()
    (tmp_path / "tok" / "tokenizer.json").write_text("{}")
    for out, first in (("dl", "train"), ("tok", "tokenizer.json")):
        with pytest.raises(DataError, match=f"holds {first} but no manifest.json or progress.json"):
            prepare(PrepareOptions([str(small_corpus)], str(tmp_path / out), **SMALL))
    assert (tmp_path / "dl" / "train" / "part-0001.jsonl").read_text() == '{"text": "precious"}\n'
    assert (tmp_path / "tok" / "tokenizer.json").read_text() == "{}"
    for bad, message in (({"tokenizer": str(tmp_path / "nope.json")}, "is not a file"),
                         ({"vocab_size": -5}, "--vocab-size=-5 is invalid")):
        with pytest.raises(DataError, match=message):
            prepare(PrepareOptions([str(small_corpus)], str(tmp_path / "new"), **{**SMALL, **bad}))
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(DataError, match="contains no text"):
        prepare(PrepareOptions([str(tmp_path / "empty.txt")], str(tmp_path / "new"), **SMALL))
    assert not (tmp_path / "new").exists()


def test_the_train_log_shows_tokens_per_source(tmp_path, prepared, tiny_config):
    from shardline.trainer import Trainer

    mix = f'data.mix=[{{path = "{prepared}", weight = 1}}, {{path = "{prepared}", weight = 3}}]'
    cfg = tiny_config("data.path=", mix, "train.steps=3", "train.eval_interval=0", "checkpoint.interval=0")
    Trainer(cfg).build().train()
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    seen = [r["tokens_by_source"] for r in records if r["kind"] == "train"]
    assert [sum(s.values()) for s in seen] == [8 * 32 * step for step in (1, 2, 3)]
    assert list(seen[-1]) == ["0:prep", "1:prep"] and seen[-1]["1:prep"] > seen[-1]["0:prep"]


def test_a_resume_with_other_mixture_weights_is_refused(tmp_path, prepared, tiny_config):
    """Another weight maps the same sample index to other sequences: the rest of the pass would
    repeat some and skip others, with the same sample count."""
    from shardline.errors import CheckpointError
    from shardline.trainer import Trainer

    def mix(second: int) -> str:
        return f'data.mix=[{{path = "{prepared}", weight = 1}}, {{path = "{prepared}", weight = {second}}}]'

    common = ["data.path=", "train.eval_interval=0", "checkpoint.interval=2"]
    Trainer(tiny_config(*common, mix(3), "train.steps=2")).build().train()
    with pytest.raises(CheckpointError, match=r"saved for a data.mix .* \(weights, sources or their order changed\)"):
        Trainer(tiny_config(*common, mix(1), "train.steps=4")).build()
    assert Trainer(tiny_config(*common, mix(3), "train.steps=4")).build().step == 2


def test_a_vocabulary_with_gaps_gets_shards_wide_enough_and_no_id_wraps(tmp_path):
    from tokenizers import models

    from shardline.data.loader import DataBundle
    from shardline.data.shards import SplitWriter, id_bound, token_dtype

    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1, "b": 70_000}, unk_token="[UNK]"))
    assert tok.get_vocab_size() == 3 and id_bound(tok) == 70_001 and token_dtype(id_bound(tok)) == np.uint32
    assert DataBundle(tok, None, None, None).vocab_size == 70_001  # the model's embedding rows too
    writer = SplitWriter(tmp_path, "train", np.dtype(np.uint16), chat=False, state=None)
    writer.add(np.array([1, 70_000]), np.array([2]), None)
    with pytest.raises(DataError, match="token id 70000 does not fit the folder's uint16 shards"):
        writer.flush()


def test_a_table_column_that_is_not_text_is_one_line(tmp_path):
    pq.write_table(pa.table({"text": [1, 2, 3], "body": ["a b", None, "c d"]}), tmp_path / "t.parquet")
    with pytest.raises(DataError, match=r"column 'text' holds int values, not text \(set data.text_field"):
        read_documents(str(tmp_path / "t.parquet"))
    assert read_documents(str(tmp_path / "t.parquet"), "body") == ["a b", "c d"]  # a null row holds no document


def test_a_prepared_folder_too_small_to_evaluate_says_to_prepare_again(tmp_path, small_corpus):
    """Its split was made by prepare: raising data.val_fraction would change nothing."""
    prepare(PrepareOptions([str(small_corpus)], str(tmp_path / "prep"), val_fraction=0.001, **SMALL))
    with pytest.raises(DataError, match=r"prepare it again with --overwrite and a larger --val-fraction, evaluate on "
                                        r"all of a file \(data.val_path\), or set train.eval_interval=0"):
        data(tmp_path / "prep", seq_len=8192)


def test_nothing_held_out_trains_on_every_document_without_evaluation(tmp_path, small_corpus):
    """val_fraction 0 (raw data, and prepare's --val-fraction 0): every document is a training one,
    and an evaluation, with nothing to evaluate on, is refused in one line naming what to set."""
    everything = data(small_corpus, "data.val_fraction=0", "train.eval_interval=0")
    some = data(small_corpus, "train.eval_interval=0")
    assert len(everything.val) == everything.val.num_tokens == 0
    assert everything.train.num_tokens > some.train.num_tokens > 0
    prepare(PrepareOptions([str(small_corpus)], str(tmp_path / "prep"), val_fraction=0, **SMALL))
    prepared = data(tmp_path / "prep", "train.eval_interval=0")
    assert len(prepared.val) == 0 and prepared.train.num_tokens == everything.train.num_tokens
    with pytest.raises(DataError, match=re.escape("holds nothing out to evaluate on (prepared with --val-fraction "
                                                  "0): set train.eval_interval=0 (no evaluation), prepare it again")):
        data(tmp_path / "prep")
    with pytest.raises(ConfigError, match=re.escape("data.val_fraction=0 holds nothing out for train.eval_interval=50 "
                                                    "to evaluate on: set train.eval_interval=0")):
        check_config(load_config(None, ["data.val_fraction=0"]))  # (before any data is read)
    # A prepared folder's split is its own: data.val_fraction=0 asks nothing of it (it holds one here).
    held = tmp_path / "held"
    prepare(PrepareOptions([str(small_corpus)], str(held), val_fraction=0.05, **SMALL))
    cfg = load_config(None, [f"data.path={held}", "data.val_fraction=0"])
    check_config(cfg)
    assert len(build_data(cfg).val) > 0
    with pytest.raises(DataError, match=re.escape("holds nothing out to evaluate on (data.val_fraction=0): set")):
        data(small_corpus, "data.val_fraction=0")  # (the loader's own check, for a config never checked)
    lone = tmp_path / "one.jsonl"  # one conversation is enough when none is held out
    lone.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"},
                                             {"role": "assistant", "content": "hello there"}]}) + "\n")
    chat = data(lone, "data.format=chat", "data.val_fraction=0", "train.eval_interval=0", seq_len=64)
    assert len(chat.train) > 0 and len(chat.val) == 0
    with pytest.raises(DataError, match="holds 1 conversations; chat data needs at least two"):
        data(lone, "data.format=chat", "train.eval_interval=0", seq_len=64)


@pytest.fixture(scope="module")
def bos_tokenizer(tmp_path_factory, small_corpus):
    """A tokenizer.json whose post-processor puts a BOS token before a text, as Llama 3's puts
    <|begin_of_text|> (a BPE trained on the small corpus, the BOS added to its vocabulary)."""
    from tokenizers import processors

    from shardline.data.tokenizer import train_bpe

    tok = train_bpe(read_documents(str(small_corpus)), 512)
    tok.add_special_tokens(["<|begin_of_text|>"])
    bos = tok.token_to_id("<|begin_of_text|>")
    tok.post_processor = processors.TemplateProcessing(single="<|begin_of_text|> $A", special_tokens=[
        ("<|begin_of_text|>", bos)])
    path = tmp_path_factory.mktemp("bos_tokenizer") / "tokenizer.json"
    tok.save(str(path))
    return path, bos


def _starts(split) -> np.ndarray:
    return np.asarray(split.tokens[:])[np.asarray(split.doc_starts)]


def test_text_documents_start_with_the_tokenizers_bos_raw_or_prepared(tmp_path, small_corpus, bos_tokenizer):
    """With a tokenizer whose post-processor starts a text with BOS, every text document does,
    raw or prepared (the same batches), and not with data.add_bos=false / --no-bos; the
    trained BPE has none to add."""
    from shardline.data.tokenizer import bos_prefix, load_tokenizer, train_bpe

    path, bos = bos_tokenizer
    assert bos_prefix(load_tokenizer(str(path))) == [bos] and bos_prefix(train_bpe(["a b c"] * 4, 300)) == []
    raw = data(small_corpus, f"data.tokenizer={path}")
    assert set(_starts(raw.train)) == set(_starts(raw.val)) == {bos}
    prepared = tmp_path / "prep"
    manifest = prepare(PrepareOptions([str(small_corpus)], str(prepared), tokenizer=str(path), progress=False))
    assert manifest["bos_ids"] == [bos]
    assert_same_batches(raw, data(prepared))
    without = data(small_corpus, f"data.tokenizer={path}", "data.add_bos=false")
    assert bos not in set(_starts(without.train)) and without.train.num_tokens == raw.train.num_tokens - len(
        raw.train.doc_starts)
    plain = tmp_path / "plain"
    prepare(PrepareOptions([str(small_corpus)], str(plain), tokenizer=str(path), add_bos=False, progress=False))
    assert_same_batches(without, data(plain, "data.add_bos=false"))


def test_a_prepared_folder_and_data_add_bos_must_agree(tmp_path, small_corpus, bos_tokenizer, capsys):
    """A folder prepared with BOS opened with data.add_bos=false, or one without (--no-bos, or
    prepared before BOS was added) opened with it: one line naming both fixes. Preparing again
    with the other setting starts over instead of keeping the folder."""
    path, bos = bos_tokenizer
    with_bos, without = tmp_path / "with", tmp_path / "without"
    prepare(PrepareOptions([str(small_corpus)], str(with_bos), tokenizer=str(path), progress=False))
    prepare(PrepareOptions([str(small_corpus)], str(without), tokenizer=str(path), add_bos=False, progress=False))
    with pytest.raises(DataError, match=rf"data.add_bos=false but .*with was prepared with \[{bos}\] before each "
                                        r"document; set data.add_bos=true, or prepare it again with --overwrite "
                                        r"--no-bos"):
        data(with_bos, "data.add_bos=false")
    with pytest.raises(DataError, match=rf"data.add_bos=true \(the default\) and the tokenizer starts a text with "
                                        rf"\[{bos}\], but .*without was prepared without it"):
        data(without)
    with pytest.raises(DataError, match=r"holds a finished prepare of other inputs or options \(bos\); preparing it "
                                        r"again replaces its tokens, .* or --overwrite to replace it"):
        prepare(PrepareOptions([str(small_corpus)], str(without), tokenizer=str(path), progress=True))
    manifest = prepare(PrepareOptions([str(small_corpus)], str(without), tokenizer=str(path), progress=True,
                                      overwrite=True))
    assert "was prepared from other inputs or options (bos); --overwrite: replacing it" in capsys.readouterr().err
    assert manifest["bos_ids"] == [bos]
    data(without)  # agrees now


def test_the_tokenizers_settings_and_chat_template_travel_with_a_prepared_folder_into_a_run(
        tmp_path, small_corpus, bos_tokenizer):
    """prepare keeps the files beside --tokenizer (its settings, chat template), so a run trained
    on the folder holds them as a run on the tokenizer itself would (`generate --chat`, `convert
    to-hf`); preparing again with a tokenizer without them drops them."""
    from shardline.config import load_config
    from shardline.trainer import Trainer

    chosen = tmp_path / "hf_tokenizer"
    chosen.mkdir()
    shutil.copyfile(bos_tokenizer[0], chosen / "tokenizer.json")
    (chosen / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ messages }}", "eos_token": "x"}))
    (chosen / "chat_template.jinja").write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    out = tmp_path / "prep"
    prepare(PrepareOptions([str(small_corpus)], str(out), tokenizer=str(chosen / "tokenizer.json"), progress=False))
    for name in ("tokenizer_config.json", "chat_template.jinja"):
        assert (out / name).read_bytes() == (chosen / name).read_bytes(), name
    run = tmp_path / "run"
    Trainer(load_config(None, [f"data.path={out}", f"run.dir={run}", "train.steps=1", "train.seq_len=64",
                               "model.dim=64", "model.n_layers=1", "model.n_heads=4", "model.ffn_dim=128"])).build()
    assert (run / "chat_template.jinja").read_bytes() == (chosen / "chat_template.jinja").read_bytes()
    prepare(PrepareOptions([str(small_corpus)], str(out), tokenizer=str(bos_tokenizer[0]), progress=False))
    assert not (out / "tokenizer_config.json").exists() and not (out / "chat_template.jinja").exists()


def test_bos_is_added_once_and_a_resume_keeps_the_runs_setting(tmp_path, small_corpus, bos_tokenizer):
    """Text written with its BOS already (a pre-rendered document) keeps one; a run trained with
    BOS resumed with data.add_bos=false (or a run from before the key, read as false, resumed
    with the default) is refused in one line naming the key."""
    from shardline.config import load_config
    from shardline.data.encode import encode_documents
    from shardline.data.tokenizer import load_tokenizer
    from shardline.errors import ConfigError
    from shardline.trainer import Trainer

    path, bos = bos_tokenizer
    tok = load_tokenizer(str(path))
    tokens, lengths, _ = encode_documents(tok, ["<|begin_of_text|>in the beginning", "in the beginning"], None,
                                          bos=[bos])
    assert lengths[0] == lengths[1] and list(tokens).count(bos) == 2 and tokens[1] != bos
    run = tmp_path / "run"
    base = [f"data.path={small_corpus}", f"data.tokenizer={path}", f"run.dir={run}", "train.steps=2",
            "train.seq_len=64", "model.dim=64", "model.n_layers=1", "model.n_heads=4", "model.ffn_dim=128",
            "checkpoint.interval=1", "train.eval_interval=0", "train.stop_at_step=1", "metrics.progress=none"]
    Trainer(load_config(None, base)).build().train()
    from shardline.dry_run import dry_run

    for launch in (lambda cfg: Trainer(cfg).build(), lambda cfg: dry_run(cfg, 1)):  # a dry run fails as the launch
        with pytest.raises(ConfigError, match="was trained with data.add_bos=true, this run has false: every "
                                              "document's tokens would change; set data.add_bos=true to resume it"):
            launch(load_config(None, [*base, "data.add_bos=false"]))


def test_a_sentencepiece_tokenizer_sees_a_conversation_as_its_chat_pipeline_does():
    """Llama 2's and Mistral's tokenizers (Metaspace: every encode call starts with "▁") gave each
    segment of a conversation its own leading space when segments were tokenized one by one: the
    ids differed from the model's own chat tokenization at every turn. The rendering is tokenized
    whole now, and the mask falls on exactly the replies' tokens."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    from shardline.data.chat_template import ChatTemplate
    from shardline.data.encode import encode_chat

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    text = ["[INST] what is one? [/INST] It is 1.", "[INST] and two? [/INST] It is 2. Done."] * 20
    tok.train_from_iterator(text, trainers.BpeTrainer(vocab_size=120, special_tokens=["<unk>", "</s>"]))
    chat = [{"role": "user", "content": "what is one?"}, {"role": "assistant", "content": "It is 1."},
            {"role": "user", "content": "and two?"}, {"role": "assistant", "content": "It is 2. Done."}]
    template = ChatTemplate(MISTRAL_LIKE.replace("[/INST]", "[/INST] "), eos_token="</s>")
    ids, mask = encode_chat(tok, chat, template)
    rendered = "[INST] what is one? [/INST] It is 1.</s>[INST] and two? [/INST] It is 2. Done.</s>"
    assert ids == tok.encode(rendered, add_special_tokens=False).ids
    targets = [tok.id_to_token(i) for i, m in zip(ids, mask) if m]
    assert "".join(targets) == "▁It▁is▁1.</s>▁It▁is▁2.▁Done.</s>"  # "▁It": with the space the template wrote


def test_a_header_token_that_takes_in_the_replys_leading_blank_stays_the_headers():
    """An added token with rstrip (Phi-3's <|assistant|>) takes in the whitespace after it, the
    reply's leading blank too: it is still the header, given at inference, not a target."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers, trainers

    from shardline.data.chat_template import ChatTemplate
    from shardline.data.encode import encode_chat

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.train_from_iterator(["what is one? It is 1."] * 20,
                            trainers.BpeTrainer(vocab_size=80, special_tokens=["<unk>"]))
    tok.add_special_tokens([AddedToken("<|assistant|>", rstrip=True, special=True),
                            AddedToken("<|user|>", special=True), AddedToken("<|end|>", special=True)])
    template = ChatTemplate("{% for m in messages %}{{ '<|' + m['role'] + '|>\\n' + m['content'] + '<|end|>' }}"
                            "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}")
    chat = [{"role": "user", "content": "what is one?"}, {"role": "assistant", "content": " It is 1."}]
    ids, mask = encode_chat(tok, chat, template)
    header = tok.token_to_id("<|assistant|>")
    assert header in ids and mask[ids.index(header)] == 0
    targets = tok.decode([i for i, m in zip(ids, mask) if m], skip_special_tokens=False)
    assert targets.replace("▁", "").replace(" ", "") == "Itis1.<|end|>"


def test_prepare_counts_and_names_what_it_skips_and_a_run_on_the_folder_says_so(tmp_path, small_corpus, capsys):
    from shardline.cli import main

    docs = read_documents(str(small_corpus))[:60]
    src = tmp_path / "src"
    src.mkdir()
    pq.write_table(pa.table({"text": docs[:30] + [None, " "]}), src / "a.parquet")
    (src / "b.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs[30:]))
    (src / "notes.csv").write_text("id,text\n1,not read\n")
    out = tmp_path / "prep"
    assert main(["prepare", str(src), "--out", str(out), "--vocab-size", "512", "--val-fraction", "0.1",
                 "--quiet"]) == 0
    err = capsys.readouterr().err
    assert f"note: skipped 2 empty or null documents and 1 file(s) of no type it reads ({src / 'notes.csv'}" in err
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["empty_documents"] == 2 and manifest["files_not_read"] == [str(src / "notes.csv")]
    fields = data(out).describe(steps=10)
    assert fields["empty_documents_skipped"] == 2 and fields["files_not_read"] == str(src / "notes.csv")


def test_a_folder_prepared_before_fingerprints_gets_one_when_prepared_again(tmp_path, small_corpus):
    """Such a folder's resumes were not compared with the data they saved, without a word: the data
    line says so, and prepare with the same arguments adds the fingerprint (no tokenizing)."""
    out = tmp_path / "prep"
    made = prepare(PrepareOptions([str(small_corpus)], str(out), **SMALL))
    manifest = json.loads((out / "manifest.json").read_text())
    del manifest["train_fingerprint"]  # as prepared before this version
    (out / "manifest.json").write_text(json.dumps(manifest))
    assert data(out).describe(steps=1)["fingerprint"].startswith("none: a folder prepared before fingerprints")
    again = prepare(PrepareOptions([str(small_corpus)], str(out), **SMALL))
    assert again["train_fingerprint"] == made["train_fingerprint"]
    assert json.loads((out / "manifest.json").read_text())["train_fingerprint"] == made["train_fingerprint"]
    assert data(out).describe(steps=1)["fingerprint"] == made["train_fingerprint"]


def test_a_shard_damaged_in_place_is_one_line_at_the_batch_not_an_index_error(tmp_path, small_prepared):
    """Bytes of a shard changed, its size kept (a launch checks sizes, not hashes): token ids past the
    vocabulary reached the embedding as an IndexError traceback mid-run."""
    damaged = tmp_path / "prep"
    shutil.copytree(small_prepared, damaged)
    shard = next((damaged / "train").glob("*.bin"))
    tokens = np.fromfile(shard, dtype=np.uint16)
    tokens[::7] = np.iinfo(np.uint16).max
    tokens.tofile(shard)
    bundle = data(damaged)
    with pytest.raises(DataError, match=rf"^{re.escape(str(damaged))} holds token id 65535, past its tokenizer's "
                                        r"\d+: its shards are damaged; `shardline prepare --verify --out"):
        bundle.train.batch(np.arange(len(bundle.train)))
    assert data(small_prepared).train.batch(np.arange(4))["input_ids"].max() < 512


def test_document_starts_are_checked_across_the_chunks_they_are_read_in():
    from shardline.data.packing import check_starts

    check_starts(np.array([0, 3, 5, 9, 12], dtype=np.int64), 20, "x", chunk=2)
    for bad in ([0, 3, 5, 4, 12], [0, 3, 2, 9, 12], [0, 3, 5, 9, 20]):  # (a drop inside a chunk, between two; past)
        with pytest.raises(DataError, match="^x: its document starts do not rise from 0 inside the 20 tokens"):
            check_starts(np.array(bad, dtype=np.int64), 20, "x", chunk=2)


@pytest.mark.parametrize("edit", ["zeroed", "past_the_end", "first_not_zero"])
def test_a_document_index_edited_in_place_is_one_line_at_the_launch(tmp_path, small_prepared, edit):
    """An offset of docs.idx changed, its size kept: the run trained with other document masks, in silence."""
    damaged = tmp_path / "prep"
    shutil.copytree(small_prepared, damaged)
    index = damaged / "train" / "docs.idx"
    starts = np.fromfile(index, dtype=np.int64)
    at = {"zeroed": len(starts) // 2, "past_the_end": len(starts) - 1, "first_not_zero": 0}[edit]
    starts[at] = {"zeroed": 0, "past_the_end": 10**12, "first_not_zero": 1}[edit]
    starts.tofile(index)
    with pytest.raises(DataError, match=rf"^{re.escape(str(index))}: its document starts do not rise from 0 inside "
                                        r"the [\d,]+ tokens \(edited or damaged after prepare\?\); prepare the folder "
                                        "again with --overwrite$"):
        data(damaged)
    data(small_prepared)  # (the folder as prepare wrote it)


def test_a_template_that_closes_the_conversation_with_eos_is_masked_by_turns():
    """Phi-3's template ends a conversation with eos where no generation prompt follows, so a
    prefix's rendering is no prefix of the next one's (it was refused as a rewriting template).
    The closing comes off each prefix's last piece: the pieces make the whole conversation's
    rendering, each reply and its <|end|> are targets, the headers and prompts are not, and the
    closing eos ends the last reply."""
    from shardline.data.chat_template import ChatTemplate
    from shardline.data.encode import chat_segments

    template = ChatTemplate(PHI3_LIKE.replace("SEP", "'\\n'"), eos_token="<|endoftext|>")
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "hello"}, {"role": "user", "content": "bye"},
                {"role": "assistant", "content": "farewell"}]
    pieces = chat_segments(messages, template)
    assert pieces == [("<|system|>\nbe brief<|end|>\n", False), ("<|user|>\nhi<|end|>\n", False),
                      ("<|assistant|>\n", False), ("hello<|end|>\n", True), ("<|user|>\nbye<|end|>\n", False),
                      ("<|assistant|>\n", False), ("farewell<|end|>\n<|endoftext|>", True)]
    from shardline.data.chat_template import render_template as _render

    assert "".join(text for text, _ in pieces) == _render(template, messages)
    ends_with_user = chat_segments(messages[:2], template)  # (a closing after a prompt is not a target)
    assert ends_with_user[-1] == ("<|user|>\nhi<|end|>\n<|endoftext|>", False)
    # A closing of eos and a newline (it was refused as a template that rewrites earlier turns)
    newline = ChatTemplate(PHI3_LIKE.replace("SEP", "'\\n'").replace("{{ eos_token }}", "{{ eos_token + '\\n' }}"),
                           eos_token="<|endoftext|>")
    pieces = chat_segments(messages, newline)
    assert pieces[3] == ("hello<|end|>\n", True) and pieces[-1] == ("farewell<|end|>\n<|endoftext|>\n", True)
    assert "".join(text for text, _ in pieces) == _render(newline, messages)


def test_an_end_of_document_token_only_tokenizer_config_names_separates_documents(tmp_path):
    """A tokenizer whose end of text has a name we do not know ([EOT]) packed documents with nothing
    between them although its tokenizer_config.json names it: read there, raw and prepared alike."""
    from tokenizers import models, pre_tokenizers

    from shardline.data.tokenizer import eos_id
    from shardline.launch_notes import launch_notes

    folder = tmp_path / "tok"
    folder.mkdir()
    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "[EOT]": 1, "a": 2, "b": 3}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(folder / "tokenizer.json"))
    text = tmp_path / "docs.jsonl"
    text.write_text("".join(json.dumps({"text": " ".join("ab"[(i + j) % 2] for j in range(5 + i % 3))}) + "\n"
                            for i in range(40)))
    settings = ["data.val_fraction=0.1", "train.seq_len=16", "train.eval_interval=0", "metrics.peak_tflops=1"]

    def raw_and_note():
        cfg = load_config(None, [f"data.path={text}", f"data.tokenizer={folder / 'tokenizer.json'}", *settings])
        notes = dict(launch_notes(cfg, "cpu", 1.0, 1, tokenizer=tok))
        return build_data(cfg).train, notes

    unnamed, notes = raw_and_note()
    assert eos_id(tok, folder / "tokenizer.json") is None and "no_end_of_document_token" in notes
    assert 1 not in unnamed.tokens
    for named in ("[EOT]", {"content": "[EOT]", "special": True}):  # as transformers writes it, either way
        (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": named}))
        assert eos_id(tok, folder / "tokenizer.json") == 1 and eos_id(tok) is None
        packed, notes = raw_and_note()
        assert "no_end_of_document_token" not in notes
        assert int((np.asarray(packed.tokens) == 1).sum()) == packed.num_documents  # one after each document
    manifest = prepare(PrepareOptions([str(text)], str(tmp_path / "prep"), tokenizer=str(folder / "tokenizer.json"),
                                      val_fraction=0.1, progress=False))
    assert manifest["eos_id"] == 1 and manifest["request"]["eos"] == 1  # (a prepare begun without it starts over)
    cfg = load_config(None, [f"data.path={tmp_path / 'prep'}", *settings])
    prepared = build_data(cfg).train
    every = np.arange(len(packed))
    assert len(prepared) == len(packed)
    assert all(np.array_equal(prepared.batch(every)[k], packed.batch(every)[k]) for k in ("input_ids", "labels"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|not_a_token|>"}))
    assert eos_id(tok, folder / "tokenizer.json") is None


def test_a_folder_reads_alike_for_train_and_prepare_past_links_and_hidden_files(tmp_path):
    """A linked folder was skipped in silence (documents not trained on), a file linked twice was
    read twice by a run but once by prepare (raw and prepared batches differed), and .git,
    .ipynb_checkpoints or a macOS ._ file were trained on (or stopped the run)."""
    from shardline.data.sources import files_not_read, input_files, read_documents

    elsewhere = tmp_path / "more"
    elsewhere.mkdir()
    (elsewhere / "b.jsonl").write_text(json.dumps({"text": "linked folder text"}) + "\n")
    folder = tmp_path / "data"
    (folder / ".git").mkdir(parents=True)
    (folder / ".ipynb_checkpoints").mkdir()
    (folder / "a.jsonl").write_text(json.dumps({"text": "own text"}) + "\n")
    (folder / ".git" / "notes.txt").write_text("git internals")
    (folder / ".ipynb_checkpoints" / "a-checkpoint.jsonl").write_text(json.dumps({"text": "a copy"}) + "\n")
    (folder / "._a.jsonl").write_bytes(b"\x00\x05\x16\x07 AppleDouble")
    (folder / "twice.jsonl").symlink_to(folder / "a.jsonl")
    (folder / "more").symlink_to(elsewhere)
    (folder / "loop").symlink_to(folder)  # (a link back up: no loop)
    assert [f.name for f in input_files(str(folder))] == ["a.jsonl", "b.jsonl"]
    assert sorted(read_documents(str(folder), "text")) == ["linked folder text", "own text"]
    assert files_not_read(str(folder)) == []
    manifest = prepare(PrepareOptions([str(folder)], str(tmp_path / "prep"), val_fraction=0.0, **SMALL))
    assert manifest["input_documents"] == 2


def test_a_plain_folder_reads_in_the_order_it_always_did_and_a_link_inside_adds_nothing(tmp_path):
    """The order decides the documents' order, hence the data fingerprint an existing run's resume
    compares: a plain tree reads as sorted(rglob) did; a link to a folder inside it (current -> v2)
    neither reads it twice nor moves its files ahead of v1's."""
    from shardline.data.sources import input_files

    folder = tmp_path / "d"
    for name in ("a.jsonl", "a-b/x.jsonl", "a.txt", "B/y.jsonl", "v1/z.jsonl", "v2/z.jsonl", "a-b/c/w.txt",
                 "v1/sub/k.jsonl"):
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(json.dumps({"text": name}) + "\n")
    old = sorted(p for p in folder.rglob("*") if p.is_file())
    assert input_files(str(folder)) == old
    (folder / "current").symlink_to(folder / "v2")
    assert input_files(str(folder)) == old


def test_a_link_to_a_folder_above_the_data_is_not_followed(tmp_path):
    """`up -> ..` read everything beside the data folder (a run dir there: its metrics.jsonl)."""
    from shardline.data.sources import input_files

    (tmp_path / "beside.jsonl").write_text(json.dumps({"text": "not data"}) + "\n")
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "a.jsonl").write_text(json.dumps({"text": "data"}) + "\n")
    (tmp_path / "data" / "up").symlink_to(tmp_path)
    assert [f.name for f in input_files(str(tmp_path / "data"))] == ["a.jsonl"]


def test_a_glob_pattern_reads_a_file_once_as_prepare_does(tmp_path):
    """A pattern deduped by path: `data/*.jsonl` over a file linked twice, or `data/*` over a folder and
    a link to it, read files twice in a run where prepare (by real file) read them once."""
    from shardline.data.sources import input_files, inputs_files

    data = tmp_path / "data"
    (data / "v2").mkdir(parents=True)
    (data / "a.jsonl").write_text(json.dumps({"text": "a"}) + "\n")
    (data / "v2" / "b.jsonl").write_text(json.dumps({"text": "b"}) + "\n")
    (data / "twice.jsonl").symlink_to(data / "a.jsonl")
    (data / "current").symlink_to(data / "v2")
    for pattern in (f"{data}/*.jsonl", f"{data}/*"):
        assert input_files(pattern) == inputs_files([pattern], "INPUT")
    assert [f.name for f in input_files(f"{data}/*")] == ["a.jsonl", "b.jsonl"]


def test_a_finished_folder_is_replaced_only_with_overwrite(tmp_path, small_corpus, capsys):
    """A slip in the inputs replaced hours of tokens in silence (one info line), and the runs trained
    on them could no longer resume. It is refused, naming what differs; --overwrite replaces it, and
    redoes a folder of the same inputs (whose shard was damaged: "nothing to do" before)."""
    out, short = tmp_path / "prep", tmp_path / "short.txt"
    short.write_text("a few words\n\nand a second document\n", encoding="utf-8")
    first = prepare(PrepareOptions([str(small_corpus)], str(out), vocab_size=300, progress=False))
    before = {p.name: p.read_bytes() for p in (out / "train").iterdir()}
    prepare(PrepareOptions([str(small_corpus)], str(out), vocab_size=300))  # (a rerun reads no shard: it says so)
    assert "nothing to do (its shards are not read again: --verify checks them)" in capsys.readouterr().err
    with pytest.raises(DataError, match=re.escape(f"--out {out} holds a finished prepare of other inputs or options "
                                                  f"(inputs: + {short.resolve()}, - {small_corpus.resolve()});")
                       + ".*give another --out, or --overwrite to replace it"):  # (each file named)
        prepare(PrepareOptions([str(short)], str(out), vocab_size=300, progress=False))
    assert {p.name: p.read_bytes() for p in (out / "train").iterdir()} == before  # (nothing touched)
    small_corpus.touch()  # (the same file, edited: its time differs)
    with pytest.raises(DataError, match=re.escape(f"(inputs: {small_corpus.resolve()} changed (size or time))")):
        prepare(PrepareOptions([str(small_corpus)], str(out), vocab_size=300, progress=False))
    (out / "train" / "tokens-00000.bin").write_bytes(b"\0" * len(before["tokens-00000.bin"]))
    again = prepare(PrepareOptions([str(small_corpus)], str(out), vocab_size=300, progress=False, overwrite=True))
    assert {p.name: p.read_bytes() for p in (out / "train").iterdir()} == before  # the same inputs' tokens
    assert again["train_fingerprint"] == first["train_fingerprint"]


def test_a_folder_another_prepare_finishes_while_this_one_tokenizes_is_judged_again(tmp_path, small_corpus,
                                                                                    monkeypatch):
    """The choice was made before the folder's lock: srun's tasks with --overwrite each prepared the
    folder again in turn, and one of other inputs finished meanwhile was replaced without --overwrite."""
    from shardline.data import prepare as prepare_module

    out, other = tmp_path / "prep", tmp_path / "other.txt"
    other.write_text("a few words\n\nand a second document of words\n" * 30, encoding="utf-8")
    real_count, inner = prepare_module._count, []

    def another_prepare_meanwhile(opts, files):  # (as if a peer task held the lock through its prepare)
        if not inner:
            inner.append(None)
            inner[0] = prepare(PrepareOptions(inner_inputs, str(out), vocab_size=300, progress=False,
                                              overwrite=inner_overwrites))
            inner.append({f: f.stat().st_mtime_ns for f in out.rglob("*.bin")})
        return real_count(opts, files)

    monkeypatch.setattr(prepare_module, "_count", another_prepare_meanwhile)
    inner_inputs, inner_overwrites = [str(small_corpus)], False  # the same inputs: taken as done, --overwrite or not
    written = prepare(PrepareOptions([str(small_corpus)], str(out), vocab_size=300, progress=False, overwrite=True))
    assert written == inner[0] and {f: f.stat().st_mtime_ns for f in out.rglob("*.bin")} == inner[1]  # not redone
    inner.clear()  # srun's tasks, each with --overwrite, over a folder prepared before: one redoes it, not each
    inner_overwrites = True
    written = prepare(PrepareOptions([str(small_corpus)], str(out), vocab_size=300, progress=False, overwrite=True))
    assert written == inner[0] and {f: f.stat().st_mtime_ns for f in out.rglob("*.bin")} == inner[1]
    inner_overwrites = False
    inner.clear()
    inner_inputs = [str(other)]  # other inputs, finished meanwhile: refused without --overwrite
    (tmp_path / "prep2").mkdir()
    out = tmp_path / "prep2"
    with pytest.raises(DataError, match="holds a finished prepare of other inputs or options"):
        prepare(PrepareOptions([str(small_corpus)], str(out), vocab_size=300, progress=False))
    assert (out / "manifest.json").is_file()  # the peer's folder kept


def test_a_killed_prepares_workers_go_with_it_and_a_waiting_rerun_says_so(tmp_path):
    """SIGKILL (or SIGTERM) to a prepare of 2 workers left them running, holding the folder's lock
    they had inherited: the rerun waited for ever, and said nothing."""
    import fcntl
    import subprocess
    import sys
    import time

    text, small = tmp_path / "big.txt", tmp_path / "small.txt"
    text.write_text("".join(f"document {i}: " + "words of the corpus and more words " * 60 + "\n\n"
                            for i in range(6000)), encoding="utf-8")
    small.write_text("a few words\n\nand a second document\n", encoding="utf-8")
    out, repo = tmp_path / "prep", Path(__file__).parents[2]
    proc = subprocess.Popen([sys.executable, "-m", "shardline", "prepare", str(text), "--out", str(out), "--workers",
                             "2", "--vocab-size", "300", "--shard-tokens", "20000", "--quiet"], cwd=repo)
    deadline = time.time() + 120
    while time.time() < deadline and not (out / "progress.json").is_file():
        time.sleep(0.1)
    time.sleep(1.0)  # (its workers tokenizing)
    assert proc.poll() is None and not (out / "manifest.json").exists(), "the prepare ended before the kill"
    proc.kill()
    proc.wait()
    with open(out / "prepare.lock", "a", encoding="utf-8") as handle:
        for _ in range(100):  # free within seconds: no orphan holds it
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                time.sleep(0.1)
        else:
            raise AssertionError("the killed prepare's workers still hold its lock")
        said = tmp_path / "said.txt"  # (this test holds the lock now: a rerun waits, and says so)
        with open(said, "w", encoding="utf-8") as err:
            rerun = subprocess.Popen([sys.executable, "-m", "shardline", "prepare", str(small), "--out", str(out),
                                      "--vocab-size", "300"], cwd=repo, stderr=err)
            deadline = time.time() + 60
            while time.time() < deadline and "waiting for it" not in said.read_text(encoding="utf-8"):
                time.sleep(0.1)
            rerun.kill()
            rerun.wait()
        assert f"another prepare of {out} holds its prepare.lock; waiting for it" in said.read_text(encoding="utf-8")


def test_a_prepare_stopped_by_sigterm_says_so_and_the_same_command_resumes_it(tmp_path, small_prepared):
    """SIGTERM to a prepare's process group (scancel, a container's stop) ended it with no word: it
    now says it stopped and that the same command resumes it, exits 143, and keeps what it committed
    (a resume from it: test_an_interrupted_prepare_resumes_and_never_leaves_a_manifest_behind)."""
    import json
    import subprocess
    import sys
    import time

    text = tmp_path / "big.txt"
    text.write_text("".join(f"document {i}: " + "words of the corpus and more words " * 20 + "\n\n\n"
                            for i in range(20000)), encoding="utf-8")  # (documents end at two blank lines)
    out, repo = tmp_path / "prep", Path(__file__).parents[2]
    command = [sys.executable, "-m", "shardline", "prepare", str(text), "--out", str(out), "--workers", "2",
               "--tokenizer", str(small_prepared / "tokenizer.json"), "--shard-tokens", "20000", "--quiet"]
    proc = subprocess.Popen(command, cwd=repo, stderr=subprocess.PIPE, text=True, start_new_session=True)
    deadline, done = time.time() + 120, 0
    while time.time() < deadline and not done and proc.poll() is None:
        time.sleep(0.1)
        try:
            done = json.loads((out / "progress.json").read_text(encoding="utf-8")).get("documents_done", 0)
        except (OSError, ValueError):
            pass
    assert proc.poll() is None and done, "the prepare ended before it committed a chunk and was stopped"
    os.killpg(proc.pid, signal.SIGTERM)  # (the prepare and its workers, as scancel sends it)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 143, err
    assert "shardline: prepare stopped by SIGTERM; the same command resumes it" in err and "Traceback" not in err
    state = json.loads((out / "progress.json").read_text(encoding="utf-8"))
    assert state["documents_done"] >= done and not (out / "manifest.json").exists()


def test_a_folder_a_run_reads_is_not_replaced_under_it(tmp_path, small_corpus):
    """`prepare --overwrite` replaced a folder under a running job: its held-out split, mapped at the
    first evaluation, was the new folder's (another tokenizer's), and the eval losses logged were
    those of other data. A reader's shared lock on the manifest makes the overwrite refuse; one
    that holds it makes a new reader refuse, and a folder no run reads is replaced as before."""
    import gc

    from shardline.data.readers import unread
    from shardline.data.shards import open_prepared

    out = tmp_path / "prep"
    prepare(PrepareOptions([str(small_corpus)], str(out), **SMALL))
    data = open_prepared(str(out), 32)
    with pytest.raises(DataError, match=re.escape(f"{out} is being read by a run (train or eval on it): "
                                                  "replacing it would change that run's data under it; stop the run")):
        prepare(PrepareOptions([str(small_corpus)], str(out), overwrite=True, **SMALL))
    assert (out / "manifest.json").is_file() and len(data.val)  # untouched
    del data
    gc.collect()
    with unread(out):
        with pytest.raises(DataError, match=re.escape(f"{out} is being prepared again (a `shardline prepare "
                                                      "--overwrite` holds it)")):
            open_prepared(str(out), 32)
    prepare(PrepareOptions([str(small_corpus)], str(out), overwrite=True, **SMALL))  # no reader now


@pytest.mark.parametrize("name", ["../victim.bin", "/etc/hostname"])
def test_a_manifest_naming_a_shard_outside_its_folder_is_refused(tmp_path, small_corpus, name):
    """A crafted manifest mapped any file as training tokens (`../` or absolute), and `--verify`
    hashed it; an absolute one's size check ended in a traceback."""
    import json

    from shardline.data.shards import open_prepared, verify

    out = tmp_path / "prep"
    prepare(PrepareOptions([str(small_corpus)], str(out), **SMALL))
    (tmp_path / "victim.bin").write_bytes(b"\0\0" * 100)
    manifest = json.loads((out / "manifest.json").read_text(encoding="utf-8"))
    manifest["splits"]["train"]["shards"][0]["file"] = name
    (out / "manifest.json").write_text(json.dumps(manifest), encoding="utf-8")
    for read in (lambda: open_prepared(str(out), 32), lambda: verify(out)):
        with pytest.raises(DataError, match=re.escape(f"{out / 'manifest.json'} is damaged (splits.train.shards[0] "
                                                      "names a file outside the folder); prepare the folder again")):
            read()


def test_a_shard_linked_out_of_its_folder_is_refused_and_side_files_linked_out_are_not_copied(
        tmp_path, small_corpus, small_prepared, capsys):
    """A prepared folder holding `train/tokens-00000.bin -> a file of yours` trained on that file; a
    --tokenizer folder holding `merges.txt -> ~/.ssh/id_rsa` had it copied into the prepared folder
    (and on into run dirs and exports), readable by all."""
    import shutil

    from shardline.data.shards import open_prepared, verify

    out = tmp_path / "prep"
    prepare(PrepareOptions([str(small_corpus)], str(out), **SMALL))
    shard = next((out / "train").glob("*.bin"))
    shutil.move(shard, tmp_path / "yours.bin")
    shard.symlink_to(tmp_path / "yours.bin")
    with pytest.raises(DataError, match=rf"train/{shard.name} links to .*yours\.bin, outside the folder"):
        open_prepared(str(out), 32)
    assert f"train/{shard.name}" in verify(out)
    given, secret = tmp_path / "given", tmp_path / "id_rsa"
    given.mkdir()
    secret.write_text("-----BEGIN PRIVATE KEY-----")
    shutil.copy(small_prepared / "tokenizer.json", given / "tokenizer.json")
    (given / "merges.txt").symlink_to(secret)
    prepare(PrepareOptions([str(small_corpus)], str(tmp_path / "prep2"), tokenizer=str(given / "tokenizer.json"),
                           **{**SMALL, "vocab_size": 0}))
    assert not (tmp_path / "prep2" / "merges.txt").exists()
    assert f"note: {given / 'merges.txt'} links to {secret}, outside its folder: not copied" in capsys.readouterr().err


def test_what_a_stopped_prepare_says_a_rerun_does_follows_the_folder_it_left(tmp_path, small_corpus, capsys):
    """A `prepare --overwrite` stopped in its first passes (counting, training the tokenizer) had
    replaced nothing, yet said "the same command without --overwrite resumes it": that rerun is
    refused on the earlier finished prepare still there. What it says now follows the folder."""
    from shardline.data.cli import _stoppable

    def interrupted(opts):
        raise KeyboardInterrupt

    other = tmp_path / "other.txt"
    other.write_text(small_corpus.read_text(encoding="utf-8")[: 20_000], encoding="utf-8")
    out = tmp_path / "prep"
    prepare(PrepareOptions([str(small_corpus)], str(out), **SMALL))
    assert _stoppable(interrupted, PrepareOptions([str(other)], str(out), overwrite=True, **SMALL)) == 130
    err = capsys.readouterr().err
    assert f"prepare interrupted; nothing in {out} was replaced (it holds its earlier prepare)" in err, err
    assert "resumes" not in err
    with pytest.raises(DataError, match="holds a finished prepare of other inputs"):  # (why "resumes" was wrong)
        prepare(PrepareOptions([str(other)], str(out), **SMALL))

    fresh = tmp_path / "fresh"
    assert _stoppable(interrupted, PrepareOptions([str(other)], str(fresh), **SMALL)) == 130
    assert "nothing was committed; the same command starts again" in capsys.readouterr().err

    with pytest.raises(PrepareStopped):  # committed chunks, no manifest: a rerun resumes
        prepare(PrepareOptions([str(small_corpus)], str(fresh), shard_tokens=30_000, stop_after_shards=2, **SMALL))
    assert _stoppable(interrupted, PrepareOptions([str(small_corpus)], str(fresh), overwrite=True, **SMALL)) == 130
    assert ("the same command without --overwrite resumes it (with --overwrite it starts over), keeping the "
            "documents it committed") in capsys.readouterr().err


def test_a_dry_run_refuses_a_chat_checkpoint_of_the_older_packing_as_the_launch_does(tmp_path, small_prepared):
    """A chat checkpoint saved before whole-conversation packing (its data position names no packing)
    on raw files: the dry run passed it, reading no data, and the launch refused it. How chat is
    packed follows from the config, so the dry run refuses it too, saying what keeps the run."""
    import torch

    from shardline.dry_run import dry_run
    from shardline.errors import CheckpointError
    from shardline.trainer import Trainer

    path = tmp_path / "chat.jsonl"
    path.write_text(chat_records(60), encoding="utf-8")
    run = tmp_path / "run"
    base = [f"data.path={path}", "data.format=chat", f"data.tokenizer={small_prepared / 'tokenizer.json'}",
            f"run.dir={run}", "train.steps=4", "train.seq_len=256", "model.dim=64", "model.n_layers=1",
            "model.n_heads=4", "model.ffn_dim=128", "checkpoint.interval=2", "train.eval_interval=0",
            "metrics.progress=none", "data.val_fraction=0.1"]
    Trainer(load_config(None, [*base, "train.stop_at_step=2"])).build().train()
    dry_run(load_config(None, base), 1)  # (as this shardline saved it: it goes on)
    state_file = run / "checkpoints" / "step-000002" / "trainer" / "rank0.pt"
    state = torch.load(state_file, weights_only=True)
    del state["data"]["packing"]  # as an older shardline saved it
    torch.save(state, state_file)
    resealed(state_file.parents[1], "trainer/rank0.pt")
    for launch in (lambda cfg: dry_run(cfg, 1), lambda cfg: Trainer(cfg).build()):
        with pytest.raises(CheckpointError, match=r"cut from one stream \(by an earlier shardline\)"
                                                  r".*finish the run with the shardline that saved it"):
            launch(load_config(None, base))


def test_shard_tokens_sets_the_shards_size_near_what_it_asks(tmp_path, small_corpus):
    """A shard commits at the first unit of work (2 MB of text) past --shard-tokens: asking for 100k
    gave shards of ~510k tokens. Units of work shrink with it; a shard stays whole documents."""
    out = tmp_path / "prep"
    prepare(PrepareOptions([str(small_corpus)], str(out), shard_tokens=20_000, vocab_size=512, progress=False))
    sizes = [s["tokens"] for s in json.loads((out / "manifest.json").read_text())["splits"]["train"]["shards"]]
    assert len(sizes) > 2 and all(20_000 <= n <= 1.3 * 20_000 for n in sizes[:-1]), sizes


CJK_SENTENCES = ("大型语言模型的训练需要大量的计算资源和数据。", "数据并行把同一个模型复制到每一块显卡上。",
                 "张量并行把一个矩阵乘法切分到多块显卡上计算。", "流水线并行把模型的层分成几个阶段。",
                 "检查点让训练在故障之后从最近保存的状态继续。", "混合精度训练用半精度计算并保留单精度的主权重。",
                 "上下文并行把很长的序列切分到多个设备上。", "专家并行把混合专家模型的专家分布到不同设备。")


def test_shard_tokens_holds_for_cjk_text(tmp_path):
    """Units of work were sized at ~4 characters a token: CJK text through a small BPE (a token or more
    a character, 3 bytes each) gave shards 3-12x --shard-tokens. They follow the text's tokens a byte."""
    rng = np.random.default_rng(0)
    docs = ["".join(rng.choice(CJK_SENTENCES, size=int(rng.integers(5, 40)))) for _ in range(1500)]
    corpus = tmp_path / "zh.jsonl"
    corpus.write_text("".join(json.dumps({"text": d}, ensure_ascii=False) + "\n" for d in docs), encoding="utf-8")
    out = tmp_path / "prep"
    prepare(PrepareOptions([str(corpus)], str(out), shard_tokens=20_000, vocab_size=300, progress=False))
    sizes = [s["tokens"] for s in json.loads((out / "manifest.json").read_text())["splits"]["train"]["shards"]]
    assert len(sizes) > 2 and all(20_000 <= n <= 1.3 * 20_000 for n in sizes[:-1]), sizes


def _worker_signals(parent: int, out) -> None:
    from shardline.data.pool import _worker_start

    _worker_start(parent, ())
    out.put((signal.getsignal(signal.SIGINT) == signal.SIG_IGN, signal.getsignal(signal.SIGTERM) == signal.SIG_DFL))


def test_a_tokenizing_worker_leaves_ctrl_c_to_the_prepare():
    """A terminal's Ctrl-C reaches every process of the group: a worker raising KeyboardInterrupt while it
    held the pool's queue lock left `prepare --workers 2` waiting for ever (1 in ~27 tries)."""
    import multiprocessing as mp

    ctx = mp.get_context("fork")
    out = ctx.Queue()
    child = ctx.Process(target=_worker_signals, args=(os.getpid(), out))
    child.start()
    assert out.get(timeout=60) == (True, True)
    child.join(timeout=60)


def test_a_bpe_smaller_than_asked_is_said(tmp_path, capsys):
    """--vocab-size 2048 on a small corpus printed "training a byte-level BPE of 2048 tokens", then
    vocab 359, nothing else: the model's vocabulary silently became 359."""
    from shardline.cli import main

    (tmp_path / "a.txt").write_text("\n\n\n".join(f"a short document number {i}" for i in range(40)))
    assert main(["prepare", str(tmp_path / "a.txt"), "--out", str(tmp_path / "prep"), "--vocab-size", "2048",
                 "--val-fraction", "0.1", "--quiet"]) == 0
    learned = json.loads((tmp_path / "prep" / "manifest.json").read_text())["vocab_size"]
    assert learned < 2048
    assert f"note: the BPE learned {learned:,} tokens, not --vocab-size 2,048" in capsys.readouterr().err


def test_copies_of_a_document_fall_on_one_side_of_the_split(tmp_path, capsys):
    """Three copies of one file: a split by position held out one copy and trained on the other two,
    word for word (the eval loss was a training loss). Chosen by content, copies go together: raw and
    prepared alike, none of the held-out documents is in training."""
    from shardline.cli import main

    docs = [f"document {i} about topic {i % 7} with words {i * 3}" for i in range(200)]
    src = tmp_path / "src"
    src.mkdir()
    for k in range(3):
        (src / f"p{k}.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    raw = data(src, "data.val_fraction=0.05")
    assert "held_out_in_training" not in raw.describe(steps=1)
    assert main(["prepare", str(src), "--out", str(tmp_path / "prep"), "--vocab-size", "300", "--val-fraction",
                 "0.05", "--quiet"]) == 0
    assert "also in the training split" not in capsys.readouterr().err
    manifest = json.loads((tmp_path / "prep" / "manifest.json").read_text())
    assert manifest["held_out_in_training"] == 0
    assert manifest["splits"]["val"]["documents"] % 3 == 0 and manifest["splits"]["val"]["documents"] > 0


def test_the_rule_by_position_stays_for_runs_saved_under_it(tiny_config, tmp_path, small_corpus):
    """data.split=position: the split before 2026-12-07 (exactly round(n x share) documents, by the
    count), which a run on raw files saved under it resumes with; its checkpoint records the rule."""
    import torch

    from shardline.data.validation import split_documents
    from shardline.trainer import Trainer

    docs = [f"document number {i}: some words {i * 7 % 13}" for i in range(3000)]
    by_position, by_content = split_documents(docs, 0.01, "position")[1], split_documents(docs, 0.01)[1]
    assert len(by_position) == 30 and set(by_position) != set(by_content)
    grown = split_documents(docs + [f"new {i}" for i in range(30)], 0.01, "position")[1]
    assert len(set(by_position) & set(grown)) < 15  # (what the rule by content was made for)
    with pytest.raises(ConfigError, match="data.split='hash' is invalid: content or position"):
        tiny_config("data.split=hash").check()
    common = [f"data.path={small_corpus}", "data.split=position", "train.steps=2", "checkpoint.interval=2",
              "train.eval_interval=0"]
    Trainer(tiny_config(*common, "train.stop_at_step=1", "checkpoint.interval=1")).build().train()
    state = torch.load(tmp_path / "run" / "checkpoints" / "step-000001" / "trainer" / "rank0.pt", weights_only=True)
    assert state["data"]["split"] == "position"
    assert Trainer(tiny_config(*common)).build().step == 1  # (resumed: the same documents train)
    # The other rule on resume: its BPE (trained on the training documents) and its tokens differ. The refusal
    # blamed the tokenizer; it names the split and the key that resumes it
    with pytest.raises(CheckpointError, match=r"held out by position \(data.split=position; .*resume it with "
                                              r"--data.split=position$"):
        Trainer(tiny_config(*[c for c in common if c != "data.split=position"])).build()


def test_a_folder_prepared_by_position_is_named_so_when_prepared_again(tmp_path):
    """A folder from before the rule by content (its request without "split"): preparing it again was
    refused as of "other options (split)", an option no flag names."""
    src = tmp_path / "docs.jsonl"
    src.write_text("".join(json.dumps({"text": f"document {i} " * 20}) + "\n" for i in range(60)))
    out = tmp_path / "prep"
    prepare(PrepareOptions([str(src)], str(out), **SMALL))
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["request"]["split"] == "content-hash"
    del manifest["request"]["split"]  # (as a folder prepared before it holds it)
    (out / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(DataError, match=r"other inputs or options \(the held-out documents' rule \(by position "
                                        r"before 2026-12-07, by content since\)\)"):
        prepare(PrepareOptions([str(src)], str(out), **SMALL))
    prepare(PrepareOptions([str(src)], str(tmp_path / "none"), **{**SMALL, "val_fraction": 0.0}))
    assert "split" not in json.loads((tmp_path / "none" / "manifest.json").read_text())["request"]  # (nothing held)


def test_the_held_out_documents_stay_held_out_when_documents_are_added_or_reordered():
    """Adding 1% more documents moved 8 of 10 held-out documents into training (a split by position,
    seeded by the count): a run continued on the grown data, or evaluated on it, scored documents it
    had trained on. By content, every document stays on its side."""
    from shardline.data.validation import split_documents

    docs = [f"document number {i}: some words {i * 7 % 13}" for i in range(3000)]
    _, val = split_documents(docs, 0.01)
    _, grown_val = split_documents(docs + [f"new {i}" for i in range(300)], 0.01)
    _, shuffled_val = split_documents(docs[::-1], 0.01)
    assert 10 < len(val) < 50  # about 1%, not exactly
    assert set(val) == {d for d in grown_val if d in set(docs)} == set(shuffled_val)
    assert len(split_documents(docs[:3], 0.01)[1]) == 1  # at least one, where none falls below the share
    assert len(split_documents(docs[:3], 1e-30)[1]) == 1  # (a share below one in 2**64: still one)
    assert split_documents(docs, 0.0)[1] == []
    # never every one: two documents at 0.4 were both held out 16% of the time, nothing left to train on
    pairs = [[f"a {i}", f"b {i}"] for i in range(200)]
    assert all(len(split_documents(pair, 0.49)[0]) == 1 for pair in pairs)


def test_a_conversation_holding_values_json_cannot_write_has_a_digest():
    """A parquet's messages may carry timestamps or bytes beside role and content: the held-out copy
    count's digest raised a TypeError there, on every chat launch and prepare."""
    import datetime

    from shardline.data.validation import digest

    chat = [{"role": "user", "content": "hi", "ts": datetime.datetime(2026, 1, 2)}]
    assert digest(chat) == digest([{"role": "user", "content": "hi", "ts": datetime.datetime(2026, 1, 2)}])
    assert digest(chat) != digest([{"role": "user", "content": "hi", "ts": datetime.datetime(2026, 1, 3)}])


def test_workers_past_the_cores_run_as_many_as_the_cores(capsys, small_corpus, tmp_path):
    """`--workers 300` forked 300 processes on 2 cores (a number a few digits long: that many)."""
    from shardline.data import pool
    from shardline.data.pool import worker_count

    cores = pool.usable_cores()
    assert worker_count(1) == 1 and worker_count(10**6) == cores
    assert f"--workers 1000000 is more than the {cores} cores here: {cores} run" in capsys.readouterr().err
    with pytest.raises(DataError, match=r"^--workers=0 is invalid: a number of processes, >= 1$"):
        prepare(PrepareOptions([str(small_corpus)], str(tmp_path / "out"), workers=0))


def test_a_worker_forked_as_a_sigterm_lands_goes_as_the_default_would(tmp_path):
    """A SIGTERM to the group while the pool forked a worker ran the prepare's handler in the worker,
    before the worker took the default back: a traceback from its fork's hooks on the prepare's stderr."""
    import signal
    from types import SimpleNamespace

    from shardline.data.cli import _stoppable

    def forking(opts):
        pid = os.fork()
        if pid == 0:  # (the worker: SIGTERM lands before its initializer)
            try:
                os.kill(os.getpid(), signal.SIGTERM)
                sum(range(1000))  # (Python runs the handler between bytecodes)
                os._exit(0)
            except BaseException:
                os._exit(7)  # the prepare's own handler raised in the worker
        return {"worker": os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])}

    assert _stoppable(forking, SimpleNamespace(out=str(tmp_path), overwrite=False)) == {"worker": 128 + signal.SIGTERM}


def test_a_dataset_dicts_other_splits_are_named_and_an_empty_text_field_refused(tmp_path, small_corpus, capsys):
    """prepare read a DatasetDict's train split and passed its validation split over in silence; it took
    --text-field '' (a run on the raw files refuses data.text_field='')."""
    from shardline.cli import main

    ds = tmp_path / "ds"
    (ds / "train").mkdir(parents=True), (ds / "validation").mkdir(), (ds / "dataset_dict.json").write_text("{}")
    (ds / ".cache").mkdir()  # (hf download's own: no split)
    text = small_corpus.read_text(encoding="utf-8")
    (ds / "train" / "t.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in text.split("\n\n\n")[:200]))
    (ds / "validation" / "v.jsonl").write_text(json.dumps({"text": "held out"}) + "\n")
    assert main(["prepare", str(ds), "--out", str(tmp_path / "prep"), "--vocab-size", "300", "--quiet"]) == 0
    said = capsys.readouterr().err
    assert (f"note: {ds} is a datasets DatasetDict: its train split is read, not validation (a run evaluates on "
            f"one as data.val_path={ds / 'validation'}, tokenized with its tokenizer)") in said
    assert main(["prepare", str(ds), "--out", str(tmp_path / "p2"), "--text-field", ""]) == 2
    assert "--text-field='' is invalid: must be a field name" in capsys.readouterr().err


def test_a_small_source_read_many_times_over_the_run_is_said(tmp_path, tiny_config, small_prepared):
    """One document weighted 9 to 1 was read 130 times a pass, said only inside the data event."""
    from shardline.trainer import Trainer

    small = tmp_path / "one.jsonl"
    small.write_text(json.dumps({"text": "a short source of a few words, read again and again. " * 12}) + "\n")
    mix = f'data.mix=[{{path = "{small_prepared}"}}, {{path = "{small}", weight = 9}}]'
    common = ["data.path=", mix, f"data.tokenizer={small_prepared / 'tokenizer.json'}", "train.steps=8",
              "train.eval_interval=0", "checkpoint.interval=0", "data.val_fraction=0"]
    Trainer(tiny_config(*common)).build().train()
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    sources = next(r for r in records if r.get("event") == "data")["sources"]
    said = [r for r in records if r.get("event") == "source_repeated"]
    assert len(said) == 1 and list(said[0]["epochs"]) == ["one.jsonl"], said
    assert said[0]["epochs"]["one.jsonl"] == sources["one.jsonl"]["epochs"] > 4
    assert sources[small_prepared.name]["epochs"] < 4  # (the large source: not named)
