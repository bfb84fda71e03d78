"""What the GPU tests share: one training run per distinct config, and room for dynamo's recompiles.

A GPU session is short (benchmarks/gpu_check.sh gives these tests a few minutes), and each
CUDA run compiles kernels (flex attention, compiled blocks) the first time it meets a
shape, so a baseline several tests compare against is trained once (`trained`).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch._dynamo.config

from shardline.config import load_config
from shardline.trainer import Trainer
from tests.conftest import tiny_overrides
from tests.distributed.harness import losses


@pytest.fixture(scope="package", autouse=True)
def _room_for_recompiles():
    """One process runs every GPU test, and their distinct flex-attention and block
    configurations can add up to dynamo's default limit of 8 recompiles of a function, past
    which the function would run uncompiled with only a warning: a compile test would then
    pass on eager code. Here the limit is 64 and hitting it fails the test (a training run
    compiles each of them once). For this package only: the settings go back after it."""
    with torch._dynamo.config.patch(recompile_limit=64, fail_on_recompile_limit_hit=True):
        yield


@pytest.fixture(scope="session")
def trained(tmp_path_factory, small_corpus):
    """train(*overrides) -> {step: loss} of a tiny-config run with those overrides, trained once
    per session for each distinct list (the run dir apart). `train.seen[overrides]` holds what
    the run did beyond its losses: the attention kernel its start event names and the graphs
    dynamo compiled (a test of a kernel or of compile checks the run used it)."""
    from torch._dynamo.utils import counters

    done: dict[tuple[str, ...], dict[int, float] | Exception] = {}

    def train(*overrides: str) -> dict[int, float]:
        if overrides not in done:
            run: Path = tmp_path_factory.mktemp("run")
            try:
                counters.clear()
                Trainer(load_config(None, tiny_overrides(run, small_corpus, *overrides))).build().train()
                done[overrides] = losses(run)
                records = map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
                start = next(r for r in records if r.get("event") == "start")
                train.seen[overrides] = {"attention": start["attention"],
                                         "graphs": counters["stats"]["unique_graphs"]}
            except Exception as e:  # a failed baseline fails each test that needs it, trained once
                done[overrides] = e
        if isinstance(done[overrides], Exception):
            raise done[overrides]
        return dict(done[overrides])

    train.seen = {}
    return train
