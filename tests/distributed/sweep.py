"""Check many layouts for parity with one process at once, without stopping at the first failure.

A tool for hunting bugs in layout combinations the suite does not run (pytest does not
collect it). Each case trains the parity model (harness.PARITY_OVERRIDES) on WORLD gloo
ranks and is compared with one process: every step's loss, the evaluation, the final
parameters and the gradient norms. A case given as `A|B` runs its first half (overrides A)
to step 2 and resumes it under overrides B.

    python -m tests.distributed.sweep WORLD "COMMON OVERRIDES" name="OVERRIDES" [name="A|B" ...]

e.g. `python -m tests.distributed.sweep 4 "model.tie_embeddings=1"
zbv_fsdp="parallel.dp_shard=2 parallel.pp=2 parallel.pp_schedule=zbv parallel.pp_virtual_stages=2
train.micro_batch_size=1"`. COMMON applies to the one-process reference too (model shape,
precision, faults); layout keys belong in the cases. SWEEP_DIR=path keeps the runs there.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

from shardline.config import load_config
from shardline.data.prepare import PrepareOptions, prepare
from shardline.trainer import Trainer
from tests.conftest import write_small_corpus
from tests.distributed.harness import PARITY_OVERRIDES, assert_same_run, run_world


def sweep(world: int, common: list[str], cases: dict[str, str], root: Path) -> dict[str, str]:
    """Run every case on `world` ranks (one spawn) and the reference in this process; returns
    each case's verdict: "ok" or the first mismatch."""
    (root / "raw").mkdir(parents=True)
    raw = write_small_corpus(root / "raw")
    data = root / "prepared"
    prepare(PrepareOptions(inputs=[str(raw)], out=str(data), vocab_size=512, progress=False))
    base = [*PARITY_OVERRIDES, f"data.path={data}", *common]
    Trainer(load_config(None, [*base, f"run.dir={root / 'reference'}"])).build().train()
    jobs = []
    for name, spec in cases.items():
        halves = spec.split("|")
        if len(halves) == 2:
            jobs += [(root / name, [*base, *halves[0].split(), "train.stop_at_step=2"]),
                     (root / name, [*base, *halves[1].split()])]
        else:
            jobs.append((root / name, [*base, *spec.split()]))
    run_world(world, jobs)
    verdicts = {}
    for name in cases:
        try:
            assert_same_run(root / name, root / "reference")
            verdicts[name] = "ok"
        except AssertionError as e:
            verdicts[name] = f"MISMATCH {str(e)[:300]}"
    return verdicts


def main(argv: list[str]) -> int:
    if len(argv) < 3:
        print(__doc__)
        return 2
    cases = dict(arg.split("=", 1) for arg in argv[2:])
    keep = os.environ.get("SWEEP_DIR")  # keep the runs there (metrics.jsonl, checkpoints) to compare by hand
    with tempfile.TemporaryDirectory(prefix="sweep") as tmp:
        verdicts = sweep(int(argv[0]), argv[1].split(), cases, Path(keep) if keep else Path(tmp))
    for name, verdict in verdicts.items():
        print(f"{name}: {verdict}")
    return 0 if all(v == "ok" for v in verdicts.values()) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
