"""A mixture's eval loss by source: each source's held-out sequences of the evaluation scored apart and
logged beside the whole (`eval_loss_by_source`), and given by `shardline eval` alike."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from shardline.cli import main
from shardline.data.sampler import eval_micro_batches
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
    # Worked out apart: the evaluation's sequences (spread over the held-out mixture), each source's scored
    # in one batch, its mean over its labelled tokens; the whole is the mean over both sources' tokens
    trainer = Trainer(tiny_config(*settings)).build()  # (resumes the step-2 checkpoint: the weights evaluated)
    try:
        val, t = trainer.data.val, trainer.cfg.train
        chosen = np.concatenate(eval_micro_batches(len(val), t.eval_batches * t.global_batch_size,
                                                   t.micro_batch_size))
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
