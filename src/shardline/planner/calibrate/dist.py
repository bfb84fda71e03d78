"""CPU cost of the distributed wrappers themselves: DTensor dispatch (TP) and FSDP2's hooks.

On a GPU these run on the host while kernels run on the device; on a CPU they take the
same cores as the compute, and with small blocks they rival it. Measured between two
gloo processes with the trainer's own wrappers (models/llama/parallelize.apply_tp,
parallel/data_parallel.apply_fsdp) on small blocks (SIZES), mostly timed with each
rank's thread CPU clock (waiting on a peer costs none, so the collectives, costed
separately by planner/comm.py, drop out); the size-dependent parts are lines through two sizes:

* tp_layer_overhead_us:   extra CPU time of one TP+SP block's forward + backward over
                          half the plain block's (slope over 1 and 3 blocks: the ends drop out)
* fsdp_layer_overhead_us: the same for one FSDP2-wrapped block (zero 3: gathered twice),
                          with fsdp_layer_overhead_us_per_mb per MB of its fp32 parameters
* tp_layer_wall_us:       TP's block in wall time, so with its collectives and the waits on
                          the peer, which on CPU ranks run far beyond their alpha-beta
                          cost; with tp_layer_wall_us_per_mb per MB of the block's fp32
                          activations (dim 64 x 32 tokens and dim 128 x 8 x 256 tokens)
* tp_head_wall_us:        the same for TP's ends (vocabulary-parallel embedding, output and
                          loss), with tp_head_wall_us_per_mb per MB of a rank's fp32 logits
                          (vocabularies 128 and 4096 at the wide size)
* tp_head_overhead_us, fsdp_root_overhead_us: the same for the rest of the model (the
                          intercept: vocabulary-parallel embedding, output and loss under TP;
                          the root module's hooks under FSDP)
* dtensor_param_overhead_us: extra CPU time per parameter tensor of the host's AdamW +
                          gradient clipping when parameters are DTensors (FSDP, TP)
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import statistics
import tempfile
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from shardline.errors import ShardlineError
from shardline.layout import Layout
from shardline.models.llama import Llama, ModelArgs
from shardline.models.llama.parallelize import apply_tp
from shardline.optim.windowed import WindowedAdamW
from shardline.parallel.collectives import clip_grad_norm
from shardline.parallel.data_parallel import apply_fsdp
from shardline.parallel.dims import ParallelDims
from shardline.planner.calibrate.comm import _free_port

# The blocks measured: FSDP at small and large, TP's wall time at small and wide (1 MB of
# activations, the size training runs at, in short sequences to keep attention cheap).
SIZES = {"small": (64, 1, 32), "large": (192, 1, 512), "wide": (128, 8, 256)}  # dim, sequences, length
BIG_VOCAB = 4096  # TP's ends are timed at vocabularies of 128 and this
REPS, ROUNDS = 3, 7  # each figure: the median over ROUNDS of the fastest of REPS calls


def _fastest(fn, clock=time.thread_time, reps: int = REPS) -> float:
    times = []
    for _ in range(reps):
        t0 = clock()
        fn()
        times.append(clock() - t0)
    return min(times)


def _in_rounds(timers: dict, n_rounds: int = ROUNDS) -> dict:
    """Median over interleaved rounds of each timer's fastest call.

    The figures are differences of nearby timings (wrapped minus plain, 3 blocks minus 1),
    so a slow second on a shared machine must not land on one side only: every timer
    runs once per round, and the median drops the rounds a neighbour disturbed.
    """
    for fn in timers.values():
        fn()  # warm-up
    rounds = {name: [] for name in timers}
    for _ in range(n_rounds):
        for name, fn in timers.items():
            # "-wall" timers: wall time, waiting on the peer included (TP's many small collectives)
            rounds[name].append(_fastest(fn, time.perf_counter if name.endswith("-wall") else time.thread_time))
    return {name: statistics.median(times) for name, times in rounds.items()}


def _model(layers: int, dim: int, vocab: int = 128):
    torch.manual_seed(0)
    args = ModelArgs(dim=dim, n_layers=layers, n_heads=4, n_kv_heads=2, ffn_dim=2 * dim, vocab_size=vocab)
    return Llama(args), args


def _step_fn(model, ids: torch.Tensor):
    labels = torch.randint(0, 128, ids.shape)

    def step():
        out = model(ids)
        if isinstance(out, DTensor):  # vocabulary-sharded logits: the trainer's loss-parallel cross-entropy
            with loss_parallel():
                torch.nn.functional.cross_entropy(out.flatten(0, 1), labels.flatten()).backward()
        else:
            torch.nn.functional.cross_entropy(out.flatten(0, 1), labels.flatten()).backward()

    return step


def _optimizer_fn(model, dims):
    opt = WindowedAdamW(model.parameters(), lr=1e-4, fused=True)  # the trainer's on the host (auto)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)

    def step():
        clip_grad_norm(model, 1.0, dims, defer_to=opt)  # as the trainer clips: as AdamW steps
        opt.step()

    return step


def _dims(world: int, **degrees):
    """The trainer's meshes for `degrees` on `world` ranks."""
    dims = ParallelDims(Layout(**degrees))
    assert dims.world_size == world, (degrees, world)
    dims.build_mesh(torch.device("cpu"))
    return dims


def _worker(rank: int, world: int, port: int, out: str, rounds: int) -> None:
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    try:
        plain_dims, tp_dims, fsdp_dims = _dims(1), _dims(world, tp=world, dp_shard=1), _dims(world, dp_shard=world)
        # Every rank runs the same timers in the same order: FSDP and TP collectives match up.
        timers, n_params, nbytes = {}, {}, {}
        for size, (dim, batch, length) in SIZES.items():
            ids, tokens = torch.randint(0, 128, (batch, length)), batch * length
            for name, wrap, dims in (("plain", None, plain_dims), ("tp", "tp", tp_dims), ("fsdp", "fsdp", fsdp_dims)):
                if (name, size) in (("tp", "large"), ("fsdp", "wide")):
                    continue
                for layers in (1, 3):
                    model, _ = _model(layers, dim)
                    nbytes[size] = {"block_params_mb": 4e-6 * sum(p.numel() for p in model.layers["0"].parameters()),
                                    "activations_mb": 4e-6 * tokens * dim}
                    if wrap == "tp":
                        apply_tp(model, tp_dims.submesh("tp"), sequence_parallel=True, loss_parallel=True)
                    elif wrap == "fsdp":
                        apply_fsdp(model, [model], fsdp_dims, "fp32", cpu_offload=False)
                    if size != "wide":
                        timers[f"{name}{layers}-{size}"] = _step_fn(model, ids)
                    if name != "fsdp" and size != "large":
                        timers[f"{name}{layers}-{size}-wall"] = _step_fn(model, ids)
                    if layers == 3 and size == "small":
                        timers[f"{name}_opt"] = _optimizer_fn(model, dims)
                        n_params[name] = len(list(model.parameters()))
        # TP's ends at a training-sized vocabulary: one block at the wide size, whose ends are
        # its time less the wide block's slope (the blocks do not depend on the vocabulary).
        dim, batch, length = SIZES["wide"]
        for name in ("plain", "tp"):
            model, _ = _model(1, dim, BIG_VOCAB)
            if name == "tp":
                apply_tp(model, tp_dims.submesh("tp"), sequence_parallel=True, loss_parallel=True)
            timers[f"{name}1-vocab-wall"] = _step_fn(model, torch.randint(0, 128, (batch, length)))
        nbytes["logits_mb"] = {str(v): 4e-6 * batch * length * v for v in (128, BIG_VOCAB)}
        t = _in_rounds(timers, rounds)
        res: dict = {"sizes_mb": nbytes}
        for name in n_params:
            res[name] = {"per_param_s": t[f"{name}_opt"] / n_params[name]}
            for key, suffix in (("small", ""), ("large", "_large"), ("small-wall", "_wall"),
                                ("wide-wall", "_wide_wall")):
                if f"{name}1-{key}" not in t:
                    continue
                slope = (t[f"{name}3-{key}"] - t[f"{name}1-{key}"]) / 2
                res[name].update({f"per_layer{suffix}_s": slope, f"ends{suffix}_s": t[f"{name}1-{key}"] - slope})
            if f"{name}1-vocab-wall" in t:
                res[name]["ends_vocab_wall_s"] = t[f"{name}1-vocab-wall"] - res[name]["per_layer_wide_wall_s"]
        if rank == 0:
            Path(out).write_text(json.dumps(res), encoding="utf-8")
    finally:
        dist.destroy_process_group()


def _line(small: tuple[float, float], large: tuple[float, float]) -> tuple[float, float]:
    """(intercept, slope) of the line through two (size, cost) points, both kept >= 0."""
    slope = max(0.0, (large[1] - small[1]) / (large[0] - small[0]))
    return max(0.0, small[1] - slope * small[0]), slope


def measure_wrappers(world: int = 2, rounds: int = ROUNDS) -> tuple[dict, dict]:
    """(profile fields in microseconds, raw per-layer and per-parameter seconds); ~50 s on 2 cores."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "wrappers.json")
        try:
            mp.spawn(_worker, args=(world, _free_port(), out, rounds), nprocs=world, join=True)
        except (mp.ProcessRaisedException, mp.ProcessExitedException, RuntimeError, OSError) as e:
            raise ShardlineError(f"calibrate: measuring the TP/FSDP wrappers with {world} processes "
                                 f"failed: {e}") from None
        raw = json.loads(Path(out).read_text(encoding="utf-8"))
    plain, mb = raw["plain"], raw["sizes_mb"]

    def extra(name: str, key: str, plain_share: float) -> float:
        return max(0.0, raw[name][key] - plain[key] * plain_share) * 1e6

    fields = {"tp_layer_overhead_us": extra("tp", "per_layer_s", 1 / world),
              "tp_head_overhead_us": extra("tp", "ends_s", 1 / world),
              "fsdp_root_overhead_us": extra("fsdp", "ends_s", 1.0),
              "dtensor_param_overhead_us": max(0.0, raw["fsdp"]["per_param_s"] - plain["per_param_s"]) * 1e6}
    # FSDP per block: a fixed part and a part that grows with the block's parameters, which
    # its hooks copy into and out of the gather and reduce-scatter buffers.
    fields["fsdp_layer_overhead_us"], fields["fsdp_layer_overhead_us_per_mb"] = _line(
        (mb["small"]["block_params_mb"], extra("fsdp", "per_layer_s", 1.0)),
        (mb["large"]["block_params_mb"], extra("fsdp", "per_layer_large_s", 1.0)))
    # TP per block in wall time (its collectives and the waits on the peer included), per MB
    # of the block's fp32 activations.
    fields["tp_layer_wall_us"], fields["tp_layer_wall_us_per_mb"] = _line(
        (mb["small"]["activations_mb"], extra("tp", "per_layer_wall_s", 1 / world)),
        (mb["wide"]["activations_mb"], extra("tp", "per_layer_wide_wall_s", 1 / world)))
    # TP's ends (vocabulary-parallel embedding, output, loss) in wall time, per MB of a rank's
    # fp32 logits.
    fields["tp_head_wall_us"], fields["tp_head_wall_us_per_mb"] = _line(
        (mb["logits_mb"]["128"] / world, extra("tp", "ends_wide_wall_s", 1 / world)),
        (mb["logits_mb"][str(BIG_VOCAB)] / world, extra("tp", "ends_vocab_wall_s", 1 / world)))
    return fields, {k: dataclasses.asdict(v) if dataclasses.is_dataclass(v) else v for k, v in raw.items()}
