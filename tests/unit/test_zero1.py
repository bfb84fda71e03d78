"""ZeRO-1's optimizer on real gloo ranks: each rank keeps states for its rows only, and
the update equals plain AdamW on the full parameters (end-to-end parity is in
tests/distributed/test_parity.py)."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh

from shardline.parallel.zero1 import Zero1AdamW, row_range
from tests.distributed.harness import free_port


def test_row_ranges_cut_like_dtensor_shard0():
    assert [row_range(5, r, 2) for r in range(2)] == [(0, 3), (3, 5)]
    assert [row_range(2, r, 4) for r in range(4)] == [(0, 1), (1, 2), (2, 2), (2, 2)]  # empty slices


def _worker(rank: int, world: int, port: int, errors) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard",))
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 3))
        plain = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 3))
        plain.load_state_dict(model.state_dict())
        sharded = Zero1AdamW(model, [{"params": list(model.parameters())}], mesh, "dp_shard", lr=0.1)
        reference = torch.optim.AdamW(plain.parameters(), lr=0.1)
        for step in range(3):
            x = torch.randn(4, 6, generator=torch.Generator().manual_seed(step))
            for m, opt in ((model, sharded), (plain, reference)):
                m(x).square().sum().backward()  # same data on every rank: the all-reduce is a no-op
                opt.step()
                opt.zero_grad()
        for (name, p), q in zip(model.named_parameters(), plain.parameters()):
            if not torch.allclose(p, q, atol=1e-6):
                errors.put(f"rank {rank}: {name} differs from plain AdamW")
            if p.grad is not None:
                errors.put(f"rank {rank}: zero_grad left {name}.grad")
        held = sum(s["exp_avg"].numel() for s in sharded.state.values())
        mine = sum((lambda lo, hi: (hi - lo) * (p[0].numel() if p.ndim > 1 else 1))(
            *row_range(p.shape[0], rank, world)) for p in model.parameters())
        if held != mine or held >= sum(p.numel() for p in model.parameters()):
            errors.put(f"rank {rank} holds {held} moment values, expected its rows' {mine}")
    finally:
        dist.destroy_process_group()


def test_zero1_updates_like_adamw_with_a_share_of_the_states():
    errors = mp.get_context("spawn").SimpleQueue()
    mp.start_processes(_worker, args=(2, free_port(), errors), nprocs=2, start_method="spawn")
    found = []
    while not errors.empty():
        found.append(errors.get())
    assert not found, found
