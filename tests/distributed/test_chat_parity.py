"""Parity on chat data: every layout trains on conversations exactly like one process.

Chat sequences differ from text where a layout can go wrong: only the replies carry labels,
so each rank and micro-batch holds a different number of them, and the loss is the mean over
the global batch's labelled tokens (a rank averaging its own, or dividing by its micro-batch
count, trains a different model); and a sequence packs whole conversations of varied lengths,
kept apart by document ids that context parallelism splits and a pipeline carries.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from shardline.config import load_config
from shardline.data.loader import build_data
from shardline.data.prepare import PrepareOptions, prepare
from shardline.models.loss import IGNORE_INDEX
from shardline.trainer import Trainer
from tests.conftest import write_small_corpus
from tests.distributed.harness import PARITY_OVERRIDES, PARITY_STEPS, assert_same_run, losses, run_world

# A conversation of 1-3 exchanges with replies of 1-12 words: rows hold unequal label counts.
WORDS = "sun moon river stone cloud field wind rain snow tree leaf bird".split()
SEQ_LEN = 256
LAYOUTS = {
    "fsdp2": ["parallel.dp_shard=2"],
    "ddp2_accum": ["parallel.dp_replicate=2", "parallel.dp_shard=1", "train.micro_batch_size=1"],
    "pp2_1f1b": ["parallel.pp=2", "parallel.pp_schedule=1f1b"],
    "cp2_ring": ["parallel.cp=2", "parallel.cp_mode=ring"],
    "tp2_loss_parallel": ["parallel.tp=2"],
}
# Chat with text replayed (a third of the sequences): rows of all labels beside rows of a few.
MIXED = {"fsdp2_mixed": LAYOUTS["fsdp2"], "ddp2_accum_mixed": LAYOUTS["ddp2_accum"]}
SINGLE = {False: "single", True: "single_mixed"}


def _conversations(n: int) -> str:
    rows = []
    for i in range(n):
        messages = [{"role": "system", "content": "Answer in words."}] if i % 3 == 0 else []
        for turn in range(1 + i % 3):
            words = " ".join(WORDS[(i + k) % len(WORDS)] for k in range(1 + (7 * i + turn) % 12))
            messages += [{"role": "user", "content": f"Name {turn + i % 5} things ({i})."},  # (no two alike)
                         {"role": "assistant", "content": words + "."}]
        rows.append(json.dumps({"messages": messages}) + "\n")
    return "".join(rows)


def _base(root: Path, mixed: bool = False) -> list[str]:
    """The chat folder alone, or (`mixed`) with a text folder replayed beside it (data.mix[i].format)."""
    data = ([f'data.mix=[{{path = "{root / "prepared"}", format = "chat"}}, {{path = "{root / "text"}", '
             'weight = 0.5}]'] if mixed else [f"data.path={root / 'prepared'}", "data.format=chat"])
    return [*PARITY_OVERRIDES, "model.n_layers=2", f"train.seq_len={SEQ_LEN}", *data]


@pytest.fixture(scope="module")
def chat_runs(tmp_path_factory):
    """(one process's run, {layout: 2-rank run}) on a prepared chat folder."""
    root = tmp_path_factory.mktemp("chat_parity")
    raw = root / "chat.jsonl"
    raw.write_text(_conversations(300))
    prepare(PrepareOptions([str(raw)], str(root / "prepared"), format="chat", val_fraction=0.1, vocab_size=512,
                           progress=False))
    prepare(PrepareOptions([str(write_small_corpus(root))], str(root / "text"), vocab_size=512, progress=False,
                           tokenizer=str(root / "prepared" / "tokenizer.json")))
    for mixed in (False, True):
        Trainer(load_config(None, [*_base(root, mixed), f"run.dir={root / SINGLE[mixed]}"])).build().train()
    run_world(2, [(root / name, [*_base(root), *extra]) for name, extra in LAYOUTS.items()]
              + [(root / name, [*_base(root, mixed=True), *extra]) for name, extra in MIXED.items()])
    return root / SINGLE[False], root


def test_the_setting_holds_what_it_claims(chat_runs):
    """Rows of several whole conversations, unequal label counts with unlabelled prompts, and a
    loss that moves: without them the parity below would test text data again."""
    single, root = chat_runs
    cfg = load_config(None, [*_base(root), f"run.dir={single}"])
    bundle = build_data(cfg)
    first = bundle.sampler.global_batch(0)  # step 1's sequences
    rows = bundle.train.batch(first)
    labelled = (rows["labels"] != IGNORE_INDEX).sum(dim=1).tolist()
    assert len(set(labelled)) > 3 and max(labelled) < 0.8 * cfg.train.seq_len, labelled
    assert max(len(set(docs.tolist())) for docs in rows["doc_ids"]) >= 3
    mbs = cfg.train.micro_batch_size  # each dp rank's share of step 1 holds its own count of labels
    halves = [sum(bundle.train.count_labels(m) for m in bundle.sampler.rank_micro_batches(0, r, 2, mbs))
              for r in range(2)]
    assert halves[0] != halves[1] and sum(halves) == sum(labelled), halves
    mixed = build_data(load_config(None, [*_base(root, mixed=True), f"run.dir={root / SINGLE[True]}"]))
    for step in range(PARITY_STEPS):  # text rows (nearly all labelled) beside chat rows in every step
        batch = mixed.sampler.global_batch(step)
        assert (mixed.train.sequences_per_source(batch) > 0).all(), step
    src, _ = mixed.train.locate(batch)
    counts = (mixed.train.batch(batch)["labels"] != IGNORE_INDEX).sum(dim=1).numpy()
    assert counts[src == 1].min() > counts[src == 0].max(), (src, counts)
    records = [json.loads(line) for line in (single / "metrics.jsonl").read_text().splitlines()]
    data = next(r for r in records if r.get("event") == "data")
    assert data["conversations_cut"] < 0.2 * data["documents"] and data["sequences_without_replies"] == 0, data
    steps = losses(single)
    assert sorted(steps) == [1, 2, 3] and steps[3] < steps[1], steps


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_chat_run_on_two_ranks_matches_one_process(chat_runs, layout):
    single, root = chat_runs
    assert_same_run(root / layout, single)


@pytest.mark.parametrize("layout", list(MIXED))
def test_chat_with_text_replayed_on_two_ranks_matches_one_process(chat_runs, layout):
    _, root = chat_runs
    assert_same_run(root / layout, root / SINGLE[True])


@pytest.mark.parametrize("mixed", [False, True])
def test_a_dry_run_of_a_chat_runs_resume_passes_as_the_launch_does(chat_runs, mixed, capsys):
    """The dry run checks a resume before reading the data: it refused every chat run's, comparing
    the checkpoint's packing with the packing of data it had not read."""
    from shardline.cli import main

    _, root = chat_runs
    run = root / SINGLE[mixed]
    assert main(["train", "--dry-run", f"--run.dir={run}", f"--train.steps={PARITY_STEPS + 3}"]) == 0, \
        capsys.readouterr().err
    assert f"resumes from {run / 'checkpoints'}" in capsys.readouterr().out
