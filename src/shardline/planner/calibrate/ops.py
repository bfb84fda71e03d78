"""The measurements behind `shardline calibrate`, each fitted to what the cost model uses.

Every timing is the fastest of a few repetitions (see `time_it`). Compute is measured
the way training runs it, forward and backward together, so the efficiencies the
planner applies to both are what both reach:

* linear layers: F.linear forward + backward (three GEMMs, two on transposed operands),
  6·m·n·k FLOPs, over shapes from thin to square;
* attention: SDPA forward + backward with a document mask, 3.5 x the forward FLOPs;
* element-wise work: an RMSNorm + SwiGLU-style gate + residual block, forward and
  backward with fresh outputs (allocation included), its bytes counted op by op with
  a dispatch mode exactly as the cost model counts them (inputs + outputs per op);
* the loss: cross-entropy forward + backward over a vocabulary, against the 32 bytes
  per entry the cost model charges (exp/log make it slower than plain traffic on CPUs);
* per-op overhead of tiny ops; AdamW + clipping as bytes of traffic per parameter.
"""

from __future__ import annotations

import functools
import statistics
import time

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from shardline.devices import synchronize
from shardline.layout import Layout
from shardline.models.llama.model import sdpa_document_mask
from shardline.optim.fused import FusedAdamW
from shardline.optim.windowed import WindowedAdamW
from shardline.parallel.collectives import clip_grad_norm
from shardline.parallel.dims import ParallelDims

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
_VIEWS = ("view", "t.", "_unsafe_view", "transpose", "expand", "unsqueeze", "split", "detach", "alias",
          "slice", "select", "as_strided", "_reshape_alias", "squeeze", "permute")


def time_it(fn, device: torch.device, budget_s: float = 0.3, max_reps: int = 20, clock=time.perf_counter) -> float:
    """Fastest of repeated fn() calls after one warm-up, within about `budget_s`.

    The minimum, not the median: on a shared machine other processes only ever slow a
    run down, so the fastest repetition is the best estimate of the machine itself.
    `clock` may be time.thread_time: CPU time, which other processes do not inflate
    (meaningful with one torch thread, which then runs every kernel on this thread).
    """
    fn()
    synchronize(device)
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < max_reps and (len(times) < 3 or time.perf_counter() - start < budget_s):
        t0 = clock()
        fn()
        synchronize(device)
        times.append(max(clock() - t0, 1e-9))
    return min(times)


class _ByteCounter(TorchDispatchMode):
    """Bytes read and written by every non-view op run under it (inputs + outputs)."""

    def __init__(self):
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not func.__name__.startswith(_VIEWS):
            leaves = tree_leaves((args, kwargs, out))
            self.bytes += sum(t.numel() * t.element_size() for t in leaves if isinstance(t, torch.Tensor))
        return out


def measure_linear(dtype: str, device: torch.device, peak: float, shapes, clock=time.perf_counter) -> list[dict]:
    """(m tokens, n out, k in): F.linear forward + backward, efficiency of 6·m·n·k FLOPs."""
    out = []
    for m, n, k in shapes:
        x = torch.randn(m, k, device=device, dtype=DTYPES[dtype], requires_grad=True)
        w = torch.randn(n, k, device=device, dtype=DTYPES[dtype], requires_grad=True)
        grad = torch.randn(m, n, device=device, dtype=DTYPES[dtype])
        t = time_it(functools.partial(_linear_step, x, w, grad), device, clock=clock)
        out.append({"m": m, "n": n, "k": k, "seconds": t, "eff": 6 * m * n * k / t / peak})
    return out


def _linear_step(x: torch.Tensor, w: torch.Tensor, grad: torch.Tensor) -> None:
    F.linear(x, w).backward(grad)
    x.grad = w.grad = None


def measure_attention(dtype: str, device: torch.device, peak: float, shapes, clock=time.perf_counter) -> list[dict]:
    out = []
    for b, heads, s, hd in shapes:
        q, k, v = (torch.randn(b, heads, s, hd, device=device, dtype=DTYPES[dtype], requires_grad=True)
                   for _ in range(3))
        docs = torch.arange(s, device=device)[None] * 2 // s  # two documents per sequence
        mask = sdpa_document_mask(docs, DTYPES[dtype])  # the trainer's: additive on a CPU, boolean on a GPU
        t = time_it(functools.partial(_attention_step, q, k, v, mask), device, clock=clock)
        flops = 3.5 * 4 * b * s * s * heads * hd  # forward + 2.5x backward, no causal skipping
        out.append({"b": b, "s": s, "heads": heads, "head_dim": hd, "seconds": t, "eff": flops / t / peak})
    return out


def _attention_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> None:
    F.scaled_dot_product_attention(q, k, v, attn_mask=mask).sum().backward()


def _elementwise_block(x: torch.Tensor, w: torch.Tensor, dtype: str) -> None:
    """A norm on the fp32 residual, a gate in the compute dtype (cast as autocast would), a residual add."""
    n = (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)) * w
    n = n.to(DTYPES[dtype])
    (x + F.silu(n) * n).sum().backward()


def measure_elementwise(device: torch.device, dtype: str = "fp32", sizes=((2048, 256), (2048, 768)),
                        clock=time.perf_counter) -> float:
    """GB/s that norm/gate/residual ops reach, forward + backward, as the cost model counts bytes."""
    rates = []
    for tokens, width in sizes:
        x = torch.randn(tokens, width, device=device, requires_grad=True)
        w = torch.ones(width, device=device, requires_grad=True)
        counter = _ByteCounter()
        with counter:
            _elementwise_block(x, w, dtype)
        t = time_it(functools.partial(_elementwise_block, x, w, dtype), device, clock=clock)
        rates.append(counter.bytes / t / 1e9)
    return statistics.median(rates)


def measure_loss_eff(device: torch.device, bandwidth_gbs: float, tokens: int = 2048, vocab: int = 4096,
                     clock=time.perf_counter) -> float:
    """Share of the element-wise rate that cross-entropy forward + backward reaches (32 B per entry)."""
    logits = torch.randn(tokens, vocab, device=device, requires_grad=True)
    labels = torch.randint(0, vocab, (tokens,), device=device)
    t = time_it(lambda: F.cross_entropy(logits, labels).backward(), device, clock=clock)
    return 32 * tokens * vocab / t / (bandwidth_gbs * 1e9)


def measure_bandwidth(device: torch.device, sizes_mib=(2, 8, 32), clock=time.perf_counter) -> dict[str, float]:
    """Streaming GB/s of c = a + b (3 x size bytes, preallocated output), for the record."""
    out = {}
    for mib in sizes_mib:
        n = mib * 2**20 // 4
        a, b, c = (torch.randn(n, device=device) for _ in range(3))
        t = time_it(functools.partial(torch.add, a, b, out=c), device, clock=clock)
        out[f"{mib}MiB"] = 3 * n * 4 / t / 1e9
    return out


def measure_op_overhead(device: torch.device, n_ops: int = 200, clock=time.perf_counter) -> float:
    """Microseconds per tiny op, forward and backward (counted as 2.6 ops per forward op)."""
    x = torch.ones(16, device=device, requires_grad=True)

    def chain():
        y = x
        for _ in range(n_ops):
            y = y * 1.0001
        y.sum().backward()

    return time_it(chain, device, clock=clock) / (n_ops * 2.6) * 1e6


def measure_optimizer(device: torch.device, bandwidth_gbs: float, n_params: int = 4_000_000,
                      clock=time.perf_counter) -> float:
    """AdamW + gradient clipping time, as bytes of memory traffic per parameter: the AdamW the trainer
    steps there (fused on a GPU, the clip in its kernel: shardline/optim/fused.py; on the host a window
    at a time, shardline/optim/windowed.py)."""
    sizes = [n_params // 40] * 40
    params = [torch.nn.Parameter(torch.randn(s, device=device)) for s in sizes]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = (FusedAdamW(params, lr=1e-4) if device.type == "cuda"
           else WindowedAdamW(params, lr=1e-4, foreach=True))

    model = torch.nn.ParameterList(params)
    dims = ParallelDims(Layout())

    def step():
        clip_grad_norm(model, 1.0, dims, defer_to=opt)  # the trainer's clip: inside AdamW's step
        opt.step()

    t = time_it(step, device, clock=clock)
    return t * bandwidth_gbs * 1e9 / sum(sizes)
