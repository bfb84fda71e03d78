"""Memory on a CUDA device: expandable segments in effect, peak allocated and reserved in
the metrics, and metrics.profile_steps' trace and allocator snapshot. Skipped without CUDA.

What the CPU suite cannot show: that torch (2.11 on the GPU machine) reads the allocator
setting shardline writes, and that the CUDA-only files (kernels in the trace, the memory
snapshot) are written and readable.
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys

import pytest

from shardline.config import load_config
from shardline.trainer import Trainer
from tests.conftest import tiny_overrides

pytestmark = pytest.mark.gpu

CUDA = ["run.device=cuda", "train.precision=fp32", "train.steps=4", "train.eval_interval=0", "checkpoint.interval=0",
        "metrics.log_interval=2", "train.attention=sdpa"]  # no flex compile: not what is tested here

# Run in a fresh process: torch reads the allocator setting once, when CUDA first
# allocates, and this test process may have started CUDA already.
ALLOCATOR_PROBE = """
import json, sys, torch
from shardline.config import load_config
from shardline.trainer import Trainer
Trainer(load_config(None, json.loads(sys.argv[1])))
torch.zeros(1, device="cuda")
snapshot = torch.cuda.memory._snapshot()
# Three readings, the first one present wins (torch 2.11's library names the first two;
# the accelerator-wide getter is newer): the segment the zeros went into, the allocator's
# settings in the snapshot, the settings string.
segments = [s for s in snapshot["segments"] if "is_expandable" in s]
if segments:
    on = any(s["is_expandable"] for s in segments)
elif "allocator_settings" in snapshot:
    on = snapshot["allocator_settings"].get("expandable_segments")
else:
    on = "expandable_segments:True" in torch._C._accelerator_getAllocatorSettings()
print(json.dumps({"expandable": bool(on)}))
"""


def _probe(overrides: list[str], **env: str) -> bool:
    clean = {k: v for k, v in os.environ.items() if k not in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")}
    out = subprocess.run([sys.executable, "-c", ALLOCATOR_PROBE, json.dumps(overrides)], env={**clean, **env},
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])["expandable"]


def test_expandable_segments_are_in_effect_unless_the_user_says_otherwise(tmp_path, small_corpus):
    overrides = tiny_overrides(tmp_path / "run", small_corpus, *CUDA)
    assert _probe(overrides) is True
    assert _probe([*overrides, "memory.expandable_segments=false"]) is False
    assert _probe(overrides, PYTORCH_ALLOC_CONF="expandable_segments:False") is False  # the user's wins


@pytest.fixture(scope="module")
def profiled_run(tmp_path_factory, small_corpus):
    run = tmp_path_factory.mktemp("profiled") / "run"
    cfg = load_config(None, tiny_overrides(run, small_corpus, *CUDA, "metrics.profile_steps=[2, 3]"))
    Trainer(cfg).build().train()
    return run


def test_profile_steps_write_a_trace_with_kernels_and_a_memory_snapshot(profiled_run):
    trace = json.loads((profiled_run / "profile" / "rank0_steps2-3.json").read_text())
    names = {e.get("name", "") for e in trace["traceEvents"]}
    assert {n for n in names if n.startswith("shardline.step.")} == {"shardline.step.2", "shardline.step.3"}
    assert any(e.get("cat") == "kernel" for e in trace["traceEvents"]), "no CUDA kernels in the trace"
    with open(profiled_run / "profile" / "rank0_steps2-3_memory.pickle", "rb") as f:
        snapshot = pickle.load(f)
    assert snapshot["segments"] and any(snapshot["device_traces"]), "the snapshot holds no allocation history"


def test_peak_allocated_and_reserved_are_logged(profiled_run):
    lines = (profiled_run / "metrics.jsonl").read_text().splitlines()
    train = [r for r in map(json.loads, lines) if r["kind"] == "train"]
    assert [r["step"] for r in train] == [2, 4]
    for rec in train:
        assert 0 < rec["peak_mem_gib"] <= rec["peak_reserved_gib"], rec


def test_the_rng_state_is_this_gpus_and_older_all_gpu_states_still_load():
    """A rank saves its own GPU's generator, so a resume that sees fewer GPUs loads it."""
    import torch

    from shardline.resilience.recovery import get_rng_state, set_rng_state

    state = get_rng_state()
    assert isinstance(state["cuda"], torch.Tensor)
    first = torch.rand(4, device="cuda")
    set_rng_state(state)
    assert torch.equal(torch.rand(4, device="cuda"), first)
    mine = torch.cuda.current_device()
    older = [torch.cuda.get_rng_state(i) for i in range(torch.cuda.device_count())] + [state["cuda"]] * 2
    older[mine] = state["cuda"]  # saved with more GPUs: this rank's own is at its index
    torch.rand(4, device="cuda")  # move the generator on
    set_rng_state({**state, "cuda": older})
    assert torch.equal(torch.cuda.get_rng_state(), state["cuda"])
    set_rng_state({**state, "cuda": []})  # fewer than this rank's index: left as it is, no IndexError


@pytest.mark.parametrize("compiled", [False, True])
def test_an_moe_block_keeps_in_bf16_what_the_planner_counts(compiled):
    """What the CPU suite cannot count: on CUDA the grouped GEMM takes its rows cast to bf16 (c bytes a
    dim), where the CPU's runs them in fp32, so fp32 there cannot tell the planner's c + 8 (eagerly) or 2c
    (compiled) bytes a routed slot from 3c or c + 4. A shared expert adds its casts beside the router's
    fp32 input."""
    import torch

    from shardline.planner import activations as act
    from tests.unit.test_planner_memory import _autograd_saved_bytes_per_token, _moe_block

    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("the grouped GEMM runs in bf16 on Hopper and newer (a loop of GEMMs before)")
    args = _moe_block(4, shared=1)
    saved = _autograd_saved_bytes_per_token(args, "bf16", compiled=compiled, device="cuda")
    block = act.llama_compiled_block(args, "bf16") if compiled else act.llama_block(args, "bf16")
    assert saved == pytest.approx(act.block_bytes_per_token(block), rel=0.02)
