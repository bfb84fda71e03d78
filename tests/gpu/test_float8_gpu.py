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
CUDA = ["run.device=cuda", "train.steps=8", "train.eval_interval=0", "checkpoint.interval=0",
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
