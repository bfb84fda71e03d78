"""Data: readers, clear DataErrors, packing with document boundaries, the sampler."""

from __future__ import annotations

import gzip
import json
import re
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from shardline.config import load_config
from shardline.data import GlobalBatchSampler, build_data
from shardline.data.validation import split_documents
from shardline.data.packing import IGNORE_INDEX, PackedSequences, pack_rows
from shardline.data.sources import read_documents
from shardline.data.tokenizer import load_tokenizer
from shardline.errors import DataError


def test_shipped_corpus_is_real_text():
    docs = read_documents("")
    assert len(docs) == 1189
    assert docs[0].startswith("Genesis 1\n\nIn the beginning God created the heaven and the earth.")
    assert sum(map(len, docs)) > 3_000_000


def test_reads_txt_jsonl_parquet_gz_and_folders(tmp_path):
    (tmp_path / "a.txt").write_text("first doc\n\n\n\nsecond doc\nstill second\n")
    (tmp_path / "b.jsonl").write_text('{"text": "third"}\n\n{"text": "fourth", "id": 4}\n')
    pq.write_table(pa.table({"body": ["fifth", "sixth"]}), tmp_path / "c.parquet")
    (tmp_path / "d.jsonl.gz").write_bytes(gzip.compress(b'{"text": "seventh"}\n'))
    (tmp_path / "notes.md").write_text("ignored: not a data file")
    assert read_documents(str(tmp_path / "a.txt")) == ["first doc", "second doc\nstill second\n"]
    assert read_documents(str(tmp_path / "c.parquet"), text_field="body") == ["fifth", "sixth"]
    docs = read_documents(str(tmp_path / "b.jsonl")) + read_documents(str(tmp_path / "d.jsonl.gz"))
    assert docs == ["third", "fourth", "seventh"]
    (tmp_path / "c.parquet").unlink()
    assert len(read_documents(str(tmp_path))) == 5
    (tmp_path / "e.ndjson").write_text('{"text": "eighth"}\n')  # JSON lines under their other common name
    assert read_documents(str(tmp_path / "e.ndjson")) == ["eighth"]
    assert len(read_documents(str(tmp_path))) == 6


def test_txt_read_in_chunks_splits_as_the_whole_text_would(tmp_path, monkeypatch):
    """Breaks that straddle chunk boundaries, grow across them or start in a previous chunk's
    trailing whitespace: 7-character chunks give what splitting the whole text gives."""
    import random

    from shardline.data import sources

    monkeypatch.setattr(sources, "_CHUNK", 7)
    rng = random.Random(0)
    pieces = ["a", "b", " ", "\t", "\n", "\r\n", "\n\n\n", "\r", "\u3000", "\xa0", "字"]
    for _ in range(200):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 80)))
        (tmp_path / "r.txt").write_bytes(text.encode())
        lines = text.replace("\r\n", "\n").replace("\r", "\n")  # (line ends read as Python's open() reads them)
        whole = [d for d in sources._DOC_BREAK.split(lines) if d.strip()]  # (blank pieces: no document)
        assert list(sources._split_txt(tmp_path / "r.txt")) == whole, repr(text)


def test_txt_with_windows_or_old_mac_line_ends_reads_as_with_unix_ones(tmp_path):
    """Each "\r" stayed in the text (the BPE learnt "\r\n", the model would write it, and a file's
    copy with "\n" line ends had another fingerprint); a file of "\r" line ends was one document."""
    unix = "first doc\n\n\nsecond doc\nstill second\n"
    for ends in ("\r\n", "\r"):
        (tmp_path / "w.txt").write_bytes(unix.replace("\n", ends).encode())
        assert read_documents(str(tmp_path / "w.txt")) == ["first doc", "second doc\nstill second\n"]


def test_txt_lines_of_full_width_blanks_are_blank_and_a_byte_order_mark_is_not_text(tmp_path):
    """Chinese text indents with U+3000, and separator lines keep it: such lines are blank (they
    merged two chapters into one document); a BOM Notepad writes was the first document's first
    character (and what the model learnt to open with), as .jsonl never had it."""
    text = "\u3000\u3000第一章。\n\n\u3000\u3000\n\n\u3000\u3000第二章开始。\n\n\xa0\n\n第三章。"
    (tmp_path / "z.txt").write_bytes(b"\xef\xbb\xbf" + text.encode())
    assert read_documents(str(tmp_path / "z.txt")) == ["\u3000\u3000第一章。", "\u3000\u3000第二章开始。", "第三章。"]


def _damaged_gzip() -> bytes:
    """A gzip stream with flipped bytes inside: zlib.error, not gzip's own BadGzipFile."""
    data = bytearray(gzip.compress(b'{"text": "' + bytes(range(97, 123)) * 300 + b'"}\n', mtime=0))
    data[30:38] = b"\xff" * 8
    return bytes(data)


@pytest.mark.parametrize("name, content, message", [
    pytest.param("flipped.jsonl.gz", _damaged_gzip(), "cannot read data file", id="flipped.jsonl.gz"),
    ("bad.jsonl", '{"text": "ok"}\n{"text": broken\n', "line 2 is not valid JSON"),
    ("lines.json", '{"text": "ok"}\n', r"unsupported type; use .* \(optionally .gz\); JSON lines in a .json file are "
                                       "read once it is named .jsonl$"),
    ("table.csv", "text\nok\n", r"unsupported type; use .* \(optionally .gz\)$"),
    ("nofield.jsonl", '{"body": "x"}\n', "no string field 'text'"),
    ("numtext.jsonl", '{"text": 5}\n', r"has no string field 'text' \(its value: 5\) \(set data.text_field"),
    ("array.jsonl", '{"text": "ok"}\n["a", "b"]\n', r"line 2 is a JSON list: give one object a line$"),
    ("bare.jsonl", '"just text"\n', r"line 1 is a JSON str: give one object a line$"),
    ("empty.txt", "", "contains no text"),
    ("blank.jsonl", "\n\n", "contains no text"),
    ("latin1.txt", b"caf\xe9", "is not UTF-8 text at line 1 .byte offset 3. .unexpected end of data.: convert it, e.g. "
     "iconv -f WINDOWS-1252"),  # (GB18030, named for any file, would garble Western European text)
    ("latin1.jsonl", '{"text": "café naïve"}\n'.encode("latin-1"), "iconv -f WINDOWS-1252 -t UTF-8"),
    ("cp1252.txt", "Straße und Köln sind schön\n".encode("cp1252"), "iconv -f WINDOWS-1252"),  # (ß and ö read as GB)
    ("stray.jsonl", '{"text": "Café crème, déjà vu"}\n'.encode() + '{"text": "Müller"}\n'.encode("cp1252"),
     "iconv -f WINDOWS-1252"),  # (UTF-8's é before the bad byte come in pairs: not GB18030's)
    ("pt.txt", "informações e ação\n".encode("cp1252"), "iconv -f WINDOWS-1252"),  # (two letters: not GB18030's)
    ("stray2.jsonl", '{"text": "Müller"}\n'.encode("cp1252") + '{"text": "déjà vu, été"}\n'.encode(),
     "iconv -f WINDOWS-1252"),  # (nor after it)
    ("stray.txt", "第一行\n".encode() * 3 + b"\xff\nrest\n", r"is not UTF-8 text at line 4 \(byte offset 30\)"),
    ("mac.txt", b"one\rtwo\rthree\r\xff\r", r"is not UTF-8 text at line 4 \(byte offset 14\)"),  # lone \r ends
    ("crlf.txt", b"one\r\ntwo\r\n\xff", r"is not UTF-8 text at line 3 \(byte offset 10\)"),
    ("seam.txt", b"a" * ((1 << 20) - 1) + b"\r\nb\n\xff",  # a \r\n cut by the 1 MiB read: one line end
     rf"is not UTF-8 text at line 3 \(byte offset {(1 << 20) + 3:,}\)"),
    ("gbk.jsonl", b'{"text": "ok"}\n{"text": "' + "中文".encode("gbk") + b'"}\n', "line 2 is not UTF-8 text "
     ".invalid continuation byte.: convert it, e.g. iconv -f GB18030 -t UTF-8"),
    ("trunc.jsonl.gz", b"\x1f\x8b\x08\x00garbage", "cannot read data file"),
    # what is no text at all was told to convert from WINDOWS-1252: named by its bytes
    ("zipped.jsonl", gzip.compress(b'{"text": "ok"}\n'), r"its bytes are gzip-compressed: name the file \*.gz$"),
    ("noise.txt", bytes(range(256)) * 4, r"its bytes are binary \(control bytes no text holds\)"),
    ("utf16.txt", "hello".encode("utf-16"), "its bytes are UTF-16 text: convert it, iconv -f UTF-16 -t UTF-8$"),
    ("prompts.jsonl", '{"prompt": "2+2?", "completion": "4"}\n', r"it holds a conversation: read it as chat "
     r"\(data.format=chat"),
    ("keys.jsonl", '{"body": "x", "id": 3}\n', r"prepare: --text-field\); its keys: body, id$"),
    ("bad.parquet", b"PAR1 not really", "cannot read parquet file"),
])
def test_malformed_files_raise_data_error(tmp_path, name, content, message):
    path = tmp_path / name
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(DataError, match=message) as err:
        read_documents(str(path))
    assert name in str(err.value) or "contains no text" in str(err.value)


def test_a_folders_held_out_files_are_not_trained_on(tmp_path):
    """A dataset's own validation or test files beside its training files: refused, since every
    file of a folder is trained on; a folder of training files alone, or one named file, is read."""
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "train-0000.jsonl").write_text('{"text": "train me"}\n')
    (tmp_path / "data" / "validation.jsonl").write_text('{"text": "held out"}\n')
    (tmp_path / "data" / "contest").mkdir()  # "test" and "dev" inside words: read
    (tmp_path / "data" / "contest" / "devices.txt").write_text("also trained")
    with pytest.raises(DataError, match=r"holds held-out files \(validation.jsonl\) beside the training files"):
        read_documents(str(tmp_path / "data"))
    (tmp_path / "data" / "validation.jsonl").rename(tmp_path / "validation.jsonl")
    assert sorted(read_documents(str(tmp_path / "data"))) == ["also trained", "train me"]
    assert read_documents(str(tmp_path / "validation.jsonl")) == ["held out"]  # named: the user's choice


def test_a_glob_pattern_reads_the_files_it_matches(tmp_path):
    """data.path = a pattern (not an existing path): the data files it matches and those under
    the folders it matches, sorted; a pattern that sweeps in held-out files, or matches no data
    file, is one line naming the pattern."""
    (tmp_path / "data" / "more").mkdir(parents=True)
    (tmp_path / "data" / "train-0001.jsonl").write_text('{"text": "second"}\n')
    (tmp_path / "data" / "train-0000.jsonl").write_text('{"text": "first"}\n')
    (tmp_path / "data" / "more" / "train-0002.jsonl").write_text('{"text": "third"}\n')
    (tmp_path / "data" / "validation.jsonl").write_text('{"text": "held out"}\n')
    (tmp_path / "data" / "notes.md").write_text("not data")
    root = tmp_path / "data"
    assert read_documents(f"{root}/train-*.jsonl") == ["first", "second"]
    assert read_documents(f"{root}/**/train-*.jsonl") == ["third", "first", "second"]  # sorted paths
    assert read_documents(f"{root}/m*") == ["third"]  # a matched folder is read whole
    with pytest.raises(DataError, match=r"holds held-out files \(validation.jsonl\) beside"):
        read_documents(f"{root}/*")
    with pytest.raises(DataError, match=r"data.path='.*notes\.m\*' matches 1 path\(s\) but no .txt"):
        read_documents(f"{root}/notes.m*")
    with pytest.raises(DataError, match=r"matches no path \(a pattern: the path does not exist as written\)"):
        read_documents(f"{root}/test-*.jsonl")
    (tmp_path / "prep-a").mkdir()
    (tmp_path / "prep-a" / "manifest.json").write_text("{}")
    with pytest.raises(DataError, match="matches the prepared folder .*prep-a: give a prepared folder by its own"):
        read_documents(f"{tmp_path}/prep-*")


def test_parquet_without_the_text_column_is_one_line(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"body": ["a", "b"], "id": [1, 2]}), tmp_path / "x.parquet")
    with pytest.raises(DataError) as err:
        read_documents(str(tmp_path / "x.parquet"))
    assert "has no column 'text'" in str(err.value) and "body, id" in str(err.value)
    assert "\n" not in str(err.value)


def test_a_damaged_tokenizer_cache_is_retrained_not_blamed_on_the_user(small_corpus, tmp_path, monkeypatch):
    from shardline.data.tokenizer import cache_dir, get_tokenizer

    monkeypatch.setenv("SHARDLINE_CACHE", str(tmp_path / "cache"))
    docs = read_documents(str(small_corpus))[:20]
    first = get_tokenizer(docs, "", 300)
    (cached,) = (cache_dir() / "tokenizers").glob("*.json")
    cached.write_text("{ damaged")
    again = get_tokenizer(docs, "", 300)
    assert again.get_vocab() == first.get_vocab() and json.loads(cached.read_text())  # rewritten whole


def test_missing_path_and_empty_folder(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        read_documents(str(tmp_path / "nope"))
    with pytest.raises(DataError, match="holds no"):
        read_documents(str(tmp_path))


def test_unreadable_tokenizer(tmp_path):
    bad = tmp_path / "tokenizer.json"
    bad.write_text("{not json")
    with pytest.raises(DataError, match="cannot be read as a tokenizer.json"):
        load_tokenizer(str(bad))


def test_too_little_data_for_seq_len(tmp_path):
    (tmp_path / "t.jsonl").write_text("".join(json.dumps({"text": f"doc {i} is short"}) + "\n" for i in range(20)))
    cfg = load_config(None, [f"data.path={tmp_path / 't.jsonl'}", "train.seq_len=512", "data.vocab_size=300"])
    with pytest.raises(DataError, match="too few for one sequence of train.seq_len=512"):
        build_data(cfg)


def test_packing_keeps_document_boundaries():
    packed = PackedSequences([[1, 2, 3], [4, 5], [6, 7, 8, 9]], seq_len=4, eos_id=0)
    assert packed.tokens.tolist() == [1, 2, 3, 0, 4, 5, 0, 6, 7, 8, 9, 0]
    assert len(packed) == 2
    b = packed.batch([0, 1])
    assert b["input_ids"].tolist() == [[1, 2, 3, 0], [4, 5, 0, 6]]
    assert b["doc_ids"].tolist() == [[0, 0, 0, 0], [1, 1, 1, 2]]
    # eos predicts the next document's first token: impossible under the mask, so ignored
    assert b["labels"].tolist() == [[2, 3, 0, IGNORE_INDEX], [5, 0, IGNORE_INDEX, 7]]


@pytest.mark.parametrize("world", [1, 2, 4, 8])
def test_sampler_is_layout_independent(world):
    sampler = GlobalBatchSampler(num_samples=37, global_batch_size=16, seed=7)
    for step in (0, 1, 2, 5):  # 16 x 5 > 37: crosses epoch boundaries
        pieces = [np.concatenate(sampler.rank_micro_batches(step, r, world, micro_batch_size=2))
                  for r in range(world)]
        assert np.array_equal(np.concatenate(pieces), sampler.global_batch(step))


def test_sampler_epochs_are_permutations_and_seeded():
    s = GlobalBatchSampler(num_samples=12, global_batch_size=4, seed=1)
    epoch0 = np.concatenate([s.global_batch(k) for k in range(3)])
    epoch1 = np.concatenate([s.global_batch(k) for k in range(3, 6)])
    assert sorted(epoch0) == sorted(epoch1) == list(range(12))
    assert not np.array_equal(epoch0, epoch1)
    other = GlobalBatchSampler(num_samples=12, global_batch_size=4, seed=2)
    assert not np.array_equal(other.global_batch(0), s.global_batch(0))
    assert np.array_equal(GlobalBatchSampler(12, 4, seed=1).global_batch(4), s.global_batch(4))


def test_validation_split_is_disjoint_and_deterministic():
    docs = [f"document number {i}" for i in range(200)]
    train, val = split_documents(docs, 0.05)
    assert 4 <= len(val) <= 20 and len(train) + len(val) == 200 and not set(train) & set(val)
    assert split_documents(docs, 0.05) == (train, val)
    one_train, one_val = split_documents(["x" * 1000], 0.1)
    assert len(one_train[0]) == 900 and len(one_val[0]) == 100


def test_trained_tokenizer_round_trips_and_is_cached(small_corpus):
    cfg = load_config(None, [f"data.path={small_corpus}", "data.vocab_size=512", "train.seq_len=64"])
    a = build_data(cfg)
    b = build_data(cfg)
    assert a.vocab_size == 512 and a.tokenizer.to_str() == b.tokenizer.to_str()
    text = "In the beginning God created the heaven and the earth."
    assert a.tokenizer.decode(a.tokenizer.encode(text).ids) == text
    assert len(a.train) > 100 and len(a.val) >= 1


def test_an_empty_document_is_dropped_and_counts_no_boundary():
    """Without an eos an empty document would start where the next one does, and count_labels
    would count that boundary twice; it is dropped, as encode_documents drops one."""
    packed = PackedSequences([[1, 2, 3], [], [4, 5, 6, 7, 8]], seq_len=4, eos_id=None)
    labels = packed.batch([0])["labels"]
    assert packed.num_documents == 2
    assert packed.count_labels([0]) == int((labels != IGNORE_INDEX).sum()) == 3


def test_count_labels_matches_batches(small_corpus):
    cfg = load_config(None, [f"data.path={small_corpus}", "data.vocab_size=512", "train.seq_len=64"])
    train = build_data(cfg).train
    idx = np.array([0, 5, 17, len(train) - 1])
    assert train.count_labels(idx) == int((train.batch(idx)["labels"] != IGNORE_INDEX).sum())
    every = np.arange(len(train))
    ignored = len(train) * 64 - train.count_labels(every)
    assert ignored == int((train.batch(every)["labels"] == IGNORE_INDEX).sum()) > 0


def test_a_tokenizer_folder_is_read_as_its_tokenizer_json(tmp_path, small_corpus):
    """Users point at an HF model folder (`generate --tokenizer` took one; data.tokenizer and
    `prepare --tokenizer` refused it): a folder holding a tokenizer.json names that file, so its side
    files (a chat template) are read beside it; a folder without one is still refused."""
    from shardline.data.cli import _tokenizer_arg
    from shardline.data.tokenizer import load_tokenizer
    from shardline.preflight import use_model_tokenizer

    with pytest.raises(DataError, match=rf"data.tokenizer='{tmp_path}' is a folder without a tokenizer.json: give "
                                        "the tokenizer.json to use$"):
        load_tokenizer(str(tmp_path))
    slow = tmp_path / "slow"  # a GPT-2-style folder: the files a fast tokenizer is converted from
    slow.mkdir()
    (slow / "vocab.json").write_text("{}")
    (slow / "merges.txt").write_text("")
    with pytest.raises(DataError, match=r"it holds a slow tokenizer's vocab.json, merges.txt, which shardline does "
                                        r"not read: transformers writes its tokenizer.json with AutoTokenizer"):
        load_tokenizer(str(slow))
    cfg = load_config(None, [f"data.path={small_corpus}", "data.vocab_size=300"])
    build_data(cfg).tokenizer.save(str(tmp_path / "tokenizer.json"))
    given = load_config(None, [f"data.path={small_corpus}", f"data.tokenizer={tmp_path}"])
    use_model_tokenizer(given)  # (what a launch, its dry run and eval each call first)
    assert given.data.tokenizer == str(tmp_path / "tokenizer.json")
    assert build_data(given).tokenizer.get_vocab_size() == 300
    assert _tokenizer_arg(str(tmp_path)) == str(tmp_path / "tokenizer.json")
    assert _tokenizer_arg(str(tmp_path / "other.json")) == str(tmp_path / "other.json")


def test_conversations_read_as_text_are_refused_pointing_at_the_chat_format(tmp_path):
    """`--text-field messages` handed conversation lists to the text tokenizer (an AttributeError
    traceback); without it, the 'no field text' error never said the file was chat data."""
    from shardline.data.prepare import PrepareOptions
    from shardline.data.sources import read_documents
    from shardline.errors import ConfigError, DataError

    chat = tmp_path / "chat.jsonl"
    chat.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    with pytest.raises(DataError, match="it holds a conversation: read it as chat \\(data.format=chat, "
                                        "or in data.mix the source's format = \"chat\""):
        read_documents(str(chat))
    with pytest.raises(ConfigError, match="data.text_field='messages'.*set data.format=chat"):
        load_config(None, ["data.text_field=messages"]).check()
    with pytest.raises(ConfigError, match="or format = \"chat\" on the data.mix sources that hold them"):
        load_config(None, ["data.text_field=messages", f'data.mix=[{{path = "{chat}"}}]']).check()
    with pytest.raises(DataError, match="--text-field messages .* --format chat"):
        PrepareOptions(inputs=[str(chat)], out=str(tmp_path / "out"), text_field="messages").read_field()


def test_a_folder_reads_upper_case_suffixes(tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "A.TXT").write_text("upper case name\n")
    (tmp_path / "d" / "b.txt").write_text("lower case name\n")
    from shardline.data.sources import read_documents

    assert sorted(d.strip() for d in read_documents(str(tmp_path / "d"))) == ["lower case name", "upper case name"]


def test_what_reading_skips_is_counted_and_the_run_covers_its_epochs(tmp_path):
    """Null and blank texts and files of no type a reader takes were dropped in silence: a launch's
    `data` event now counts and names them (hidden files and a datasets folder's metadata aside)."""
    docs = [f"document number {i} has some words in it" for i in range(60)]
    pq.write_table(pa.table({"text": docs[:30] + [None, "", "   "]}), tmp_path / "a.parquet")
    (tmp_path / "b.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs[30:] + [""]))
    (tmp_path / "README.md").write_text("about this data")
    (tmp_path / "extra.json").write_text(json.dumps(docs))
    (tmp_path / ".hidden").write_text("editor state")
    (tmp_path / "state.json").write_text("{}")  # a save_to_disk folder's own metadata
    cfg = load_config(None, [f"data.path={tmp_path}", "train.seq_len=16", "data.vocab_size=300",
                             "train.global_batch_size=4", "train.micro_batch_size=4", "data.val_fraction=0.2"])
    bundle = build_data(cfg)
    fields = bundle.describe(steps=50)
    assert fields["empty_documents_skipped"] == 4  # a null, an empty and a blank row; an empty JSON line
    assert fields["files_not_read"] == f"{tmp_path / 'README.md'}, {tmp_path / 'extra.json'}"
    assert fields["documents"] == bundle.train.num_documents and fields["sequences"] == len(bundle.train)
    assert fields["epochs"] == round(50 * 4 / len(bundle.train), 3)
    assert fields["tokens"] == len(bundle.train) * 16 and fields["held_out_sequences"] == len(bundle.val)
    assert fields["held_out_documents"] == bundle.val.num_documents > 0
    clean = tmp_path / "clean"
    clean.mkdir()
    (clean / "c.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    cfg = load_config(None, [f"data.path={clean}", "train.seq_len=16", "data.vocab_size=300", "data.val_fraction=0.2"])
    fields = build_data(cfg).describe(steps=10)
    assert "empty_documents_skipped" not in fields and "files_not_read" not in fields


def test_blank_lines_around_a_txt_files_documents_are_no_empty_document(tmp_path):
    """A .txt file ending (or opening) with blank lines counted an "empty or null document" skipped:
    on every such corpus, sending users looking for bad records that were not there."""
    path = tmp_path / "t.txt"
    path.write_text("\n\n\n\ndoc one\n\n\n  \n\n\ndoc two\n\n\n")
    left = {}
    assert read_documents(str(path), left_out=left) == ["doc one", "doc two"] and left["empty_documents"] == 0
    path.write_text("\n\n\n   \n")
    with pytest.raises(DataError, match="contains no text"):
        read_documents(str(path))


def test_null_chat_rows_are_counted_as_empty_documents(tmp_path):
    talk = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello there"}]
    pq.write_table(pa.table({"messages": [talk, None, talk, talk]}), tmp_path / "c.parquet")
    left: dict = {}
    assert len(read_documents(str(tmp_path / "c.parquet"), "messages", left)) == 3 and left["empty_documents"] == 1
    # a conversation of no messages holds nothing to train on either: counted, as the README says
    (tmp_path / "c.jsonl").write_text("".join(json.dumps({"messages": m}) + "\n" for m in (talk, [], talk)))
    left = {}
    assert len(read_documents(str(tmp_path / "c.jsonl"), "messages", left)) == 2 and left["empty_documents"] == 1


def test_a_null_jsonl_text_is_an_empty_document_as_a_parquet_null_is(tmp_path):
    """{"text": null} stopped the run ("has no string field") where a parquet null row is counted as
    an empty document; a record without the field is still refused (a wrong data.text_field)."""
    (tmp_path / "t.jsonl").write_text('{"text": "some words here"}\n{"text": null}\n{"text": "and more"}\n')
    left: dict = {}
    assert read_documents(str(tmp_path / "t.jsonl"), "text", left) == ["some words here", "and more"]
    assert left["empty_documents"] == 1
    (tmp_path / "t.jsonl").write_text('{"text": "some words here"}\n{"body": "x"}\n')
    with pytest.raises(DataError, match="line 2 has no string field 'text'"):
        read_documents(str(tmp_path / "t.jsonl"), "text", {})


def test_a_tokenizer_that_cannot_encode_the_data_is_one_line_and_a_closed_vocabulary_works(tmp_path):
    """A WordLevel tokenizer.json without its [UNK] token loads, then fails on the first word it
    lacks: that was a traceback (from the BOS probe's "a") in train and prepare alike. Text made
    of its own words encodes."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    from shardline.data.encode import encode_documents
    from shardline.data.tokenizer import bos_prefix, load_tokenizer

    closed = Tokenizer(models.WordLevel({"hello": 0, "world": 1}))
    closed.pre_tokenizer = pre_tokenizers.Whitespace()
    closed.save(str(tmp_path / "tokenizer.json"))
    tok = load_tokenizer(str(tmp_path / "tokenizer.json"))
    assert bos_prefix(tok) == []
    tokens, lengths, _ = encode_documents(tok, ["hello world", "world hello hello"], None, None, False, [])
    assert list(tokens) == [0, 1, 1, 0, 0] and list(lengths) == [2, 3]
    with pytest.raises(DataError, match=r"^the tokenizer cannot encode this data: .*UNK.* \(a vocabulary without"):
        encode_documents(tok, ["hello there"], None, None, False, [])


def test_a_data_file_that_links_to_nothing_is_refused_not_skipped(tmp_path, small_corpus):
    """A folder (or a pattern) holding a link to a missing file (a Hugging Face cache with a blob
    gone) trained on the other files alone, without a word."""
    from shardline.data.sources import input_files

    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "a.jsonl").write_bytes(small_corpus.read_bytes())
    (tmp_path / "data" / "b.jsonl").symlink_to(tmp_path / "gone" / "b.jsonl")
    for given in (tmp_path / "data", tmp_path / "data" / "*.jsonl"):
        with pytest.raises(DataError, match=r"b.jsonl is a link to .*gone/b.jsonl, which does not exist"):
            input_files(str(given))
    (tmp_path / "data" / "b.jsonl").unlink()
    assert [f.name for f in input_files(str(tmp_path / "data"))] == ["a.jsonl"]


def test_a_byte_order_mark_is_read_past_not_refused(tmp_path):
    """Files saved by some Windows editors start with a UTF-8 byte-order mark: refused before with
    Python's own "Unexpected UTF-8 BOM (decode using utf-8-sig)"."""
    from shardline.data.sources import read_documents

    (tmp_path / "a.jsonl").write_bytes(b"\xef\xbb\xbf" + b'{"text": "first"}\n{"text": "second"}\n')
    assert read_documents(str(tmp_path / "a.jsonl")) == ["first", "second"]


def test_chat_rows_come_in_an_order_blind_to_what_they_hold():
    """An evaluation of part of a held-out split reads its first rows: they must hold a fair sample
    of its conversations. Best-fit rows sorted by their first conversation put rows of many short
    ones first (16.6 conversations a row in the first 16, against 9.9 overall, on this mix)."""
    rng = np.random.default_rng(3)
    sizes = np.minimum(rng.lognormal(5.5, 1.0, 20_000).astype(np.int64) + 16, 5000)
    rows = pack_rows(np.cumsum(sizes) - sizes, int(sizes.sum()), 4097)
    held = np.diff(rows.first)  # conversations a row
    assert abs(np.corrcoef(np.arange(len(held)), held)[0, 1]) < 0.05
    assert abs(held[:len(held) // 10].mean() / held.mean() - 1) < 0.1
    assert sorted(rows.docs.tolist()) == list(range(len(sizes)))


def test_no_chat_documents_make_no_rows():
    empty = PackedSequences([], 8, 0, masks=[])
    assert len(empty) == 0 and empty.count_labels([]) == 0


def test_a_tokenizer_cache_that_cannot_be_written_costs_a_training_not_the_run(tmp_path, monkeypatch, capsys):
    """SHARDLINE_CACHE naming a file (or an unwritable home) stopped the run with NotADirectoryError
    after the tokenizer was trained; a `~` in it made a folder named `~`."""
    from shardline.data.tokenizer import cache_dir, get_tokenizer

    (tmp_path / "afile").write_text("x")
    monkeypatch.setenv("SHARDLINE_CACHE", str(tmp_path / "afile"))
    tok = get_tokenizer(["some text to learn from"] * 20, "", 300)
    assert tok.get_vocab_size() > 0
    assert "the tokenizer cache" in capsys.readouterr().err
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("SHARDLINE_CACHE", "~/cache")
    assert cache_dir() == tmp_path / "cache"


def test_a_few_documents_holding_out_far_more_than_val_fraction_is_said_at_launch_and_in_the_dry_run(
        tiny_config, tmp_path, small_corpus, small_prepared, capsys):
    """1% asked, one whole document of three held out: a third of the data never trained on, where
    the dry run said "(1 of them held out)" and the launch nothing. Not said where the share is
    about what was asked (the corpus), nor for a prepared folder (its split is prepare's, said there)."""
    from shardline.cli import main
    from shardline.data.validation import held_out_note
    from shardline.metrics import history
    from shardline.trainer import Trainer

    text = small_corpus.read_text(encoding="utf-8")
    few = tmp_path / "few.jsonl"
    few.write_text("".join(json.dumps({"text": text[i::3]}) + "\n" for i in range(3)), encoding="utf-8")
    common = [f"data.tokenizer={small_prepared / 'tokenizer.json'}", "train.steps=1", "train.eval_interval=0"]
    cfg = tiny_config(f"data.path={few}", *common)
    Trainer(cfg).build().train()
    said = [r for r in history(Path(cfg.run.dir) / "metrics.jsonl") if r.get("event") == "held_out_large"]
    assert len(said) == 1 and said[0]["val_fraction"] == 0.01, said
    assert re.fullmatch(r"[\d,]+ of [\d,]+ sequences \((3\d|4\d)%\)", said[0]["held_out"][f"data.path={few}"]), said
    assert "data.val_fraction=0 with train.eval_interval=0" in said[0]["to_train_on_them"]
    assert main(["train", "--dry-run", f"--run.dir={tmp_path / 'dry'}", f"--data.path={few}",
                 *(f"--{o}" for o in common)]) == 0
    assert "3 documents (1 of them held out for evaluation: 33% of the text, where data.val_fraction=0.01 asks " \
           "for 1%, a whole document at least" in capsys.readouterr().out
    for path in (small_corpus, small_prepared):  # (the corpus: ~1%; a folder: prepare's split)
        data = build_data(tiny_config(f"data.path={path}", *common))
        assert held_out_note(tiny_config(f"data.path={path}", *common), data.train, data.val) is None
    # In a mixture beside a large source (the sum's share is small) and a prepared folder: named alone
    mix = f'data.mix=[{{path = "{small_corpus}", weight = 1}}, {{path = "{few}", weight = 1}}, ' \
          f'{{path = "{small_prepared}", weight = 1}}]'
    cfg = tiny_config(mix, *common)
    data = build_data(cfg)
    assert list(held_out_note(cfg, data.train, data.val)["held_out"]) == [f"data.mix[1].path={few}"]


def test_the_dry_run_names_the_files_a_folder_holds_that_are_not_read(tmp_path, small_corpus, capsys):
    """The launch's data line named them (files_not_read); the dry run, the check before it, did not."""
    from shardline.cli import main

    folder = tmp_path / "data"
    folder.mkdir()
    (folder / "corpus.txt").write_text(small_corpus.read_text(encoding="utf-8"), encoding="utf-8")
    (folder / "README.md").write_text("about this data\n")
    (folder / "meta.json").write_text("{}\n")
    assert main(["train", "--dry-run", f"--run.dir={tmp_path / 'run'}", f"--data.path={folder}"]) == 0
    said = capsys.readouterr().out
    assert "(not read: README.md, meta.json; it reads .txt, .jsonl, .parquet, .arrow, .ndjson files)" in said


def test_sources_split_by_content_at_one_share_hold_out_the_same_documents():
    """By content, a document held out in one source is held out in any other at that share (files added or
    not), or at a larger one (not the reverse: a larger share holds out documents a smaller one trains on); a
    folder split by position (prepared before) matches only its own files in order."""
    from shardline.data.overlaps import _Read, _held_out_within

    a, more = _Read(set(), files=("x",), fraction=0.05), _Read(set(), files=("x", "y"), fraction=0.05)
    larger = _Read(set(), files=("x",), fraction=0.1)
    assert _held_out_within(a, more) and _held_out_within(more, a)
    assert _held_out_within(a, larger) and not _held_out_within(larger, a)
    old = _Read(set(), files=("x",), fraction=0.05, rule=None)
    assert not _held_out_within(a, old) and _held_out_within(old, _Read(set(), files=("x",), fraction=0.05, rule=None))
    assert not _held_out_within(old, _Read(set(), files=("x", "y"), fraction=0.05, rule=None))
    from shardline.data.overlaps import _reads  # (a raw source under data.split=position: split as those folders)

    assert _reads("", 0.05, "position").rule is None and _reads("", 0.05).rule == a.rule
