"""ParallelDims: every impossible layout is a ConfigError before any collective runs."""

from __future__ import annotations

import dataclasses

import pytest

from shardline.config import load_config
from shardline.errors import ConfigError
from shardline.models.llama import ModelArgs
from shardline.parallel.dims import ParallelDims
from shardline.parallel.pipeline import split_layers, stages_of_rank

ARGS = ModelArgs(dim=64, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=512, ffn_dim=128)


def dims_for(world: int, *overrides: str, args: ModelArgs = ARGS) -> ParallelDims:
    cfg = load_config(None, ["train.global_batch_size=16", "train.micro_batch_size=2", "train.seq_len=32",
                             *overrides])
    dims = ParallelDims.from_config(cfg.parallel, world)
    dims.check_against(args, cfg)
    return dims


def test_dp_shard_fills_the_rest():
    dims = dims_for(8, "parallel.tp=2", "parallel.pp=2")
    assert (dims.dp_replicate, dims.dp_shard, dims.tp, dims.pp, dims.dp) == (1, 2, 2, 2, 2)


@pytest.mark.parametrize("world, overrides, message", [
    (4, ["parallel.dp_shard=3"], "does not match the world size 4"),
    (6, ["parallel.tp=4"], "does not match the world size 6"),
    (4, ["parallel.tp=4"], "must divide n_heads=4 and n_kv_heads=2; valid tp: 1, 2"),
    (8, ["parallel.pp=8"], "fewer than the 8 pipeline stages"),
    (4, ["parallel.pp=2", "parallel.pp_schedule=interleaved_1f1b", "parallel.pp_virtual_stages=4"],
     "fewer than the 8 pipeline stages"),
    (2, ["parallel.pp=2", "parallel.pp_schedule=interleaved_1f1b"], "needs pp_virtual_stages >= 2"),
    (2, ["parallel.pp=2", "parallel.pp_virtual_stages=2"], "runs one stage per rank"),
    (2, ["parallel.pp=2", "parallel.pp_microbatches=3"], "pp_microbatches=3 but"),
    (2, ["parallel.pp=2", "train.micro_batch_size=16"], "cannot fill 2 pipeline stages"),
    (8, ["train.micro_batch_size=4"], "not divisible by train.micro_batch_size=4 x 8"),
    (2, ["parallel.cp=2", "parallel.dp_shard=1"], "context parallel is not implemented yet"),
    (2, ["parallel.ep=2", "parallel.dp_shard=1"], "expert parallel is not implemented yet"),
    (4, ["parallel.zero=1", "parallel.tp=2"], "zero=1 composes with data parallelism only"),
    (2, ["parallel.tp=2", "train.seq_len=33"], "must be divisible by parallel.tp=2"),
    (2, ["memory.cpu_offload=true", "run.device=cpu"], "needs a GPU"),
])
def test_invalid_layouts(world, overrides, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace("[", r"\[")):
        dims_for(world, *overrides)


def test_tied_embeddings_with_pp_are_refused_only_for_v_shapes_with_data_parallelism():
    tied = dataclasses.replace(ARGS, tie_embeddings=True)
    dims_for(2, "parallel.tp=2", args=tied)  # one vocab-sharded weight for both ends
    dims_for(2, "parallel.pp=2", args=tied)  # a copy on the last stage, gradients summed
    dims_for(8, "parallel.pp=2", "parallel.tp=2", args=tied)  # x FSDP 2
    dims_for(4, "parallel.pp=2", "parallel.tp=2", "parallel.pp_schedule=zbv", args=tied)  # one rank holds both ends
    for dp in ("parallel.dp_shard=2", "parallel.dp_replicate=2"):
        with pytest.raises(ConfigError, match="tied embeddings and data parallelism"):
            dims_for(4, "parallel.pp=2", "parallel.pp_schedule=dualpipev", dp, args=tied)


def test_layer_split_balances_the_output_head():
    assert split_layers(8, 4, head_cost=0.0) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    # a heavy head (big vocabulary) leaves the last stage fewer blocks
    split = split_layers(8, 2, head_cost=2.0)
    assert split == [[0, 1, 2, 3, 4], [5, 6, 7]]
    assert all(split_layers(16, 5, head_cost=1.5))  # every stage keeps a block


def test_stage_placement():
    assert stages_of_rank(1, pp=4, virtual=2, schedule="interleaved_1f1b") == [1, 5]
    assert stages_of_rank(1, pp=4, virtual=2, schedule="zbv") == [1, 6]
    assert stages_of_rank(0, pp=2, virtual=1, schedule="1f1b") == [0]
