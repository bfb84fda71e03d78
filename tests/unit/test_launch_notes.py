"""What a launch tells its user as it starts (preflight.launch_notes): events, nothing refused."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from shardline.config import load_config
from shardline.devices import CPU_PEAK_ASSUMED
from shardline.launch_notes import launch_notes
from shardline.trainer import Trainer

FINETUNE = Path(__file__).parents[2] / "configs" / "finetune.toml"


@pytest.fixture(autouse=True)
def idle_host(monkeypatch):
    """The notes as an idle host gives them (this machine's load would add cpu_busy to some)."""
    monkeypatch.setattr("shardline.launch_notes.cpu_load", lambda: 0.0)


def test_a_busy_host_is_named_beside_its_mfu(monkeypatch):
    """Two threads on two shared cores moved a step's time 17x: the log's tokens/s and mfu said nothing of it."""
    import os

    monkeypatch.setattr("shardline.launch_notes.cpu_load", lambda: os.cpu_count() + 1.5)
    note = dict(launch_notes(load_config(None, []), "cpu", 0.1, 1))["cpu_busy"]
    assert note["load"] == os.cpu_count() + 1.5 and "tokens/s and mfu move with it" in note["why"]
    monkeypatch.setattr("shardline.launch_notes.cpu_load", lambda: os.cpu_count() + 0.5)  # (its own rank's load)
    assert "cpu_busy" not in dict(launch_notes(load_config(None, []), "cpu", 0.1, 1))
    assert "cpu_busy" not in dict(launch_notes(load_config(None, ["train.precision=bf16"]), "cuda", 989.0, 1))


def test_a_batch_scripts_own_shell_holding_several_tasks_is_named(monkeypatch):
    """`python -m shardline train` in an sbatch script of --ntasks=8 (srun forgotten): one process
    trained, the job's other GPUs idle, and nothing said."""
    for key in ("SLURM_STEP_NUM_TASKS", "TORCHELASTIC_RUN_ID", "WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("SLURM_NTASKS", "8")
    cfg = load_config(None, ["metrics.peak_tflops=0.5"])
    notes = dict(launch_notes(cfg, "cpu", 0.5, 1))
    assert notes["slurm_tasks_unused"]["tasks"] == 8 and "srun python -m shardline train" in notes[
        "slurm_tasks_unused"]["fix"]
    monkeypatch.setenv("SLURM_STEP_NUM_TASKS", "1")  # srun's one task, on purpose
    assert launch_notes(cfg, "cpu", 0.5, 1) == []
    monkeypatch.setenv("SLURM_NTASKS", "1")
    monkeypatch.delenv("SLURM_STEP_NUM_TASKS")
    assert launch_notes(cfg, "cpu", 0.5, 1) == []


def test_an_unknown_gpu_and_idle_gpus_are_named_with_their_fix():
    plain = load_config(None, [])
    assert launch_notes(plain, "cpu", 0.1, 1) == [("mfu_peak_assumed", {"peak_tflops": 0.1, "why": CPU_PEAK_ASSUMED})]
    assert launch_notes(load_config(None, ["metrics.peak_tflops=0.5"]), "cpu", 0.5, 1) == []  # the machine's own
    # several ranks on a CPU: each one's peak (its threads' share), and the job's that the log's mfu divides by
    assert dict(launch_notes(plain, "cpu", 0.1, 4))["mfu_peak_assumed"] == {
        "peak_tflops": 0.1, "ranks": 4, "job_peak_tflops": 0.4, "why": CPU_PEAK_ASSUMED}
    plain.train.settle_precision(on_gpu=True)  # (as a launch on a GPU settles auto before its notes)
    notes = dict(launch_notes(plain, "cuda", None, 1, "NVIDIA L40S", 4))
    assert notes.keys() == {"mfu_unknown", "one_gpu_of_several"}
    assert notes["mfu_unknown"]["device"] == "NVIDIA L40S" and "metrics.peak_tflops" in notes["mfu_unknown"]["fix"]
    assert "torchrun --nproc_per_node=4" in notes["one_gpu_of_several"]["fix"]
    assert launch_notes(plain, "cuda", 989.0, 4, "NVIDIA H100 80GB HBM3", 4) == []  # torchrun, a known peak
    assert launch_notes(plain, "cuda", 989.0, 1, "NVIDIA H100 80GB HBM3", 1) == []


def test_a_pretraining_learning_rate_on_trained_weights_is_named():
    """The default optim.lr (3e-3, for the tiny preset from scratch) on an HF model or a
    checkpoint; the shipped fine-tune config's lr is not."""
    for start in ("model.hf_path=some/hf-folder", "model.init_from=some/checkpoint"):
        notes = dict(launch_notes(load_config(None, [start]), "cpu", 0.1, 1))
        assert notes["lr_high_for_trained_weights"]["lr"] == 3e-3, start
        assert notes["lr_high_for_trained_weights"]["fix"] == "fine-tunes commonly take optim.lr 1e-5 to 1e-4"
    assert launch_notes(load_config(FINETUNE, ["model.hf_path=some/hf-folder"]), "cuda", 989.0, 8, "H100", 8) == []


def test_a_shape_no_hf_family_has_is_named_at_the_start_not_at_the_export(tiny_config):
    """Qwen2's q/k/v biases with Qwen3's per-head q/k norms (or with experts) train, but the
    export refuses them: the run says so as it starts, through the trainer."""
    import json

    from shardline.models import get_preset

    tiny = get_preset("tiny")
    assert launch_notes(load_config(None, []), "cuda", 989.0, 1, model=replace(tiny, qkv_bias=True)) == []
    notes = dict(launch_notes(load_config(None, []), "cpu", 0.1, 1, model=replace(tiny, qkv_bias=True, qk_norm=True)))
    assert "a norm on each query and key head" in notes["not_exportable_to_hf"]["reason"]
    moe = get_preset("tiny-moe")
    notes = dict(launch_notes(load_config(None, []), "cpu", 0.1, 1, model=replace(moe, qkv_bias=True)))
    assert "routed experts" in notes["not_exportable_to_hf"]["reason"]
    # what the export refuses, the same words (one rule: interop.hf_config.hf_export_problem)
    notes = dict(launch_notes(load_config(None, []), "cpu", 0.1, 1, model=moe))  # shared experts
    assert "shared_experts=1 has no Hugging Face" in notes["not_exportable_to_hf"]["reason"]
    mixtral = get_preset("mixtral-8x7b")
    assert launch_notes(load_config(None, []), "cuda", 989.0, 1, model=mixtral) == []

    cfg = tiny_config("train.steps=1", "model.qkv_bias=1", "model.qk_norm=1", "train.eval_interval=0")
    Trainer(cfg).build().train()
    events = [json.loads(line) for line in (Path(cfg.run.dir) / "metrics.jsonl").read_text().splitlines()]
    assert [e for e in events if e.get("event") == "not_exportable_to_hf"]


def test_half_precision_on_a_cpu_is_named_as_likely_slower(monkeypatch):
    """Allowed (it runs the GPU's path), but a user saw bf16 at 2.2x fp32's step time with no word.
    Not said where the CPU has AMX tiles for the dtype, where bf16 ran 1.4-1.5x as fast as fp32."""
    from shardline import devices

    monkeypatch.setattr(devices, "_cpu_flags", lambda: {"avx2", "avx512f", "avx512_bf16", "amx_bf16"})
    assert "half_precision_on_cpu" not in dict(launch_notes(load_config(None, ["train.precision=bf16"]), "cpu",
                                                            0.1, 1))
    assert "half_precision_on_cpu" in dict(launch_notes(load_config(None, ["train.precision=fp16"]), "cpu", 0.1, 1))
    monkeypatch.setattr(devices, "_cpu_flags", lambda: {"avx2", "avx512f", "avx512_bf16"})
    notes = dict(launch_notes(load_config(None, ["train.precision=bf16"]), "cpu", 0.1, 1))
    assert notes["half_precision_on_cpu"]["precision"] == "bf16" and "fp32" in notes["half_precision_on_cpu"]["why"]
    assert "half_precision_on_cpu" not in dict(launch_notes(load_config(None, ["train.precision=bf16"]), "cuda",
                                                            989.0, 1))
    assert "half_precision_on_cpu" not in dict(launch_notes(load_config(None, ["train.precision=fp32"]), "cpu",
                                                            0.1, 1))


def test_fp32_on_a_gpu_is_named_with_its_cost():
    """Allowed (a numerics check), but a run at ~1/15 of the bf16 peak is worth a word; auto gives bf16 there."""
    notes = dict(launch_notes(load_config(None, ["train.precision=fp32"]), "cuda", 67.0, 1, gpu_bf16=True))
    assert "~15x under the bf16 one" in notes["fp32_on_gpu"]["why"]
    assert "fp32_on_gpu" not in dict(launch_notes(load_config(None, ["train.precision=bf16"]), "cuda", 989.0, 1))
    assert "fp32_on_gpu" not in dict(launch_notes(load_config(None, ["train.precision=fp32"]), "cpu", 0.1, 1))
    # A card with no bf16 of its own (a V100, where auto settles fp32) is not told to use bf16; an L40S,
    # which the table lacks, is
    assert "fp32_on_gpu" not in dict(launch_notes(load_config(None, ["train.precision=fp32"]), "cuda", 125.0, 1,
                                                  "Tesla V100-SXM2-32GB", 1, gpu_bf16=False))
    assert "fp32_on_gpu" in dict(launch_notes(load_config(None, ["train.precision=fp32"]), "cuda", None, 1,
                                              "NVIDIA L40S", 1, gpu_bf16=True))


def test_chat_data_without_a_template_is_named_as_chatml(tmp_path):
    """A user's chat run silently rendered ChatML, its markers split into byte pieces, and its
    export had no chat template for transformers."""
    import json

    from tokenizers import Tokenizer, models

    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    notes = dict(launch_notes(load_config(None, ["data.format=chat"]), "cuda", 989.0, 1, tokenizer=tok))
    assert "<|im_start|> and <|im_end|> are no tokens" in notes["chat_as_chatml"]["markers"]
    assert "convert to-hf writes the ChatML template" in notes["chat_as_chatml"]["export"]
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ messages }}"}))
    with_template = load_config(None, ["data.format=chat", f"data.tokenizer={tmp_path / 'tokenizer.json'}"])
    assert "chat_as_chatml" not in dict(launch_notes(with_template, "cuda", 989.0, 1, tokenizer=tok))
    assert "chat_as_chatml" not in dict(launch_notes(load_config(None, []), "cuda", 989.0, 1, tokenizer=tok))


def test_a_run_that_saves_nothing_to_disk_says_so():
    """checkpoint.interval=0 ran to its end and left no weights (the memory tier's snapshots went
    with it), in silence."""
    ram = dict(launch_notes(load_config(None, ["checkpoint.interval=0", "checkpoint.memory_interval=10",
                                                "metrics.peak_tflops=1"]), "cpu", 1.0, 1))
    assert "in-memory snapshots go when it finishes" in ram["no_disk_checkpoints"]["reason"]
    none = dict(launch_notes(load_config(None, ["checkpoint.interval=0", "metrics.peak_tflops=1"]), "cpu", 1.0, 1))
    assert "no state is saved at all" in none["no_disk_checkpoints"]["reason"]
    assert launch_notes(load_config(None, ["metrics.peak_tflops=1"]), "cpu", 1.0, 1) == []


def test_a_run_that_saved_nothing_says_so_as_it_ends(tiny_config, capsys):
    """The start's event scrolls away (a fine-tune read interval=0 as "at the end only" and found no
    weights): the end says it again, last."""
    trainer = Trainer(tiny_config("train.steps=2", "checkpoint.interval=0", "train.eval_interval=0")).build()
    trainer.train()
    trainer.close()
    assert "checkpoint.interval=0: the weights trained to step 2 were not saved" in capsys.readouterr().err


def test_in_memory_snapshots_on_one_process_say_they_have_no_replica():
    """memory_snapshot_held said redundancy=replica with 0 MiB of it: read as a guard it was not."""
    cfg = load_config(None, ["checkpoint.memory_interval=10", "metrics.peak_tflops=1"])
    alone = dict(launch_notes(cfg, "cpu", 1.0, 1))
    assert alone["memory_snapshots_unguarded"]["memory_redundancy"] == "replica"
    assert "no peer to hold a replica or parity" in alone["memory_snapshots_unguarded"]["why"]
    assert "memory_snapshots_unguarded" not in dict(launch_notes(cfg, "cpu", 1.0, 2))


def test_a_tokenizer_without_an_end_of_document_token_is_named(tmp_path):
    """Its documents were packed with nothing between them and generate never stopped, in silence."""
    from tokenizers import Tokenizer, models

    odd = tmp_path / "tok.json"
    Tokenizer(models.WordLevel({"[UNK]": 0, "[EOT]": 1, "a": 2}, unk_token="[UNK]")).save(str(odd))
    cfg = load_config(None, [f"data.tokenizer={odd}", "metrics.peak_tflops=1"])
    notes = dict(launch_notes(cfg, "cpu", 1.0, 1, tokenizer=Tokenizer.from_file(str(odd))))
    assert "documents are packed with nothing between them" in notes["no_end_of_document_token"]["why"]
    for eos in ("</s>", "<\uff5cend\u2581of\u2581sentence\uff5c>"):  # Llama 2's, DeepSeek's
        known = Tokenizer(models.WordLevel({"[UNK]": 0, eos: 1}, unk_token="[UNK]"))
        assert "no_end_of_document_token" not in dict(launch_notes(cfg, "cpu", 1.0, 1, tokenizer=known))


def test_a_hand_relaunch_with_drills_says_they_fire_again(monkeypatch):
    """The same command run again (resumed, not a torchrun restart) fired its kill drill again, and
    again: said as the run starts. A first launch, or a restart (which skips them), says nothing."""
    for key in ("TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT"):
        monkeypatch.delenv(key, raising=False)
    cfg = load_config(None, ["faults.kill_rank=2", "faults.kill_step=85", "metrics.peak_tflops=1"])
    note = dict(launch_notes(cfg, "cpu", 1.0, 8, resumed=True))["drills_armed_on_resume"]
    assert note["faults"] == "faults.kill_rank" and "fire again" in note["why"]
    unarmed = load_config(None, ["faults.slow_in=data", "faults.kill_wipes_memory=true", "metrics.peak_tflops=1"])
    assert "drills_armed_on_resume" not in dict(launch_notes(unarmed, "cpu", 1.0, 8, resumed=True))  # nothing fires
    assert "drills_armed_on_resume" not in dict(launch_notes(cfg, "cpu", 1.0, 8))
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert "drills_armed_on_resume" not in dict(launch_notes(cfg, "cpu", 1.0, 8, resumed=True))


def test_settings_a_config_never_reads_and_a_fine_tunes_lr_on_new_weights_are_named(small_prepared):
    """fp8.recipe with fp32, memory.ac_every without selective checkpointing passed in silence, and
    configs/finetune.toml without model.hf_path trained a random model at lr 2e-5."""
    cfg = load_config(None, ["fp8.recipe=rowwise", "memory.ac_every=3", "parallel.cp_mode=ulysses",
                             "checkpoint.interval=0", "checkpoint.keep=5", "optim.lr=2e-5", "metrics.peak_tflops=1"])
    notes = dict(launch_notes(cfg, "cpu", 1.0, 1))
    assert notes["settings_unused"] == {"fp8.recipe": "train.precision is not fp8",
                                        "memory.ac_every": "memory.activation_checkpoint is not selective",
                                        "parallel.cp_mode": "parallel.cp=1", "checkpoint.keep": "checkpoint.interval=0"}
    assert notes["lr_low_for_new_weights"]["lr"] == 2e-5
    assert "lr_low_for_new_weights" not in dict(launch_notes(cfg, "cpu", 1.0, 1, resumed=True))  # a lowered lr
    used = load_config(None, ["train.precision=fp8", "fp8.recipe=rowwise", "memory.activation_checkpoint=selective",
                              "memory.ac_every=3", "metrics.peak_tflops=1"])
    assert "settings_unused" not in dict(launch_notes(used, "cpu", 1.0, 1))
    chat = load_config(None, ["data.format=chat", "data.text_field=conversations", "metrics.peak_tflops=1"])
    assert dict(launch_notes(chat, "cpu", 1.0, 1))["settings_unused"] == {
        "data.text_field": "chat data reads each record's 'messages'"}
    own = load_config(None, ["data.format=chat", "metrics.peak_tflops=1", f'data.mix=[{{path = "{small_prepared}", '
                             'format = "text"}]'])  # (notes read no data: the folder is only named)
    assert dict(launch_notes(own, "cpu", 1.0, 1))["settings_unused"]["data.format"] == (
        "every data.mix source sets its own format")
    # a preset beside starting weights: their shape is the model's (a tiny-moe preset was read as the dense one's)
    started = load_config(None, ["model.init_from=runs/x/checkpoints/step-000010", "model.preset=tiny-moe",
                                 "metrics.peak_tflops=1"])  # (notes read no weights: the folder is only named)
    assert "model.preset" in dict(launch_notes(started, "cpu", 1.0, 1))["settings_unused"]
    # A prepared folder's held-out split was fixed by prepare.
    prepared = load_config(None, [f"data.path={small_prepared}", "data.val_fraction=0.1", "metrics.peak_tflops=1"])
    assert dict(launch_notes(prepared, "cpu", 1.0, 1))["settings_unused"] == {
        "data.val_fraction": "the data is prepared: `shardline prepare --val-fraction` fixed its held-out split"}
    from shardline import layout as layouts

    ddp = load_config(None, ["parallel.dp_replicate=2", "parallel.dp_shard=1", "parallel.zero=1",
                             "metrics.peak_tflops=1"])
    notes = dict(launch_notes(ddp, "cpu", 1.0, 2, layout=layouts.resolve(ddp, 2)))
    assert notes["settings_unused"] == {"parallel.zero": "nothing is sharded: dp_shard x cp = 1, so DDP or one rank"}
    ssd = load_config(None, ["parallel.dp_replicate=2", "parallel.dp_shard=1", "parallel.zero=1",
                             "memory.ssd_offload_dir=/tmp/x", "metrics.peak_tflops=1"])
    assert "settings_unused" not in dict(launch_notes(ssd, "cpu", 1.0, 2, layout=layouts.resolve(ssd, 2)))  # read there


def test_fp8_on_a_cpu_is_said_once_as_a_note_not_by_every_rank_on_stderr():
    notes = dict(launch_notes(load_config(None, ["train.precision=fp8"]), "cpu", 0.1, 2))
    assert notes["fp8_emulated"]["why"].startswith("float8 matmuls are emulated on a CPU")
    assert "fp8_emulated" not in dict(launch_notes(load_config(None, ["train.precision=bf16"]), "cpu", 0.1, 2))


def test_a_cpu_run_whose_model_states_pass_the_hosts_memory_is_refused_before_the_model_is_built(
        tiny_config, tmp_path, monkeypatch):
    """llama3-8b on a 23 GiB host was killed by the kernel after a minute, without a line (exit 137):
    its weights, gradients and AdamW states alone (16 bytes a parameter) pass the host's memory."""
    from shardline.devices import host_memory_problem
    from shardline.errors import ConfigError
    from shardline.trainer import Trainer

    gib = 2**30
    pages = {"SC_PAGE_SIZE": 4096, "SC_PHYS_PAGES": 8 * gib // 4096}  # an 8 GiB host
    monkeypatch.setattr("shardline.devices.os.sysconf", lambda name: pages[name])
    said = host_memory_problem(8 * 10**9, 2, 8)  # a quarter of 128 GB on this host of 8 GiB
    assert said.startswith("the model's weights, gradients and AdamW states alone take 29.8 GiB on this host (16 "
                           "bytes a parameter of 8.00 B; 2 of its 8 ranks here), past its 8.0 GiB of memory")
    assert host_memory_problem(10**8, 1, 1) is None  # 1.5 GiB of states: may fit (the dry run says more)
    pages["SC_PHYS_PAGES"] = 2**20 // 4096  # a 1 MiB host: the test model's few MiB of states do not fit
    with pytest.raises(ConfigError, match=r"the model's weights, gradients and AdamW states alone take .* past its "
                                          r"0.0 GiB of memory"):
        Trainer(tiny_config(run_dir=tmp_path / "run")).build()
    assert not (tmp_path / "run").exists()  # (refused before the lock: nothing written)


def test_a_vocabulary_size_the_tokenizer_overrides_is_said_unused(tmp_path):
    """data.vocab_size=8000 beside a tokenizer of 3,000 tokens: the run took 3,000, without a word."""
    from shardline.launch_notes import unused_settings

    given = load_config(None, [f"data.tokenizer={tmp_path / 'tok.json'}", "data.vocab_size=8000"])
    assert "data.tokenizer" in unused_settings(given)["data.vocab_size"]
    assert "data.vocab_size" not in unused_settings(load_config(None, ["data.vocab_size=8000"]))  # (a BPE's size)
