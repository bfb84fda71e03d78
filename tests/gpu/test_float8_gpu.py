"""train.precision = fp8 on a CUDA device with float8 GEMMs (compute capability >= 8.9).

What the CPU suite (tests/unit/test_float8.py, emulated) cannot show: that the pinned
torchao imports on the GPU machine's torch (2.11 + CUDA), that its real `_scaled_mm`
path trains with both recipes, eager and compiled, to losses close to bf16's, and that
the MFU of an fp8 run is measured against the bf16 peak. Skipped without CUDA;
`benchmarks/gpu_check.sh` runs them.
"""

from __future__ import annotations

import math

import pytest
import torch

from shardline.config import load_config
from shardline.devices import peak_tflops
from shardline.trainer import Trainer
from tests.conftest import tiny_overrides
from tests.distributed.harness import losses

pytestmark = pytest.mark.gpu

# Every block projection's dims are multiples of 16 (dim 128, 4 heads of 32, 2 kv heads, ffn 384).
# SDPA: the attention kernel is not what these test (tests/gpu/test_attention_gpu.py does), and
# flex would cost each configuration a compile.
CUDA = ["run.device=cuda", "train.precision=fp32", "train.steps=8", "train.eval_interval=0", "checkpoint.interval=0",
        "model.dim=128", "model.n_heads=4", "model.n_kv_heads=2", "model.ffn_dim=384", "train.seq_len=128",
        "train.attention=sdpa"]


def _needs_float8_gemm() -> None:
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("float8 GEMMs need compute capability >= 8.9")


def _train(tmp_path, corpus, name: str, *extra: str) -> tuple[Trainer, dict[int, float]]:
    trainer = Trainer(load_config(None, tiny_overrides(tmp_path / name, corpus, *CUDA, *extra))).build()
    trainer.train()
    return trainer, losses(tmp_path / name)


def test_torchao_float8_imports():
    import torchao
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training, precompute_float8_dynamic_scale_for_fsdp

    assert torchao.__version__.startswith("0.18.0"), torchao.__version__
    assert callable(convert_to_float8_training) and callable(precompute_float8_dynamic_scale_for_fsdp)
    assert Float8LinearConfig.from_recipe_name("rowwise").emulate is False


@pytest.mark.parametrize("recipe, compiled", [("tensorwise", False), ("rowwise", False), ("tensorwise", True)])
def test_fp8_trains_close_to_bf16(tmp_path, small_corpus, trained, recipe, compiled):
    _needs_float8_gemm()
    from torchao.float8.float8_linear import Float8Linear

    extra = ["train.compile=true"] if compiled else []
    bf16 = trained(*CUDA, "train.precision=bf16", *extra)
    trainer, fp8 = _train(tmp_path, small_corpus, "fp8", "train.precision=fp8", f"fp8.recipe={recipe}", *extra)
    linears = [m for m in trainer.model.modules() if isinstance(m, Float8Linear)]
    assert len(linears) == 14 and not any(m.config.emulate for m in linears)  # 7 per block, real GEMMs
    assert all(math.isfinite(v) for v in fp8.values()) and fp8[8] < fp8[1]
    for step in bf16:
        assert fp8[step] == pytest.approx(bf16[step], rel=5e-2), (step, fp8, bf16)
    assert trainer.peak_tflops == peak_tflops(trainer.device, "bf16")  # MFU against the bf16 peak


def test_an_eager_float8_block_saves_bf16s_activations_and_no_weight_copy():
    """What the planner prices for eager fp8 (planner/peak.float8_blocks, activations.llama_block):
    on CUDA, torchao's Float8Linear casts its input to autocast's bf16 and saves that, and saves
    the fp32 weight itself, so a block keeps bf16's activations and no weight copy. (The CPU's
    emulation cannot show the first: there CUDA autocast is off and the inputs stay fp32.)"""
    _needs_float8_gemm()
    from shardline.models.llama import Llama, ModelArgs
    from shardline.parallel.float8 import convert
    from shardline.planner import activations as act

    args = ModelArgs(dim=128, n_layers=1, n_heads=4, n_kv_heads=2, vocab_size=97, ffn_dim=384)
    torch.manual_seed(0)
    model = Llama(args).cuda()
    convert(model, "tensorwise", emulate=False, fsdp_all_gather=False)
    b, s = 2, 80  # 160 tokens: no activation has a weight's shape
    x = torch.randn(b, s, args.dim, device="cuda", requires_grad=True)
    cos, sin = model.rotary(torch.arange(s, device="cuda"), x.device)
    skip = {t.untyped_storage().data_ptr() for t in (*model.parameters(), cos, sin)}
    shapes = {tuple(p.shape[::k]) for p in model.parameters() if p.dim() == 2 for k in (1, -1)}
    saved, copies = {}, {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in skip and t.dim() > 0:
            copy = t.dtype == torch.bfloat16 and t.dim() == 2 and tuple(t.shape) in shapes
            (copies if copy else saved)[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), torch.autocast("cuda", dtype=torch.bfloat16):
        model.layers["0"](x, cos, sin, None)
    assert not copies
    assert sum(saved.values()) / (b * s) == pytest.approx(act.block_bytes_per_token(act.llama_block(args, "fp8")))
