"""Peak memory of one forward + backward at a 128k vocabulary, plain loss against the
chunked one (`train.loss_chunk_tokens`), in the same run.

Each variant runs in its own fresh process (so one's allocations cannot hide in
another's peak) on the same model, weights and batch: a small Llama (dim 256, 2 layers)
with Llama 3's vocabulary of 128256, whose output projection and cross-entropy then
dominate a step's memory, as they do on the 1B shape at seq 4096. Two peaks are taken:

- tensors: the largest sum of bytes of live tensor storages during forward + backward
  (parameters and their gradients included), counted op by op by a dispatch mode, so it
  is exact and the same on every machine;
- RSS: the process's peak resident memory (`ru_maxrss`) minus its RSS just before the
  step, what the operating system saw (allocator and library noise included).

The loss and the largest absolute difference of the output weight's gradient, over all of
its elements (vocab x dim), are printed against the plain variant: the chunked loss must give
the same numbers. (Before 2026-12-06 the difference was taken over the first 8 rows only.)

    .venv/bin/python benchmarks/loss_memory.py [--tokens 2048] [--chunks 0,1024,256] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
import weakref
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from _env import environment, header

VOCAB = 128256


class PeakTensorBytes(TorchDispatchMode):
    """Live tensor-storage bytes, op by op; `peak` is their maximum (storages counted once)."""

    def __init__(self, already_live: list[torch.Tensor]):
        super().__init__()
        self.refs: dict[int, int] = {}  # storage pointer -> live tensors on it
        self.live = self.peak = 0
        for t in already_live:
            self._track(t)

    def _track(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        ptr, size = storage.data_ptr(), storage.nbytes()
        if ptr not in self.refs:
            self.refs[ptr] = 0
            self.live += size
            self.peak = max(self.peak, self.live)
        self.refs[ptr] += 1
        weakref.finalize(t, self._release, ptr, size)

    def _release(self, ptr: int, size: int) -> None:
        self.refs[ptr] -= 1
        if not self.refs[ptr]:
            del self.refs[ptr]
            self.live -= size

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                self._track(t)
        return out


def build(tokens: int, seq_len: int, seed: int = 0):
    """The model and one batch, identical in every process."""
    from shardline.models.llama import Llama, ModelArgs

    args = ModelArgs(dim=256, n_layers=2, n_heads=8, n_kv_heads=4, vocab_size=VOCAB, ffn_dim=768,
                     max_seq_len=seq_len)
    model = Llama(args)
    model.init_weights(seed=seed)
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (tokens // seq_len, seq_len), generator=gen)
    return model, ids, ids.roll(-1, dims=1)


def measure(chunk: int, tokens: int, seq_len: int, grad_path: str = "") -> dict:
    """One forward + backward with the given chunk size (0: the plain loss), in this process; the
    output weight's whole gradient is saved to `grad_path` (too large for the JSON line) to compare."""
    from shardline.models.loss import LinearCrossEntropy

    torch.set_num_threads(2)
    model, ids, labels = build(tokens, seq_len)
    model.loss = LinearCrossEntropy(chunk)
    rss_before = _rss_mib()
    started = time.perf_counter()
    mode = PeakTensorBytes(list(model.parameters()) + list(model.buffers()) + [ids, labels])
    start_mib = mode.live / 2**20  # the weights and the batch
    with mode:
        loss = model(ids, labels=labels) / labels.numel()
        loss.backward()
    seconds = time.perf_counter() - started
    grad = model.output.weight.grad
    out = {"chunk_tokens": chunk, "peak_tensor_mib": mode.peak / 2**20, "weights_mib": start_mib,
           "rss_peak_mib": _peak_rss_mib(),
           "rss_start_mib": rss_before, "loss": loss.item(), "seconds": seconds,
           "grad_norm": grad.norm().item()}
    if grad_path:
        torch.save(grad, grad_path)
    return out


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def run_variant(chunk: int, tokens: int, seq_len: int, grad_path: str) -> dict:
    """measure() in a fresh process."""
    here = str(Path(__file__).resolve().parent)  # runnable from any directory
    code = (f"import json, sys; sys.path.insert(0, {here!r}); import loss_memory as m; "
            f"print(json.dumps(m.measure({chunk}, {tokens}, {seq_len}, {grad_path!r})))")
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    result["peak_rss_over_start_mib"] = result["rss_peak_mib"] - result["rss_start_mib"]
    return result


def variants(chunks: list[int], tokens: int, seq_len: int) -> list[dict]:
    """Each chunk size in a fresh process, and the max abs difference of its whole output-weight
    gradient from the first's (`max_grad_diff`)."""
    with tempfile.TemporaryDirectory() as tmp:
        results = [run_variant(c, tokens, seq_len, f"{tmp}/grad{i}.pt") for i, c in enumerate(chunks)]
        base = torch.load(f"{tmp}/grad0.pt")
        for i, r in enumerate(results):
            r["max_grad_diff"] = (torch.load(f"{tmp}/grad{i}.pt") - base).abs().max().item()
    return results


def chunk_sizes(parser: argparse.ArgumentParser, text: str) -> list[int]:
    """--chunks as sizes: a bad one is refused here, not as a traceback from a variant's process."""
    parts = text.split(",")
    if not all(part.strip().isdecimal() for part in parts):
        parser.error(f"--chunks takes whole numbers of tokens, comma-separated (0: the plain loss), not {text!r}")
    return [int(part) for part in parts]


def check_batch(parser: argparse.ArgumentParser, tokens: int, seq_len: int) -> None:
    """The batch is tokens // seq_len whole sequences: any other count would be rounded down unseen
    (the header then reporting tokens the step never ran), or to no sequence at all."""
    if seq_len <= 0:
        parser.error(f"--seq-len must be positive, not {seq_len}")
    if tokens <= 0 or tokens % seq_len:
        parser.error(f"--tokens must be a positive multiple of --seq-len ({seq_len}), not {tokens}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=2048, help="tokens in the micro-batch (a multiple of --seq-len)")
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--chunks", default="0,1024,256", help="loss_chunk_tokens values; 0 = the plain loss")
    parser.add_argument("--json", default=None, help="also write the figures to this file")
    a = parser.parse_args()
    chunks = chunk_sizes(parser, a.chunks)
    check_batch(parser, a.tokens, a.seq_len)
    env = environment()
    print(header(env), flush=True)
    results = variants(chunks, a.tokens, a.seq_len)
    base = results[0]
    logits_mib = a.tokens * VOCAB * 4 / 2**20
    print(f"vocab {VOCAB}, {a.tokens} tokens (seq {a.seq_len}); fp32 logits of the batch: {logits_mib:.0f} MiB")
    print(f"weights and batch (in every peak): {base['weights_mib']:.0f} MiB")
    print("| loss_chunk_tokens | peak tensors MiB | ratio | above weights MiB | peak RSS over start MiB | loss "
          "| max grad diff | s |")
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        diff = r["max_grad_diff"]
        print(f"| {r['chunk_tokens'] or 'off'} | {r['peak_tensor_mib']:.0f} | "
              f"{r['peak_tensor_mib'] / base['peak_tensor_mib']:.2f} | {r['peak_tensor_mib'] - r['weights_mib']:.0f} | "
              f"{r['peak_rss_over_start_mib']:.0f} | "
              f"{r['loss']:.6f} | {diff:.1e} | {r['seconds']:.2f} |")
    if a.json:
        with open(a.json, "w") as f:
            settings = {"tokens": a.tokens, "seq_len": a.seq_len, "sequences": a.tokens // a.seq_len, "vocab": VOCAB,
                        "chunks": chunks}
            json.dump({"env": env, "settings": settings, "variants": results}, f, indent=1)


if __name__ == "__main__":
    main()
