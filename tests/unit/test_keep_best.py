"""checkpoint.keep_best: the lowest eval loss's checkpoint kept past checkpoint.keep, across a resume."""

from __future__ import annotations

import json

import pytest

from shardline.errors import ConfigError
from shardline.trainer import Trainer

# lr 2 diverges on the tiny model: its eval loss is lowest at the first evaluation, as a fine-tune
# that overfits is at its best before its last checkpoint.
DIVERGING = ("optim.lr=2.0", "train.steps=6", "train.eval_interval=2", "checkpoint.interval=6", "checkpoint.keep=1")


def records(run) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_the_best_eval_losss_checkpoint_is_saved_and_kept(tiny_config, tmp_path):
    run = tmp_path / "run"
    Trainer(tiny_config(*DIVERGING, "checkpoint.keep_best=true")).build().train()
    logged = records(run)
    evals = [(r["step"], r["eval_loss"]) for r in logged if r["kind"] == "eval"]
    best = min(evals, key=lambda e: e[1])
    assert best[0] < 6, evals  # (the case: the best is not the newest checkpoint)
    lowest, improved = float("inf"), []
    for step, loss in evals:  # an event at each new lowest, naming its checkpoint
        if loss < lowest:
            lowest, improved = loss, [*improved, step]
    said = [r for r in logged if r.get("event") == "best_checkpoint"]
    assert [r["step"] for r in said] == improved
    assert said[-1]["checkpoint"] == str(run / "checkpoints" / f"step-{best[0]:06d}")
    # saved at its evaluation (not a multiple of checkpoint.interval) and kept beside the newest (keep=1)
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == [f"step-{best[0]:06d}", "step-000006"]
    # A resume knows the best so far (else its first evaluation would be a "best", and the kept folder pruned)
    resumed = Trainer(tiny_config(*DIVERGING, "checkpoint.keep_best=true", "train.steps=10", "checkpoint.interval=2",
                                  "train.eval_interval=4")).build()
    assert resumed.step == 6 and resumed.best_eval == pytest.approx(best[::-1])  # (loss, step)
    assert resumed.checkpointer.keep_also == [run / "checkpoints" / f"step-{best[0]:06d}"]
    resumed.train()
    everything = [(r["step"], r["eval_loss"]) for r in records(run) if r["kind"] == "eval"]
    overall = min(everything, key=lambda e: e[1])[0]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == sorted({f"step-{overall:06d}", "step-000010"})
    assert all(r["eval_loss"] < best[1] for r in records(run) if r.get("event") == "best_checkpoint" and r["step"] > 6)


def test_without_it_only_the_newest_are_kept(tiny_config, tmp_path):
    Trainer(tiny_config(*DIVERGING)).build().train()
    assert [p.name for p in (tmp_path / "run" / "checkpoints").iterdir()] == ["step-000006"]
    assert not [r for r in records(tmp_path / "run") if r.get("event") == "best_checkpoint"]


def test_keeping_the_best_needs_saves(tiny_config):
    with pytest.raises(ConfigError, match="checkpoint.keep_best=True is invalid: needs checkpoint.interval > 0"):
        tiny_config("checkpoint.keep_best=true", "checkpoint.interval=0").check()


def test_a_best_whose_save_is_refused_is_no_best(tiny_config, tmp_path):
    """The best was recorded before its save: a save the disk refused left a "best" whose folder never
    existed, and the one before it unprotected."""
    run = tmp_path / "run"
    Trainer(tiny_config(*DIVERGING, "checkpoint.keep_best=true", "checkpoint.interval=2", "faults.refuse_save_step=2")
            ).build().train()
    logged = records(run)
    assert any(r.get("event") == "checkpoint_failed" and r["step"] == 2 for r in logged)
    said = [r["step"] for r in logged if r.get("event") == "best_checkpoint"]
    assert said and 2 not in said, said
    assert all((run / "checkpoints" / f"step-{s:06d}").is_dir() for s in said[-1:])


def test_the_evaluation_a_stop_left_owed_is_ranked_too(tiny_config, tmp_path):
    """The resumed run makes up the evaluation a stop skipped: it was never compared with the best, so a
    best there went unkept. Its step is saved again (on every rank alike) and kept."""
    run = tmp_path / "run"
    Trainer(tiny_config(*DIVERGING, "checkpoint.keep_best=true", "train.stop_at_step=3", "checkpoint.interval=3")
            ).build().train()
    resumed = Trainer(tiny_config(*DIVERGING, "checkpoint.keep_best=true", "checkpoint.interval=3")).build()
    assert resumed.step == 3
    resumed.best_eval = (float("inf"), 0)  # (as if the step-2 evaluation had been a worse one)
    resumed._evaluate_owed()
    assert resumed.best_eval[1] == 3 and resumed.checkpointer.keep_also[-1] == run / "checkpoints" / "step-000003"
    assert [r["step"] for r in records(run) if r.get("event") == "best_checkpoint"][-1] == 3
    resumed.close()


def test_best_gives_eval_convert_and_generate_the_best_checkpoint(tiny_config, tmp_path, capsys):
    """A fine-tuner's "load the best model at the end": a run dir gave its newest checkpoint, past the best,
    and the best's folder had to be found by hand."""
    from shardline.cli import main

    run = tmp_path / "run"
    Trainer(tiny_config(*DIVERGING, "checkpoint.keep_best=true")).build().train()
    evals = [(r["step"], r["eval_loss"]) for r in records(run) if r["kind"] == "eval"]
    best = min(evals, key=lambda e: e[1])
    folder = run / "checkpoints" / f"step-{best[0]:06d}"
    assert best[0] < 6
    capsys.readouterr()
    assert main(["eval", str(run), "--best", "--json"]) == 0
    got = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert got["checkpoint"] == str(folder) and got["loss"] == pytest.approx(best[1], rel=1e-6)
    assert main(["convert", "to-hf", str(run), str(tmp_path / "hf"), "--best"]) == 0
    assert f"of {folder})" in capsys.readouterr().out
    assert main(["generate", str(run), "--best", "--max-new-tokens", "2", "--json"]) == 0
    said = capsys.readouterr()
    assert json.loads(said.out)["checkpoint"] == str(folder) and f"sampling {folder}, the best" in said.err
    # a checkpoint folder, or a run that kept no best: one line each
    assert main(["eval", str(folder), "--best"]) == 2
    assert "--best takes a run dir, not a checkpoint folder" in capsys.readouterr().err
    Trainer(tiny_config(*DIVERGING, run_dir=tmp_path / "plain")).build().train()
    assert main(["convert", "to-hf", str(tmp_path / "plain"), str(tmp_path / "hf2"), "--best"]) == 2
    assert "kept no best checkpoint: its run had checkpoint.keep_best off" in capsys.readouterr().err


def test_a_best_at_the_newest_checkpoint_is_named_in_its_own_state(tiny_config, tmp_path):
    """The save of an evaluation that beats the best came before the best was recorded: that checkpoint's
    state named the best before it, so --best on a run improving to its end gave an older, worse one (gone
    under checkpoint.keep=1), and a resume from it compared against that older loss."""
    from shardline.interop.convert import best_checkpoint

    run = tmp_path / "run"
    improving = ("optim.lr=1e-3", "train.steps=6", "train.eval_interval=2", "checkpoint.interval=6",
                 "checkpoint.keep=1", "checkpoint.keep_best=true")
    Trainer(tiny_config(*improving)).build().train()
    evals = [r["eval_loss"] for r in records(run) if r["kind"] == "eval"]
    assert evals == sorted(evals, reverse=True)  # (the case: each evaluation the best so far)
    assert best_checkpoint(run) == run / "checkpoints" / "step-000006"
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-000006"]
    resumed = Trainer(tiny_config(*improving[:1], "train.steps=8", *improving[2:])).build()
    try:
        assert resumed.best_eval == pytest.approx((evals[-1], 6))
    finally:
        resumed.close()


def test_a_best_whose_async_write_is_refused_later_gives_way_to_the_one_before(tiny_config, tmp_path):
    """An async save returns before its write lands: a best named there whose write the storage refused later
    stayed the best, so later states named a folder never written (--best: "gone"), a loss between the two
    was no new best, and a resume pruned the true best's folder."""
    trainer = Trainer(tiny_config(*DIVERGING, "checkpoint.keep_best=true", "checkpoint.mode=async")).build()
    try:
        trainer.best_eval, trainer._bests_before = (1.0, 4), [(float("inf"), 0), (2.0, 2)]
        trainer._forget_refused_best()  # (nothing refused: it stays)
        assert trainer.best_eval == (1.0, 4)
        trainer.tiers.refused.add(4)
        trainer._forget_refused_best()
        assert trainer.best_eval == (2.0, 2) and trainer._bests_before == [(float("inf"), 0)]
    finally:
        trainer.close()
