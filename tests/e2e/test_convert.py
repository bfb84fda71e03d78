"""`shardline convert` both ways, and runs that start from converted weights."""

from __future__ import annotations

import json

import pytest
import torch

from shardline.cli import main
from shardline.models.factory import args_from_json
from shardline.resilience.checkpoint import read_meta
from shardline.trainer import Trainer

transformers = pytest.importorskip("transformers")


def test_checkpoint_to_hf_and_back(tiny_config, tmp_path):
    trainer = Trainer(tiny_config("train.steps=6", "train.eval_interval=0")).build()
    trainer.train()
    hf_dir, back = tmp_path / "hf", tmp_path / "back"
    assert main(["convert", "to-hf", str(tmp_path / "run"), str(hf_dir)]) == 0
    assert (hf_dir / "tokenizer.json").is_file()
    hf = transformers.LlamaForCausalLM.from_pretrained(hf_dir).eval()
    ids = torch.randint(0, trainer.data.vocab_size, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, trainer.model.eval()(ids), rtol=1e-4, atol=1e-4)

    assert main(["convert", "from-hf", str(hf_dir), str(back)]) == 0
    assert read_meta(back)["model_args"] == json.loads(json.dumps(read_meta(
        tmp_path / "run" / "checkpoints" / "step-000006")["model_args"]))
    assert args_from_json(read_meta(back)["model_args"]) == trainer.model_args

    # A new run starts from the converted weights: its first loss equals the trained
    # model's loss on that batch, far below the loss of a fresh init.
    fresh = Trainer(tiny_config("train.steps=1", run_dir=tmp_path / "fresh")).build()
    tuned = Trainer(tiny_config("train.steps=1", f"model.init_from={back}", run_dir=tmp_path / "tuned")).build()
    batch = tuned.data.train.batch([0, 1])
    for name, p in tuned.model.state_dict().items():
        torch.testing.assert_close(p, trainer.model.state_dict()[name])
    assert tuned.steps.loss_sum(batch) < fresh.steps.loss_sum(batch)


def test_train_from_hf_folder(tiny_config, tmp_path):
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=600)
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path / "hf")
    trainer = Trainer(tiny_config("train.steps=2", f"model.hf_path={tmp_path / 'hf'}")).build()
    assert trainer.model_args.vocab_size == 600
    trainer.train()


def test_convert_errors_exit_2(tmp_path, capsys):
    assert main(["convert", "to-hf", str(tmp_path / "nothing"), str(tmp_path / "out")]) == 2
    assert "neither a checkpoint folder nor a run dir" in capsys.readouterr().err
    assert main(["convert", "from-hf", str(tmp_path / "nothing"), str(tmp_path / "out")]) == 2
