"""What a dry run judges the device by: --gpu's datasheet when given (fp8 too), else this
machine's card with its own memory (a table entry matched by a part of the name may not be it)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from shardline import dry_run
from shardline.errors import ConfigError


def _card(monkeypatch, name: str, gib: float) -> None:
    """This machine shows one CUDA card of that name and memory (the CPU suite has none)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: name)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda *a: SimpleNamespace(total_memory=gib * 2**30))


def test_a_card_smaller_than_its_table_entry_is_estimated_at_its_own_memory(tiny_config, monkeypatch):
    cfg = tiny_config("run.device=cuda")
    _card(monkeypatch, "NVIDIA A100-SXM4-40GB", 39.4)
    hw = dry_run._device(cfg, None)
    assert hw.mem_gib == pytest.approx(39.4) and hw.name == "NVIDIA A100-SXM4-40GB (39.4 GiB)"
    assert hw.peak_tflops["bf16"] == 312.0  # the A100's speeds still
    _card(monkeypatch, "NVIDIA A100-SXM4-80GB", 79.2)  # the table's own card: its entry as it is
    assert dry_run._device(cfg, None).name == "a100-80gb"
    _card(monkeypatch, "NVIDIA L40S", 44.4)  # not in the table: its memory, an H100's speeds
    assert dry_run._device(cfg, None).mem_gib == pytest.approx(44.4)
    assert "an H100's speeds assumed" in dry_run._device(cfg, None).name
    assert dry_run._device(cfg, "h200").mem_gib == 139.8  # --gpu: the target, not this card


def test_fp8_is_judged_on_the_target_gpu_given(tiny_config, monkeypatch):
    cfg = tiny_config("train.precision=fp8", "run.device=cuda")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (8, 0))  # this machine: an A100
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert "on h100-sxm" in dry_run.dry_run(cfg, 1, "h100-sxm")[0]  # an A100 login node checks an H100 launch
    with pytest.raises(ConfigError, match="--gpu a100-80gb has none"):
        dry_run.dry_run(cfg, 1, "a100-80gb")
    with pytest.raises(ConfigError, match="this GPU is 8.0"):  # without --gpu: this machine's card
        dry_run.dry_run(cfg, 1)


def test_pipeline_keys_without_a_pipeline_are_named_unused(tiny_config):
    report, _ = dry_run.dry_run(tiny_config("run.device=cpu", "parallel.pp_schedule=interleaved_1f1b",
                                            "parallel.pp_virtual_stages=2"), 1)
    assert ("notes     set but unused: parallel.pp_schedule (parallel.pp=1), parallel.pp_virtual_stages "
            "(parallel.pp=1)") in report
    assert "set but unused" not in dry_run.dry_run(tiny_config("run.device=cpu"), 1)[0]
    assert "zero=3 (nothing sharded)" in report  # (the default zero, read by nothing on one process)
    # A balance for a ring that Ulysses alone does not have; the hybrid's ring reads it.
    ulysses = ("run.device=cpu", "parallel.cp=2", "parallel.dp_shard=1", "parallel.cp_balance=none")
    report, _ = dry_run.dry_run(tiny_config(*ulysses, "parallel.cp_mode=ulysses"), 2)
    assert "set but unused: parallel.cp_balance (parallel.cp_mode=ulysses has no ring to balance)" in report
    assert "set but unused" not in dry_run.dry_run(tiny_config(*ulysses, "parallel.cp_mode=ring"), 2)[0]
    # A floor for a schedule that never decays
    floor = ("run.device=cpu", "optim.min_lr_ratio=0.05")
    report, _ = dry_run.dry_run(tiny_config(*floor, "optim.schedule=constant"), 1)
    assert "set but unused: optim.min_lr_ratio (optim.schedule=constant has no floor)" in report
    assert "set but unused" not in dry_run.dry_run(tiny_config(*floor, "optim.schedule=cosine"), 1)[0]
    # Batches past the run's last (a typo's 99999 passed in silence); one the run reaches is read
    # (batches are 0-based, and a skip past the run's own batches moves none of them: 6 steps read 0..5)
    report, _ = dry_run.dry_run(tiny_config("run.device=cpu", "train.steps=6", "train.skip_batches=[6, 99999]"), 1)
    assert "set but unused: train.skip_batches (the run reads batches 0..5: every one named lies past them)" in report
    assert "set but unused" not in dry_run.dry_run(tiny_config("run.device=cpu", "train.steps=6",
                                                               "train.skip_batches=[5, 99999]"), 1)[0]


def test_the_card_estimated_is_the_one_run_device_names(tiny_config, monkeypatch):
    """run.device=cuda:1 on a machine whose first card is another (a small display card)."""
    cards = {0: ("NVIDIA T400", 1.9), 1: ("NVIDIA H100 80GB HBM3", 79.6)}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: cards[i][0])
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda i=0: SimpleNamespace(total_memory=cards[i][1] * 2**30))
    assert dry_run._device(tiny_config("run.device=cuda:1"), None).name == "h100-sxm"
    assert "T400" in dry_run._device(tiny_config("run.device=cuda"), None).name


def test_a_card_past_the_machines_is_one_line(tiny_config, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(ConfigError, match=r"run.device='cuda:5' but this machine has 2 CUDA device\(s\)"):
        dry_run._device(tiny_config("run.device=cuda:5"), None)
    # several ranks each take their local rank's card, whatever cuda:N says: the first is priced, none refused
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i=0: SimpleNamespace(total_memory=79.6 * 2**30))
    assert dry_run._device(tiny_config("run.device=cuda:5"), None, ranks=8).name == "h100-sxm"


def test_the_dry_run_says_the_lr_curve_and_the_seeds(tiny_config):
    """What an ablation varies, said before it runs: a warm-up as long as the run is named, as the
    launch's warmup_cut note names it."""
    report, _ = dry_run.dry_run(tiny_config("run.device=cpu", "optim.warmup_steps=12", "train.data_seed=3"), 1)
    line = next(x for x in report.splitlines() if x.startswith("optim"))
    assert "12 warm-up step(s) (as long as the run: the lr peaks at its last step" in line and "cosine" not in line
    assert line.endswith("seed 1234, data order 3"), line
    report, _ = dry_run.dry_run(tiny_config("run.device=cpu", "optim.schedule=constant", "optim.warmup_steps=2"), 1)
    assert "2 warm-up step(s), then constant; weight decay 0.1, grad clip 1; seed 1234 (weights and data order)" \
        in report
    report, _ = dry_run.dry_run(tiny_config("run.device=cpu", "optim.weight_decay=0", "train.grad_clip=0"), 1)
    assert "; weight decay 0, no grad clip; seed" in report  # (the two other settings an ablation varies)
    # A WSD decay the warm-up shortens (5 of 10 steps asked, 8 warming up), as the wsd_decay_cut note says it
    report, _ = dry_run.dry_run(tiny_config("run.device=cpu", "train.steps=10", "optim.schedule=wsd",
                                            "optim.warmup_steps=8", "optim.decay_fraction=0.5"), 1)
    assert "then wsd down to 0.1 x lr over the last 2 step(s) (5 asked: the decay starts after the warm-up)" in report
    # rsqrt's min_lr_ratio is a floor it reaches (1 / 0.1**2 = 100 of 200 steps) or not, not where it ends
    report, _ = dry_run.dry_run(tiny_config("run.device=cpu", "train.steps=200", "optim.schedule=rsqrt",
                                            "optim.warmup_steps=1"), 1)
    assert "1 warm-up step(s), then rsqrt (lr x sqrt(1 / step)) to 0.1 x lr at the last step, floor 0.1 x lr from " \
           "step 100; weight decay 0.1, grad clip 1; seed" in report
    report, _ = dry_run.dry_run(tiny_config("run.device=cpu", "train.steps=200", "optim.schedule=rsqrt",
                                            "optim.warmup_steps=20"), 1)
    assert "then rsqrt (lr x sqrt(20 / step)) to 0.316 x lr at the last step, floor 0.1 x lr not reached by step " \
           "200" in report and "set but unused" not in report
    # 98 / 0.7**2 is 200.00000000000003 in floats: the floor is reached at update 200, as the curve has it
    report, _ = dry_run.dry_run(tiny_config("run.device=cpu", "train.steps=200", "optim.schedule=rsqrt",
                                            "optim.warmup_steps=98", "optim.min_lr_ratio=0.7"), 1)
    assert "floor 0.7 x lr from step 200;" in report
    report, _ = dry_run.dry_run(tiny_config("run.device=cpu", "train.steps=200", "optim.schedule=rsqrt",
                                            "optim.warmup_steps=10", "optim.min_lr_ratio=1"), 1)
    assert "floor 1 x lr from step 10;" in report  # (the warm-up's last step: not one before it)


def test_precision_auto_is_bf16_on_a_gpu_and_fp32_on_a_cpu(tiny_config, capsys):
    """train.precision's default: a GPU launch from a config that never named it trained in fp32, ~15x
    under the bf16 peak, and the dry run said so only inside its MFU line."""
    cfg = tiny_config()
    assert cfg.train.precision == "auto"
    report, _ = dry_run.dry_run(cfg, 1, "h100-sxm")
    assert cfg.train.precision == "bf16" and "/ the bf16 dense peak" in report
    assert "precision bf16 (train.precision=auto: bf16 on a GPU with it, else fp32)" in report
    report, _ = dry_run.dry_run(tiny_config("run.device=cpu"), 1)
    assert "precision fp32 (train.precision=auto" in report and "/ the fp32 dense peak" in report
    report, _ = dry_run.dry_run(tiny_config("train.precision=fp32"), 1, "h100-sxm")  # asked for: said
    assert "precision fp32 (train.precision=fp32 on a GPU: its matmuls run at the fp32 peak" in report
    report, _ = dry_run.dry_run(tiny_config("train.precision=fp16"), 1, "h100-sxm")
    assert "\nprecision fp16 (dynamic loss scaling from 2**16, a resume from its saved scale: an overflowing step is " \
           "skipped, the scale halved; doubled after 2000 steps without one)\n" in report
    # (what comes with it: its loss scaling, fp8's recipe and emulation, a chunked loss)
    report, _ = dry_run.dry_run(tiny_config("train.precision=fp8", "train.loss_chunk_tokens=64", "run.device=cpu"), 1)
    assert "\nprecision fp8 (torchao float8, fp8.recipe=tensorwise; the output layer and the router in bf16; " \
           "emulated on a CPU: for testing only); the loss 64 tokens at a time (train.loss_chunk_tokens" in report
    from shardline.cli import main  # estimate prices the GPU it is given in bf16 too

    assert main(["estimate", "--config", "configs/tiny.toml", "--gpu", "h100-sxm"]) == 0  # (the file: auto too)
    assert "(4,096 tokens), bf16, document mask" in capsys.readouterr().out


def test_an_older_card_is_not_advised_bf16_and_its_own_card_is_asked(tiny_config, monkeypatch):
    """A V100 (compute capability 7.0) emulates bf16, slower than fp32: a dry run there with fp32 asked for
    gave the launch note's advice to use bf16 all the same. And run.device=cuda:1's card is the one asked,
    not card 0."""
    _card(monkeypatch, "Tesla V100-SXM2-32GB", 31.7)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    asked = []
    cards = {0: (9, 0), 1: (7, 0)}  # card 0 an H100, card 1 a V100
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: asked.append(d) or cards[d or 0])
    report, _ = dry_run.dry_run(tiny_config("train.precision=fp32", "run.device=cuda:1"), 1)
    assert "\nprecision fp32\n" in report and asked == [1]
    report, _ = dry_run.dry_run(tiny_config("run.device=cuda:1"), 1)
    assert "precision fp32 (train.precision=auto" in report  # auto there: fp32 too
    report, _ = dry_run.dry_run(tiny_config("train.precision=fp32", "run.device=cuda:0"), 1)
    assert "precision fp32 (train.precision=fp32 on a GPU: its matmuls run at the fp32 peak" in report
    asked.clear()  # two ranks: each takes its local rank's card, whatever cuda:N says; card 0 is priced
    report, _ = dry_run.dry_run(tiny_config("run.device=cuda:1"), 2)
    assert asked[0] == 0 and "precision bf16 (train.precision=auto" in report
