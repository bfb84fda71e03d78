"""A module that no tensor-parallel style lays out is refused at build: under sequence parallelism
it sees one rank's tokens, its gradient differs across the tp ranks, and the copies drift apart."""

from __future__ import annotations

import torch.multiprocessing as mp

from tests.distributed.harness import gloo_rank, start_ranks
from tests.ports import free_port


def _worker(rank: int, world: int, port: int, seen) -> None:
    import torch
    from torch import nn

    from shardline.config import load_config
    from shardline.layout import Layout
    from shardline.models.factory import build_meta_model
    from shardline.models.llama import ModelArgs
    from shardline.models.llama.model import RMSNorm
    from shardline.models.llama.parallelize import parallelize
    from shardline.parallel.dims import ParallelDims

    with gloo_rank(rank, world, port):
        args = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=128, ffn_dim=128)
        for sp in (True, False):
            cfg = load_config(None, ["train.seq_len=16", "parallel.tp=2", "parallel.dp_shard=1",
                                     f"parallel.sequence_parallel={str(sp).lower()}"])
            for extra in ("none", "post_norm", "q_scale"):
                dims = ParallelDims(Layout(tp=2, dp_shard=1, sequence_parallel=sp))
                dims.build_mesh(torch.device("cpu"))
                model = build_meta_model(args)
                with torch.device("meta"):
                    if extra == "post_norm":  # a researcher's post-attention norm on the block, left out of the plan
                        model.layers["1"].post_norm = RMSNorm(args.dim, args.norm_eps)
                    if extra == "q_scale":  # a per-head-channel scale inside attention: it sees this rank's heads
                        model.layers["0"].attention.q_scale = nn.Parameter(torch.ones(args.dim // args.n_heads))
                try:
                    parallelize(model, args, dims, cfg, torch.device("cpu"))
                    seen.put((rank, sp, extra, "built"))
                except ValueError as e:
                    seen.put((rank, sp, extra, str(e)))


def test_a_parameter_the_tp_plan_leaves_out_is_refused():
    """Under sequence parallelism any plain parameter; without it, one inside a block's attention or
    feed-forward (a post-norm on the replicated stream is rightly plain there, as one process's)."""
    seen = mp.get_context("spawn").SimpleQueue()
    start_ranks(_worker, args=(2, free_port(), seen), nprocs=2)
    found = {}
    while not seen.empty():
        rank, sp, extra, said = seen.get()
        found[rank, sp, extra] = said
    assert len(found) == 12, found
    for (rank, sp, extra), said in found.items():
        if extra == "none" or (extra == "post_norm" and not sp):
            assert said == "built", (rank, sp, extra, said)
        else:
            name = "layers.1.post_norm.weight" if extra == "post_norm" else "layers.0.attention.q_scale"
            assert said.startswith(f"parameter {name} has no tensor-parallel layout (1 such): "), said
            assert "\n" not in said and ("or parallel.sequence_parallel=false" in said) == (extra == "post_norm")
