"""The fused AdamW that takes gradient clipping's multiply into its kernel (shardline/optim/fused.py),
run here through torch's fused CPU kernel (the GPU's takes the same grad_scale input:
tests/gpu/test_train_gpu.py checks it there)."""

from __future__ import annotations

import pytest
import torch

from shardline.layout import Layout
from shardline.optim.fused import FusedAdamW
from shardline.parallel.collectives import clip_grad_norm
from shardline.parallel.dims import ParallelDims
from shardline.precision import AgreedGradScaler


def params() -> list[torch.nn.Parameter]:
    torch.manual_seed(0)
    return [torch.nn.Parameter(torch.randn(*s)) for s in [(300, 70), (1000,), (7,), (64, 33)]]


def gradients(ps: list[torch.Tensor], step: int, scale: float = 1.0) -> None:
    g = torch.Generator().manual_seed(step)
    for p in ps:
        p.grad = torch.randn(p.shape, generator=g) * scale


def run(cls, max_norms: list[float], scaler: AgreedGradScaler | None = None):
    """Steps of `cls` with seeded gradients, clipped by clip_grad_norm handing it the scale
    (defer_to): the parameters, the optimizer and the norms."""
    ps, dims, norms = params(), ParallelDims(Layout()), []
    opt = cls([{"params": ps[:2], "weight_decay": 0.1}, {"params": ps[2:], "weight_decay": 0.0}], lr=1e-2, fused=True)
    for i, max_norm in enumerate(max_norms):
        if scaler is None:
            gradients(ps, i)
        else:  # the fp16 path: gradients of a scaled loss, unscaled before the clip as the trainer does
            gradients(ps, i, scale=scaler.get_scale())
            scaler.unscale_(opt)
        norms.append(clip_grad_norm(torch.nn.ParameterList(ps), max_norm, dims, defer_to=opt))
        assert (getattr(opt, "clip_scale", None) is None) == (cls is torch.optim.AdamW or not max_norm)
        if scaler is None:
            opt.step()
        else:
            scaler.step(opt)
            scaler.update()
        assert getattr(opt, "clip_scale", None) is None  # for one step only
        assert not hasattr(opt, "grad_scale")  # what it borrowed is put back as it was: absent
    return ps, opt, norms


@pytest.mark.parametrize("fp16_scaler", [False, True], ids=["no_scaler", "fp16_scaler"])
def test_the_clip_in_the_fused_kernel_is_the_clip_apart(fp16_scaler):
    """Clipped, not clipped (a scale of 1) and measure-only steps: the same weights, moments and
    clipped gradients as torch's fused AdamW after the clip's own pass, to within a rounding of the
    gradient (dividing by the reciprocal of the scale, not multiplying by it); also under an fp16
    loss scaler, which sets grad_scale and found_inf around the step."""
    def make_scaler():
        return AgreedGradScaler(torch.device("cpu"), agree=False, init_scale=2.0 ** 8) if fp16_scaler else None
    max_norms = [0.5, 1e6, 0.0, 0.5]  # the last clipped: the gradients compared are those the kernel wrote back
    (plain_ps, plain, plain_norms), (ours_ps, ours, our_norms) = (
        run(cls, max_norms, make_scaler()) for cls in (torch.optim.AdamW, FusedAdamW))
    assert plain_norms == our_norms and min(plain_norms[0], plain_norms[3]) > 10  # those two clipped
    for a, b in zip(plain_ps, ours_ps):
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-6, atol=1e-9)  # the kernel writes them back clipped
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(ours.state[b][key], plain.state[a][key], rtol=1e-5, atol=1e-12)
    moved = max((a - p0).abs().max().item() for a, p0 in zip(plain_ps, params()))
    assert moved > 1e-3  # the steps did move the weights: the comparison is not of untouched ones


def test_the_clip_scale_gates_nothing_a_skipped_step_holds_back():
    """A step whose update is withheld (found_inf, the device anomaly check's gate) changes nothing,
    and a skipped step's scale, dropped by zero_grad, never reaches a later step's gradients."""
    ps = params()
    opt = FusedAdamW(ps, lr=1e-2)
    before = [p.detach().clone() for p in ps]
    gradients(ps, 0)
    clip_grad_norm(torch.nn.ParameterList(ps), 0.5, ParallelDims(Layout()), defer_to=opt)
    opt.found_inf = torch.tensor(1.0)
    opt.step()
    assert all(torch.equal(a, b) for a, b in zip(before, ps))
    assert all(s["step"].item() == 0 for s in opt.state.values())
    opt.found_inf = None
    opt.clip_scale = torch.tensor(float("nan"))  # a non-finite norm's scale, then the step skipped
    opt.zero_grad(set_to_none=True)
    for p in ps:
        p.grad = torch.zeros_like(p)
    opt.param_groups[0]["lr"] = 0.0
    opt.step()
    assert all(torch.equal(a, b) for a, b in zip(before, ps))
