"""Mixture-of-experts and expert parallelism on real gloo ranks.

First the layer: two ranks each route half of a batch through experts split between
them (ExpertParallel) and must reproduce one process's output and gradients. Two
classic bugs must fail the same comparison: results sent home without undoing the
regrouping by expert (a mis-ordered combine), and expert gradients summed over the ep
group as if the experts were data-parallel replicas (the wrong group).

Then whole runs: MoE training (balance loss, z-loss and the bias update all on,
dropless) under ep, ep x FSDP, ep x pp, ep x cp, ep borrowing the cp ranks, ep x tp, tp, pp, cp,
activation checkpointing and ZeRO-1 with ep and with tp gives the single process's losses and
final weights (and, under ZeRO-1, gradient norms), also when a run is resumed under another ep.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from shardline.config import load_config
from shardline.models.llama.model import ModelArgs
from shardline.models.moe import MoEArgs
from shardline.models.moe.layer import MoEFeedForward
from shardline.parallel.expert.dispatch import ExpertParallel, _Exchange
from shardline.trainer import Trainer
from tests.distributed.harness import (ALL_STEPS, PARITY_OVERRIDES, assert_same_run,
                                       gloo_rank, losses, outcome, run_world, start_ranks)
from tests.ports import free_port

ARGS = ModelArgs(dim=16, n_layers=1, n_heads=2, vocab_size=8, ffn_dim=8,
                 moe=MoEArgs(n_experts=4, top_k=2, expert_ffn_dim=8, shared_experts=1))
BROKEN = ["combine_misordered", "expert_grads_over_ep"]


class _MisorderedCombine(ExpertParallel):
    """Sends expert outputs home in expert order instead of the order the rows came in."""

    def __call__(self, experts, x, counts):
        send_counts = counts.view(self.ep, self.n_local)
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts.contiguous(), group=self.ep_group)
        send, recv = send_counts.sum(1).tolist(), recv_counts.sum(1).tolist()
        arrived = _Exchange.apply(x, send, recv, self.ep_group)
        local_expert = torch.arange(self.n_local).repeat(self.ep)
        by_expert = torch.argsort(torch.repeat_interleave(local_expert, recv_counts.flatten()), stable=True)
        y = experts(arrived[by_expert], recv_counts.sum(0))
        return _Exchange.apply(y, recv, send, self.ep_group)  # bug: y[back] would restore the arrival order


def _layer() -> MoEFeedForward:
    torch.manual_seed(0)
    layer = MoEFeedForward(ARGS)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return layer


def _layer_errors(rank: int, world: int) -> dict[str, float]:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(4, 6, ARGS.dim, generator=gen)
    weights = torch.randn(4, 6, ARGS.dim, generator=gen)
    ref = _layer()
    ref_out = ref(x)
    (ref_out * weights).sum().backward()
    mine = slice(rank * 2, rank * 2 + 2)
    n_local = ARGS.moe.n_experts // world
    experts = slice(rank * n_local, (rank + 1) * n_local)
    errors = {}
    for variant in ["correct", *BROKEN]:
        layer = _layer()
        for name in ("w1", "w2", "w3"):  # keep this rank's experts only
            setattr(layer.experts, name, torch.nn.Parameter(getattr(layer.experts, name).data[experts].clone()))
        cls = _MisorderedCombine if variant == "combine_misordered" else ExpertParallel
        layer.dispatch = cls(ARGS.moe.n_experts, dist.group.WORLD)
        out = layer(x[mine])
        (out * weights[mine]).sum().backward()
        expert_grads = [getattr(layer.experts, n).grad for n in ("w1", "w2", "w3")]
        if variant == "expert_grads_over_ep":
            for g in expert_grads:
                dist.all_reduce(g)  # bug: the tokens of every ep rank are already in these gradients
        # Data-parallel parameters (the router, the shared expert): their gradients do sum over ranks.
        dense = [layer.router.gate.weight, *layer.shared.parameters()]
        dense_grads = [p.grad.clone() for p in dense]
        for g in dense_grads:
            dist.all_reduce(g)
        ref_dense_grads = [p.grad for p in (ref.router.gate.weight, *ref.shared.parameters())]
        ref_expert_grads = [getattr(ref.experts, n).grad[experts] for n in ("w1", "w2", "w3")]
        pairs = [(out, ref_out[mine]), *zip(dense_grads, ref_dense_grads), *zip(expert_grads, ref_expert_grads)]
        errors[variant] = max(float((a - b).detach().abs().max()) for a, b in pairs)
    return errors


def _worker(rank: int, world: int, port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        Path(out_dir, f"{rank}.json").write_text(json.dumps(_layer_errors(rank, world)))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def layer_errors(tmp_path_factory):
    out = tmp_path_factory.mktemp("ep_layer")
    start_ranks(_worker, args=(2, free_port(), str(out)), nprocs=2)
    ranks = [json.loads((out / f"{r}.json").read_text()) for r in range(2)]
    return {k: max(r[k] for r in ranks) for k in ranks[0]}


def test_expert_parallel_layer_matches_one_process(layer_errors):
    assert layer_errors["correct"] < 1e-5, layer_errors


@pytest.mark.parametrize("broken", BROKEN)
def test_a_misordered_combine_or_wrong_gradient_group_is_caught(layer_errors, broken):
    assert layer_errors[broken] > 1e-3, layer_errors


# ---- whole runs ---------------------------------------------------------------------

# Two blocks, the first dense (tiny-moe's): one MoE block, on its own stage under pp 2.
MOE = ["model.preset=tiny-moe", "model.n_layers=2", "moe.num_experts=4", "moe.expert_ffn_dim=32",
       "moe.aux_loss_coef=0.01", "moe.z_loss_coef=0.001", "moe.bias_update_rate=0.01"]
MOE_2 = {
    "ep2_ac_full": ["parallel.dp_shard=2", "parallel.ep=2", "memory.activation_checkpoint=full"],
    "pp2_1f1b": ["parallel.pp=2"],
    "tp2_sp": ["parallel.tp=2"],  # experts split over tp, shared experts by columns/rows
    # ZeRO-1 under ep: no DDP; the dense states cut over dp_shard, the experts' over efsdp (1 here)
    "ep2_zero1": ["parallel.dp_shard=2", "parallel.ep=2", "parallel.zero=1"],
    # ZeRO-1 over the cp ranks: DDP over them, every state (experts' too) cut over dp_shard x cp
    "cp2_zero1": ["parallel.cp=2", "parallel.zero=1"],
    # ep borrows the cp ranks: each cp rank holds other experts (efsdp 1: no sum over cp)
    "ep2_from_cp2": ["parallel.dp_shard=1", "parallel.cp=2", "parallel.ep=2"],
}
MOE_4 = {
    "ep4": ["parallel.dp_shard=4", "parallel.ep=4"],
    "ep2_pp2": ["parallel.dp_shard=2", "parallel.ep=2", "parallel.pp=2"],
    "ep2_cp2": ["parallel.dp_shard=2", "parallel.ep=2", "parallel.cp=2"],  # expert grads sum over cp too
    "ep2_tp2": ["parallel.dp_shard=2", "parallel.ep=2", "parallel.tp=2"],  # experts over ep x tp
    "tp2_zero1": ["parallel.dp_shard=2", "parallel.tp=2", "parallel.zero=1"],  # experts cut like TP shards
    # The experts' states cut over efsdp = the 2 cp ranks, which interleave with ep on the mesh.
    "ep2_cp2_zero1": ["parallel.dp_shard=2", "parallel.ep=2", "parallel.cp=2", "parallel.zero=1"],
    # ep 4 = dp_shard 2 x cp 2 (flattened, cp inner), the experts' states cut over efsdp 1.
    "ep4_from_dp2_cp2_zero1": ["parallel.dp_shard=2", "parallel.cp=2", "parallel.ep=4", "parallel.zero=1"],
    # ep = the 2 Ulysses ranks, experts over ep x tp (ep_tp flattened from cp_ulysses and tp).
    "ep2_from_ulysses2_tp2": ["parallel.dp_shard=1", "parallel.cp=2", "parallel.cp_mode=ulysses", "parallel.ep=2",
                              "parallel.tp=2"],
}
# The second half is ep 2 x dp_shard 4: experts FSDP-sharded over 2 ranks (efsdp).
RESHARD_4 = [("fsdp4_to_ep2", ["parallel.dp_shard=4", "train.stop_at_step=2"],
              ["parallel.dp_shard=4", "parallel.ep=2"]),
             # ZeRO-1 with the experts' states cut over efsdp 2 x ep 2, resumed with them whole on
             # each rank of ep x tp (efsdp 1) and the dense states cut over dp_shard 2 x tp 2.
             ("ep2_zero1_to_ep2_tp2_zero1", ["parallel.dp_shard=4", "parallel.ep=2", "parallel.zero=1",
                                             "train.stop_at_step=2"],
              ["parallel.dp_shard=2", "parallel.ep=2", "parallel.tp=2", "parallel.zero=1"])]
# ZeRO-1's expert states (cut over efsdp, with ep) resumed as FSDP's shards.
RESHARD_2 = [("ep2_zero1_to_fsdp2", ["parallel.dp_shard=2", "parallel.ep=2", "parallel.zero=1", "train.stop_at_step=2"],
              ["parallel.dp_shard=2"])]


# Token dropping: each rank routes its own micro-batch, so its experts keep the tokens one
# process keeps of that micro-batch (under cp it is refused: layout/rules.py).
CAPACITY = "moe.capacity_factor=1.0"


def _base(corpus) -> list[str]:
    return [*PARITY_OVERRIDES, *MOE, f"data.path={corpus}"]


@pytest.fixture(scope="module")
def moe_reference(tmp_path_factory, small_prepared):
    run = tmp_path_factory.mktemp("moe_reference")
    Trainer(load_config(None, [*_base(small_prepared), f"run.dir={run}"])).build().train()
    return run


@pytest.fixture(scope="module")
def moe_world2(tmp_path_factory, small_prepared):
    root = tmp_path_factory.mktemp("moe_world2")
    jobs = [(root / name, [*_base(small_prepared), *extra]) for name, extra in MOE_2.items()]
    jobs.append((root / "ep2_to_single", [*_base(small_prepared), "parallel.dp_shard=2", "parallel.ep=2",
                                           "train.stop_at_step=2"]))
    for name, first, second in RESHARD_2:
        jobs += [(root / name, [*_base(small_prepared), *first]), (root / name, [*_base(small_prepared), *second])]
    jobs.append((root / "ep2_capacity", [*_base(small_prepared), CAPACITY, "parallel.dp_shard=2", "parallel.ep=2"]))
    run_world(2, jobs)
    # The second half of ep2_to_single: one process, every expert on it.
    Trainer(load_config(None, [*_base(small_prepared), f"run.dir={root / 'ep2_to_single'}"])).build().train()
    return root


@pytest.fixture(scope="module")
def moe_world4(tmp_path_factory, small_prepared):
    root = tmp_path_factory.mktemp("moe_world4")
    jobs = [(root / name, [*_base(small_prepared), *extra]) for name, extra in MOE_4.items()]
    for name, first, second in RESHARD_4:
        jobs += [(root / name, [*_base(small_prepared), *first]), (root / name, [*_base(small_prepared), *second])]
    run_world(4, jobs)
    return root


@pytest.mark.parametrize("run", [*MOE_2, "ep2_to_single", *(name for name, _, _ in RESHARD_2)])
def test_world2_moe_matches_single_process(moe_world2, moe_reference, run):
    assert sorted(losses(moe_world2 / run)) == ALL_STEPS
    assert_same_run(moe_world2 / run, moe_reference)


@pytest.mark.slow
@pytest.mark.parametrize("run", [*MOE_4, *(name for name, _, _ in RESHARD_4)])
def test_world4_moe_matches_single_process(moe_world4, moe_reference, run):
    assert sorted(losses(moe_world4 / run)) == ALL_STEPS
    assert_same_run(moe_world4 / run, moe_reference)


def _same_bookkeeping(run: Path, reference: Path) -> None:
    for key in ("expert_load_max", "aux_loss", "dropped_tokens", "dropped_share"):
        got, want = losses(run, key=key), losses(reference, key=key)
        assert got.keys() == want.keys() and all(abs(got[s] - want[s]) <= 1e-5 * max(1, abs(want[s])) for s in want), \
            (key, got, want)
    got, want = losses(run, key="expert_load_by_layer"), losses(reference, key="expert_load_by_layer")
    assert got.keys() == want.keys() and all(got[s].keys() == want[s].keys() for s in want), (got, want)
    assert all(abs(got[s][i] - want[s][i]) <= 1e-4 * max(1, want[s][i]) for s in want for i in want[s]), (got, want)


@pytest.mark.parametrize("run", list(MOE_2))
def test_expert_load_and_balance_loss_are_logged(moe_world2, moe_reference, run):
    """The layout-independent bookkeeping: the same load imbalance and balance loss as one
    process, whichever way the layout splits the tokens (a count taken twice, or over tp,
    would show in the balance loss; the load ratio ignores a uniform over-count)."""
    _same_bookkeeping(moe_world2 / run, moe_reference)
    assert all(v > 1.0 for v in losses(moe_reference, key="expert_load_max").values())
    assert all(v > 0.0 for v in losses(moe_reference, key="aux_loss").values())


def test_token_dropping_under_ep_drops_what_one_process_drops(moe_world2, small_prepared, tmp_path):
    reference = tmp_path / "capacity"
    Trainer(load_config(None, [*_base(small_prepared), CAPACITY, f"run.dir={reference}"])).build().train()
    assert_same_run(moe_world2 / "ep2_capacity", reference)
    _same_bookkeeping(moe_world2 / "ep2_capacity", reference)
    assert all(v > 0 for v in losses(reference, key="dropped_tokens").values())
    dropless = losses(moe_world2 / "ep2_ac_full")
    assert losses(reference) != dropless  # tokens were dropped: the capacity is binding here


def _fused_zero1_build(rank: int, world: int, port: int, corpus: str, root: str) -> None:
    """Build (no step) a run whose pipeline stages hold other parameters: layers 0-1 dense on
    stage 0, MoE layers 2-3 on stage 1, whose ZeRO-1 slices of its two local experts (ep 2 of
    dp 4: cut over 2 ranks) are strided."""
    with gloo_rank(rank, world, port, timeout_s=30):
        cfg = load_config(None, [*_base(corpus), "model.n_layers=4", "moe.first_dense_layers=2", "parallel.pp=2",
                                 "parallel.dp_shard=4", "parallel.ep=2", "parallel.zero=1", "train.micro_batch_size=1",
                                 "optim.implementation=fused", f"run.dir={root}/run"])
        ended = outcome(lambda: (Trainer(cfg).build(), "built")[1])
        Path(root, f"rank{rank}.json").write_text(json.dumps(ended))


def test_fused_zero1_is_refused_alike_on_every_pipeline_stage(small_prepared, tmp_path):
    """The fused kernel cannot update strided ZeRO-1 slices: decided from the stage's own
    parameters, a dense stage went on alone (and under `auto` would take another update and
    anomaly check than its peers). Every rank now refuses, in one line."""
    start_ranks(_fused_zero1_build, (8, free_port(), str(small_prepared), str(tmp_path)), nprocs=8)
    outcomes = {json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(8)}
    assert len(outcomes) == 1, outcomes
    assert outcomes.pop().startswith("ConfigError: optim.implementation=fused is invalid with this layout: ZeRO-1's "
                                     "slices of layers.2.")


def _nan_in_a_held_expert(rank: int, world: int, port: int, root: str) -> None:
    """Experts 2 and 3 on rank 1 (ep 2 of 4 experts), expert 3's w3 holding a NaN; each rank
    checks the experts it holds, as a run from an HF folder does."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from shardline.interop.hf import check_finite
    from shardline.models.factory import build_model_on

    with gloo_rank(rank, world, port, timeout_s=30):
        model = build_model_on(dataclasses.replace(ARGS, moe=dataclasses.replace(ARGS.moe, shared_experts=0)), "cpu")
        model.init_weights(seed=0)  # (a Mixtral shape: no shared experts)
        experts = model.layers["0"].feed_forward.experts
        whole = experts.w3.detach().clone()
        whole[3, 1, 0] = float("nan")
        mesh = init_device_mesh("cpu", (world,))
        experts.w3 = torch.nn.Parameter(distribute_tensor(whole, mesh, [Shard(0)], src_data_rank=None))
        ended = outcome(lambda: (check_finite(model, "weights", Path(root)), "finite")[1])
        # A plain weight sharded as FSDP shards it, its NaN in rank 1's rows (an IndexError there, once)
        experts.w3 = torch.nn.Parameter(distribute_tensor(whole.nan_to_num(), mesh, [Shard(0)], src_data_rank=None))
        wq = model.layers["0"].attention.wq
        rows = wq.weight.detach().clone()
        rows[-1, 0] = float("inf")
        wq.weight = torch.nn.Parameter(distribute_tensor(rows, mesh, [Shard(0)], src_data_rank=None))
        plain = outcome(lambda: (check_finite(model, "weights", Path(root)), "finite")[1])
        Path(root, f"rank{rank}.json").write_text(json.dumps([ended, plain]))


def test_a_nan_in_an_expert_another_rank_holds_is_named_by_its_own_tensor(tmp_path):
    """Under ep the refusal said "expert 0's tensor, or another of its 4 experts'": the rank holding
    the NaN now names its expert (3, its second), as one process does; a plain weight's shard is
    named by the weight's one tensor."""
    start_ranks(_nan_in_a_held_expert, (2, free_port(), str(tmp_path)), nprocs=2)
    (experts0, plain0), (experts1, plain1) = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert experts0 == plain0 == "finite"
    assert experts1 == ("CheckpointError: weights: parameter layers.0.feed_forward.experts.w3 (read from tensor "
                        "model.layers.0.block_sparse_moe.experts.3.w3.weight) holds NaN or inf values; these weights "
                        "cannot be trained or converted (re-save them from a healthy copy)"), experts1
    assert plain1.startswith("CheckpointError: weights: parameter layers.0.attention.wq.weight (read from tensor "
                             "model.layers.0.self_attn.q_proj.weight) holds NaN or inf"), plain1
