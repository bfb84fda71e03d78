"""ZeRO-1's optimizer on real gloo ranks: each rank keeps states for its rows only, and
the update equals plain AdamW on the full parameters (end-to-end parity is in
tests/distributed/test_parity.py)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh

from shardline.parallel.zero1 import Zero1AdamW, row_range
from tests.distributed.harness import start_ranks
from tests.ports import free_port


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
    start_ranks(_worker, args=(2, free_port(), errors), nprocs=2)
    found = []
    while not errors.empty():
        found.append(errors.get())
    assert not found, found


# ---- under tensor parallelism: the dp group of each tp coordinate ---------------------


def _tp_models(tp_mesh):
    """A column- then row-parallel MLP over `tp_mesh`, and the same MLP whole."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(0)
    plain = torch.nn.Sequential(torch.nn.Linear(6, 8, bias=False), torch.nn.ReLU(), torch.nn.Linear(8, 5, bias=False))
    model = torch.nn.Sequential(torch.nn.Linear(6, 8, bias=False), torch.nn.ReLU(), torch.nn.Linear(8, 5, bias=False))
    model.load_state_dict(plain.state_dict())
    parallelize_module(model, tp_mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    return model, plain


def _train_tp(model, plain, opt, reference, dp_rank: int, dp: int) -> None:
    """Three steps; dp rank r sees batch r, the reference the sum over every rank's batch."""
    for step in range(3):
        xs = [torch.randn(4, 6, generator=torch.Generator().manual_seed(10 * step + r)) for r in range(dp)]
        model(xs[dp_rank]).square().sum().backward()
        sum(plain(x).square().sum() for x in xs).backward()
        opt.reduce_gradients(scatter=True)
        for o in (opt, reference):
            o.step()
            o.zero_grad()


def _tp_worker(rank: int, world: int, port: int, errors) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "tp"))
        model, _ = _tp_models(mesh["tp"])
        try:
            Zero1AdamW(model, [{"params": list(model.parameters())}], mesh, "tp", lr=0.1)
            errors.put(f"rank {rank}: cutting states over tp, which shards the parameters, was accepted")
        except ValueError as e:
            if "already shards parameter 0.weight" not in str(e):
                errors.put(f"rank {rank}: unexpected message {e}")
        for problem in _check_fused(mesh):
            errors.put(f"rank {rank}: {problem}")
        for wrong_group in (False, True):
            for problem in _check_tp_run(mesh, wrong_group):
                errors.put(("wrong group: " if wrong_group else f"rank {rank}: ") + problem)
        for problem in _check_experts(rank, world):  # the same 4 ranks (one spawn for both tests)
            errors.put(f"experts, rank {rank}: {problem}")
    finally:
        dist.destroy_process_group()


def _check_fused(mesh) -> list[str]:
    """The column-parallel weight's slice (its columns) is a strided view, which the fused AdamW
    updates wrongly on CPU (outside the slice) and refuses on GPU: an explicit fused is refused
    in one line, auto takes foreach."""
    from shardline.config import OptimConfig
    from shardline.errors import ConfigError
    from shardline.optim import build_optimizer

    model, _ = _tp_models(mesh["tp"])
    problems = []
    try:
        build_optimizer(model, OptimConfig(implementation="fused"), mesh, "dp_shard")
        problems.append("the fused AdamW was taken for strided slices")
    except ConfigError as e:
        if "optim.implementation=fused is invalid with this layout: ZeRO-1's slices of 0.weight" not in str(e):
            problems.append(f"unexpected message {e}")
    chosen = build_optimizer(model, OptimConfig(implementation="auto"), mesh, "dp_shard")
    if chosen.defaults.get("fused") or not chosen.defaults.get("foreach"):
        problems.append(f"auto took {chosen.defaults} for strided slices")
    return problems


def _check_tp_run(mesh, wrong_group: bool) -> list[str]:
    """What differs from plain AdamW after three steps (parameters and saved states)."""
    model, plain = _tp_models(mesh["tp"])
    opt = Zero1AdamW(model, [{"params": list(model.parameters())}], mesh, "dp_shard", lr=0.1)
    if wrong_group:  # the deliberate mistake: reduce and gather over the tp ranks
        opt.cuts[0].group = mesh.get_group("tp")
    reference = torch.optim.AdamW(plain.parameters(), lr=0.1)
    _train_tp(model, plain, opt, reference, mesh.get_local_rank("dp_shard"), 2)
    states, problems = opt.checkpoint_state()["state"], []
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        if not torch.allclose(p.full_tensor(), q, atol=1e-6):
            problems.append(f"{name} differs from plain AdamW")
        # The saved state, reassembled from every (dp, tp) block, is the whole model's.
        if not torch.allclose(states[name]["exp_avg"].full_tensor(), reference.state[q]["exp_avg"], atol=1e-6):
            problems.append(f"saved exp_avg of {name} is not plain AdamW's")
    return problems


@pytest.fixture(scope="module")
def world4_problems() -> list[str]:
    errors = mp.get_context("spawn").SimpleQueue()
    start_ranks(_tp_worker, args=(4, free_port(), errors), nprocs=4)
    found = []
    while not errors.empty():
        found.append(errors.get())
    return found


def test_zero1_under_tp_shards_over_the_dp_group_of_each_tp_coordinate(world4_problems):
    """Matches AdamW on the whole model and saves its states; the same check catches a
    reduce-scatter and all-gather over the wrong (tp) group. The fused AdamW is kept off its
    strided slices."""
    found = [e for e in world4_problems if not e.startswith("experts")]
    assert [e for e in found if not e.startswith("wrong group")] == [], found
    assert any(e.startswith("wrong group") and "differs from plain AdamW" in e for e in found), found


# ---- routed experts under expert parallelism: a second cut, over efsdp -----------------


def _check_experts(rank: int, world: int) -> list[str]:
    """Three steps of a dense weight and 4 experts split over ep (ParallelDims' own meshes)."""
    from torch.distributed.tensor import Shard, distribute_tensor

    from shardline.layout import Layout
    from shardline.parallel.collectives import clip_grad_norm
    from shardline.parallel.dims import ParallelDims

    dims = ParallelDims(Layout(dp_shard=4, ep=2, zero=1))
    dims.build_mesh(torch.device("cpu"))
    torch.manual_seed(0)
    plain = torch.nn.ParameterDict({"dense": torch.nn.Parameter(torch.randn(5, 6)),
                                    "experts": torch.nn.Parameter(torch.randn(4, 3, 6))})
    model = torch.nn.ParameterDict({"dense": torch.nn.Parameter(plain["dense"].detach().clone()),
                                    "experts": torch.nn.Parameter(distribute_tensor(
                                        plain["experts"].detach(), dims.submesh("ep"), [Shard(0)]))})
    groups, problems = [{"params": list(model.values())}], []
    try:
        Zero1AdamW(model, groups, dims.zero1_mesh(), dims.zero1_shard_dim, lr=0.1)
        problems.append("experts split over ep were accepted on the dense mesh")
    except ValueError as e:
        if "lack the dims" not in str(e):
            problems.append(f"unexpected refusal: {e}")
    opt = Zero1AdamW(model, groups, dims.zero1_mesh(), dims.zero1_shard_dim, dims.zero1_expert_cut(), lr=0.1)
    reference = torch.optim.AdamW(plain.values(), lr=0.1)
    for step in range(3):
        xs = [torch.randn(2, 6, generator=torch.Generator().manual_seed(10 * step + r)) for r in range(world)]
        _expert_loss(model, xs, rank).backward()
        sum((x @ plain["dense"].T).square().sum() + torch.einsum("ti,eoi->teo", x, plain["experts"]).square().sum()
            for x in xs).backward()
        opt.reduce_gradients(scatter=True)
        norm = clip_grad_norm(model, 0.0, dims)  # the experts' squares summed over efsdp, once
        want = torch.linalg.vector_norm(torch.cat([p.grad.flatten() for p in plain.values()]))
        if not torch.allclose(norm, want, rtol=1e-5):
            problems.append(f"gradient norm {float(norm)} != {float(want)}")
        for o in (opt, reference):
            o.step()
            o.zero_grad()
    return problems + _expert_run_problems(model, plain, opt, reference, dims)


def _expert_loss(model, xs, rank: int) -> torch.Tensor:
    """This rank's batch through the dense weight, and its ep group's batches (what the
    all-to-all would bring) through its local experts: ranks 2m and 2m + 1 form an ep group."""
    w = model["experts"].to_local()
    group = [xs[r] for r in range(len(xs)) if r // 2 == rank // 2]
    return (xs[rank] @ model["dense"].T).square().sum() + sum(torch.einsum("ti,eoi->teo", x, w).square().sum()
                                                              for x in group)


def _expert_run_problems(model, plain, opt, reference, dims) -> list[str]:
    """Weights and saved states equal AdamW's; the rank holds its row blocks' states only."""
    states, problems = opt.checkpoint_state()["state"], []
    for name in ("dense", "experts"):
        p, q = model[name], plain[name]
        if not torch.allclose(p.full_tensor() if name == "experts" else p, q, atol=1e-5):
            problems.append(f"{name} differs from plain AdamW")
        if not torch.allclose(states[name]["exp_avg"].full_tensor(), reference.state[q]["exp_avg"], atol=1e-5):
            problems.append(f"saved exp_avg of {name} is not plain AdamW's")
    dense_rows = row_range(5, dims.submesh("dp_shard").get_local_rank(), 4)
    expert_rows = row_range(3, dims.submesh("efsdp").get_local_rank(), 2)  # of its 2 experts' 3 rows
    mine = 6 * (dense_rows[1] - dense_rows[0]) + 2 * 6 * (expert_rows[1] - expert_rows[0])
    held = sum(s["exp_avg"].numel() for s in opt.state.values())
    if held != mine:
        problems.append(f"holds {held} moment values, not its blocks' {mine}")
    return problems


def test_zero1_cuts_routed_experts_over_efsdp_never_ep(world4_problems):
    """dp_shard 4 = efsdp 2 x ep 2: experts split over ep, their states cut over efsdp apart from
    the dense ones' (over dp_shard); matches AdamW (weights, saved states, the clipping norm)
    with each rank holding only its blocks' states, and the dense mesh alone refuses the experts."""
    assert [e for e in world4_problems if e.startswith("experts")] == [], world4_problems


def test_clipping_in_one_process_matches_torch():
    """The one-process path (plain gradients, foreach norms and scaling) clips as torch's
    clip_grad_norm_ does: the same norm, the same gradients."""
    from shardline.layout import Layout
    from shardline.parallel.collectives import clip_grad_norm
    from shardline.parallel.dims import ParallelDims

    torch.manual_seed(0)
    ours, theirs = (torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4)) for _ in range(2))
    theirs.load_state_dict(ours.state_dict())
    for model in (ours, theirs):
        model(torch.randn(5, 8, generator=torch.Generator().manual_seed(1))).square().sum().backward()
    norm = clip_grad_norm(ours, 0.5, ParallelDims(Layout()))
    want = torch.nn.utils.clip_grad_norm_(theirs.parameters(), 0.5)
    assert norm > 0.5 and torch.allclose(norm, want)
    for a, b in zip(ours.parameters(), theirs.parameters()):
        torch.testing.assert_close(a.grad, b.grad)
