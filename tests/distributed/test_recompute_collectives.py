"""The tensor-parallel collectives a recomputed forward replays, counted on two gloo ranks.

The planner charges each activation-checkpointing mode for what the rerun forward
replays in backward (planner/microbatch_comm._tp_layer): under sequence parallelism both
all-gathers and attention's reduce-scatter, without it attention's all-reduce, under op-level
AC as under full (no policy saves a collective's output). This counts them in a real step.
And a tied embedding under FSDP x TP stays one parameter of the root FSDP unit; ZeRO-2 keeps
its blocks gathered from forward to backward, ZeRO-3 does not.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import CommDebugMode

from shardline.config import load_config
from shardline.trainer import Trainer
from tests.distributed.harness import PARITY_OVERRIDES, gloo_rank, start_ranks
from tests.ports import free_port

LAYERS = 2
RUNS = [(True, "none"), (True, "op"), (True, "full"), (False, "none"), (False, "op")]


def _counts(rank: int, port: int, corpus: str, out: str) -> None:
    found = {}
    with gloo_rank(rank, 2, port):
        for i, (sp, ac) in enumerate(RUNS):
            overrides = [*PARITY_OVERRIDES, f"model.n_layers={LAYERS}", "train.steps=1", "train.eval_interval=0",
                         "checkpoint.interval=0", "train.global_batch_size=2", f"data.path={corpus}",
                         "parallel.tp=2", f"parallel.sequence_parallel={str(sp).lower()}",
                         f"memory.activation_checkpoint={ac}", f"run.dir={Path(out).parent / f'run{i}'}"]
            trainer = Trainer(load_config(None, overrides)).build()
            with CommDebugMode() as mode:
                trainer.train()
            found[f"{sp}-{ac}"] = {str(op).split(".")[-1]: n for op, n in mode.get_comm_counts().items()}
        # Tied embeddings under FSDP x TP: the two ends are one parameter of the root FSDP unit
        # (embedding and norm), not two gathered and reduced apart (FSDP under offload: shard 1).
        tied = Trainer(load_config(None, [*overrides, "model.tie_embeddings=1", "memory.cpu_offload=true",
                                          f"run.dir={Path(out).parent / 'tied'}"])).build()
        model = tied.model
        found["tied_root_params"] = len(model._get_fsdp_state()._fsdp_param_group.fsdp_params)
        found["tied_is_one"] = model.output.weight is model.tok_embeddings.weight
        tied.guard.stop_watching()
        tied.lock.release()
        # ZeRO-2 keeps each block's gathered weights from its forward to its backward (one
        # all-gather per step); ZeRO-3 frees them after the forward (a second one in backward).
        for zero in (2, 3):
            trainer = Trainer(load_config(None, [
                *PARITY_OVERRIDES, f"model.n_layers={LAYERS}", "train.steps=1", "checkpoint.interval=0",
                f"data.path={corpus}", "parallel.dp_shard=2", f"parallel.zero={zero}",
                f"run.dir={Path(out).parent / f'zero{zero}'}"])).build()
            trainer.model(trainer.data.train.batch([rank])["input_ids"])
            weights = list(trainer.model.layers.parameters())
            found[f"zero{zero}_sharded_after_forward"] = sum(isinstance(w, DTensor) for w in weights) / len(weights)
            trainer.guard.stop_watching()
            trainer.lock.release()
    if rank == 0:
        Path(out).write_text(json.dumps(found))


def test_a_rerun_forward_replays_the_gathers_and_attentions_outgoing_collective(tmp_path, small_corpus):
    out = tmp_path / "counts.json"
    start_ranks(_counts, args=(free_port(), str(small_corpus), str(out)), nprocs=2)
    found = json.loads(out.read_text())
    assert (found.pop("tied_root_params"), found.pop("tied_is_one")) == (2, True)
    assert (found.pop("zero2_sharded_after_forward"), found.pop("zero3_sharded_after_forward")) == (0, 1)
    counts = {key: Counter(value) for key, value in found.items()}
    for sp, replayed in ((True, {"all_gather_into_tensor": 2, "reduce_scatter_tensor": 1}),
                         (False, {"all_reduce": 1})):
        for ac in ("op", "full") if sp else ("op",):
            extra = counts[f"{sp}-{ac}"] - counts[f"{sp}-none"]
            assert extra == Counter({op: n * LAYERS for op, n in replayed.items()}), (sp, ac, extra)
