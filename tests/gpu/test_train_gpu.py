"""The training path on a CUDA device: bf16 runs, the chunked loss, compile, NCCL and
FSDP2's CPU offload. Skipped without CUDA; `benchmarks/gpu_check.sh` runs them.

What the CPU suite cannot show: that the same code runs on the GPU machine's torch
(2.11 + CUDA there), that bf16 autocast and inductor's GPU code give the losses eager
gives, and that an NCCL group drives FSDP2 with and without offload to the same place
(also one GPU offloading through the trainer, which makes its own one-rank group).
"""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.distributed as dist

from shardline.config import load_config
from shardline.data.tokenizer import train_bpe
from shardline.trainer import Trainer
from tests.conftest import tiny_overrides
from tests.distributed.harness import losses

pytestmark = pytest.mark.gpu

# No evaluation and no checkpoints (each costs a graph or a save) except where a test needs them.
# sdpa: auto would take compiled flex attention (packed documents on CUDA), a compile per graph
# (training, no-grad eval, checkpointed blocks, fp32): test_attention_gpu.py checks flex, and
# benchmarks/gpu_train.py trains with it.
CUDA = ["run.device=cuda", "train.precision=fp32", "train.steps=8", "train.eval_interval=0", "checkpoint.interval=0",
        "model.dim=128", "model.n_heads=4", "model.n_kv_heads=2", "model.ffn_dim=384", "train.seq_len=128",
        "train.attention=sdpa"]
BF16 = (*CUDA, "train.precision=bf16")


def _train(tmp_path, corpus, name: str, *extra: str) -> dict[int, float]:
    cfg = load_config(None, tiny_overrides(tmp_path / name, corpus, *CUDA, *extra))
    Trainer(cfg).build().train()
    return losses(tmp_path / name)


def test_bf16_run_trains_logs_mfu_and_resumes(tmp_path, small_corpus):
    saved = ("train.precision=bf16", "checkpoint.interval=4", "train.eval_interval=4")
    first = _train(tmp_path, small_corpus, "bf16", *saved)
    assert sorted(first) == list(range(1, 9)) and all(math.isfinite(v) for v in first.values())
    assert first[8] < first[1]
    records = [json.loads(line) for line in (tmp_path / "bf16" / "metrics.jsonl").read_text().splitlines()]
    assert any((r.get("mfu") or 0) > 0 for r in records if r["kind"] == "train")
    assert any(r["kind"] == "eval" for r in records)
    # The same run stopped at step 4 and resumed from its checkpoint logs the same losses.
    _train(tmp_path, small_corpus, "halves", *saved, "train.stop_at_step=4")
    resumed = _train(tmp_path, small_corpus, "halves", *saved)
    for step in first:
        assert resumed[step] == pytest.approx(first[step], rel=1e-3), (step, resumed, first)


def test_chunked_loss_matches_the_plain_loss_in_bf16(trained):
    plain = trained(*BF16)
    chunked = trained(*BF16, "train.loss_chunk_tokens=96")
    assert chunked[1] == pytest.approx(plain[1], rel=1e-3)  # same weights: only the summation order differs
    for step in plain:
        assert chunked[step] == pytest.approx(plain[step], rel=2e-2), (step, chunked, plain)


def test_compiled_blocks_train_like_eager_in_bf16(trained):
    eager = trained(*BF16)
    key = (*BF16, "train.compile=true", "train.loss_chunk_tokens=96", "memory.activation_checkpoint=full")
    compiled = trained(*key)
    for step in eager:
        assert compiled[step] == pytest.approx(eager[step], rel=2e-2), (step, compiled, eager)
    assert trained.seen[key]["graphs"] >= 1  # dynamo compiled the blocks (flex alone compiles in both runs)


def _fsdp_losses(offload: bool, steps: int = 4) -> tuple[list[float], dict[str, torch.Tensor]]:
    """A tiny Llama under FSDP2 on a one-rank NCCL mesh, fp32, with our data-parallel
    settings (sum reductions, fp32 reduce), optionally with the states offloaded to CPU."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    from shardline.models.llama import ModelArgs
    from shardline.models.factory import build_model_on
    from shardline.parallel.data_parallel import mixed_precision, sum_gradients

    args = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=256, max_seq_len=64)
    model = build_model_on(args, "cpu")
    model.init_weights(seed=7)
    if not offload:
        model.to("cuda")
    mesh = init_device_mesh("cuda", (1,))
    extra = {"offload_policy": CPUOffloadPolicy()} if offload else {}
    for block in model.layers.values():
        sum_gradients(fully_shard(block, mesh=mesh, mp_policy=mixed_precision("fp32"), **extra))
    sum_gradients(fully_shard(model, mesh=mesh, mp_policy=mixed_precision("fp32"), **extra))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    gen = torch.Generator().manual_seed(0)
    out = []
    for _ in range(steps):
        tokens = torch.randint(0, 256, (4, 65), generator=gen).cuda()
        loss = model(tokens[:, :-1], labels=tokens[:, 1:]) / tokens[:, 1:].numel()
        loss.backward()
        opt.step()
        opt.zero_grad()
        out.append(loss.item())
    params = {k: v.full_tensor().detach().cpu() for k, v in model.state_dict().items() if hasattr(v, "full_tensor")}
    return out, params


def test_fsdp2_cpu_offload_matches_no_offload_over_nccl():
    store = dist.HashStore()
    dist.init_process_group("nccl", store=store, rank=0, world_size=1, device_id=torch.device("cuda", 0))
    try:
        on_gpu, params_gpu = _fsdp_losses(offload=False)
        offloaded, params_cpu = _fsdp_losses(offload=True)
    finally:
        dist.destroy_process_group()
    assert offloaded == pytest.approx(on_gpu, rel=1e-5)
    assert params_gpu.keys() == params_cpu.keys() and params_gpu
    for name, value in params_gpu.items():
        torch.testing.assert_close(params_cpu[name], value, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


def test_an_async_snapshot_of_gpu_shards_holds_them_on_the_host_only():
    """checkpoint.mode=async copies the state to host memory; DTensor.from_local once moved each
    copied shard back to the mesh's GPU: a second copy of the state in device memory."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    from shardline.resilience.async_checkpoint import snapshot

    store = dist.HashStore()
    dist.init_process_group("nccl", store=store, rank=0, world_size=1, device_id=torch.device("cuda", 0))
    try:
        weight = distribute_tensor(torch.randn(1024, 1024, device="cuda"), init_device_mesh("cuda", (1,)), [Shard(0)])
        before = torch.cuda.memory_allocated()
        copy = snapshot({"w": weight, "moments": [weight * 2]})
        torch.cuda.synchronize()
        assert torch.cuda.memory_allocated() == before
        for held, of in ((copy["w"], weight), (copy["moments"][0], weight * 2)):
            assert isinstance(held, DTensor) and held.to_local().device.type == "cpu"
            assert held.placements == of.placements and held.device_mesh == of.device_mesh
            torch.testing.assert_close(held.to_local(), of.to_local().cpu(), rtol=0, atol=0)
    finally:
        dist.destroy_process_group()


def test_one_gpu_cpu_offload_through_the_trainer_matches_no_offload(tmp_path, small_corpus, trained):
    """memory.cpu_offload on one GPU, as a user runs it: the trainer makes a one-rank NCCL group,
    FSDP2 over a size-1 shard dim keeps parameters, gradients and AdamW states on the host
    (pinned), and the run trains like the same run without offload (fp32)."""
    from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule
    from torch.distributed.tensor import DTensor

    plain = trained(*CUDA)
    try:
        cfg = load_config(None, tiny_overrides(tmp_path / "offload", small_corpus, *CUDA, "memory.cpu_offload=true"))
        trainer = Trainer(cfg).build()
        assert dist.is_initialized() and dist.get_world_size() == 1
        units = [m for m in trainer.model.modules() if isinstance(m, FSDPModule)]
        assert units and all(isinstance(m._get_fsdp_state()._fsdp_param_group.offload_policy, CPUOffloadPolicy)
                             and m._get_fsdp_state()._fsdp_param_group.offload_policy.pin_memory for m in units)
        trainer.train()
        params = list(trainer.model.parameters())
        assert all(isinstance(p, DTensor) and p.device.type == "cpu" for p in params)
        states = [v for s in trainer.optimizer.state.values() for k, v in s.items() if k != "step"]
        assert states and all(v.device.type == "cpu" for v in states)
        assert all(b.device.type == "cuda" for b in trainer.model.buffers())
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    offloaded = losses(tmp_path / "offload")
    assert sorted(offloaded) == sorted(plain)
    for step in plain:  # fused AdamW on the GPU against foreach on the host: last bits only
        assert offloaded[step] == pytest.approx(plain[step], rel=1e-4), (step, offloaded, plain)


def test_one_gpu_offload_starts_an_moe_run_from_an_hf_folder(tmp_path, small_corpus):
    """Offloaded parameters on the host, the routers' balancing bias on the GPU: the HF weights
    still load (torch's full-state-dict loader takes one device for all tensors), and the run
    starts from them."""
    transformers = pytest.importorskip("transformers")
    hf_cfg = transformers.Qwen3MoeConfig(hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                         head_dim=16, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True,
                                         mlp_only_layers=[0], vocab_size=600)
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(hf_cfg).eval()
    hf.save_pretrained(tmp_path / "hf")
    # the folder's tokenizer, which the run on raw text needs (it refuses to train a new one)
    train_bpe(small_corpus.read_text().split("\n"), 512).save(str(tmp_path / "hf" / "tokenizer.json"))
    ids = torch.randint(0, 600, (2, 16), generator=torch.Generator().manual_seed(0))
    try:
        cfg = load_config(None, tiny_overrides(tmp_path / "run", small_corpus, "run.device=cuda",
                                               "train.precision=fp32", "train.steps=2", "train.eval_interval=0",
                                               "checkpoint.interval=0",
                                               "memory.cpu_offload=true", f"model.hf_path={tmp_path / 'hf'}"))
        trainer = Trainer(cfg).build()
        with torch.no_grad():
            mine = trainer.model.eval()(ids.cuda()).float().cpu()
            torch.testing.assert_close(mine, hf(ids).logits, rtol=0, atol=1e-4)
        trainer.model.train()
        trainer.train()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_a_fused_save_resumed_by_a_foreach_run_steps_with_its_counts_on_the_host():
    """Loading an optimizer places its step counts by the saved groups' flags: a fused save
    loaded into a foreach AdamW left them on the GPU (one host read per parameter per step);
    apply_hyperparameters puts back this build's flags and the counts where it reads them."""
    from shardline.config import OptimConfig
    from shardline.optim import apply_hyperparameters, build_scheduler

    params = [torch.nn.Parameter(torch.randn(8, 8, device="cuda")) for _ in range(2)]
    fused = torch.optim.AdamW(params, lr=1e-3, fused=True)
    for p in params:
        p.grad = torch.ones_like(p)
    fused.step()
    foreach = torch.optim.AdamW(params, lr=1e-3, foreach=True)
    foreach.load_state_dict(fused.state_dict())
    for state in foreach.state.values():  # where torch's load puts them for a fused save (whatever this torch did)
        state["step"] = state["step"].cuda()
    apply_hyperparameters(foreach, build_scheduler(foreach, 10, OptimConfig()), OptimConfig())
    assert all(g["foreach"] and not g["fused"] for g in foreach.param_groups)
    assert all(s["step"].device.type == "cpu" for s in foreach.state.values())
    foreach.step()


def test_the_gpu_optimizer_clips_inside_its_fused_kernel():
    """build_optimizer gives a CUDA model the fused AdamW that takes the clip's scale as its kernel's
    grad_scale (optim/fused.py): the same weights as torch's fused AdamW after the clip's own pass."""
    from shardline.config import OptimConfig
    from shardline.layout import Layout
    from shardline.optim import build_optimizer
    from shardline.optim.fused import FusedAdamW
    from shardline.parallel.collectives import clip_grad_norm
    from shardline.parallel.dims import ParallelDims

    runs = []
    for folded in (False, True):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Linear(256, 64)).cuda()
        opt = build_optimizer(model, OptimConfig(lr=1e-2))
        assert type(opt) is FusedAdamW
        if not folded:
            opt = torch.optim.AdamW(opt.param_groups, fused=True)
        for step in range(3):
            torch.manual_seed(step)
            model(torch.randn(32, 64, device="cuda")).square().sum().backward()
            clip_grad_norm(model, 0.5, ParallelDims(Layout()), defer_to=opt)
            opt.step()
            opt.zero_grad()
        runs.append([p.detach().clone() for p in model.parameters()])
    for a, b in zip(*runs):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)


def test_the_host_optimizer_waits_for_a_gpu_verdict_before_it_steps():
    """Under CPU offload the fused AdamW steps the host's states, while a skip verdict (an fp16
    scaler's found_inf, the anomaly check's) is a GPU tensor still being computed: torch's fused
    AdamW copies it to the host with non_blocking=True and its CPU kernel reads it at once. The
    windowed AdamW copies it and waits (optim/windowed.py): a verdict of "skip" behind a long queue
    of GPU work leaves the host's weights and step untouched."""
    from shardline.optim.windowed import WindowedAdamW

    torch.manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(256, 256))
    before = weight.detach().clone()
    opt = WindowedAdamW([weight], lr=1e-2, fused=True)
    weight.grad = torch.randn(256, 256)
    x = torch.randn(4096, 4096, device="cuda")
    for _ in range(30):  # tens of milliseconds of queued work before the verdict exists
        x = torch.tanh(x @ x)
    opt.found_inf = (x.sum() * 0 + 1).float()  # "skip", once the queue gets there
    opt.step()
    assert torch.equal(weight.detach(), before)
    assert opt.state[weight]["step"].item() == 0
