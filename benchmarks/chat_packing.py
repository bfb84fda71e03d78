"""Chat packing: best-fit (ours, data/packing.py) against next-fit in stream order, side by side.

A chat sequence holds whole conversations. How many positions a packing leaves to fill (positions
that train on nothing) is the throughput a chat run loses; how long it takes is start-up every
rank pays. This script packs synthetic conversation lengths both ways and reports, per length mix:
sequences, the fill share, the time to pack (median of `--repeat`; best-fit builds the rows, the
next-fit baseline only counts them, so the two times are not like for like), and the time to
assemble micro-batches from memory-mapped shards (a prepared folder's `TokenShards`) for
best-fit's gathered rows against the text path's contiguous windows over the same stream.

    .venv/bin/python benchmarks/chat_packing.py                     # ~1 min on 2 cores
    .venv/bin/python benchmarks/chat_packing.py --conversations 200000 --json out.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from _env import environment, header
from shardline.data.packing import PackedSequences, pack_rows
from shardline.data.shards import TokenShards


def next_fit_rows(sizes: list[int], width: int) -> int:
    """The baseline: each row takes the next conversation while it fits (a longer one is a row, cut)."""
    rows, held = 0, 0
    for size in sizes:
        if held and held + size > width:
            rows, held = rows + 1, 0
        if size >= width:
            rows += 1
        else:
            held += size
    return rows + (held > 0)


def length_mixes(n: int, rng: np.random.Generator) -> dict[str, tuple[np.ndarray, int]]:
    """(conversation lengths, seq_len) per mix: uniform, and a heavy-tailed one like real chat data."""
    tail = np.minimum(rng.lognormal(5.5, 1.0, n).astype(np.int64) + 16, 60_000)  # median ~260 tokens
    return {
        "uniform 50-1500, seq 4096": (rng.integers(50, 1500, n), 4096),
        "lognormal (median ~260), seq 512": (tail, 512),
        "lognormal (median ~260), seq 2048": (tail, 2048),
        "lognormal (median ~260), seq 4096": (tail, 4096),
    }


def least_conversations(batch: int) -> int:
    """Conversations enough for `batch` rows of 4096 to read, both ways, whatever their lengths: a row holds at most
    256 of length_mixes' shortest (16 tokens), and the text rows need batch x 4096 + 1 tokens."""
    return 256 * batch + 1


def timed(fn, repeat: int) -> tuple[float, object]:
    times, out = [], None
    for _ in range(repeat):
        start = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), out


def pack_mix(sizes: np.ndarray, seq_len: int, repeat: int) -> dict:
    width = seq_len + 1
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
    total = int(sizes.sum())
    used = int(np.minimum(sizes, width).sum())  # the tokens a row can hold of them
    ours_s, rows = timed(lambda: pack_rows(starts, total, width), repeat)
    base_s, base_rows = timed(lambda: next_fit_rows(sizes.tolist(), width), repeat)
    ours_fill, base_fill = 1 - used / (len(rows.lengths) * width), 1 - used / (base_rows * width)
    return {"conversations": len(sizes), "seq_len": seq_len, "cut": rows.truncated,
            "best_fit": {"sequences": len(rows.lengths), "fill": round(ours_fill, 5), "pack_s": round(ours_s, 3)},
            "next_fit": {"sequences": base_rows, "fill": round(base_fill, 5), "pack_s": round(base_s, 3),
                         "pack_s_counts_only": True},
            "useful_tokens_ratio": round((1 - ours_fill) / (1 - base_fill), 4)}


def batch_speed(sizes: np.ndarray, seq_len: int, batch: int, shards: int, repeat: int) -> dict:
    """Micro-batches a second from `shards` memory-mapped shards, chat rows (gathered) against text
    windows, and the time to count the labels of a global batch of 512 chat rows (every step does)."""
    total = int(sizes.sum())
    stream = np.random.default_rng(1).integers(0, 32_000, total).astype(np.uint16)
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
    with tempfile.TemporaryDirectory() as tmp:
        bounds = np.linspace(0, total, shards + 1).astype(np.int64)
        paths = []
        for k in range(shards):
            path = Path(tmp) / f"shard{k}.bin"
            stream[bounds[k]:bounds[k + 1]].tofile(path)
            paths.append(path)
        sizes_of = np.diff(bounds).tolist()
        tokens = TokenShards(paths, sizes_of, np.uint16)
        mask = TokenShards(paths, sizes_of, np.uint16)  # any values: only the reading is timed
        chat = PackedSequences.from_stream(tokens, starts, seq_len, mask)
        text = PackedSequences.from_stream(tokens, starts, seq_len)
        rng = np.random.default_rng(2)
        picks = [rng.choice(min(len(chat), len(text)), batch, replace=False) for _ in range(20)]
        chat_s, _ = timed(lambda: [chat.batch(p) for p in picks], repeat)
        text_s, _ = timed(lambda: [text.batch(p) for p in picks], repeat)
        step = rng.choice(len(chat), min(512, len(chat)), replace=False)
        count_s, _ = timed(lambda: chat.count_labels(step), repeat)
    return {"batch": batch, "shards": shards, "chat_batches_per_s": round(20 / chat_s, 1),
            "text_batches_per_s": round(20 / text_s, 1), "chat_vs_text": round(text_s / chat_s, 3),
            "count_labels_512_rows_ms": round(count_s * 1e3, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--conversations", type=int, default=2_000_000, help="per length mix")
    parser.add_argument("--repeat", type=int, default=3, help="medians of this many packings")
    parser.add_argument("--batch", type=int, default=8, help="sequences a micro-batch, for the read speed")
    parser.add_argument("--shards", type=int, nargs="+", default=[4, 256],
                        help="shard counts to read micro-batches from (a prepared folder's are 32 M tokens each)")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    if args.repeat < 1:
        parser.error(f"--repeat {args.repeat}: must be at least 1")
    if args.batch < 1:
        parser.error(f"--batch {args.batch}: must be at least 1")
    if args.conversations < least_conversations(args.batch):  # (0: no row, every fill divides by zero)
        parser.error(f"--conversations {args.conversations}: must be at least {least_conversations(args.batch)} "
                     f"(256 x --batch + 1: the read timing's micro-batch of rows, however short each one is)")
    rng = np.random.default_rng(0)
    results = {"env": environment(), "mixes": {}}
    print(header(results["env"]))
    print(f"{'length mix':<36} {'seqs best/next':>17} {'fill best':>10} {'fill next':>10} "
          f"{'useful x':>9} {'pack s best/next*':>17}")
    for name, (sizes, seq_len) in length_mixes(args.conversations, rng).items():
        r = pack_mix(sizes, seq_len, args.repeat)
        results["mixes"][name] = r
        b, n = r["best_fit"], r["next_fit"]
        print(f"{name:<36} {b['sequences']:>8}/{n['sequences']:<8} {b['fill']:>10.2%} {n['fill']:>10.2%} "
              f"{r['useful_tokens_ratio']:>9.3f} {b['pack_s']:>8.2f}/{n['pack_s']:<8.2f}")
    print("* pack s: best-fit builds the rows; next-fit counts only (no rows built): not a like-for-like time")
    sizes, seq_len = length_mixes(min(args.conversations, 200_000), rng)["lognormal (median ~260), seq 4096"]
    results["reads"] = [batch_speed(sizes, seq_len, args.batch, n, args.repeat) for n in args.shards]
    for r in results["reads"]:
        print(f"micro-batches of {r['batch']} x {seq_len} from {r['shards']} shards: chat {r['chat_batches_per_s']}/s, "
              f"text {r['text_batches_per_s']}/s ({r['chat_vs_text']:.2f}x); count_labels of 512 chat rows "
              f"{r['count_labels_512_rows_ms']} ms")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
