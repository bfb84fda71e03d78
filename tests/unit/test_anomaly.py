"""Anomaly detection and handling: skip, rollback (= never seeing the bad batch), halt."""

from __future__ import annotations

import json
import time
import math
import re
import warnings

import pytest
import torch

from shardline.cli import main
from shardline.config.resilience import AnomalyConfig
from shardline.data.sampler import batch_index
from shardline.errors import AnomalyHalt
from shardline.resilience.anomaly import AnomalyDetector
from shardline.trainer import Trainer
from tests.conftest import tiny_overrides
from tests.unit.test_trainer import params, read_records, train_losses


def test_robust_zscore_flags_spikes_not_noise():
    det = AnomalyDetector(AnomalyConfig(spike_zscore=8.0, window=20, min_history=5))
    losses = [5.0 - 0.05 * i + 0.02 * math.sin(i) for i in range(20)]
    for value in losses:
        assert det.check(value, 1.0) is None
        det.accept(value)
    assert det.check(losses[-1] + 0.05, 1.0) is None  # ordinary wiggle
    assert det.check(losses[-1] * 3, 1.0)[0] == "loss_spike"
    assert det.check(losses[-1] - 2.0, 1.0) is None  # a drop is not an anomaly
    assert det.check(float("nan"), 1.0)[0] == "nonfinite_loss"
    assert det.check(4.0, float("inf"))[0] == "nonfinite_grad_norm"


def test_batch_index_steps_over_skipped_batches():
    assert [batch_index(s, [2, 4]) for s in range(5)] == [0, 1, 3, 5, 6]


def test_nan_with_skip_drops_that_update_and_finishes(tiny_config, tmp_path):
    trainer = Trainer(tiny_config("faults.nan_step=5", "anomaly.action=skip")).build()
    trainer.train()
    assert trainer.step == 12
    events = [r for r in read_records(tmp_path / "run", "event") if r["event"] == "anomaly"]
    assert [(e["step"], e["anomaly"], e["action"]) for e in events] == [(5, "nonfinite_loss", "skip")]



def test_the_overflow_drill_is_a_non_finite_gradient_norm_outside_fp16(tiny_config, tmp_path):
    """faults.overflow_step puts an inf in a gradient (as an fp16 overflow does, where the loss scaler
    skips it: tests/distributed/test_fp16.py); in fp32 the anomaly check sees its gradient norm."""
    trainer = Trainer(tiny_config("faults.overflow_step=5", "anomaly.action=skip")).build()
    trainer.train()
    events = [r for r in read_records(tmp_path / "run", "event") if r["event"] == "anomaly"]
    assert [(e["step"], e["anomaly"], e["action"]) for e in events] == [(5, "nonfinite_grad_norm", "skip")]
    assert math.isfinite(params(trainer)["tok_embeddings.weight"].sum().item())  # (the update was dropped)


def test_a_skipped_first_update_steps_the_schedule_without_torchs_warning(tiny_config, tmp_path):
    """The schedule is indexed by step, so it steps past a skipped update (torch warns where that is
    the first): filtered once a process, not per step (leaving catch_warnings each step reset
    Python's record of warnings shown, and every once-only warning came back each step)."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        trainer = Trainer(tiny_config("faults.nan_step=1", "anomaly.action=skip", "train.steps=2",
                                      "checkpoint.interval=0", "train.eval_interval=0")).build()
        trainer.train()
    assert not [w for w in seen if "lr_scheduler.step()" in str(w.message)], [str(w.message) for w in seen]
    assert trainer.step == 2


TIERS = {"disk": ["checkpoint.interval=3"], "memory": ["checkpoint.interval=0", "checkpoint.memory_interval=3"]}


@pytest.mark.parametrize("fault,tier", [("faults.nan_step=5", "disk"), ("faults.spike_step=5", "disk"),
                                        ("faults.spike_step=5", "memory")])
def test_rollback_equals_a_run_that_never_saw_the_bad_batch(tiny_config, tmp_path, fault, tier):
    common = [*TIERS[tier], f"checkpoint.memory_dir={tmp_path / 'shm'}", "anomaly.min_history=3",
              "train.eval_interval=0", "checkpoint.keep=1"]
    # A later batch skipped by the config too: the rollback event names the batch it skipped itself.
    rolled = Trainer(tiny_config(*common, fault, "anomaly.action=rollback", "train.skip_batches=[9]",
                                 run_dir=tmp_path / "rolled")).build()
    rolled.train()
    clean = Trainer(tiny_config(*common, "train.skip_batches=[4, 9]", run_dir=tmp_path / "clean")).build()
    clean.train()
    assert rolled.rollbacks == 1 and rolled.skipped_batches == [4, 9]
    assert train_losses(tmp_path / "rolled") == train_losses(tmp_path / "clean")
    for name, value in params(clean).items():
        assert torch.equal(params(rolled)[name], value), name
    event = [r for r in read_records(tmp_path / "rolled", "event") if r["event"] == "anomaly"][0]
    assert event["action"] == "rollback" and event["to_step"] == 3 and event["skipped_batch"] == 4
    assert event["checkpoint"].startswith("memory tier step 3" if tier == "memory" else str(tmp_path))


def halt_saves(trainer, match: str) -> list[int]:
    """The steps `trainer` saved while training to the anomaly halt `match` describes."""
    saves = []
    save = trainer.save_checkpoint
    trainer.save_checkpoint = lambda: saves.append(trainer.step) or save()
    with pytest.raises(AnomalyHalt, match=match):
        trainer.train()
    return saves


def test_a_halt_right_after_an_interval_save_keeps_that_save(tiny_config, tmp_path):
    """Step 6 was just saved and step 7 is bad: the state before it is step 6's checkpoint, not
    saved a second time (on a nearly full disk the copy could fail and the halt say nothing was)."""
    trainer = Trainer(tiny_config("faults.nan_step=7", "anomaly.action=halt", run_dir=tmp_path / "run")).build()
    assert halt_saves(trainer, "at step 7; state before that step saved to .*checkpoints/step-000006;") == [6]


def test_halt_exits_3_with_a_report_and_keeps_the_state(tmp_path, small_prepared, capsys):
    run = tmp_path / "run"
    code = main(["train", *[f"--{o}" for o in tiny_overrides(run, small_prepared, "faults.nan_step=5",
                                                              "anomaly.action=halt")]])
    assert code == 3
    err = capsys.readouterr().err
    assert "halted: nonfinite_loss" in err and "at step 5" in err
    assert (run / "checkpoints" / "step-000004" / "manifest.json").is_file()  # state before the bad step
    progress = json.loads((run / "progress.json").read_text())  # (torchrun exits 1 for any failure: this says 3)
    assert (progress["phase"], progress["exit_code"]) == ("failed", 3)


def test_device_check_gives_the_host_detectors_verdicts():
    from shardline.resilience.device_anomaly import DeviceAnomalyCheck

    cfg = AnomalyConfig(spike_zscore=6.0, window=8, min_history=4)
    host, device = AnomalyDetector(cfg), DeviceAnomalyCheck(cfg, torch.device("cpu"))
    gen = torch.Generator().manual_seed(0)
    losses = (5.0 - 0.01 * torch.arange(40) + 0.05 * torch.randn(40, generator=gen)).tolist()
    losses[12], losses[20], losses[30] = 9.0, float("nan"), 7.5  # two spikes and a NaN
    norms = [1.0] * 40
    norms[25] = float("inf")
    want = []
    for step, (loss, norm) in enumerate(zip(losses, norms), start=1):
        found = host.gate(step, loss, norm)  # one interface: gate, then drain
        if found is not None:
            want.append((step, found[0]))
        device.gate(step, torch.tensor(loss), torch.tensor(norm))
    assert host.drain() == []  # the host check reported each one as it came
    got = [(e["step"], e["anomaly"]) for e in device.drain()]
    assert got == want and len(want) == 4, (got, want)
    assert device.state_dict()["history"] == pytest.approx(list(host.history))


def test_the_device_check_never_reads_a_value_on_the_host():
    """gate() is the per-step path of anomaly.check_on=device: any host read of a device value
    (`.item()`, indexing by a tensor, both `_local_scalar_dense`) would stall a GPU's queue every step."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from shardline.resilience.device_anomaly import DeviceAnomalyCheck

    class HostReads(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            HostReads.count += func is torch.ops.aten._local_scalar_dense.default
            return func(*args, **(kwargs or {}))

    check = DeviceAnomalyCheck(AnomalyConfig(spike_zscore=6.0, window=8, min_history=4), torch.device("cpu"))
    with HostReads():
        for step in range(1, 13):
            check.gate(step, torch.tensor(5.0 - 0.01 * step), torch.tensor(1.0))
    assert HostReads.count == 0
    assert len(check.pending) == 12 and check.drain() == []  # the verdicts are still there to read


@pytest.mark.parametrize("fault", ["faults.nan_step=5", "faults.spike_step=5"])
def test_check_on_device_skips_like_the_host_check(tiny_config, tmp_path, fault):
    common = [fault, "anomaly.action=skip", "anomaly.min_history=3", "optim.implementation=fused",
              "train.eval_interval=0", "checkpoint.interval=0"]
    runs = {}
    for where in ("host", "device"):
        trainer = Trainer(tiny_config(*common, f"anomaly.check_on={where}", run_dir=tmp_path / where)).build()
        trainer.train()
        runs[where] = trainer
    host, device = train_losses(tmp_path / "host"), train_losses(tmp_path / "device")
    # The injected spike is x100 of a Python float on the host, of an fp32 tensor here.
    # (metrics.jsonl holds a NaN as the string "NaN": strict JSON; float() reads it back)
    assert float(device.pop(5)) == pytest.approx(float(host.pop(5)), rel=1e-6, nan_ok=True) and device == host
    for name, value in params(runs["host"]).items():
        assert torch.equal(params(runs["device"])[name], value), name
    events = [r for r in read_records(tmp_path / "device", "event") if r["event"] == "anomaly"]
    assert [(e["step"], e["action"], e["checked_on"]) for e in events] == [(5, "skip", "device")]
    for line in (tmp_path / "host" / "metrics.jsonl").read_text().splitlines():  # strict JSON, NaN loss included
        json.loads(line, parse_constant=lambda token: pytest.fail(f"{token} is not JSON: {line}"))
    end = [r for r in read_records(tmp_path / "device", "event") if r["event"] == "end"][-1]
    assert end["anomalies"] == 1 and end["seconds"]["anomaly_skipped"] > 0


def test_a_resume_runs_the_optimizer_this_run_built_not_the_saved_ones(tiny_config, tmp_path):
    """Loading an optimizer's state brings back the saving run's fused/foreach flags: a foreach
    checkpoint resumed by a fused run with the device check (which only fused takes) failed
    at its first step."""
    common = ["train.eval_interval=0", "checkpoint.interval=3", "anomaly.min_history=2"]
    Trainer(tiny_config(*common, "optim.implementation=foreach", "train.stop_at_step=3")).build().train()
    fused = Trainer(tiny_config(*common, "optim.implementation=fused", "anomaly.check_on=device",
                                "faults.nan_step=5")).build()
    assert fused.step == 3 and all(g["fused"] and not g["foreach"] for g in fused.optimizer.param_groups)
    fused.train()
    events = [r for r in read_records(tmp_path / "run", "event") if r["event"] == "anomaly"]
    assert fused.step == 12 and [(e["step"], e["action"]) for e in events] == [(5, "skip")]


@pytest.mark.parametrize("where", ["host", "device"])
def test_a_skipped_step_leaves_the_expert_bias_as_it_leaves_the_weights(tiny_config, tmp_path, where):
    """Auxiliary-loss-free balancing moves each expert's bias by the step's load: on a step
    the anomaly check skips (a NaN's routing may throw the load anywhere) it must not move."""
    common = ["model.preset=tiny-moe", "moe.bias_update_rate=0.01", "anomaly.action=skip", "train.steps=4",
              "optim.implementation=fused", "train.eval_interval=0", "checkpoint.interval=0",
              f"anomaly.check_on={where}"]

    def biases(*extra: str, name: str) -> list[torch.Tensor]:
        trainer = Trainer(tiny_config(*common, *extra, run_dir=tmp_path / name)).build()
        trainer.train()
        return [layer.router.expert_bias.clone() for layer in trainer.experts.layers]

    before = biases("train.stop_at_step=1", name="one")
    skipped = biases("train.stop_at_step=2", "faults.nan_step=2", name="skipped")
    updated = biases("train.stop_at_step=2", name="updated")
    assert all(torch.equal(a, b) for a, b in zip(skipped, before))
    assert not all(torch.equal(a, b) for a, b in zip(updated, before))  # the step would have moved them


def test_check_on_device_refuses_what_it_cannot_gate(tiny_config):
    from shardline.errors import ConfigError

    with pytest.raises(ConfigError, match="action is not skip.*not fused"):
        Trainer(tiny_config("anomaly.check_on=device", "anomaly.action=rollback",
                            "optim.implementation=foreach")).build()
    # optim.implementation=auto is the fused kernel on the host too: preflight lets the device check be
    with Trainer(tiny_config("anomaly.check_on=device", "anomaly.action=skip")).build() as trainer:
        assert trainer.anomaly.on_device and trainer.optimizer.defaults["fused"]


@pytest.mark.parametrize("where", ["host", "device"])
def test_skipping_halts_when_the_loss_level_moved_for_good(tiny_config, tmp_path, where):
    """Skipped updates keep the weights, so a loss that moved up for good is flagged at every
    later step: after anomaly.max_consecutive in a row the run halts instead of training on
    nothing to its end."""
    trainer = Trainer(tiny_config("anomaly.action=skip", "anomaly.min_history=3", "anomaly.max_consecutive=3",
                                  f"anomaly.check_on={where}", "optim.implementation=fused", "train.eval_interval=0",
                                  "checkpoint.interval=0", "metrics.log_interval=1", run_dir=tmp_path / where)).build()
    corrupt = trainer.guard.faults.corrupt_loss
    trainer.guard.faults.corrupt_loss = lambda step, loss: corrupt(step, loss) * (100.0 if step >= 5 else 1.0)
    with pytest.raises(AnomalyHalt, match=r"\) at step 7; .*3 anomalous steps in a row \(steps 5-7\): skipping "
                                          r"cannot get past a loss level .*; the step's batch: 6 \(as "
                                          r"train.skip_batches counts them\)"):
        trainer.train()
    events = [r for r in read_records(tmp_path / where, "event") if r["event"] == "anomaly"]
    assert [(e["step"], e["action"]) for e in events] == [(5, "skip"), (6, "skip"), (7, "halt")]
    # a spike's measure is its z-score, the loss the log shows beside it (on the host and the device alike)
    train = {r["step"]: r["loss"] for r in read_records(tmp_path / where, "train")}
    assert events[0]["loss"] == pytest.approx(train[5]) and events[0]["zscore"] > 8 and "value" not in events[0]


def test_skipping_non_finite_steps_halts_with_advice_for_a_divergence(tiny_config, tmp_path):
    """No anomaly.spike_zscore makes a NaN healthy: the advice names the lr and clipping instead."""
    trainer = Trainer(tiny_config("anomaly.action=skip", "anomaly.max_consecutive=2", "train.eval_interval=0",
                                  "checkpoint.interval=0")).build()
    trainer.guard.faults.corrupt_loss = lambda step, loss: float("nan") if step >= 3 else loss
    with pytest.raises(AnomalyHalt, match=r"2 anomalous steps in a row \(steps 3-4\), the last non-finite: .*a "
                                          r"lower optim.lr, or train.grad_clip") as halted:
        trainer.train()
    assert "spike_zscore" not in str(halted.value)
    # max_consecutive=1 halts at the first: no streak to speak of ("1 anomalous steps in a row (steps 3-3)")
    trainer = Trainer(tiny_config("anomaly.action=skip", "anomaly.max_consecutive=1", "train.eval_interval=0",
                                  "checkpoint.interval=0", run_dir=tmp_path / "one")).build()
    trainer.guard.faults.corrupt_loss = lambda step, loss: float("nan") if step >= 3 else loss
    with pytest.raises(AnomalyHalt, match=r"anomaly.max_consecutive=1 halts at the first anomalous step \(step 3: "
                                          r"non-finite\); raise it to skip such steps"):
        trainer.train()


def test_the_rollback_budget_and_skip_streak_go_on_across_a_restart(tiny_config, tmp_path):
    """anomaly.max_rollbacks is the run's, not each attempt's: a requeued job that rolled back
    before halts at the next fault instead of rolling back with a fresh budget."""
    common = ["anomaly.action=rollback", "anomaly.max_rollbacks=1", "anomaly.min_history=3", "checkpoint.interval=3",
              "train.eval_interval=0"]
    first = Trainer(tiny_config(*common, "faults.nan_step=5", "train.stop_at_step=6")).build()
    first.train()
    assert first.rollbacks == 1 and first.step == 6
    again = Trainer(tiny_config(*common, "faults.nan_step=8")).build()
    assert again.step == 6 and again.rollbacks == 1
    spent = r"the run has rolled back 1 times \(anomaly.max_rollbacks=1\): the fault keeps coming back"
    with pytest.raises(AnomalyHalt, match=r"at step 8; .*; " + spent):
        again.train()  # (the halt says why a rollback run halted: its budget is spent)
    streak = tmp_path / "streak"  # a skip streak up to a saved step goes on after a restore too
    skipping = Trainer(tiny_config(*common, "anomaly.action=skip", "train.stop_at_step=3", run_dir=streak)).build()
    skipping.guard.faults.corrupt_loss = lambda step, loss: float("nan") if step >= 2 else loss
    skipping.train()
    assert Trainer(tiny_config(*common, run_dir=streak)).build()._anomaly_streak == (3, 2)


def test_a_relaunch_after_a_streak_halt_starts_a_new_streak(tiny_config, tmp_path):
    """The halted step was in the saved streak, the state saved the step before it: redone healthy after
    the relaunch, it ended no streak, and the next single anomaly halted as "3 in a row"."""
    common = ["anomaly.action=skip", "anomaly.max_consecutive=2", "anomaly.min_history=3", "train.eval_interval=0",
              "checkpoint.interval=3"]
    with pytest.raises(AnomalyHalt, match=r"2 anomalous steps in a row \(steps 5-6\)"):
        Trainer(tiny_config(*common, "faults.nan_step=5", "faults.spike_step=6")).build().train()
    again = Trainer(tiny_config(*common, "train.skip_batches=[5]", "faults.spike_step=7")).build()
    assert again.step == 5
    again.train()  # step 6 redone healthy, a lone spike at 7 skipped: no halt
    events = [r for r in read_records(tmp_path / "run", "event") if r["event"] == "anomaly"]
    assert [(e["step"], e["action"]) for e in events][-1] == (7, "skip")


@pytest.mark.parametrize("ram", [False, True])
def test_a_crash_right_after_a_rollback_keeps_the_batch_it_skipped_and_its_budget(tiny_config, tmp_path, ram):
    """The rollback saves the rolled-back step again at once: a crash before the next interval
    resumed the old copy, trained the bad batch again and got a fresh rollback budget. With the
    memory tier too, its snapshot of that step (which a restart prefers on a tie) goes."""
    common = ["anomaly.action=rollback", "anomaly.min_history=3", "checkpoint.interval=3", "train.eval_interval=0"]
    if ram:
        common += ["checkpoint.memory_interval=3", f"checkpoint.memory_dir={tmp_path / 'shm'}"]
    trainer = Trainer(tiny_config(*common, "faults.nan_step=5")).build()
    compute = trainer.compute_gradients

    def crash_after_the_rollback():
        if trainer.rollbacks:
            raise RuntimeError("the node went down")
        return compute()

    trainer.compute_gradients = crash_after_the_rollback
    with pytest.raises(RuntimeError, match="the node went down"):
        trainer.train()
    assert trainer.step == 3
    again = Trainer(tiny_config(*common)).build()
    assert again.step == 3 and again.rollbacks == 1 and again.skipped_batches == [4]


def test_a_rollback_names_the_damaged_checkpoint_it_passes_over(tiny_config, capsys):
    """The drill corrupts step 4's checkpoint (and says so: it fired in silence, as the others do not); the
    NaN at step 5 rolls back to step 2, and the log says why not to step 4, as a resume's does."""
    trainer = Trainer(tiny_config("anomaly.action=rollback", "anomaly.min_history=2", "checkpoint.interval=2",
                                  "train.eval_interval=0", "faults.corrupt_checkpoint_step=4", "faults.nan_step=5",
                                  "train.steps=6")).build()
    trainer.train()
    assert "drill: faults.corrupt_checkpoint_step=4 damaged" in capsys.readouterr().err
    records = read_records(trainer.run_dir, "event")
    (rollback,) = [r for r in records if r["event"] == "anomaly"]
    assert rollback["to_step"] == 2
    assert [r["error"] for r in records if r["event"] == "invalid_checkpoint"][0].startswith(
        f"checkpoint {trainer.run_dir / 'checkpoints' / 'step-000004'}")


def test_a_halt_right_after_a_rollback_saves_the_budget_it_spent(tiny_config, tmp_path):
    """The rollback budget runs out at the step after the checkpoint rolled back to: the state
    before it is on disk already, but without the rollback and the batch it skipped; resumed as
    it was, a restart got both back. The halt saves that step again."""
    common = ["anomaly.action=rollback", "anomaly.max_rollbacks=1", "anomaly.min_history=2", "checkpoint.interval=3",
              "train.eval_interval=0"]
    with pytest.raises(AnomalyHalt, match="at step 4; state before that step saved to .*step-000003"):
        Trainer(tiny_config(*common, "faults.nan_step=4", "faults.spike_step=4")).build().train()
    again = Trainer(tiny_config(*common)).build()
    assert again.step == 3 and again.rollbacks == 1 and again.skipped_batches == [3]
    # A run that rolled back before, restarted: a halt right after a save keeps that save (no second copy).
    halting = Trainer(tiny_config(*common[1:], "anomaly.action=halt", "faults.nan_step=7")).build()
    assert halting.rollbacks == 1
    assert halt_saves(halting, "at step 7; state before that step saved to .*step-000006;") == [6]


def test_a_halt_right_after_a_rollback_to_ram_names_the_batches_to_skip(tiny_config, tmp_path):
    """Without disk saves (checkpoint.interval=0) the snapshot rolled back to stays for a rerun,
    but it lacks the rollback and the batch it skipped (not rewritten in place: a failed write
    would lose it): the halt names what to skip, and a rerun that does resumes past it."""
    common = ["anomaly.action=rollback", "anomaly.max_rollbacks=1", "anomaly.min_history=2", "checkpoint.interval=0",
              "checkpoint.memory_interval=3", f"checkpoint.memory_dir={tmp_path / 'shm'}", "train.eval_interval=0"]
    with pytest.raises(AnomalyHalt, match=r"at step 4; nothing saved to disk .*; the in-memory snapshots stay for a "
                                          r"rerun, but predate the rollback: rerun with train.skip_batches=\[3\] "):
        Trainer(tiny_config(*common, "faults.nan_step=4", "faults.spike_step=4")).build().train()
    again = Trainer(tiny_config(*common, "train.skip_batches=[3]")).build()
    assert again.step == 3 and again.skipped_batches == [3]
    # Rolled back at step 5 (to 3), snapshot 6 held since, the budget spent at step 8: step 6 has it all.
    with pytest.raises(AnomalyHalt, match=r"at step 8; nothing saved .*; the in-memory snapshots stay for a rerun;"):
        Trainer(tiny_config(*common, "faults.nan_step=5", "faults.spike_step=8", run_dir=tmp_path / "later")
                ).build().train()


def test_a_memory_snapshot_holds_the_device_checks_pending_verdicts(tiny_config, tmp_path):
    """Step 5 is skipped on the device and snapshotted before any log reads its verdict: the
    snapshot's skip streak must count it, as a disk save's does (a restart from that snapshot
    would otherwise never report step 5, and the stuck-skipping halt would come late)."""
    trainer = Trainer(tiny_config("faults.spike_step=5", "anomaly.action=skip", "anomaly.min_history=3",
                                  "anomaly.check_on=device", "optim.implementation=fused", "metrics.log_interval=4",
                                  "train.steps=6", "train.eval_interval=0", "checkpoint.interval=0",
                                  "checkpoint.memory_interval=5", f"checkpoint.memory_dir={tmp_path / 'shm'}")).build()
    streaks, snapshot = {}, trainer.tiers.snapshot

    def recorded(step, model, optimizer, state):
        streaks[step] = list(state["anomaly_handling"]["streak"])
        return snapshot(step, model, optimizer, state)

    trainer.tiers.snapshot = recorded
    trainer.train()
    assert streaks == {5: [5, 1]}


@pytest.mark.parametrize("counter", ["TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT"])
def test_fault_drills_fire_on_a_jobs_first_attempt_only(monkeypatch, counter):
    """A requeued Slurm job (torchrun's count back at 0) that resumes before the drill's step
    must get past it, not meet it on every attempt."""
    from shardline.config.resilience import FaultsConfig
    from shardline.resilience.faults import FaultInjector

    assert FaultInjector(FaultsConfig(nan_step=2), rank=0).first_attempt
    monkeypatch.setenv(counter, "1")
    drill = FaultInjector(FaultsConfig(nan_step=2), rank=0)
    assert not drill.first_attempt and drill.corrupt_loss(2, 1.0) == 1.0


@pytest.mark.parametrize("extra, code, line", [
    (["faults.nan_step=3", "anomaly.action=halt"], 3, "shardline: halted: nonfinite_loss"),
    (["data.path=/no/such/corpus"], 2, "shardline: error: data.path='/no/such/corpus' does not exist")])
def test_under_torchrun_a_halt_or_a_refusal_ends_every_rank_with_its_code(tmp_path, small_prepared, extra, code,
                                                                          line):
    """A halt (decided on the global loss) and a refused start (agreed) end every rank alike,
    each with its one line, and the ranks leave the process group together: one that exited
    first could make a peer's gloo teardown abort (SIGABRT, -6, instead of the code; seen in 1
    of 3 and 1 of 4 runs of this test before they did). torchrun ends the workers still running
    once one has exited (SIGTERM, -15): a loaded machine can show that for the second rank."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from tests.ports import free_port

    args = [f"--{o}" for o in tiny_overrides(tmp_path / "run", small_prepared, "parallel.dp_shard=2",
                                             "train.eval_interval=0", *extra)]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--rdzv_backend=c10d",
           f"--rdzv_endpoint=127.0.0.1:{free_port()}", "-m", "shardline", "train", *args]
    done = subprocess.run(cmd, cwd=Path(__file__).parents[2], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"})
    assert done.returncode != 0  # torchrun: a worker's nonzero exit is a failure
    assert line in done.stderr, done.stderr[-3000:]
    codes = re.findall(r"exitcode\s*:\s*(-?\d+)", done.stderr)
    assert str(code) in codes and set(codes) <= {str(code), "-15"}, done.stderr[-3000:]


def test_a_rolled_back_steps_compute_is_anomaly_skipped_time_not_other(tiny_config, tmp_path):
    """The bad step's forward and backward before a rollback were in no category ("other")."""
    trainer = Trainer(tiny_config("faults.nan_step=5", "anomaly.action=rollback", "anomaly.min_history=3",
                                  "checkpoint.interval=3", "train.eval_interval=0", "train.steps=6")).build()
    compute = trainer.compute_gradients

    def slow_bad_step():
        if trainer.step + 1 == 5 and trainer.rollbacks == 0:
            time.sleep(1.5)
        return compute()

    trainer.compute_gradients = slow_bad_step
    trainer.train()
    end = [r for r in read_records(tmp_path / "run", "event") if r["event"] == "end"][-1]
    assert trainer.rollbacks == 1 and end["seconds"]["anomaly_skipped"] >= 1.5, end
    assert end["seconds"]["other"] < 1.0, end
