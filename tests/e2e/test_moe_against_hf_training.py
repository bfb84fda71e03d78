"""A shardline mixture-of-experts run against an independent training loop over transformers'
MixtralForCausalLM.

The MoE twin of test_against_hf_training.py (its corpus, batch shapes, optimizer settings and
README lr curve): `model.preset=tiny-moe` cut to 2 layers of 8 experts (top 2, each 32 wide)
and made exactly Mixtral (softmax router, renormalised top-2 weights, dropless, no shared
experts, no dense first layer, no routed-output scale, no z-loss or expert bias), exported
before the first step and loaded as MixtralForCausalLM in fp32. The reference is the dense
test's plain loop: the mean cross-entropy over the global batch's labelled tokens, gradients
accumulated over the micro-batches, torch's clip_grad_norm_ and AdamW (every matrix decayed,
the stacked experts and the router included; norm weights not), the lr of update k from the
README's curve. The per-step losses, lrs and gradient norms agree to ~5e-7 (absolute, in loss)
and ~1e-7 (relative, in gradient norm), the final weights to ~1.3e-6, router and experts
included.

With the balance loss on, the reference adds the loss docs/moe.md describes, written from
that text: per sequence and MoE layer coef x E x sum_i f_i P_i (f_i: the sequence's share of
routed slots at expert i, P_i: its mean router probability), summed over layers, averaged over
the global batch's sequences; the logged `aux_loss` is that value. It is NOT transformers' own
`router_aux_loss_coef x load_balancing_loss_func`, which pools every layer's tokens into one f
and one P per expert, per forward call (a micro-batch here) and is top_k at balance: even with
the coefficient converted as shardline exports it (x n_moe_layers / top_k) the two differ by
~1% in value at step 1 here (per sequence vs per micro-batch about two thirds of it, pooling
the layers the rest), and training with HF's moves the routers ~2e-2 away in 8 steps.

Deliberate breakages, each caught (tried by hand): top-k weights not renormalised (loss at
step 1, by 6e-5), expert gradients halved (gradient norm at step 1, 9e-4 relative), the router
not trained (balance off: loss at step 2; balance on: gradient norm at step 1), and the balance
loss's gradient scaled by 1 / micro-batch sequences instead of 1 / global-batch sequences
(gradient norm at step 1, the balance-on case).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from shardline.config import load_config
from shardline.models.loss import IGNORE_INDEX
from tests.e2e.test_against_hf_training import (CLIP, GLOBAL, STEPS, reference_adamw, reference_overrides,
                                                step_batches, train_and_export, verses)

transformers = pytest.importorskip("transformers")
safetensors = pytest.importorskip("safetensors.torch")

EXPERTS, TOP_K, EXPERT_FFN, LAYERS = 8, 2, 32, 2
MIXTRAL = ["model.preset=tiny-moe", f"model.n_layers={LAYERS}", f"moe.num_experts={EXPERTS}", f"moe.top_k={TOP_K}",
           f"moe.expert_ffn_dim={EXPERT_FFN}", "moe.shared_experts=0", "moe.first_dense_layers=0", "moe.router=softmax",
           "moe.norm_topk=1", "moe.capacity_factor=0", "moe.route_scale=1", "moe.z_loss_coef=0",
           "moe.bias_update_rate=0"]

__all__ = ["verses"]  # the dense test's corpus fixture, imported for pytest to find


def balance_loss(router_logits, batch: int, seq: int, coef: float) -> torch.Tensor:
    """docs/moe.md's balance loss of each sequence [batch]: per MoE layer E x sum_i f_i P_i (f_i the
    share of the sequence's top-k slots at expert i, P_i its mean router probability), summed over layers."""
    total = torch.zeros(batch)
    for logits in router_logits:  # one [batch x seq, E] per layer
        probs = logits.float().softmax(-1).view(batch, seq, EXPERTS)
        slots = F.one_hot(probs.topk(TOP_K, dim=-1).indices, EXPERTS).sum((1, 2)).float()  # [batch, E]
        total = total + EXPERTS * (slots / (TOP_K * seq) * probs.mean(1)).sum(-1)
    return coef * total


@pytest.mark.parametrize("aux", [0.0, 0.05], ids=["balance-off", "balance-on"])
def test_moe_training_matches_a_plain_loop_over_hf_mixtral(tmp_path, verses, aux):
    cfg = load_config(None, reference_overrides(tmp_path / "run", verses, "train.document_mask=false", *MIXTRAL,
                                                f"moe.aux_loss_coef={aux}"))
    init, data, logged, final = train_and_export(cfg, tmp_path)
    start = safetensors.load_file(str(init / "model.safetensors"))

    hf = transformers.MixtralForCausalLM.from_pretrained(init, attn_implementation="sdpa").float().train()
    c = hf.config
    assert (c.model_type, c.num_local_experts, c.num_experts_per_tok, c.intermediate_size, c.num_hidden_layers) == (
        "mixtral", EXPERTS, TOP_K, EXPERT_FFN, LAYERS)
    assert c.router_jitter_noise == 0 and not c.tie_word_embeddings
    assert c.router_aux_loss_coef == pytest.approx(aux * LAYERS / TOP_K)  # exported in HF's normalisation
    opt = reference_adamw(hf, cfg, norms=2 * LAYERS + 1)

    loads = torch.zeros(EXPERTS)
    for step in range(STEPS):
        k = step + 1
        batches, n_tokens, lr = step_batches(data, step, opt, cfg)
        opt.zero_grad(set_to_none=True)
        loss_total = aux_total = 0.0
        for b in batches:
            out = hf(input_ids=b["input_ids"], output_router_logits=True)  # no labels: HF adds no loss of its own
            loss = F.cross_entropy(out.logits.float().flatten(0, 1), b["labels"].flatten(), ignore_index=IGNORE_INDEX,
                                   reduction="sum") / n_tokens
            loss_total += loss.item()
            balance = balance_loss(out.router_logits, *b["input_ids"].shape, aux).sum() / GLOBAL
            aux_total += balance.item()
            (loss + balance if aux else loss).backward()
            for logits in out.router_logits:
                loads += torch.bincount(logits.topk(TOP_K, dim=-1).indices.flatten(), minlength=EXPERTS)
        grad_norm = torch.nn.utils.clip_grad_norm_(hf.parameters(), CLIP).item()
        opt.step()
        record = logged[k]
        assert record["lr"] == pytest.approx(lr, rel=1e-12), f"step {k}: lr"
        assert record["loss"] == pytest.approx(loss_total, abs=1e-5), f"step {k}: loss"  # the balance loss apart
        assert record["grad_norm"] == pytest.approx(grad_norm, rel=1e-5), f"step {k}: gradient norm"
        assert record["aux_loss"] == pytest.approx(aux_total, abs=1e-6), f"step {k}: balance loss"
        assert record["dropped_tokens"] == 0
        assert grad_norm > CLIP, f"step {k}: not clipped, so the check says nothing about clipping"
    assert (loads > 0).all() and loads.max() < loads.sum() / 2  # every expert trains; no single one takes all

    hf.save_pretrained(tmp_path / "reference")  # per-expert names, as the export writes them
    state = safetensors.load_file(str(tmp_path / "reference" / "model.safetensors"))
    assert set(final) == set(state)
    for name, weight in final.items():
        torch.testing.assert_close(state[name], weight, rtol=0, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
    for name in ("block_sparse_moe.gate.weight", "block_sparse_moe.experts.0.w2.weight"):
        moved = (final[f"model.layers.0.{name}"] - start[f"model.layers.0.{name}"]).abs().max()
        assert moved > 100 * 1e-5, f"{name} barely trained ({moved:.2e}): the weight check says little about it"
