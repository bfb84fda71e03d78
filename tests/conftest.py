"""Shared fixtures: a small slice of the shipped corpus and a tiny, fast config."""

from __future__ import annotations

import contextlib
import gzip
import json
import os
from pathlib import Path

import pytest
import torch.distributed as dist

from shardline.config import Config, load_config
from shardline.data.sources import shipped_corpus


def pytest_addoption(parser):
    parser.addoption("--phase", choices=("all", "shared", "alone"), default="all",
                     help="shared: leave out the tests marked alone (make test runs these on xdist workers); "
                          "alone: only those (make test runs them after, one at a time); all (default): every test")


# The files that take longest (seconds of test time, summed over their tests, in a 2-worker
# run), started first: `make test` hands xdist workers whole files in this order
# (--no-loadscope-reorder), so the last file to start is a short one and neither worker idles
# at the end while the other runs a three-minute file (longest first; xdist's own order is by
# the number of tests, which put these two-test files last).
HEAVY_FIRST = ("tests/distributed/test_compile_parallel.py", "tests/distributed/test_parity.py",
               "tests/e2e/test_benchmarks.py", "tests/e2e/test_recovery.py",
               "tests/distributed/test_expert_parallel.py", "tests/e2e/test_kill_loop.py",
               "tests/distributed/test_context_parallel.py", "tests/distributed/test_float8_fsdp.py",
               "tests/unit/test_compile.py")


def pytest_collection_modifyitems(config, items):
    """Tests marked gpu are skipped, with the reason shown, on a machine without CUDA; --phase
    picks the tests marked alone or the others (as a deselection, so it combines with -m and -k);
    the files of HEAVY_FIRST come first (a stable sort: the rest keep their order)."""
    import torch

    rank = {name: i for i, name in enumerate(HEAVY_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(rank)))

    phase = config.getoption("phase")
    if phase != "all":
        kept, dropped = [], []
        for item in items:
            (kept if (item.get_closest_marker("alone") is not None) == (phase == "alone") else dropped).append(item)
        if dropped:
            config.hook.pytest_deselected(items=dropped)
            items[:] = kept
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (run benchmarks/gpu_check.sh on one)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _no_launcher(monkeypatch):
    """Tests run as a process no launcher started, even when pytest itself runs inside a Slurm
    job or under torchrun: tests that mean a launcher set its variables themselves."""
    for key in ("SLURM_JOB_ID", "SLURM_STEP_ID", "SLURM_STEP_NUM_TASKS", "SLURM_RESTART_COUNT", "TORCHELASTIC_RUN_ID",
                "TORCHELASTIC_RESTART_COUNT"):
        monkeypatch.delenv(key, raising=False)


@pytest.fixture(scope="session", autouse=True)
def _isolated_cache(tmp_path_factory):
    # Trained tokenizers are cached per session so tests never depend on ~/.cache.
    os.environ["SHARDLINE_CACHE"] = str(tmp_path_factory.mktemp("cache"))


def write_small_corpus(folder: Path) -> Path:
    """The first 150 chapters of the shipped corpus (~500 KB), as a .jsonl file in `folder`."""
    lines = gzip.decompress(shipped_corpus().read_bytes()).decode().splitlines()[:150]
    path = folder / "small.jsonl"
    path.write_text("\n".join(lines) + "\n")
    assert json.loads(lines[0])["text"].startswith("Genesis 1")
    return path


@pytest.fixture(scope="session")
def small_corpus(tmp_path_factory) -> Path:
    """The small corpus as a raw file: every run that reads it tokenizes it at start-up."""
    return write_small_corpus(tmp_path_factory.mktemp("data"))


@pytest.fixture(scope="session")
def small_prepared(tmp_path_factory) -> Path:
    """The small corpus tokenized once by `shardline prepare`, with the BPE a raw run of
    data.vocab_size=512 trains (the tiny and parity configs' size), so it gives the raw file's
    batches bit for bit (tests/e2e/test_prepare.py holds that). For the many-rank runs: every
    rank of every run would otherwise tokenize the raw file again (~0.8 s of a 4-rank run here)."""
    from shardline.data.prepare import PrepareOptions, prepare

    raw = write_small_corpus(tmp_path_factory.mktemp("data_raw"))
    out = tmp_path_factory.mktemp("data_prepared") / "small"
    prepare(PrepareOptions(inputs=[str(raw)], out=str(out), vocab_size=512, progress=False))
    return out


TINY_OVERRIDES = [
    "model.dim=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", "model.ffn_dim=128",
    "train.seq_len=32", "train.global_batch_size=8", "train.micro_batch_size=4", "train.steps=12",
    "train.eval_interval=6", "train.eval_batches=1", "optim.warmup_steps=2", "data.vocab_size=512",
    "checkpoint.interval=6", "metrics.log_interval=1", "metrics.progress=none", "metrics.tensorboard=false",
]


def resealed(folder: Path, changed: str) -> None:
    """A checkpoint's manifest made to agree with its edited file `changed` (relative to `folder`),
    as a crafted one's maker would, or as an older shardline's file reads after a test edits it."""
    import hashlib

    manifest = json.loads((folder / "manifest.json").read_text())
    data = (folder / changed).read_bytes()
    manifest["files"][changed] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (folder / "manifest.json").write_text(json.dumps(manifest))


def tiny_overrides(run_dir: Path, corpus: Path, *extra: str) -> list[str]:
    return [*TINY_OVERRIDES, f"run.dir={run_dir}", f"data.path={corpus}", *extra]


@pytest.fixture
def tiny_config(tmp_path, small_prepared):
    """The tiny run's config, on the prepared corpus (the raw file's batches without tokenizing
    it again for every run: ~0.4 s a run here). TINY_OVERRIDES' shape (64 wide, 2 layers) and 12
    steps lie over any preset given: `model.dim=0` and the like give a preset its own shape back."""
    def make(*extra: str, run_dir: Path | None = None) -> Config:
        return load_config(None, tiny_overrides(run_dir or tmp_path / "run", small_prepared, *extra))

    return make


def autograd_nodes(out) -> list:
    """Every autograd node behind the tensor `out` (a walk of its grad_fn graph), for tests
    that count which nodes a backward pass runs."""
    seen, stack, nodes = set(), [out.grad_fn], []
    while stack:
        node = stack.pop()
        if node is not None and node not in seen:
            seen.add(node)
            nodes.append(node)
            stack.extend(next_node for next_node, _ in node.next_functions)
    return nodes


@contextlib.contextmanager
def no_group_left():
    """A one-process run under CPU offload makes the process its own one-rank group: destroyed on
    the way out, for the next test in this worker."""
    try:
        yield
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
