"""Run trainer layouts on N real gloo processes and compare them with one process.

One start per world size runs several layouts in turn (each in its own run dir), and the
ranks fork from a server that has imported torch and the trainer once (`start_ranks`), so
starting processes costs little.
"""

from __future__ import annotations

import contextlib
import json
import os
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from shardline.config import load_config
from shardline.models.factory import args_from_json, build_meta_model
from shardline.resilience.checkpoint import Checkpointer, load_weights, read_meta
from tests.ports import free_port

# optim.eps=1e-6: a layout changes the order of floating-point sums, so gradients differ
# in their last bits. For an embedding row seen once in a batch the gradient is ~1e-9,
# and Adam's g / (sqrt(v) + eps) with eps=1e-8 would blow that noise up into a full-size
# update; eps=1e-6 keeps float noise from being amplified, so what is compared is the
# layout's math, not Adam's sensitivity to rounding.
# Global batch 8 of micro-batches of 2: every layout here still accumulates (4 micro-batches in
# one process, 2 per rank at dp 2) and feeds a pipeline at least as many micro-batches as stages.
# Three steps: a resharding resume trains steps 1-2 under one layout and step 3 under another.
# optim.implementation=for-loop: AdamW's foreach kernels over DTensors make torch work out
# a sharding for every foreach call of a new layout (a 3-step FSDP 4 run took 2.8-3.8 s on
# 2 cores with foreach, 1.7-2.3 s with the loop); the per-parameter loop computes the same
# update. Foreach over DTensors keeps cases of its own (test_parity: *_foreach), fused one
# (zero1_fused_*), and the offload runs check what `auto` picks.
PARITY_STEPS = 3
ALL_STEPS = list(range(1, PARITY_STEPS + 1))
PARITY_OVERRIDES = [
    "model.dim=64", "model.n_layers=4", "model.n_heads=4", "model.n_kv_heads=2", "model.ffn_dim=128",
    "train.seq_len=32", "train.global_batch_size=8", "train.micro_batch_size=2", f"train.steps={PARITY_STEPS}",
    f"train.eval_interval={PARITY_STEPS}", "train.eval_batches=1", "optim.warmup_steps=1", "optim.lr=3e-3",
    "optim.eps=1e-6", "optim.implementation=for-loop", "data.vocab_size=512",
    f"checkpoint.interval={PARITY_STEPS}", "metrics.log_interval=1", "metrics.progress=none",
    "metrics.tensorboard=false",
]


# Ranks fork from multiprocessing's fork server, which imports these once for the session:
# spawned ranks each imported them again (~2.7 s a process; a 4-rank start took 11 s on 2
# cores, a forked one 2 s). The server imports nothing else and starts no thread before it forks.
mp.set_forkserver_preload(["torch", "shardline.trainer", "tests.distributed.harness"])


def start_ranks(fn, args: tuple, nprocs: int) -> None:
    """fn(rank, *args) on `nprocs` fresh processes, forked from the preloaded server.

    A forked rank sees the environment the server started with (the session's), not later
    changes in this process: pass what a rank needs in `args`, as the workers here do.
    """
    mp.start_processes(fn, args=args, nprocs=nprocs, start_method="forkserver")


@contextlib.contextmanager
def gloo_rank(rank: int, world: int, port: int, timeout_s: float | None = None):
    """This process as `rank` of a gloo group of `world` on this host, for the block's duration
    (one torch thread: up to 8 processes share 2 cores). `timeout_s`: the group's, for tests
    whose failure is a peer left waiting (the default is 30 minutes)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    timeout = {"timeout": timedelta(seconds=timeout_s)} if timeout_s else {}
    dist.init_process_group("gloo", rank=rank, world_size=world, **timeout)
    try:
        yield
    finally:
        dist.destroy_process_group()


def outcome(work) -> str:
    """What work() ended with on this rank: its text, a ShardlineError's one line, or "not agreed:
    <type>" for any other error (a peer gone, or left waiting for the group's timeout)."""
    from shardline.errors import ShardlineError

    try:
        return work()
    except ShardlineError as e:
        return f"{type(e).__name__}: {e}"
    except Exception as e:
        return f"not agreed: {type(e).__name__}"


def _worker(rank: int, world: int, port: int, jobs: list[tuple[str, list[str]]]) -> None:
    from shardline.trainer import Trainer

    with gloo_rank(rank, world, port):
        for run_dir, overrides, *config in jobs:  # config: a TOML file the overrides apply to
            trainer = Trainer(load_config(config[0] if config else None, [*overrides, f"run.dir={run_dir}"])).build()
            trainer.train()
            if trainer.runner.pipeline is not None:  # what the schedule's stages still hold after the step
                schedule = trainer.runner.pipeline.schedule
                stages = [schedule._stage] if hasattr(schedule, "_stage") else schedule._stages
                held = sum(len(stage.output_chunks) for stage in stages)
                (Path(run_dir) / f"held_outputs.{rank}.json").write_text(json.dumps(held))


def run_world(world: int, jobs: list[tuple]) -> None:
    """Train every (run_dir, overrides[, config file]) job on `world` spawned processes."""
    plain = [(str(d), list(o), *map(str, config)) for d, o, *config in jobs]
    start_ranks(_worker, args=(world, free_port(), plain), nprocs=world)


def losses(run_dir: Path, kind: str = "train", key: str = "") -> dict[int, float]:
    records = map(json.loads, (Path(run_dir) / "metrics.jsonl").read_text().splitlines())
    key = key or ("loss" if kind == "train" else "eval_loss")
    return {r["step"]: r[key] for r in records if r["kind"] == kind}


def assert_same_grad_norms(run: Path, reference: Path, rtol: float = 1e-5) -> None:
    """The logged global gradient norms (before clipping) of every step agree (a step that
    overflowed logs its norm as a string, "Infinity" or "NaN": the same one)."""
    got, want = losses(run, key="grad_norm"), losses(reference, key="grad_norm")
    assert sorted(got) == sorted(want), (got, want)
    for step in want:
        if isinstance(want[step], str) or isinstance(got[step], str):
            assert got[step] == want[step], (step, got[step], want[step])
        else:
            assert abs(got[step] - want[step]) <= rtol * want[step], (step, got[step], want[step])


def final_params(run_dir: Path) -> dict[str, torch.Tensor]:
    """The parameters of the run's newest checkpoint, gathered into one plain model."""
    ckpt = Checkpointer(Path(run_dir), keep=1).latest_valid()
    model = build_meta_model(args_from_json(read_meta(ckpt)["model_args"]))
    model.init_weights()
    load_weights(ckpt, model)
    return {k: v.detach() for k, v in model.state_dict().items()}


def assert_params_close_in_norm(run: Path, reference: Path, rel: float) -> None:
    """Each trained parameter tensor within `rel` of the reference's, in relative Frobenius
    norm of the difference. For runs in 16-bit or float8 arithmetic, where AdamW's
    normalisation carries a rounding difference in a rarely seen embedding row to ~5e-3 in one
    element (no elementwise bound fits), while a gradient lost or scaled moves whole tensors."""
    ref = final_params(reference)
    for name, value in final_params(run).items():
        err = float((value - ref[name]).norm() / ref[name].norm())
        assert err <= rel, (name, err, rel)


def assert_same_run(run: Path, reference: Path, rtol: float = 1e-5, atol: float = 1e-5,
                    evaluated: bool = True, grad_rtol: float | None = None, params_rel: float | None = None) -> None:
    """Every step's loss and gradient norm, the evaluations (unless the runs had none) and the
    final parameters agree (elementwise, or in norm when params_rel is given). Losses alone
    would not do: over a few AdamW steps one block's lost gradient moves them by 1e-4
    relative, the parameters by 1e-2. A gradient scaled by a constant shows in the gradient
    norm only: AdamW's update is nearly blind to it, and so are the parameters."""
    got, want = losses(run), losses(reference)
    assert sorted(got) == sorted(want), (got, want)
    for step in want:
        assert abs(got[step] - want[step]) <= rtol * abs(want[step]), (step, got[step], want[step])
    assert_same_grad_norms(run, reference, rtol if grad_rtol is None else grad_rtol)
    got_eval, want_eval = losses(run, "eval"), losses(reference, "eval")
    # A run stopped early evaluates where it stopped too: compare the reference's steps.
    assert bool(want_eval) is evaluated and want_eval.keys() <= got_eval.keys(), (got_eval, want_eval)
    for step in want_eval:
        assert abs(got_eval[step] - want_eval[step]) <= rtol * want_eval[step], (step, got_eval, want_eval)
    starts = [next(r for r in map(json.loads, (Path(p) / "metrics.jsonl").read_text().splitlines())
                   if r.get("event") == "start") for p in (run, reference)]
    assert starts[0]["params"] == starts[1]["params"], starts  # the whole model's, a pipeline stage's or not
    assert all(s["layout"].startswith("tp") and s["world_size"] >= 1 for s in starts), starts  # what ran, logged
    if params_rel is not None:
        assert_params_close_in_norm(run, reference, params_rel)
    else:
        assert_same_params(run, reference, rtol, atol)


def assert_same_params(run: Path, reference: Path, rtol: float = 1e-5, atol: float = 1e-5) -> None:
    """The final parameters agree elementwise (0, 0: bit for bit), every one of them."""
    got, ref = final_params(run), final_params(reference)
    assert sorted(got) == sorted(ref), (sorted(got), sorted(ref))
    for name, value in got.items():
        torch.testing.assert_close(value, ref[name], rtol=rtol, atol=atol, msg=lambda m: f"{name}: {m}")
