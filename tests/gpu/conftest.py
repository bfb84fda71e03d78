"""What the GPU tests share: one training run per distinct config, and room for dynamo's recompiles.

A GPU session is short (benchmarks/gpu_check.sh gives these tests a few minutes), and each
CUDA run compiles kernels (flex attention, compiled blocks) the first time it meets a
shape, so a baseline several tests compare against is trained once (`trained`).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch._dynamo.config

from shardline.config import load_config
from shardline.trainer import Trainer
from tests.conftest import tiny_overrides
from tests.distributed.harness import losses


@pytest.fixture(scope="session", autouse=True)
def _room_for_recompiles():
    # One process runs every GPU test: its distinct flex-attention and block configurations
    # add up to dynamo's default limit of 8 recompiles a function, past which a test would
    # silently run the function uncompiled, testing the wrong path. A training run has one.
    before = torch._dynamo.config.recompile_limit
    torch._dynamo.config.recompile_limit = max(before, 64)
    yield
    torch._dynamo.config.recompile_limit = before


@pytest.fixture(scope="session")
def trained(tmp_path_factory, small_corpus):
    """train(*overrides) -> {step: loss} of a tiny-config run with those overrides, trained once
    per session for each distinct list (the run dir apart)."""
    done: dict[tuple[str, ...], dict[int, float]] = {}

    def train(*overrides: str) -> dict[int, float]:
        if overrides not in done:
            run: Path = tmp_path_factory.mktemp("run")
            Trainer(load_config(None, tiny_overrides(run, small_corpus, *overrides))).build().train()
            done[overrides] = losses(run)
        return dict(done[overrides])

    return train
