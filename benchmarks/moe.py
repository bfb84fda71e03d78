"""Mixture-of-experts cost, side by side in one run.

1. Layer: tokens/s (forward + backward) of the MoE feed-forward against a dense SwiGLU
   of the same active FLOPs (hidden = top_k x expert_ffn_dim), and of the experts run
   as one grouped matmul (torch._grouped_mm) against a loop of per-expert matmuls.
   The MoE layer also pays for routing, sorting and the scatter back; this measures it.
2. Expert parallelism: one training step of `tiny-moe` on 2 gloo ranks with ep = 2,
   and the share of the step spent in the token all-to-alls (dispatch and combine,
   forward and backward), timed around each exchange on rank 0.

Medians of --repeats. On a 2-core CPU the gloo ranks share the cores: the ep share
ranks the overhead, it is not a network measurement.

    python benchmarks/moe.py [--tokens 4096] [--repeats 5] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from _env import environment, header
from shardline.models.llama.model import FeedForward, ModelArgs
from shardline.models.moe import MoEArgs
from shardline.models.moe.layer import MoEFeedForward, loop_experts

DIM, EXPERTS, TOP_K, EXPERT_FFN = 256, 8, 2, 256


def _median_seconds(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def layer_rows(tokens: int, repeats: int) -> list[dict]:
    torch.manual_seed(0)
    args = ModelArgs(dim=DIM, n_layers=1, n_heads=4, vocab_size=8, ffn_dim=TOP_K * EXPERT_FFN,
                     moe=MoEArgs(n_experts=EXPERTS, top_k=TOP_K, expert_ffn_dim=EXPERT_FFN))
    moe, dense = MoEFeedForward(args), FeedForward(DIM, TOP_K * EXPERT_FFN)
    for p in [*moe.parameters(), *dense.parameters()]:
        torch.nn.init.normal_(p, std=0.02)
    x = torch.randn(tokens // 256, 256, DIM, requires_grad=True)
    sorted_x = torch.randn(tokens * TOP_K, DIM, requires_grad=True)
    counts = torch.full((EXPERTS,), tokens * TOP_K // EXPERTS)
    e = moe.experts

    def step(fn):
        def run():
            out = fn()
            out.backward(torch.ones_like(out))  # a dense gradient (a sum's is a 0-stride view)
        return run

    cases = {
        "dense SwiGLU (same active FLOPs)": step(lambda: dense(x)),
        "MoE layer (route + grouped experts + combine)": step(lambda: moe(x)),
        "experts: grouped matmul": step(lambda: e(sorted_x, counts)),
        "experts: loop of matmuls": step(lambda: loop_experts(sorted_x, counts, e.w1, e.w3, e.w2)),
    }
    rows = []
    for name, fn in cases.items():
        seconds = _median_seconds(fn, repeats)
        rows.append({"case": name, "seconds": seconds, "tokens_per_s": tokens / seconds})
    rows[1]["vs_dense"] = rows[0]["seconds"] / rows[1]["seconds"]
    rows[2]["vs_loop"] = rows[3]["seconds"] / rows[2]["seconds"]
    return rows


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ep_worker(rank: int, port: int, repeats: int, out: str, run: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2",
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    from shardline.config import load_config
    from shardline.parallel.expert import dispatch
    from shardline.trainer import Trainer

    spent = [0.0]
    plain = dispatch.exchange

    def timed(*args):
        started = time.perf_counter()
        result = plain(*args)
        spent[0] += time.perf_counter() - started
        return result

    dispatch.exchange = timed  # benchmark instrumentation only
    # One run dir for both ranks (each its own was refused: the ranks must run one config).
    cfg = load_config(None, ["model.preset=tiny-moe", "parallel.dp_shard=2", "parallel.ep=2",
                             "train.seq_len=256", "train.global_batch_size=8", "train.micro_batch_size=4",
                             "train.eval_interval=0", "checkpoint.interval=0", "metrics.progress=none",
                             "metrics.tensorboard=false", f"run.dir={run}"])
    trainer = Trainer(cfg).build()
    steps, shares = [], []
    for _ in range(repeats + 1):
        spent[0] = 0.0
        started = time.perf_counter()
        trainer.train_step()
        seconds = time.perf_counter() - started
        steps.append(seconds)
        shares.append(spent[0] / seconds)
    trainer.guard.stop_watching()
    trainer.lock.release()
    if rank == 0:
        Path(out).write_text(json.dumps({"case": "ep2 training step (tiny-moe, 2 gloo ranks)",
                                         "step_s": statistics.median(steps[1:]),
                                         "all_to_all_share": statistics.median(shares[1:])}))
    dist.destroy_process_group()


def ep_row(repeats: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "ep.json")
        mp.start_processes(_ep_worker, args=(_free_port(), repeats, out, str(Path(tmp) / "run")), nprocs=2,
                           start_method="spawn")
        return json.loads(Path(out).read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.tokens < 256 or args.tokens % 256 or args.tokens * TOP_K % EXPERTS:
        parser.error(f"--tokens={args.tokens} must be a positive multiple of 256 (the rows are 256-token sequences, "
                     "spread evenly over the experts)")
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    env = environment()  # before the runs: the load of what else shares the cores
    if not args.json:
        print(header(env), flush=True)
    rows = layer_rows(args.tokens, args.repeats)
    ep = ep_row(args.repeats)
    if args.json:
        print(json.dumps({"env": env, "layer": rows, "ep": ep}))
        return
    print(f"MoE layer: dim {DIM}, {EXPERTS} experts, top {TOP_K}, expert ffn {EXPERT_FFN}, {args.tokens} tokens")
    for r in rows:
        extra = "".join(f" | {k.replace('_', ' ')} {r[k]:.2f}x" for k in ("vs_dense", "vs_loop") if k in r)
        print(f"  {r['case']:<48} {r['tokens_per_s']:>10,.0f} tok/s{extra}")
    print(f"{ep['case']}: {ep['step_s']:.3f} s/step, all-to-all {100 * ep['all_to_all_share']:.1f}% of it")


if __name__ == "__main__":
    main()
