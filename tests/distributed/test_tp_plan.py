"""A module that no tensor-parallel style lays out is refused at build: under sequence parallelism
it sees one rank's tokens, its gradient differs across the tp ranks, and the copies drift apart."""

from __future__ import annotations

import torch.multiprocessing as mp

from tests.distributed.harness import gloo_rank, start_ranks
from tests.ports import free_port


def _worker(rank: int, world: int, port: int, seen) -> None:
    import torch

    from shardline.config import load_config
    from shardline.layout import Layout
    from shardline.models.factory import build_meta_model
    from shardline.models.llama import ModelArgs
    from shardline.models.llama.model import RMSNorm
    from shardline.models.llama.parallelize import parallelize
    from shardline.parallel.dims import ParallelDims

    with gloo_rank(rank, world, port):
        cfg = load_config(None, ["train.seq_len=16", "parallel.tp=2", "parallel.dp_shard=1"])
        args = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=128, ffn_dim=128)
        for extra in (False, True):
            dims = ParallelDims(Layout(tp=2, dp_shard=1))
            dims.build_mesh(torch.device("cpu"))
            model = build_meta_model(args)
            if extra:  # a researcher's post-attention norm, left out of the plan
                with torch.device("meta"):
                    model.layers["1"].post_norm = RMSNorm(args.dim, args.norm_eps)
            try:
                parallelize(model, args, dims, cfg, torch.device("cpu"))
                seen.put((rank, extra, "built"))
            except ValueError as e:
                seen.put((rank, extra, str(e)))


def test_a_parameter_the_tp_plan_leaves_out_is_refused():
    seen = mp.get_context("spawn").SimpleQueue()
    start_ranks(_worker, args=(2, free_port(), seen), nprocs=2)
    found = []
    while not seen.empty():
        found.append(seen.get())
    assert sorted((rank, extra) for rank, extra, _ in found) == [(0, False), (0, True), (1, False), (1, True)], found
    for rank, extra, said in found:
        if not extra:
            assert said == "built", (rank, said)
        else:
            assert said.startswith("parameter layers.1.post_norm.weight has no tensor-parallel layout (1 such): "), said
            assert "\n" not in said
