"""Context parallelism on real gloo ranks: the attention core, then whole training runs.

Each rank draws the same full q/k/v and document ids (same seed), keeps its tokens
(by the SequenceSplit), runs the cp core, and compares its output and the gradients
of its q/k/v shards with the same slices of single-process SDPA. Two deliberately
broken variants (a merge that ignores the log-sum-exp, a zigzag split whose chunks
are swapped) must fail the same comparison: the test can tell.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.nn.attention.flex_attention import BlockMask

from shardline.config import load_config
from shardline.models.attention import FlexAttention, PackedDocuments, VarlenAttention
from shardline.models.llama.model import document_causal_mask, sdpa_attention
from shardline.parallel.context import ring as ring_module
from shardline.parallel.context.attention import ContextParallel
from shardline.parallel.context.sharding import SequenceSplit
from shardline.trainer import Trainer
from tests.distributed.harness import (ALL_STEPS, PARITY_OVERRIDES, assert_same_run, losses,
                                       run_world, start_ranks)
from tests.ports import free_port
from tests.unit.test_attention import _reference_varlen

B, H, HK, S, D = 2, 4, 2, 32, 8
# (name, ring, ulysses, balance)
CASES = [("ring4_zigzag", 4, 1, "zigzag"), ("ring4_none", 4, 1, "none"), ("ulysses4", 1, 4, "zigzag"),
         ("hybrid_2x2", 2, 2, "zigzag"), ("ring2_zigzag", 2, 1, "zigzag")]
# Ulysses alone with another local core on the gathered sequence: varlen's layout through a
# reference kernel (forward and backward), and FlexAttention (forward: it has no CPU backward).
LOCAL_CASES = [("ulysses2_varlen", 2, "varlen"), ("ulysses4_varlen", 4, "varlen"), ("ulysses2_flex", 2, "flex"),
               ("ulysses4_flex", 4, "flex")]
BROKEN = ["merge_without_lse", "zigzag_swapped"]


def _inputs(docs: bool):
    gen = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(B, h, S, D, generator=gen) for h in (H, HK, HK))
    doc_ids = torch.cumsum((torch.rand(B, S, generator=gen) < 0.15).long(), dim=1) if docs else None
    return q, k, v, doc_ids


def _reference(docs: bool):
    q, k, v, doc_ids = (t.clone().requires_grad_(t.is_floating_point()) if t is not None else None
                        for t in _inputs(docs))
    out = sdpa_attention(q, k, v, document_causal_mask(doc_ids) if doc_ids is not None else None)
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(3))
    (out * weights).sum().backward()
    return out.detach(), q.grad, k.grad, v.grad, weights


class _SwappedSplit(SequenceSplit):
    def ring_shard(self, i):  # the two zigzag chunks of a shard in the wrong order
        pos = super().ring_shard(i)
        half = len(pos) // 2
        return torch.cat([pos[half:], pos[:half]])


def _naive_merge(out_a, lse_a, out_b, lse_b):
    return (out_a + out_b) / 2, torch.maximum(lse_a, lse_b)


def _errors(cp: ContextParallel, split: SequenceSplit, docs: bool, reference, backward: bool = True) -> float:
    ref_out, ref_dq, ref_dk, ref_dv, weights = reference
    q, k, v, doc_ids = _inputs(docs)
    mine = SequenceSplit(S, split.ring, split.ulysses, split.balance).positions(cp.cp_rank)
    q, k, v = (t[:, :, mine].clone().requires_grad_(backward) for t in (q, k, v))
    out = cp.attend(q, k, v, cp.mask(doc_ids[:, mine] if doc_ids is not None else None))
    pairs = [(out, ref_out)]
    if backward:
        (out * weights[:, :, mine]).sum().backward()
        pairs += [(q.grad, ref_dq), (k.grad, ref_dk), (v.grad, ref_dv)]
    return max(float((a.detach() - b[:, :, mine]).abs().max()) for a, b in pairs)


def _local_core(kernel: str):
    """The core Ulysses runs on the gathered sequence: varlen's layout around a reference
    kernel (varlen_attn itself needs CUDA), or FlexAttention in eager (small blocks: several
    of them in 32 tokens)."""
    return VarlenAttention(kernel=_reference_varlen) if kernel == "varlen" else FlexAttention(compiled=False, block=8)


def _worker(rank: int, world: int, port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    results = {}
    try:
        references = {docs: _reference(docs) for docs in (False, True)}
        every = dist.new_group(list(range(world)))
        for name, ring, u, balance in CASES:
            cp_world = ring * u
            if cp_world != world:
                continue
            ring_group, uly_group = _grid_groups(ring, u)
            split = SequenceSplit(S, ring, u, balance)
            cp = ContextParallel(split, every, ring_group, uly_group)
            for docs in (False, True):
                results[f"{name}/docs={docs}"] = _errors(cp, split, docs, references[docs])
        for name, u, kernel in LOCAL_CASES:
            if u != world:
                continue
            _, uly_group = _grid_groups(1, u)
            split = SequenceSplit(S, 1, u, "zigzag")
            cp = ContextParallel(split, every, None, uly_group, _local_core(kernel))
            mask_type = PackedDocuments if kernel == "varlen" else BlockMask
            if not isinstance(cp.mask(_inputs(True)[3][:, split.positions(cp.cp_rank)]).local, mask_type):
                raise AssertionError(f"{name}: Ulysses did not build the {kernel} core's mask")
            for docs in (False, True):
                results[f"{name}/docs={docs}"] = _errors(cp, split, docs, references[docs], backward=kernel != "flex")
        if world == 4:  # the broken variants, on the ring of 4 with documents
            split = SequenceSplit(S, 4, 1, "zigzag")
            ring_group, _ = _grid_groups(4, 1)
            merge = ring_module.merge
            ring_module.merge = _naive_merge
            results["merge_without_lse"] = _errors(ContextParallel(split, every, ring_group, None), split, True,
                                                   references[True])
            ring_module.merge = merge
            swapped = ContextParallel(_SwappedSplit(S, 4, 1, "zigzag"), every, ring_group, None)
            results["zigzag_swapped"] = _errors(swapped, split, True, references[True])
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))
    finally:
        dist.destroy_process_group()


def _grid_groups(ring: int, u: int):
    """This rank's ring and Ulysses groups in a ring x u grid (cp rank = ring index x u + piece);
    every rank creates every group, as torch requires."""
    mine_ring = mine_u = None
    rank = dist.get_rank()
    for piece in range(u):
        ranks = [i * u + piece for i in range(ring)]
        group = dist.new_group(ranks) if ring > 1 else None
        if rank in ranks:
            mine_ring = group
    for i in range(ring):
        ranks = [i * u + piece for piece in range(u)]
        group = dist.new_group(ranks) if u > 1 else None
        if rank in ranks:
            mine_u = group
    return mine_ring, mine_u


@pytest.fixture(scope="module")
def errors(tmp_path_factory):
    found = {}
    for world in (2, 4):
        out = tmp_path_factory.mktemp(f"cp{world}")
        start_ranks(_worker, args=(world, free_port(), str(out)), nprocs=world)
        for rank in range(world):
            for key, err in json.loads((out / f"rank{rank}.json").read_text()).items():
                found[key] = max(found.get(key, 0.0), err)
    return found


@pytest.mark.parametrize("case", [f"{name}/docs={d}" for name, *_ in [*CASES, *LOCAL_CASES] for d in (False, True)])
def test_cp_attention_matches_one_process(errors, case):
    assert errors[case] < 1e-5, errors  # output and the q/k/v gradients, every rank


@pytest.mark.parametrize("broken", BROKEN)
def test_a_broken_merge_or_zigzag_order_is_caught(errors, broken):
    assert errors[broken] > 1e-2, errors


# ---- the trainer under cp: parity with one process ---------------------------------

NO_DOCS = "train.document_mask=false"
RING = ["parallel.cp_mode=ring"]
ULYSSES = ["parallel.cp_mode=ulysses"]
HYBRID = ["parallel.cp_mode=hybrid", "parallel.cp_ulysses=2"]
CP_2 = {"ring2": ["parallel.cp=2", *RING], "ulysses2": ["parallel.cp=2", *ULYSSES]}
CP_4 = {
    "ring4_zigzag": ["parallel.cp=4", *RING],
    "ring4_none": ["parallel.cp=4", *RING, "parallel.cp_balance=none"],
    "hybrid_2x2": ["parallel.cp=4", *HYBRID],
    "ulysses4": ["parallel.cp=4", *ULYSSES],  # a query head a rank, the two K/V heads repeated to four
    "cp2_fsdp2": ["parallel.cp=2", "parallel.dp_shard=2"],
    "cp2_hsdp": ["parallel.cp=2", "parallel.dp_replicate=2", "parallel.dp_shard=1"],
    "cp2_tp2_sp_ac": ["parallel.cp=2", "parallel.tp=2", "memory.activation_checkpoint=full"],
    "ulysses2_tp2": ["parallel.cp=2", *ULYSSES, "parallel.tp=2", "parallel.loss_parallel=false"],
    "ring2_pp2_1f1b": ["parallel.cp=2", *RING, "parallel.pp=2"],
    "ulysses2_pp2_gpipe": ["parallel.cp=2", *ULYSSES, "parallel.pp=2", "parallel.pp_schedule=gpipe"],
    # ZeRO-1: DDP over dp x cp, optimizer states cut over dp_shard x cp (over dp_shard 2 x cp 2
    # in test_expert_parallel.py's ep2_cp2_zero1, over cp alone in its cp2_zero1); under tp the
    # optimizer reduce-scatters the gradients itself.
    "cp2_tp2_zero1": ["parallel.cp=2", "parallel.tp=2", "parallel.zero=1"],
    # States cut over the cp ranks of each replica (the mesh slices dp_replicate beside dp_shard_cp).
    "cp2_replicas2_zero1": ["parallel.cp=2", "parallel.dp_replicate=2", "parallel.dp_shard=1", "parallel.zero=1"],
    "ring2_pp2_zero1": ["parallel.cp=2", *RING, "parallel.pp=2", "parallel.zero=1"],
}
# Also without document masking: whole runs at cp 2 (ring, Ulysses) and under a pipeline; the
# attention core alone covers both masks at ring 4, hybrid 2 x 2 and Ulysses 4, zigzag and
# contiguous, in test_cp_attention_matches_one_process.
NODOCS_4 = ("ring2_pp2_1f1b",)
# Resharding resume: a cp checkpoint resumed without cp, and the other way round.
CP_RESHARD_2 = [("cp2_to_dp2", ["parallel.cp=2", "train.stop_at_step=2"], ["parallel.dp_shard=2"]),
                ("dp2_to_cp2", ["parallel.dp_shard=2", "train.stop_at_step=2"], ["parallel.cp=2", *ULYSSES]),
                # ZeRO-1's states cut over the cp ranks, resumed as FSDP's shards.
                ("cp2_zero1_to_dp2", ["parallel.cp=2", "parallel.zero=1", "train.stop_at_step=2"],
                 ["parallel.dp_shard=2"])]


def _base(corpus, docs: bool):
    # Micro-batches of 4 (2 a step in one process and per rank at dp 1): each is a full pass
    # round the ring, which dominates these runs on 2 shared cores; the reference uses them too.
    return [*PARITY_OVERRIDES, "model.n_layers=2", "train.micro_batch_size=4", f"data.path={corpus}",
            *([] if docs else [NO_DOCS])]


def _single(tmp_path_factory, corpus, docs: bool) -> Path:
    run = tmp_path_factory.mktemp("reference_docs" if docs else "reference_nodocs")
    Trainer(load_config(None, [*_base(corpus, docs), f"run.dir={run}"])).build().train()
    return run


@pytest.fixture(scope="module")
def references(tmp_path_factory, small_prepared):
    return {docs: _single(tmp_path_factory, small_prepared, docs) for docs in (True, False)}


def _jobs(root: Path, corpus, layouts: dict[str, list[str]], docs_too: set[str]):
    jobs = []
    for name, extra in layouts.items():
        jobs.append((root / f"{name}-docs", [*_base(corpus, True), *extra]))
        if name in docs_too:
            jobs.append((root / f"{name}-nodocs", [*_base(corpus, False), *extra]))
    return jobs


@pytest.fixture(scope="module")
def cp_world2(tmp_path_factory, small_prepared):
    root = tmp_path_factory.mktemp("cp_world2")
    jobs = _jobs(root, small_prepared, CP_2, set(CP_2))
    for name, first, second in CP_RESHARD_2:
        base = _base(small_prepared, True)
        jobs += [(root / name, [*base, *first]), (root / name, [*base, *second])]
    run_world(2, jobs)
    return root


@pytest.fixture(scope="module")
def cp_world4(tmp_path_factory, small_prepared):
    root = tmp_path_factory.mktemp("cp_world4")
    run_world(4, _jobs(root, small_prepared, CP_4, NODOCS_4))
    return root


@pytest.mark.parametrize("run", [f"{n}-{d}" for n in CP_2 for d in ("docs", "nodocs")])
def test_world2_cp_matches_single_process(cp_world2, references, run):
    assert_same_run(cp_world2 / run, references[run.endswith("-docs")])


@pytest.mark.parametrize("name", [name for name, _, _ in CP_RESHARD_2])
def test_cp_resume_under_another_layout_continues_the_run(cp_world2, references, name):
    assert sorted(losses(cp_world2 / name)) == ALL_STEPS
    assert_same_run(cp_world2 / name, references[True])


@pytest.mark.parametrize("run", [f"{n}-docs" for n in CP_4] +
                         [f"{n}-nodocs" for n in NODOCS_4])
def test_world4_cp_matches_single_process(cp_world4, references, run):
    assert_same_run(cp_world4 / run, references[run.endswith("-docs")])
