"""A run that starts from an HF Qwen3-MoE folder (model.hf_path), and `shardline convert to-hf` of it."""

from __future__ import annotations

import pytest
import torch

from shardline.cli import main
from shardline.trainer import Trainer

transformers = pytest.importorskip("transformers")


def test_train_from_hf_moe_folder_and_convert_back(tiny_config, small_prepared, tmp_path):
    # The shape of tiny_config's [model] overrides (dim 64, 2 layers, ffn 128), with a dense
    # first layer and 4 experts of 32 in the second.
    cfg = transformers.Qwen3MoeConfig(hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      head_dim=16, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True,
                                      mlp_only_layers=[0], vocab_size=600)
    torch.manual_seed(0)  # transformers draws the initial weights from the global generator
    hf = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    hf.save_pretrained(tmp_path / "hf")
    trainer = Trainer(tiny_config("train.steps=2", "checkpoint.interval=2", "train.eval_interval=0",
                                  f"model.hf_path={tmp_path / 'hf'}",  # random weights: no tokenizer of their own
                                  f"data.tokenizer={small_prepared / 'tokenizer.json'}")).build()
    args = trainer.model_args
    assert (args.vocab_size, args.qk_norm, args.moe.n_experts, args.moe.first_dense_layers) == (600, True, 4, 1)
    ids = torch.randint(0, 600, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():  # the run starts from the HF weights
        torch.testing.assert_close(trainer.model.eval()(ids), hf(ids).logits, rtol=0, atol=1e-4)
    trainer.model.train()
    trainer.train()

    out = tmp_path / "back"
    assert main(["convert", "to-hf", str(tmp_path / "run"), str(out)]) == 0
    tuned = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert tuned.config.router_aux_loss_coef == cfg.router_aux_loss_coef == 0.001  # the folder's, not 0
    assert type(tuned).__name__ == "Qwen3MoeForCausalLM"
    with torch.no_grad():
        mine = trainer.model.eval()(ids)
        torch.testing.assert_close(tuned(ids).logits, mine, rtol=0, atol=1e-4)
        assert (mine - hf(ids).logits).abs().max() > 1e-3  # training moved the weights


def test_an_export_whose_routers_learned_a_balancing_bias_is_refused_with_how_many_tokens_it_reroutes(
        tiny_config, small_prepared, tmp_path, capsys):
    """HF's MoE models have no routing bias: the export chose other experts than the run, and only
    a warning said so. Refused now, measured on a sample; --drop-router-bias exports it so."""
    import re

    cfg = transformers.MixtralConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                     num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                                     vocab_size=600)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path / "hf")
    Trainer(tiny_config("train.steps=5", "checkpoint.interval=5", "train.eval_interval=0", "moe.bias_update_rate=0.05",
                        f"model.hf_path={tmp_path / 'hf'}", f"data.tokenizer={small_prepared / 'tokenizer.json'}")
            ).build().train()  # (5 sign steps of +-0.05: an odd count, so no bias is back at 0)
    assert main(["convert", "to-hf", str(tmp_path / "run"), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    said = re.search(r"learned a balancing bias \(moe.bias_update_rate\), which HF's MoE models have no place for: "
                     r"without it, (\d+\.\d)% of 256 tokens of the shipped corpus choose other experts in layer "
                     r"\d \((\d+\.\d)% over all 2 MoE layers\); give --drop-router-bias", err)
    assert said and float(said[1]) > 0, err
    assert not (tmp_path / "out").exists()
    assert main(["convert", "to-hf", str(tmp_path / "run"), str(tmp_path / "out"), "--drop-router-bias"]) == 0
    assert "warning: the routers' balancing bias" in capsys.readouterr().err
    assert (tmp_path / "out" / "config.json").is_file()
