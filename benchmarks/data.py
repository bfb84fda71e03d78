#!/usr/bin/env python
"""Data at corpus scale: `shardline prepare` throughput, start-up time and memory of a
prepared folder against the raw-text path, and the loader's tokens/s, side by side.

All in one run on a generated corpus (English-like words drawn from the shipped
corpus's vocabulary, documents of 200-8000 words, .jsonl); every figure is the median of
`--repeat` measurements (3 by default):

* prepare: MB/s of input text with 1 worker and with --workers N (and per worker), the
  two interleaved (1, N, 1, N, ...) so that machine drift hits both alike,
  using one given tokenizer (a BPE trained once on the shipped corpus), so no BPE
  training is timed;
* start-up: for each prepared size, a fresh process builds the run's data
  (`build_data`) and reads rank 0's micro-batches of the first step; wall time and peak
  RSS (VmHWM), next to the same for the raw-text path on the smallest size; the
  RSS of a process that only imports the same modules is given as the floor;
* loader: tokens/s of `train.batch()` for random sequences of the largest prepared
  corpus (one thread, warm page cache), as a multiple of 63,815 tokens/s (what one H200
  trained the 1B shape at, shardline-compile bf16: RESULTS.md's GPU table, 2026-12-04; runs
  before 2026-12-06 used a round 60k), and the CPU milliseconds that cost per 1B-shape step of
  one rank (micro-batch 4 x 4096 tokens, 4 micro-batches).

    python benchmarks/data.py                                  # sizes 20 and 100 MB, 3 repeats
    python benchmarks/data.py --sizes 50,500 --workers 8 --json data.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _env import environment, header

from shardline.data.pool import usable_cores, worker_count

REPO = Path(__file__).resolve().parents[1]
H200_1B_TOKENS_PER_S = 63_815  # measured: one H200, the 1B shape, shardline-compile bf16 (RESULTS.md, 2026-12-04)


def generate(path: Path, megabytes: float, seed: int = 0) -> int:
    """A .jsonl corpus of about `megabytes` MB; returns its size in bytes."""
    from shardline.data.sources import read_documents

    words = sorted({w for d in read_documents("")[:200] for w in d.split()})
    rng, target, size = random.Random(seed), int(megabytes * 1e6), 0
    with open(path, "w") as f:
        while size < target:
            text = " ".join(rng.choices(words, k=rng.randint(200, 8000)))
            line = json.dumps({"text": text}) + "\n"
            f.write(line)
            size += len(line)
    return size


def tokenizer_file(tmp: Path) -> Path:
    """A 4096-token BPE trained on the shipped corpus (the raw path's default size)."""
    from shardline.data.sources import read_documents
    from shardline.data.tokenizer import get_tokenizer

    path = tmp / "tokenizer.json"
    get_tokenizer(read_documents(""), "", 4096).save(str(path))
    return path


def time_prepare(corpus: Path, out: Path, tok: Path, workers: int) -> float:
    from shardline.data.prepare import PrepareOptions, prepare

    shutil.rmtree(out, ignore_errors=True)
    start = time.perf_counter()
    prepare(PrepareOptions([str(corpus)], str(out), tokenizer=str(tok), workers=workers, progress=False))
    return time.perf_counter() - start


# VmHWM, not ru_maxrss: a child's ru_maxrss can carry its parent's peak over fork + exec.
_STARTUP = """
import sys, time
start = time.perf_counter()
from shardline.config import load_config
from shardline.data import build_data
imported = time.perf_counter()
if sys.argv[1] != "-":
    cfg = load_config(None, [f"data.path={sys.argv[1]}", f"data.tokenizer={sys.argv[2]}", "train.seq_len=2048",
                             "train.global_batch_size=16", "train.micro_batch_size=4"])
    d = build_data(cfg)
    for idx in d.sampler.rank_micro_batches(0, 0, 1, 4):
        d.train.batch(idx)
hwm = next(line for line in open("/proc/self/status") if line.startswith("VmHWM:"))
print(imported - start, time.perf_counter() - imported, int(hwm.split()[1]) / 1024)
"""


def medians(rows: list[dict]) -> dict:
    """Each figure's median over repeated measurements."""
    return {key: statistics.median(r[key] for r in rows) for key in rows[0]}


def startup(path: str, tok: Path, repeat: int = 1) -> dict:
    """Fresh processes: import time, data build + first step's reads, peak RSS (MiB, VmHWM)."""
    rows = []
    for _ in range(repeat):
        out = subprocess.run([sys.executable, "-c", _STARTUP, path, str(tok)], capture_output=True, text=True,
                             check=True, env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
        imported, build, rss = map(float, out.stdout.split())
        rows.append({"import_s": imported, "startup_s": build, "peak_rss_mib": rss})
    return medians(rows)


def loader_rate(folder: Path, tok: Path, seconds: float = 5.0, repeat: int = 1) -> dict:
    """Tokens/s of random 4 x 4096 micro-batches read from a prepared folder, one thread
    (medians over `repeat` windows of `seconds`)."""
    import numpy as np

    from shardline.config import load_config
    from shardline.data import build_data

    cfg = load_config(None, [f"data.path={folder}", f"data.tokenizer={tok}", "train.seq_len=4096",
                             "train.eval_interval=0"])  # (a small corpus may hold out less than a sequence)
    train, rng, rows = build_data(cfg).train, np.random.default_rng(0), []
    for _ in range(repeat):
        tokens, cpu0, start = 0, time.process_time(), time.perf_counter()
        while time.perf_counter() - start < seconds:
            batch = train.batch(rng.integers(0, len(train), 4))
            tokens += batch["input_ids"].numel()
        wall, cpu = time.perf_counter() - start, time.process_time() - cpu0
        rate = tokens / wall
        rows.append({"tokens_per_s": rate, "x_h200_1b": rate / H200_1B_TOKENS_PER_S,
                     "cpu_ms_per_1b_step": 1e3 * cpu / tokens * 4 * 4 * 4096})
    return medians(rows)


def prepare_rates(corpus: Path, folder: Path, tok: Path, workers: int, repeat: int, nbytes: int) -> dict:
    """Prepare MB/s with 1 worker and with `workers`, interleaved (1, N, 1, N, ...): run all of one
    then all of the other, and a drift of the machine's load lands on one side only."""
    counts = sorted({1, workers})
    times: dict[int, list[float]] = {w: [] for w in counts}
    for _ in range(repeat):
        for w in counts:
            times[w].append(time_prepare(corpus, folder, tok, w))
    rates = {}
    for w, t in times.items():
        seconds = statistics.median(t)
        ran = worker_count(w)  # (past the usable cores the library runs as many as those)
        rates[f"workers={ran}"] = {"mb": nbytes / 1e6, "seconds": seconds, "mb_per_s": nbytes / 1e6 / seconds,
                                   "mb_per_s_per_worker": nbytes / 1e6 / seconds / ran}
    return rates


def corpus_sizes(p: argparse.ArgumentParser, text: str) -> list[float]:
    """--sizes in MB, each positive and finite: a size of 0 writes an empty corpus (prepare refuses it, a traceback
    after the tokenizer's training), an infinite one never stops writing."""
    try:
        sizes = [float(s) for s in text.split(",")]
    except ValueError:
        sizes = []
    if not sizes or not all(math.isfinite(s) and s > 0 for s in sizes):
        p.error(f"--sizes {text}: must be positive numbers of MB, comma-separated")
    return sizes


def run(args) -> dict:
    sizes = args.sizes
    tmp = Path(tempfile.mkdtemp(prefix="shardline-data-bench-", dir=args.tmp))
    os.environ.setdefault("SHARDLINE_CACHE", str(tmp / "cache"))
    try:
        tok = tokenizer_file(tmp)
        n = args.repeat
        res = {"env": environment(),
               "sizes_mb": sizes, "workers": args.workers, "prepare": {}, "startup": {}, "cpu_count": usable_cores(),
               "repeat": n}
        for mb in sizes:
            corpus = tmp / f"corpus{mb:g}.jsonl"
            nbytes = generate(corpus, mb)
            folder = tmp / f"prep{mb:g}"
            if mb == max(sizes):
                res["prepare"] = prepare_rates(corpus, folder, tok, args.workers, n, nbytes)
            else:
                time_prepare(corpus, folder, tok, args.workers)
            res["startup"][f"prepared {mb:g} MB"] = startup(str(folder), tok, n)
            if mb == min(sizes):
                res["startup"][f"raw {mb:g} MB"] = startup(str(corpus), tok, n)
        res["startup"]["imports only"] = startup("-", tok, n)
        res["loader"] = loader_rate(tmp / f"prep{max(sizes):g}", tok, repeat=n)
        return res
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def table(res: dict) -> str:
    lines = [header(res["env"]), f"medians of {res['repeat']} measurements",
             f"prepare ({res['cpu_count']} cores this process may use)",
             "  workers    MB    seconds   MB/s   MB/s/worker"]
    for name, r in res["prepare"].items():
        lines.append(f"  {name:<9} {r['mb']:6.1f} {r['seconds']:8.1f} {r['mb_per_s']:7.2f} "
                     f"{r['mb_per_s_per_worker']:8.2f}")
    lines += ["start-up (fresh process: build the data, read step 0's micro-batches)",
              "  data              import s  start-up s  peak RSS MiB"]
    for name, r in res["startup"].items():
        lines.append(f"  {name:<17} {r['import_s']:8.2f} {r['startup_s']:10.2f} {r['peak_rss_mib']:12.0f}")
    ld = res["loader"]
    lines += ["loader (random 4 x 4096 micro-batches from the largest prepared corpus, one thread)",
              f"  {ld['tokens_per_s']:,.0f} tokens/s = {ld['x_h200_1b']:.0f}x an H200 on the 1B shape "
              f"({H200_1B_TOKENS_PER_S:,} tokens/s, measured); "
              f"{ld['cpu_ms_per_1b_step']:.1f} CPU ms per rank per 1B step (4 micro-batches of 4 x 4096)"]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="20,100", help="corpus sizes in MB, comma-separated (default 20,100)")
    p.add_argument("--workers", type=int, default=usable_cores(), help="prepare workers (default: the usable cores)")
    p.add_argument("--repeat", type=int, default=3, help="measurements per figure; medians are reported (default 3)")
    p.add_argument("--tmp", default=None, help="folder for the generated corpora (default: the system's)")
    p.add_argument("--json", nargs="?", const="-", default=None, help="write the figures as JSON (- = stdout)")
    args = p.parse_args()
    if args.repeat < 1:
        p.error(f"--repeat {args.repeat}: must be at least 1")
    args.sizes = corpus_sizes(p, args.sizes)
    res = run(args)
    if args.json == "-":
        print(table(res), file=sys.stderr)
        print(json.dumps(res, indent=1))
        return
    print(table(res))
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
