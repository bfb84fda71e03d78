"""A mixture's eval loss by source: each source's held-out sequences of the evaluation scored apart and
logged beside the whole (`eval_loss_by_source`), and given by `shardline eval` alike."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from shardline.cli import main
from shardline.data.sampler import eval_sequences
from shardline.trainer import Trainer

WORDS = "alpha beta gamma delta epsilon zeta eta theta".split()


def test_each_sources_loss_is_its_own_sequences_mean_and_makes_up_the_whole(tiny_config, small_prepared, tmp_path,
                                                                             capsys):
    other = tmp_path / "words.jsonl"  # a second source unlike the corpus: its loss is far from the corpus's
    other.write_text("".join(json.dumps({"text": " ".join(WORDS[(i + k) % 8] for k in range(40))}) + "\n"
                             for i in range(400)))
    mix = f'data.mix=[{{path = "{small_prepared}"}}, {{path = "{other}", weight = 0.5}}]'
    settings = ("data.path=", mix, f"data.tokenizer={small_prepared / 'tokenizer.json'}", "train.steps=2",
                "train.eval_interval=2", "train.eval_batches=2", "checkpoint.interval=2")
    Trainer(tiny_config(*settings)).build().train()
    logged = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    record = next(r for r in logged if r["kind"] == "eval")
    by_source = record["eval_loss_by_source"]
    assert list(by_source) == [small_prepared.name, "words.jsonl"]
    assert abs(by_source[small_prepared.name] - by_source["words.jsonl"]) > 0.1, by_source  # (the case)
    read = record["eval_sequences_by_source"]  # (each source at least one: a small one vanished from the log)
    assert sum(read.values()) == record["eval_sequences"] and min(read.values()) >= 1, read
    # Worked out apart: the evaluation's sequences (spread over the held-out mixture), each source's scored
    # in one batch, its mean over its labelled tokens; the whole is the mean over both sources' tokens
    trainer = Trainer(tiny_config(*settings)).build()  # (resumes the step-2 checkpoint: the weights evaluated)
    try:
        val, t = trainer.data.val, trainer.cfg.train
        chosen = eval_sequences(val, t.eval_batches * t.global_batch_size)
        trainer.model.eval()
        sums, counts = [], []
        with torch.no_grad():
            for k, part in val.by_source(chosen):
                sums.append(trainer.runner.loss_sum(trainer.runner.to_device(val.batch(part))).item())
                counts.append(val.count_labels(part))
                assert by_source[trainer.data.source_names[k]] == pytest.approx(sums[-1] / counts[-1], rel=1e-5)
    finally:
        trainer.close()
    assert len(counts) == 2 and record["eval_loss"] == pytest.approx(sum(sums) / sum(counts), rel=1e-5)
    assert main(["eval", str(tmp_path / "run"), "--json"]) == 0
    got = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert got["by_source"] == pytest.approx(by_source, rel=1e-6) and got["loss"] == pytest.approx(
        record["eval_loss"], rel=1e-6)


def test_one_source_logs_no_split(tiny_config, tmp_path):
    Trainer(tiny_config("train.steps=2", "train.eval_interval=2", "checkpoint.interval=0")).build().train()
    record = next(json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
                  if '"kind": "eval"' in line)
    assert "eval_loss_by_source" not in record


@pytest.mark.parametrize("sizes, weights, asked", [((64, 64), (1, 1), 32), ((30, 30, 30), (1, 1, 1), 30),
                                                   ((60, 30), (2, 1), 30), ((130, 125), (1, 1), 64)])
def test_an_evaluation_reads_each_source_in_proportion_spread_over_it(sizes, weights, asked):
    """An even spread over the interleaved held-out mixture (A,B,A,B...) at every second index read one source
    alone (the review's find: [64, 64] asked 32 gave [32, 0]); each source's share is spread over its own."""
    from shardline.data.mixture import MixedSequences
    from shardline.data.packing import PackedSequences

    sources = [PackedSequences([[k + 1] * 8 for _ in range(n)], 7, None) for k, n in enumerate(sizes)]
    sizes = [len(s) for s in sources]  # (packed: about the sizes asked, equal ones alike)
    val = MixedSequences(sources, list(weights), interleave=True)
    chosen = eval_sequences(val, asked)
    assert len(set(chosen.tolist())) == len(chosen) == asked
    src, local = val.locate(chosen)
    got = np.bincount(src, minlength=len(sizes))
    want = np.array(val.counts) * asked / len(val)
    assert np.all(np.abs(got - want) <= 1), (got, want)
    for k in range(len(sizes)):  # spread over the source: its first and last tenth both read
        mine = local[src == k]
        assert mine.min() < 0.1 * sizes[k] and mine.max() >= 0.9 * sizes[k] - 1, mine


def test_a_mixtures_held_out_split_holds_each_sequence_once_whatever_the_weights(tiny_config, small_prepared,
                                                                                 tmp_path):
    """The held-out mixture was cut by the training weights: an up-weighted source's sequences were read again
    and again (a walkthrough's 10 reads of a 20-sequence source were 4 sequences), a down-weighted one's partly
    unread, under `--batches 0` too, which claimed every held-out sequence."""
    from shardline.data import build_data

    other = tmp_path / "words.jsonl"
    other.write_text("".join(json.dumps({"text": " ".join(WORDS[(i + k) % 8] for k in range(40 + i % 7))}) + "\n"
                             for i in range(600)))
    mix = f'data.mix=[{{path = "{small_prepared}", weight = 0.1}}, {{path = "{other}", weight = 0.9}}]'
    cfg = tiny_config("data.path=", mix, f"data.tokenizer={small_prepared / 'tokenizer.json'}",
                      "data.val_fraction=0.05")
    data = build_data(cfg)
    try:
        val = data.val
        sizes = [len(s) for s in val.sources]
        assert list(val.counts) == sizes and min(sizes) > 1
        every = eval_sequences(val, len(val))  # (--batches 0)
        src, local = val.locate(every)
        assert sorted(zip(src.tolist(), local.tolist())) == [(k, j) for k, n in enumerate(sizes) for j in range(n)]
        some = eval_sequences(val, 12)
        src, local = val.locate(some)
        assert len(set(zip(src.tolist(), local.tolist()))) == len(some) and set(src.tolist()) == {0, 1}
    finally:
        data.release()


@pytest.mark.parametrize("sizes", [(1, 2, 2, 300), (1, 2, 46), (1, 2, 2), (3, 0, 5)])
def test_a_held_out_mixture_reads_each_sequence_once_with_a_one_sequence_source(sizes):
    """The review's find: 1 / 2949 x 2949 came out 0.9999..., so a one-sequence source's block got two places
    (read twice) and another source's last sequence none; each source's share of an evaluation likewise."""
    from shardline.data.mixture import MixedSequences
    from shardline.data.packing import PackedSequences

    sources = [PackedSequences([[k + 1] * 8 for _ in range(n)], 7, None) for k, n in enumerate(sizes)]
    val = MixedSequences(sources, None, interleave=True)
    sizes = [len(s) for s in sources]
    assert list(val.counts) == sizes
    for asked in (len(sizes), 5, len(val)):
        src, local = val.locate(eval_sequences(val, asked))
        pairs = list(zip(src.tolist(), local.tolist()))
        assert len(set(pairs)) == len(pairs) and {k for k, _ in pairs} == {k for k, n in enumerate(sizes) if n}
    assert sorted(pairs) == [(k, j) for k, n in enumerate(sizes) for j in range(n)]  # (all of it: each once)
