"""Trainer behaviour: exact resume, gradient accumulation, precision modes, metrics."""

from __future__ import annotations

import json
import math
import re
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from shardline.errors import CheckpointError, ConfigError
from shardline.trainer import Trainer


def read_records(run_dir, kind):
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == kind]


def train_losses(run_dir):
    return {r["step"]: r["loss"] for r in read_records(run_dir, "train")}


def params(trainer):
    return {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


def test_resume_is_bit_identical(tiny_config, tmp_path):
    full = Trainer(tiny_config("train.steps=16", run_dir=tmp_path / "full")).build()
    full.train()
    first = Trainer(tiny_config("train.steps=16", "train.stop_at_step=8", run_dir=tmp_path / "split")).build()
    first.train()
    assert first.step == 8
    second = Trainer(tiny_config("train.steps=16", run_dir=tmp_path / "split")).build()  # resumes automatically
    assert second.step == 8
    second.train()
    ends = [r["outcome"] for r in read_records(tmp_path / "split", "event") if r["event"] == "end"]
    assert ends == ["stop_at_step", "complete"]  # (a launch's end, then the run's)
    a, b = train_losses(tmp_path / "full"), train_losses(tmp_path / "split")
    assert sorted(a) == sorted(b) == list(range(1, 17))
    assert all(a[k] == b[k] for k in a), {k: (a[k], b[k]) for k in a if a[k] != b[k]}
    for name, value in params(full).items():
        assert torch.equal(value, params(second)[name]), name
    resumes = [r for r in read_records(tmp_path / "split", "event") if r["event"] == "resume"]
    assert len(resumes) == 1 and resumes[0]["step"] == 8


def test_grad_accumulation_equals_large_batch(tiny_config, tmp_path):
    # Summation order differs, so gradients differ in the last bits. Adam divides by
    # sqrt(v) + eps, which turns a 1e-12 gradient of a rarely seen embedding row into a
    # full-size update when eps is tiny; eps=1e-6 keeps that float noise from being
    # amplified, so what is compared is the accumulation itself.
    big = Trainer(tiny_config("train.micro_batch_size=8", "optim.eps=1e-6", run_dir=tmp_path / "big")).build()
    big.train()
    small = Trainer(tiny_config("train.micro_batch_size=2", "optim.eps=1e-6", run_dir=tmp_path / "small")).build()
    small.train()
    a, b = train_losses(tmp_path / "big"), train_losses(tmp_path / "small")
    for step in a:
        assert a[step] == pytest.approx(b[step], rel=1e-5)
    for name, value in params(big).items():
        torch.testing.assert_close(params(small)[name], value, rtol=1e-5, atol=1e-5)


def test_the_first_step_is_warm_up_not_throughput(tiny_config, tmp_path):
    """A process's first step compiles and fills caches (tens of seconds on a GPU): the first
    logged window starts after it, or its tokens/s and MFU came out several times too low."""
    trainer = Trainer(tiny_config("train.steps=6", "metrics.log_interval=3", "train.eval_interval=0",
                                  "checkpoint.interval=0")).build()
    compute, calls = trainer.compute_gradients, []

    def slow_first():
        calls.append(1)
        if len(calls) == 1:
            time.sleep(3.0)
        return compute()

    trainer.compute_gradients = slow_first
    trainer.train()
    train = read_records(tmp_path / "run", "train")
    assert [r["step"] for r in train] == [3, 6]
    per_step = trainer.cfg.train.global_batch_size * trainer.cfg.train.seq_len  # (runs compared by tokens trained)
    assert [r["tokens"] for r in train] == [3 * per_step, 6 * per_step]
    # steps 2 and 3 only, as steps 4 to 6 (with step 1 in it: 1 s more)
    assert train[0]["step_time_s"] < train[1]["step_time_s"] + 0.5, train


def test_loss_falls_and_records_are_complete(tiny_config, tmp_path):
    Trainer(tiny_config("train.steps=30", "train.eval_interval=30", "optim.lr=1e-2")).build().train()
    run = tmp_path / "run"
    train = read_records(run, "train")
    assert train[-1]["loss"] < train[0]["loss"] - 1.0
    for key in ("step", "loss", "lr", "grad_norm", "tokens_per_s", "mfu", "peak_mem_gib", "step_time_s"):
        assert key in train[-1], key
    evals = read_records(run, "eval")
    assert evals and math.isfinite(evals[-1]["eval_loss"]) and evals[-1]["eval_loss"] < train[0]["loss"]
    assert (run / "config.toml").is_file() and (run / "tokenizer.json").is_file()
    ckpts = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert ckpts == ["step-000018", "step-000024", "step-000030"]  # keep=3 of every 6 steps
    from shardline.version import version

    (start,) = [r for r in read_records(run, "event") if r["event"] == "start"]
    assert start["shardline"] == version() and start["torch"] == torch.__version__  # which code trained it
    assert start["run_dir"] == str(run)  # where its files go, said at the start (a newcomer read it at the end)
    # train.precision=auto, settled by the device before anything reads it: fp32 on a CPU, as the run dir saves it
    assert start["precision"] == "fp32" and 'precision = "fp32"' in (run / "config.toml").read_text(encoding="utf-8")
    # The launch's first record: a tool that splits the log at `start` gives its notes to this launch
    assert json.loads((run / "metrics.jsonl").read_text(encoding="utf-8").splitlines()[0])["event"] == "start"


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_trains(tiny_config, tmp_path, precision):
    trainer = Trainer(tiny_config(f"train.precision={precision}", "optim.lr=1e-2")).build()
    trainer.train()
    losses = train_losses(tmp_path / "run")
    assert all(math.isfinite(v) for v in losses.values())
    assert losses[12] < losses[1]
    assert all(p.dtype == torch.float32 for p in trainer.model.parameters())  # fp32 master weights


def test_the_overflow_warning_counts_this_launchs_steps():
    from shardline.precision import LossScaler

    scaler = LossScaler(torch.device("cpu"), "fp16")
    scaler.skipped_steps, scaler.launch_skipped = 40, 3  # (the run's earlier launches skipped 37: not this one's)
    for steps, said in ((6, None), (5, "3 of the 5 steps this launch ran were skipped"), (3, "all 3 steps")):
        scaler.launch_steps = steps  # (half skipped: the scale finding its level, as fp16 runs start)
        warning = scaler.overflow_warning()
        assert warning is None if said is None else said in warning, (steps, warning)
    assert "the weights did not change" in scaler.overflow_warning()
    assert LossScaler(torch.device("cpu"), "bf16").overflow_warning() is None


def test_fp16_overflow_skips_the_step(tiny_config, tmp_path, capsys):
    trainer = Trainer(tiny_config("train.precision=fp16", "train.steps=1")).build()
    trainer.scaler.scaler._init_scale = 2.0**40  # certain overflow in fp16 on the first step
    before = params(trainer)
    trainer.train()
    assert trainer.scaler.skipped_steps == 1
    assert all(torch.equal(before[k], v) for k, v in params(trainer).items())
    events = [r["event"] for r in read_records(tmp_path / "run", "event")]
    assert "skipped_step" in events
    end = [r for r in read_records(tmp_path / "run", "event") if r["event"] == "end"][-1]
    assert end["outcome"] == "complete"
    assert end["overflow_skipped_steps"] == 1  # the scaler's skips, apart from the anomalies' (its own count)
    # Complete, yet nothing trained: said in one line, not left to the loss curve
    assert "warning: the one step this launch ran was skipped by the fp16 loss scaler" in capsys.readouterr().err
    # The train record carries the loss scale (halved by the overflow), not only the skip's event.
    assert [r["loss_scale"] for r in read_records(tmp_path / "run", "train")] == [2.0**39]
    from shardline.metrics import format_line

    logged = {**read_records(tmp_path / "run", "train")[0], "grad_norm": math.inf}  # (the file's is "Infinity")
    assert format_line(logged, 1).endswith("| loss scale 5.49756e+11")


def test_a_resume_applies_the_configs_optimizer_settings(tiny_config, tmp_path):
    """Resuming with a lower optim.lr (say after a loss spike) trains with it, and the log says so."""
    from shardline.optim import lr_multiplier

    Trainer(tiny_config("train.stop_at_step=6", "train.eval_interval=0")).build().train()
    resumed = Trainer(tiny_config("optim.lr=1e-4", "optim.weight_decay=0.0", "optim.beta2=0.99",
                                  "train.eval_interval=0", "train.precision=bf16", "train.grad_clip=0.5")).build()
    assert resumed.step == 6
    optim = resumed.cfg.optim
    for group in resumed.optimizer.param_groups:
        assert group["lr"] == pytest.approx(1e-4 * lr_multiplier(6, 12, optim))
        assert (group["weight_decay"], group["betas"]) == (0.0, (0.9, 0.99))
    changed = [r for r in read_records(tmp_path / "run", "event") if r["event"] == "optim_changed"]
    assert len(changed) == 1
    assert {k: v for k, v in changed[0].items() if k not in ("kind", "event", "step", "time")} == \
        {"optim.lr": [3e-3, 1e-4], "optim.weight_decay": [0.1, 0.0], "optim.beta2": [0.95, 0.99],
         "next_lr": pytest.approx([3e-3 * lr_multiplier(6, 12, optim), 1e-4 * lr_multiplier(6, 12, optim)])}
    # The rest of what the resume changed is said too (a precision change was silent); not the
    # optim keys said above, nor what one launch sets for itself (train.stop_at_step).
    (others,) = [r for r in read_records(tmp_path / "run", "event") if r["event"] == "config_changed"]
    assert {k: v for k, v in others.items() if k not in ("kind", "event", "step", "time")} == \
        {"train.precision": ["fp32", "bf16"], "train.grad_clip": [1.0, 0.5]}
    resumed.train()
    logged = {r["step"]: r["lr"] for r in read_records(tmp_path / "run", "train")}
    assert logged[7] == pytest.approx(1e-4 * lr_multiplier(6, 12, optim))
    assert resumed.optimizer.param_groups[0]["lr"] == pytest.approx(1e-4 * lr_multiplier(12, 12, optim))


def test_a_resume_cannot_skip_a_batch_already_trained_on(tiny_config):
    Trainer(tiny_config("train.stop_at_step=6", "train.eval_interval=0")).build().train()
    with pytest.raises(ConfigError, match=r"train.skip_batches=\[2\] names batches already trained on before "
                                          r"\S+step-000006 \(the run resumes at batch 6\)"):
        Trainer(tiny_config("train.skip_batches=[2, 8]")).build()
    assert Trainer(tiny_config("train.skip_batches=[8]")).build().skipped_batches == [8]  # ahead: fine


def test_a_resume_with_another_vocabulary_of_the_same_size_is_refused(tiny_config, tmp_path, small_prepared,
                                                                      small_corpus):
    """Another tokenizer of the same size packs the text into as many sequences, so the position
    check passed, while the embeddings were trained for other tokens."""
    tok = json.loads((small_prepared / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    (tmp_path / "a.json").write_text(json.dumps(tok))
    first, second = sorted(vocab, key=vocab.get)[300:302]  # two merged tokens trade ids
    vocab[first], vocab[second] = vocab[second], vocab[first]
    (tmp_path / "b.json").write_text(json.dumps(tok))
    common = [f"data.path={small_corpus}", "train.eval_interval=0", "checkpoint.interval=3"]
    Trainer(tiny_config(*common, f"data.tokenizer={tmp_path / 'a.json'}", "train.stop_at_step=3")).build().train()
    with pytest.raises(CheckpointError, match=r"step-000003 was trained with another tokenizer \(vocabulary \w+, "
                                              r"this run's \w+\): its embeddings mean other tokens"):
        Trainer(tiny_config(*common, f"data.tokenizer={tmp_path / 'b.json'}")).build()
    assert Trainer(tiny_config(*common, f"data.tokenizer={tmp_path / 'a.json'}")).build().step == 3


def test_a_resume_onto_edited_data_is_refused_even_at_the_same_settings(tiny_config, tmp_path, small_prepared,
                                                                        small_corpus):
    """Data edited in place (the same settings, often the same sequence count) resumed onto other
    batches in silence: the training tokens' fingerprint is saved and compared."""
    from shardline.data.sources import read_documents

    docs = read_documents(str(small_corpus))
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    common = [f"data.path={data}", f"data.tokenizer={small_prepared / 'tokenizer.json'}", "train.eval_interval=0",
              "checkpoint.interval=3"]
    Trainer(tiny_config(*common, "train.stop_at_step=3")).build().train()
    assert Trainer(tiny_config(*common)).build().step == 3  # the same data: resumed
    from shardline.data.validation import digest, held_out

    held = set(held_out(map(digest, docs), 0.01).tolist())
    first, second = [i for i in range(len(docs)) if i not in held][:2]  # two training documents trade places:
    docs[first], docs[second] = docs[second], docs[first]  # the same tokens, as many sequences, other batches
    data.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    with pytest.raises(CheckpointError, match=r"step-000003 was trained on other data \(tokens \w+, this run's "
                                              rf"\w+\): its training tokens differ \(files changed since: "
                                              rf"{re.escape(str(data))} \(modified \d{{4}}-\d\d-\d\d \d\d:\d\d\)\): "
                                              "the files were edited"):
        Trainer(tiny_config(*common)).build()  # (named: the same size, another time)
    data.write_text(data.read_text() + json.dumps({"text": "one more document " * 40}) + "\n")
    with pytest.raises(CheckpointError, match=rf"changed since: {re.escape(str(data))} \(modified [-\d :]+, "
                                              r"[\d,]+ -> [\d,]+ bytes\)"):
        Trainer(tiny_config(*common)).build()


def test_a_named_checkpoint_the_config_contradicts_is_refused_before_newer_ones_are_set_aside(tiny_config, tmp_path):
    """Resuming an older checkpoint by name sets the newer ones aside (another history); a batch
    size, seed or data it cannot resume with was found only after that, in the restore: the run
    stopped with the newer checkpoints moved out, and a plain rerun resumed the old one."""
    common = ["train.eval_interval=0", "checkpoint.interval=3"]
    Trainer(tiny_config(*common, "train.stop_at_step=9")).build().train()
    checkpoints = tmp_path / "run" / "checkpoints"
    before = sorted(p.name for p in checkpoints.iterdir())
    named = f"run.resume={checkpoints / 'step-000003'}"
    for change, says in [("train.global_batch_size=16", "train.global_batch_size=8 but this run has 16"),
                         ("train.seed=7", "order seed is 7"), ("train.skip_batches=[1]", r"train.skip_batches=\[1\]")]:
        with pytest.raises((CheckpointError, ConfigError), match=says):
            Trainer(tiny_config(*common, named, change)).build()
        assert sorted(p.name for p in checkpoints.iterdir()) == before, change
    assert Trainer(tiny_config(*common)).build().step == 9


def test_a_resume_with_another_schedule_says_so_and_a_cut_warmup_is_named(tiny_config, tmp_path):
    """The checkpoint holds the schedule's step only: a longer train.steps or another warmup
    moves the lr curve from the resume on, which the optim_changed event names."""
    Trainer(tiny_config("train.stop_at_step=6", "optim.warmup_steps=20", "train.eval_interval=0")).build().train()
    cut = [r for r in read_records(tmp_path / "run", "event") if r["event"] == "warmup_cut"]
    assert [(r["warmup_steps"], r["steps"]) for r in cut] == [(20, 12)]  # longer than the run's 12 steps
    from shardline.launch_notes import launch_notes

    equal = dict(launch_notes(tiny_config("optim.warmup_steps=12", "metrics.peak_tflops=1"), "cpu", 1.0, 1))
    assert equal["warmup_cut"] == {"warmup_steps": 12, "steps": 12,  # the lr peaks at the last step here too
                                   "why": "the warm-up covers every step: the lr is still rising at the last "
                                          "step (at most peaking there), never decaying (lower optim.warmup_steps)"}
    assert "warmup_cut" not in dict(launch_notes(tiny_config("optim.warmup_steps=11"), "cpu", 1.0, 1))
    resumed = Trainer(tiny_config("train.steps=24", "optim.warmup_steps=4", "train.eval_interval=0")).build()
    (changed,) = [r for r in read_records(tmp_path / "run", "event") if r["event"] == "optim_changed"]
    assert (changed["train.steps"], changed["optim.warmup_steps"]) == ([12, 24], [20, 4])
    assert "optim.schedule" not in changed
    # The lr of the next update, before (the cut warm-up's 7/12 of the peak) and now (past a 4-step warm-up)
    from shardline.optim import lr_multiplier

    lr = resumed.cfg.optim.lr
    assert changed["next_lr"] == pytest.approx([lr * 7 / 12, lr * lr_multiplier(6, 24, resumed.cfg.optim)])
    assert resumed.optimizer.param_groups[0]["lr"] == pytest.approx(changed["next_lr"][1])  # what the step uses


def test_resume_flag_without_checkpoint_fails(tiny_config):
    with pytest.raises(CheckpointError, match="no valid checkpoint"):
        Trainer(tiny_config("run.resume=latest")).build()


def test_never_resume_refuses_to_overwrite(tiny_config, tmp_path, monkeypatch):
    Trainer(tiny_config("train.steps=6")).build().train()
    with pytest.raises(ConfigError, match="already holds checkpoints"):
        Trainer(tiny_config("run.resume=never")).build()
    # A run that saved nothing has its records there all the same (a sweep's loop reusing a name
    # superseded them)
    bare = tmp_path / "bare"
    Trainer(tiny_config("train.steps=4", "checkpoint.interval=0", "metrics.log_interval=1",
                        run_dir=bare)).build().train()
    with pytest.raises(ConfigError, match="already holds a run's training records"):
        Trainer(tiny_config("run.resume=never", run_dir=bare)).build()
    # A restart of that refused job (torchrun restarts on any failure) is refused again: the
    # checkpoints are another run's.
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-7")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    with pytest.raises(ConfigError, match="already holds checkpoints"):
        Trainer(tiny_config("run.resume=never")).build()
    with pytest.raises(ConfigError, match="already holds a run's training records"):  # (not the refused job's own)
        Trainer(tiny_config("run.resume=never", run_dir=bare)).build()
    # A job that started fresh and saved: its restart reruns the same command line and goes
    # on from what the first attempt saved.
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    monkeypatch.setenv("SLURM_JOB_ID", "77")  # one Slurm job (no srun step) ...
    fresh = tmp_path / "fresh"
    Trainer(tiny_config("run.resume=never", "train.stop_at_step=6", run_dir=fresh)).build().train()
    own = tmp_path / "own"  # (and one that saved nothing: its records are its restart's to go on over)
    Trainer(tiny_config("run.resume=never", "checkpoint.interval=0", "metrics.log_interval=1",
                        run_dir=own)).build().train()
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert Trainer(tiny_config("run.resume=never", run_dir=fresh)).build().step == 6
    assert Trainer(tiny_config("run.resume=never", run_dir=own)).build().step == 0
    # ... whose next torchrun launch (another run id) is refused, and so is its restart.
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-8")
    with pytest.raises(ConfigError, match="already holds checkpoints"):
        Trainer(tiny_config("run.resume=never", run_dir=fresh)).build()


def test_resume_with_other_data_layout_is_refused(tiny_config):
    Trainer(tiny_config("train.steps=6")).build().train()
    with pytest.raises(CheckpointError, match="saved at train.seq_len=32; this run has 16"):
        Trainer(tiny_config("train.seq_len=16")).build()
    with pytest.raises(CheckpointError, match=r"in the order of seed 1234; this run's order seed is 7 \(train.seed\): "
                                              ".*set train.seed=1234,"):
        Trainer(tiny_config("train.seed=7")).build()
    with pytest.raises(CheckpointError, match=r"seed is 7 \(train.data_seed\): .*set train.data_seed=1234,"):
        Trainer(tiny_config("train.data_seed=7")).build()  # (the key that sets this run's order: it works)
    assert Trainer(tiny_config("train.seed=7", "train.data_seed=1234")).build().step == 6  # the same order
    # The sample position is step x global batch: another batch size would skip samples.
    with pytest.raises(CheckpointError, match="global_batch_size=8 but this run has 16"):
        Trainer(tiny_config("train.global_batch_size=16")).build()


def test_fewer_steps_than_the_checkpoint_holds_is_refused_before_anything_is_written(tiny_config, tmp_path,
                                                                                    monkeypatch):
    """A shorter run asked of a run dir holding a longer one would exit having trained nothing
    (the README's quick start run twice): refused in one line, by the dry run too."""
    from shardline.preflight import check_resume

    Trainer(tiny_config("train.steps=6", "train.eval_interval=0")).build().train()
    before = (tmp_path / "run" / "metrics.jsonl").read_text()

    def unbuilt(*args, **kwargs):  # the launch refuses before it builds the model (and loads the state)
        raise AssertionError("the model was built")

    with monkeypatch.context() as m:
        m.setattr("shardline.trainer.loop.build_model", unbuilt)
        for check in (lambda cfg: Trainer(cfg).build(), check_resume):
            with pytest.raises(ConfigError, match=r"train.steps=4 is behind .*step-000006, saved at step 6: nothing"):
                check(tiny_config("train.steps=4", "train.eval_interval=0"))
    assert (tmp_path / "run" / "metrics.jsonl").read_text() == before
    Trainer(tiny_config("train.steps=6", "train.eval_interval=0")).build()  # a finished run found finished


def test_the_resume_check_reads_the_saved_step_and_shape_apart(tiny_config, tmp_path):
    """A damaged manifest step does not hide the shape check (nor raise a TypeError); a
    vocabulary the dry run only estimates is not compared."""
    import dataclasses
    import json

    from shardline.errors import CheckpointError
    from shardline.preflight import check_resume_fits

    trainer = Trainer(tiny_config("train.steps=2", "train.eval_interval=0"))
    trainer.build().train()
    path = tmp_path / "run" / "checkpoints" / "step-000002"
    args = trainer.model_args
    check_resume_fits(path, args, 2)
    manifest = json.loads((path / "manifest.json").read_text())
    (path / "manifest.json").write_text(json.dumps({**manifest, "step": "2"}))
    with pytest.raises(CheckpointError, match="another shape") as deeper:
        check_resume_fits(path, dataclasses.replace(args, n_layers=3), 2)
    assert "tokenizer" not in str(deeper.value)
    other_vocab = dataclasses.replace(args, vocab_size=args.vocab_size + 64)
    # A vocabulary changes with the data, not a [model] key: the line says where it comes from.
    with pytest.raises(CheckpointError, match=r"vocab_size.*a vocabulary follows the tokenizer \(data.path"):
        check_resume_fits(path, other_vocab, 2)
    check_resume_fits(path, other_vocab, 2, vocab_known=False)


def test_seq_len_beyond_the_presets_maximum_raises_the_recorded_maximum(tiny_config):
    trainer = Trainer(tiny_config("train.seq_len=32", "train.steps=1", "checkpoint.interval=0",
                                  "train.eval_interval=0")).build()
    assert trainer.model_args.max_seq_len == 1024  # tiny's own maximum holds shorter sequences
    from shardline.config import load_config
    from shardline.preflight import preflight

    cfg = load_config(None, ["train.seq_len=2048"])
    assert preflight(cfg, 1, tokenizer_vocab=4096).model_args.max_seq_len == 2048


def test_an_eval_reads_a_small_held_out_split_once_each(tiny_config, tmp_path):
    """A held-out split smaller than eval_batches global batches is read whole, each sequence
    once: the mean over distinct text, the count in the record (was: repeated to make up the count,
    its first sequences weighted twice)."""
    import numpy as np

    trainer = Trainer(tiny_config("train.eval_batches=41")).build()
    val = trainer.data.val
    held_out = len(val)
    assert held_out < 41 * 8 and (41 * 8) % held_out, held_out  # the case: asked more, not a multiple
    one_each = trainer.runner.eval_loss_total([np.array([i]) for i in range(held_out)], val.batch)
    expected = one_each.item() / val.count_labels(np.arange(held_out))
    trainer.metrics = type("Log", (), {"log": lambda self, kind, **f: records.append(f)})()
    records: list[dict] = []
    assert trainer.evaluate() == pytest.approx(expected, rel=1e-5)
    assert records[0]["eval_sequences"] == held_out


def test_a_failing_watchdog_close_keeps_the_runs_own_error_and_frees_the_run_dir(tiny_config, tmp_path,
                                                                                   monkeypatch):
    """The failure path stops the watchdog first; its last report failing to write (a full disk)
    must not replace the run's error, keep the signal handlers installed or the run dir locked."""
    import signal

    before = signal.getsignal(signal.SIGTERM)
    trainer = Trainer(tiny_config()).build()

    def disk_full():
        raise OSError(28, "No space left on device")

    def step_fails():
        raise ValueError("the run's own error")

    monkeypatch.setattr(trainer.guard.watchdog, "close", disk_full)
    monkeypatch.setattr(trainer, "_train", step_fails)
    with pytest.raises(ValueError, match="the run's own error"):
        trainer.train()
    assert signal.getsignal(signal.SIGTERM) == before
    assert Trainer(tiny_config()).build().step == 0  # the dir is free again


def test_a_relaunch_of_a_finished_run_says_there_is_nothing_to_train(tiny_config, tmp_path):
    """A requeue or a rerun of a run that reached train.steps trains nothing and exits 0, as it
    may; the resume record says so instead of the run ending silently."""
    Trainer(tiny_config("train.steps=6", "train.eval_interval=0")).build().train()
    Trainer(tiny_config("train.steps=6", "train.eval_interval=0")).build().train()
    resumed = [r for r in read_records(tmp_path / "run", "event") if r["event"] == "resume"]
    assert [(r["step"], r.get("note", "")) for r in resumed] == [(6, "train.steps (or stop_at_step) reached: nothing "
                                                                      "to train")]


def test_data_seed_sets_the_data_order_apart_from_the_initialisation(tiny_config, tmp_path):
    """An ablation of the initialisation alone keeps the data order (train.data_seed), one of the
    order alone keeps the weights (train.seed); -1, the default, reads the order from train.seed."""
    def built(*seeds: str, name: str):
        trainer = Trainer(tiny_config(*seeds, run_dir=tmp_path / name)).build()
        order = np.concatenate([trainer.data.sampler.global_batch(i) for i in range(3)])
        weights = trainer.model.tok_embeddings.weight.detach().clone()
        trainer.close()
        return order, weights

    plain = built("train.seed=5", name="plain")
    other_init = built("train.seed=6", "train.data_seed=5", name="init")
    other_order = built("train.seed=5", "train.data_seed=9", name="order")
    assert np.array_equal(plain[0], other_init[0]) and not torch.equal(plain[1], other_init[1])
    assert not np.array_equal(plain[0], other_order[0]) and torch.equal(plain[1], other_order[1])
    with pytest.raises(ConfigError, match=r"train.data_seed=-2 is invalid: must be -1 \(train.seed\)"):
        Trainer(tiny_config("train.data_seed=-2"))


def test_a_folder_prepared_again_with_a_new_bpe_is_told_to_take_the_runs_tokenizer(tiny_config, tmp_path,
                                                                                   small_corpus):
    """A document fixed, the folder prepared again (--overwrite, no --tokenizer): prepare trained a new
    BPE, and the refusal said "keep data.tokenizer", which the user had never set."""
    from shardline.data.prepare import PrepareOptions, prepare

    text, out = tmp_path / "c.jsonl", tmp_path / "prep"
    text.write_text(small_corpus.read_text(encoding="utf-8"), encoding="utf-8")
    prepare(PrepareOptions([str(text)], str(out), vocab_size=512, progress=False))
    common = [f"data.path={out}", "train.eval_interval=0", "checkpoint.interval=3"]
    run = Trainer(tiny_config(*common, "train.stop_at_step=3"))
    run.build().train()
    text.write_text(text.read_text(encoding="utf-8").replace("the", "thy"), encoding="utf-8")
    prepare(PrepareOptions([str(text)], str(out), vocab_size=512, progress=False, overwrite=True))
    with pytest.raises(CheckpointError, match=re.escape(
            f"prepare it again with --overwrite --tokenizer {Path(run.cfg.run.dir) / 'tokenizer.json'}, the run's "
            "copy")):
        Trainer(tiny_config(*common)).build()


def test_a_config_changed_after_build_is_refused_by_train_which_frees_the_run_dir(tiny_config, tmp_path):
    """Set in a notebook between build() and train(): train.steps was half used (a 3-step schedule run to
    step 6, logged at another lr) and optim.lr not at all. Refused in one line; the lock is let go."""
    cfg = tiny_config("train.steps=3", "train.eval_interval=0")
    trainer = Trainer(cfg).build()
    cfg.train.steps, cfg.optim.lr = 6, 1.0
    with pytest.raises(ConfigError, match=r"^the config was changed after build\(\) \(train.steps, optim.lr\): "):
        trainer.train()
    assert not (tmp_path / "run" / ".lock").exists()
    assert Trainer(cfg).build().train()["step"] == 6  # (a new Trainer of it trains it)


def test_trainers_made_of_one_config_object_edited_between_them_each_train_their_own(tiny_config, tmp_path):
    """A notebook's sweep: Trainer t1 of cfg, cfg edited for t2, t2 of it. t1 refused to train ("the config
    was changed after build()") and cfg itself was rewritten (run.dir absolute, precision settled)."""
    cfg = tiny_config("train.steps=2", "train.eval_interval=0", "train.precision=auto", run_dir=tmp_path / "a")
    first = Trainer(cfg).build()
    cfg.run.dir, cfg.train.steps = str(tmp_path / "b"), 3
    second = Trainer(cfg).build()
    assert (first.train()["step"], second.train()["step"]) == (2, 3)
    assert cfg.train.precision == "auto" and first.cfg.train.precision == "fp32"
    assert first.cfg.run.dir == str(tmp_path / "a")
    # An edit made while no later Trainer is made of the object is meant for the one made last: refused,
    # not passed over, before build() and after it.
    third = Trainer(cfg)
    cfg.optim.lr = 1.0
    with pytest.raises(ConfigError, match=r"^the config was changed after Trainer\(cfg\) was made \(optim.lr\): "
                                          "the Trainer works on a copy made then; build a new Trainer"):
        third.build()


def test_a_relative_run_dir_is_the_folder_meant_at_construction_whatever_the_cwd_later(tiny_config, tmp_path,
                                                                                       monkeypatch):
    """A notebook's chdir between build() and train() made the lock look lost ("taken over since this
    Trainer was built"), and the refusal left the lock held."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    monkeypatch.chdir(tmp_path / "a")
    trainer = Trainer(tiny_config("train.steps=2", "train.eval_interval=0", run_dir=Path("run"))).build()
    monkeypatch.chdir(tmp_path / "b")
    assert trainer.train()["step"] == 2
    assert (tmp_path / "a" / "run" / "checkpoints").is_dir() and not (tmp_path / "b" / "run").exists()
    assert not (tmp_path / "a" / "run" / ".lock").exists()


def test_a_run_that_fails_says_so_in_its_log(tiny_config, tmp_path):
    """A crash (a lost node, an error in a step) left metrics.jsonl ending on its last train record:
    to a requeue script reading the run dir, a cut-off log. A stop and a halt have their own events."""
    trainer = Trainer(tiny_config("train.steps=6", "train.eval_interval=0")).build()
    compute, calls = trainer.compute_gradients, []

    def broken_in_the_third():
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("boom\nits second line")
        return compute()

    trainer.compute_gradients = broken_in_the_third
    with pytest.raises(RuntimeError, match="boom"):
        trainer.train()
    last = read_records(tmp_path / "run", "event")[-1]
    assert (last["event"], last["step"], last["error"], last["lost_peer"]) == ("failed", 2, "RuntimeError: boom", False)


def test_a_ctrl_c_inside_torchs_checkpoint_writer_is_no_failure_in_the_log(tiny_config, tmp_path):
    """torch's writer hands a Ctrl-C back wrapped in its CheckpointException: the CLI said "interrupted",
    the log said `failed`."""
    from torch.distributed.checkpoint.api import CheckpointException

    for n, (inner, said) in enumerate([(KeyboardInterrupt(), []), (OSError("disk"), ["failed"])]):
        trainer = Trainer(tiny_config("train.steps=2", "train.eval_interval=0", run_dir=tmp_path / str(n))).build()
        trainer.close(failed=True, error=CheckpointException("save failed", {0: (inner, None)}))
        assert [e["event"] for e in read_records(tmp_path / str(n), "event") if e["event"] == "failed"] == said
