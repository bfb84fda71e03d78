"""train.compile under tensor, data, pipeline and context parallelism on real gloo ranks:
compiled blocks train like eager ones.

Compiled runs must also show that their blocks ran compiled code: each block has its
compiled call (or, under activation checkpointing, a compiled forward the checkpoint
wraps), dynamo captured graphs and broke none of them (a block that fell back to eager,
whole or in part, fails), except where parts run eagerly on purpose (parallel/compile.py):
under a zero-bubble schedule the Linear layers, under a cp ring the ring's attention.
Without the embedding's AsyncCollectiveTensor output resolved before the first block,
backward fails; with the checkpoint traced into the block, too.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch._functorch.config

from shardline.config import load_config
from shardline.parallel.compile import config_problem as compile_problem
from tests.distributed.harness import ALL_STEPS, PARITY_OVERRIDES, assert_same_run, gloo_rank, losses, start_ranks
from tests.ports import free_port

TP_SP = ["parallel.tp=2", "parallel.sequence_parallel=true"]
# Training only: evaluation would compile each block again as a no_grad graph (~30% of a cold
# compile); tests/unit/test_compile.py checks compiled evaluation.
NO_EVAL = "train.eval_interval=0"


def _worker(rank: int, world: int, port: int, jobs: list[tuple[str, list[str]]]) -> None:
    from torch._dynamo.utils import counters

    from shardline.trainer import Trainer

    with gloo_rank(rank, world, port):
        for run_dir, overrides in jobs:
            torch._dynamo.reset()  # each run compiles its own graphs, counted afresh
            counters.clear()
            trainer = Trainer(load_config(None, [*overrides, f"run.dir={run_dir}"])).build()
            trainer.train()
            stages = trainer.runner.pipeline.modules if trainer.runner.pipeline is not None else []
            for stage in (m for m in stages if m.output is not None):  # the last stage scores a chunked loss
                compiled_loss = hasattr(stage._loss.score, "_torchdynamo_orig_callable")
                (Path(run_dir) / "last_stage_loss.json").write_text(json.dumps(compiled_loss))
            if rank == 0:
                score = trainer.model.loss.score
                seen = {"compiled_blocks": [_compiled(b) for b in trainer.model.layers.values()],
                        "compiled_loss": hasattr(score, "_torchdynamo_orig_callable"),
                        "graphs": counters["stats"]["unique_graphs"], "breaks": dict(counters["graph_break"]),
                        "aot_cache": torch._functorch.config.enable_autograd_cache}
                (Path(run_dir) / "compiled.json").write_text(json.dumps(seen))


def _compiled(block: torch.nn.Module) -> bool:
    """The block's call is compiled, or a forward somewhere under its checkpoint wrapper is."""
    forward = block.forward
    while forward is not None and not hasattr(forward, "_torchdynamo_orig_callable"):
        forward = getattr(forward, "__wrapped__", None)
    return block._compiled_call_impl is not None or forward is not None


# Other layouts compiled on two ranks, each against the eager tp run (layouts train alike,
# test_parity.py): FSDP2 units around compiled, fully checkpointed blocks with the chunked loss
# (which the 1F1B pipeline's stages run too: dynamo traces them again, inductor's disk cache
# can serve the kernels); the ring's exchange between compiled code. They run after the tp
# jobs, so with AOTAutograd's disk cache off (apply_compile turns it off process-wide under tp).
OTHER_LAYOUTS = {
    "compiled_fsdp_ac_chunked": ["parallel.dp_shard=2", "memory.activation_checkpoint=full",
                                 "train.loss_chunk_tokens=16"],
    "compiled_pp_1f1b": ["parallel.pp=2", "parallel.pp_schedule=1f1b", "memory.activation_checkpoint=full",
                         "train.loss_chunk_tokens=16"],
    "compiled_cp_ring": ["parallel.cp=2"],
}


@pytest.mark.slow  # two ranks compiling with inductor on 2 CPU cores: ~45-80 s, warm or cold cache
def test_compiled_blocks_train_like_eager_under_tp_fsdp_pp_and_cp(tmp_path, small_prepared):
    """TP with SP, plain and under op AC: one graph a block, its collectives traced in; FSDP,
    1F1B: compiled blocks, nothing breaking; the cp ring: breaking only around the ring."""
    base = [*PARITY_OVERRIDES, f"data.path={small_prepared}", NO_EVAL]
    runs = {"compiled": [*TP_SP, "train.compile=true"],
            "compiled_op_ac": [*TP_SP, "train.compile=true", "memory.activation_checkpoint=op"],
            **{name: [*extra, "train.compile=true"] for name, extra in OTHER_LAYOUTS.items()}}
    jobs = [(str(tmp_path / n), [*base, *extra]) for n, extra in {"eager": TP_SP, **runs}.items()]
    start_ranks(_worker, args=(2, free_port(), jobs), nprocs=2)
    want = losses(tmp_path / "eager")
    assert sorted(want) == ALL_STEPS
    assert json.loads((tmp_path / "eager" / "compiled.json").read_text())["graphs"] == 0
    for name in runs:
        assert sorted(losses(tmp_path / name)) == ALL_STEPS, name
        # losses, grad norms, weights (1e-4: inductor sums in its own order; AdamW carries that to ~2e-5)
        assert_same_run(tmp_path / name, tmp_path / "eager", atol=1e-4, evaluated=False)
        seen = json.loads((tmp_path / name / "compiled.json").read_text())
        assert seen["compiled_blocks"] and all(seen["compiled_blocks"]), (name, seen)
        # the ring's attention runs eagerly on purpose (parallel/compile.py); nothing else breaks
        breaks = [reason for reason in seen["breaks"] if name != "compiled_cp_ring" or "ring_attention" not in reason]
        assert seen["graphs"] >= 1 and not breaks, (name, seen)
        if name == "compiled_cp_ring":
            assert seen["breaks"], seen  # the test must see the break it allows
        if name not in OTHER_LAYOUTS:  # under tp a rank must not load another rank's graph
            assert seen["aot_cache"] is False, (name, seen)
        # the cross-entropy is compiled, except on vocab-sharded logits (tp's loss parallelism)
        assert seen["compiled_loss"] is (name in OTHER_LAYOUTS), (name, seen)
    # the pipeline's last stage scores its chunked loss with the compiled one too
    assert json.loads((tmp_path / "compiled_pp_1f1b" / "last_stage_loss.json").read_text()) is True


@pytest.mark.slow  # four ranks compiling on 2 CPU cores: ~45-60 s
@pytest.mark.skipif(compile_problem(True, 2, "dualpipev") is not None, reason="torch < 2.13: refused at preflight")
def test_compiled_tensor_parallel_blocks_under_dualpipev_train_like_eager(tmp_path, small_prepared):
    """tp 2 with sequence parallelism x dualpipev on 4 ranks, the zero-bubble schedule's split
    backward: the Linear layers run eagerly at graph breaks with their module calls and
    tensor-parallel hooks, the code between them compiled (breaking nowhere else), and the
    weight pass gives eager's gradients."""
    layout = [*TP_SP, "parallel.pp=2", "parallel.pp_schedule=dualpipev", "parallel.pp_virtual_stages=2",
              "train.micro_batch_size=1"]
    base = [*PARITY_OVERRIDES, f"data.path={small_prepared}", NO_EVAL, *layout]
    jobs = [(str(tmp_path / "eager"), base), (str(tmp_path / "compiled"), [*base, "train.compile=true"])]
    start_ranks(_worker, args=(4, free_port(), jobs), nprocs=4)
    assert sorted(losses(tmp_path / "compiled")) == sorted(losses(tmp_path / "eager")) == ALL_STEPS
    assert_same_run(tmp_path / "compiled", tmp_path / "eager", atol=1e-4, evaluated=False)  # the weight pass
    seen = json.loads((tmp_path / "compiled" / "compiled.json").read_text())
    assert seen["graphs"] >= 1 and seen["breaks"], seen
    assert seen["compiled_blocks"] and all(seen["compiled_blocks"]), seen
    # nothing else breaks (SDPA once did, on a symbolic enable_gqa)
    assert not [reason for reason in seen["breaks"] if "Linear.forward" not in reason], seen
