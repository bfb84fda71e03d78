"""AdamW on the host stepped a window at a time (shardline/optim/windowed.py): the same bits as
torch's AdamW for each of its implementations, and what build_optimizer picks where."""

from __future__ import annotations

import pytest
import torch

from shardline.config import OptimConfig
from shardline.errors import ConfigError
from shardline.optim import build_optimizer, windowed
from shardline.optim.windowed import WindowedAdamW, local
from tests.distributed.harness import gloo_rank, start_ranks
from tests.ports import free_port

IMPLEMENTATIONS = {"foreach": {"foreach": True}, "for-loop": {"foreach": False}, "fused": {"fused": True}}


def params(contiguous: bool = False) -> list[torch.nn.Parameter]:
    """Tensors of 21000 and 33153 elements (cut across windows of ALIGN), small ones (together),
    and a transposed one (a window of its own; with `contiguous`, the same values laid out plainly)."""
    torch.manual_seed(0)
    shapes = [(300, 70), (1000,), (7,), (64, 33), (129, 257)]
    odd = torch.randn(40, 30).t()
    return [torch.nn.Parameter(torch.randn(*s)) for s in shapes] + [
        torch.nn.Parameter(odd.contiguous() if contiguous else odd)]


def groups(ps: list[torch.Tensor]) -> list[dict]:
    return [{"params": ps[:3], "weight_decay": 0.1}, {"params": ps[3:], "weight_decay": 0.0}]


def stepped(opt: torch.optim.Optimizer, ps: list[torch.Tensor], steps: int) -> None:
    """`steps` updates with the same seeded gradients whatever the optimizer, laid out as their
    parameters (as autograd's are), the second parameter without one at the third step: AdamW then
    leaves it and its step alone."""
    for i in range(steps):
        g = torch.Generator().manual_seed(i)
        for j, p in enumerate(ps):
            p.grad = None if (i, j) == (2, 1) else torch.empty_like(p).copy_(torch.randn(p.shape, generator=g))
        opt.step()


def assert_same_as_torch(make, impl: str) -> torch.optim.Optimizer:
    """Four steps of `make(groups, **hyper)` at a window of ALIGN elements against torch's AdamW:
    weights, moments and steps bit for bit; the windows counted through `_prefetch`. The reference for
    fused steps the transposed one laid out plainly: torch's kernel walks memory, not strides (right
    here only because gradient and moments share the weight's layout), ours steps a plain copy of it."""
    plain_params, ours_params = params(contiguous=impl == "fused"), params()
    plain = torch.optim.AdamW(groups(plain_params), lr=1e-2, **IMPLEMENTATIONS[impl])
    ours = make(groups(ours_params), lr=1e-2, **IMPLEMENTATIONS[impl])
    ours.window = windowed.ALIGN
    asked = []
    ours._prefetch = asked.append  # called with every window but the first
    stepped(plain, plain_params, 4)
    stepped(ours, ours_params, 4)
    if impl != "fused" or ours.FUSED_IN_WINDOWS:
        assert len(asked) >= 4 * 15  # 6 + 9 windows for the two large tensors alone
    else:  # in RAM the fused kernel takes each group's tensors at once, the transposed one apart
        assert len(asked) == 4 * 2
    for a, b in zip(plain_params, ours_params):
        assert torch.equal(a, b)
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(plain.state[a][key], ours.state[b][key]), key
        assert ours.state[b]["exp_avg"].stride() == b.stride()
    assert [ours.state[p]["step"].item() for p in ours_params] == [4, 3, 4, 4, 4, 4]
    return ours


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_the_windowed_step_is_torchs_adamw_bit_for_bit(impl):
    assert_same_as_torch(WindowedAdamW, impl)


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_the_clip_folded_into_the_step_is_the_clip_apart_bit_for_bit(impl):
    """clip_grad_norm handing its scale to WindowedAdamW (defer_to) against torch's AdamW after the
    clip multiplied every gradient itself: weights, moments and the clipped gradients bit for bit
    (fused: to 1e-6, its kernel divides by the scale's reciprocal, optim/fused.py); the scale serves
    one step only."""
    from shardline.layout import Layout
    from shardline.parallel.collectives import clip_grad_norm
    from shardline.parallel.dims import ParallelDims

    dims = ParallelDims(Layout())
    runs = []
    for cls in (torch.optim.AdamW, WindowedAdamW):
        ps = params()
        opt = cls(groups(ps), lr=1e-2, **IMPLEMENTATIONS[impl])
        opt.window = windowed.ALIGN
        norms = []
        for i in range(3):
            g = torch.Generator().manual_seed(i)
            for p in ps:
                p.grad = torch.empty_like(p).copy_(torch.randn(p.shape, generator=g))
            norms.append(clip_grad_norm(torch.nn.ParameterList(ps), 0.5 if i < 2 else 0.0, dims, defer_to=opt))
            assert (getattr(opt, "clip_scale", None) is None) == (cls is torch.optim.AdamW or i == 2)
            opt.step()
            assert getattr(opt, "clip_scale", None) is None
        runs.append((ps, opt, norms))
    (plain_ps, plain, plain_norms), (ours_ps, ours, our_norms) = runs
    assert plain_norms == our_norms and plain_norms[0] > 10  # every step but the last clipped
    same = torch.equal if impl != "fused" else lambda x, y: torch.allclose(x, y, rtol=1e-6, atol=1e-7)
    for a, b in zip(plain_ps, ours_ps):
        assert same(a, b) and same(a.grad, b.grad)
        for key in ("exp_avg", "exp_avg_sq"):
            assert same(plain.state[a][key], ours.state[b][key]), key


def test_the_fused_kernel_steps_tensors_laid_out_unlike_their_gradients():
    """torch's fused AdamW walks each tensor's memory, not its strides: a transposed weight with a
    plain gradient, a plain weight with a transposed gradient and a weight with gaps (every other
    column) would pair the wrong elements. Ours steps such a tensor through plain copies: the same
    bits as torch's fused AdamW on the same values laid out plainly."""
    torch.manual_seed(0)
    values = [torch.randn(40, 30), torch.randn(30, 40), torch.randn(40, 60)]
    gaps = torch.zeros(40, 120)
    gaps[:, ::2] = values[2]
    odd = [values[0].t().contiguous().t(), values[1].clone(), gaps[:, ::2]]
    plain = [torch.nn.Parameter(v.clone()) for v in values]
    ours = [torch.nn.Parameter(v) for v in odd]
    assert not ours[0].is_contiguous() and not ours[2].is_contiguous()
    reference = torch.optim.AdamW(plain, lr=1e-2, fused=True)
    windowed_opt = WindowedAdamW(ours, lr=1e-2, fused=True)
    for step in range(3):
        g = torch.Generator().manual_seed(step)
        grads = [torch.randn(v.shape, generator=g) for v in values]
        for p, grad in zip(plain, grads):
            p.grad = grad.clone()
        for i, (p, grad) in enumerate(zip(ours, grads)):
            p.grad = grad.t().contiguous().t() if i == 1 else grad.clone()  # the second's gradient transposed
        reference.step()
        windowed_opt.step()
    for a, b in zip(plain, ours):
        assert torch.equal(a, b)
        assert torch.equal(reference.state[a]["exp_avg_sq"], windowed_opt.state[b]["exp_avg_sq"])


@pytest.mark.parametrize("unscaled_first", [True, False])
def test_the_fused_host_step_takes_a_loss_scalers_scale_and_verdict_as_the_gpus_does(unscaled_first):
    """Under fp16 a GradScaler hands a fused AdamW its scale and verdict (grad_scale, found_inf)
    instead of unscaling itself: the host's windowed AdamW, the clip's scale folded in with the
    scaler's, against FusedAdamW (the GPU's) on the same scaled gradients, with the trainer's order
    (unscale_, then the clip) and without it: weights, moments and steps alike, and the step with
    an inf skipped by both (nothing moves, the step count included)."""
    from shardline.optim.fused import FusedAdamW

    runs = []
    for cls in (FusedAdamW, WindowedAdamW):
        ps = params()[:5]  # laid out plainly: torch's fused kernel is the reference here
        opt = cls(groups(ps), lr=1e-2, fused=True)
        scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=1000)
        for i in range(4):
            g = torch.Generator().manual_seed(i)
            scale = scaler.scale(torch.tensor(1.0))  # a loss of 1, scaled: the factor the gradients carry
            for p in ps:
                p.grad = torch.randn(p.shape, generator=g) * scale
            if i == 1:
                ps[3].grad[0, 0] = float("inf")
            if unscaled_first:
                scaler.unscale_(opt)
            opt.clip_scale = torch.tensor(0.25)  # as clip_grad_norm(defer_to=opt) leaves it
            scaler.step(opt)
            scaler.update()
        runs.append((ps, opt))
    (ref_ps, ref), (ours_ps, ours) = runs
    for a, b in zip(ref_ps, ours_ps):
        assert torch.equal(a, b)
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(ref.state[a][key], ours.state[b][key]), key
        assert ours.state[b]["step"].item() == 3  # four steps, one skipped
    plain = params()[:5]  # and the clip and the scale did reach the update: not the plain AdamW's
    unclipped = torch.optim.AdamW(groups(plain), lr=1e-2, fused=True)
    for i in range(4):
        g = torch.Generator().manual_seed(i)
        for p in plain:
            p.grad = torch.randn(p.shape, generator=g)
        if i != 1:
            unclipped.step()
    assert not torch.equal(unclipped.state[plain[0]]["exp_avg"], ours.state[ours_ps[0]]["exp_avg"])


def test_a_skipped_steps_clip_scale_is_dropped_with_its_gradients():
    """A step skipped after the clip (an fp16 overflow's non-finite norm) must not hand its scale to
    the next step: zero_grad drops it, as torch's distributed state dict steps zero gradients at
    lr 0 to create missing states (NaN x 0 would poison every weight; test_trainer's fp16 overflow
    test caught that)."""
    ps = params()
    opt = WindowedAdamW(ps, lr=1e-2)
    opt.clip_scale = torch.tensor(float("nan"))  # what clip_grad_norm hands over for non-finite gradients
    opt.zero_grad(set_to_none=True)
    before = [p.detach().clone() for p in ps]
    for p in ps:
        p.grad = torch.zeros_like(p)
    opt.param_groups[0]["lr"] = 0.0
    opt.step()
    assert all(torch.equal(a, b) for a, b in zip(before, ps))


def test_a_window_is_a_multiple_of_align_and_holds_small_tensors_together():
    ps = params()
    opt = WindowedAdamW(ps, lr=1e-2)
    opt.window = windowed.ALIGN + 100  # rounded down to ALIGN
    stepped(opt, ps, 1)
    for p in ps:
        p.grad = torch.zeros_like(p)
    moments = ([opt.state[p][k] for p in ps] for k in ("exp_avg", "exp_avg_sq"))
    args = (ps, [p.grad for p in ps], *moments, [opt.state[p]["step"] for p in ps])
    sizes = [[e[0].numel() for e in w] for w in windowed._windows(*args, windowed.ALIGN)]
    assert sizes[:6] == [[4096]] * 5 + [[520, 1000, 7, 2112]]  # 21000 cut in ALIGNs, the rest joined by the next
    assert sizes[6:] == [[4096]] * 8 + [[385], [1200]]  # 33153 cut; the transposed one whole, alone
    assert sum(map(sum, sizes)) == sum(p.numel() for p in ps)


def test_build_optimizer_windows_the_host_and_leaves_devices_to_torch():
    """auto takes the fused kernel wherever the parameters are: windowed on the host (a CPU run, the
    states of CPU offload), torch's with the clip folded in elsewhere (meta stands for a GPU here);
    an explicit foreach is windowed on the host and torch's own elsewhere."""
    from shardline.optim.fused import FusedAdamW

    on_host = build_optimizer(torch.nn.Linear(4, 4), OptimConfig())
    on_device = build_optimizer(torch.nn.Linear(4, 4, device="meta"), OptimConfig())
    assert type(on_host) is WindowedAdamW and on_host.defaults["fused"]
    assert type(on_device) is FusedAdamW
    foreach = OptimConfig(implementation="foreach")
    host_foreach = build_optimizer(torch.nn.Linear(4, 4), foreach)
    device_foreach = build_optimizer(torch.nn.Linear(4, 4, device="meta"), foreach)
    assert type(host_foreach) is WindowedAdamW and host_foreach.defaults["foreach"]
    assert type(device_foreach) is torch.optim.AdamW and not device_foreach.defaults["fused"]


def test_other_adamw_variants_are_refused_in_one_line():
    with pytest.raises(ConfigError, match="windowed AdamW steps plain AdamW; not with amsgrad"):
        WindowedAdamW(params(), amsgrad=True)


def _dtensor_worker(rank: int, world: int, port: int, impl: str) -> None:
    """Weights sharded on the first dim (cut across windows), replicated norms, a sharded weight
    whose gradient arrives replicated and a replicated one whose gradient is still partial (each
    a window of DTensors: the partial one's local shapes match, only its placement tells), a plain
    weight with a non-contiguous gradient and an empty one, all clipped: every rank's shards and
    steps equal torch's AdamW after the clip's own multiply bit for bit."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

    from shardline.layout import Layout
    from shardline.parallel.collectives import clip_grad_norm
    from shardline.parallel.dims import ParallelDims

    with gloo_rank(rank, world, port):
        mesh = init_device_mesh("cpu", (world,))

        def made() -> tuple[list[torch.nn.Parameter], list]:
            torch.manual_seed(0)
            full = [torch.randn(64, 300), torch.randn(300), torch.randn(16, 8), torch.randn(12), torch.randn(20, 30),
                    torch.randn(0, 4)]
            ps = [torch.nn.Parameter(distribute_tensor(full[0], mesh, [Shard(0)])),
                  torch.nn.Parameter(distribute_tensor(full[1], mesh, [Replicate()])),
                  torch.nn.Parameter(distribute_tensor(full[2], mesh, [Shard(0)])),
                  torch.nn.Parameter(distribute_tensor(full[3], mesh, [Replicate()])),
                  torch.nn.Parameter(full[4]), torch.nn.Parameter(full[5])]
            grad_placements = [[Shard(0)], [Replicate()], [Replicate()], [Partial()], None, None]
            return ps, grad_placements

        results = []
        for cls in (torch.optim.AdamW, WindowedAdamW):
            ps, placements = made()
            opt = cls([{"params": ps[:4], "weight_decay": 0.1}, {"params": ps[4:], "weight_decay": 0.0}], lr=1e-2,
                      **IMPLEMENTATIONS[impl])  # DTensors and plain tensors apart: foreach cannot mix them
            opt.window = windowed.ALIGN
            for i in range(3):
                g = torch.Generator().manual_seed(i)
                for p, where in zip(ps, placements):
                    full = torch.randn(p.shape, generator=g)
                    if where is None:  # plain: a transposed copy's transpose, not contiguous (but for the
                        odd = full.ndim == 2 and not (cls is torch.optim.AdamW and impl == "fused")  # fused
                        p.grad = full.t().contiguous().t() if odd else full  # reference: its kernel reads memory
                    elif where == [Partial()]:  # each rank's part: torch's AdamW sums them
                        p.grad = DTensor.from_local(full * (rank + 1), mesh, where)
                    else:
                        p.grad = distribute_tensor(full, mesh, where)
                # Clipped too: the windows multiply DTensor and plain gradients by the scale as the clip would.
                clip_grad_norm(torch.nn.ParameterList(ps), 5.0, ParallelDims(Layout()), defer_to=opt)
                opt.step()
            assert cls is torch.optim.AdamW or not ps[4].grad.is_contiguous()
            results.append([local(t).clone() for p in ps for t in (p, *(opt.state[p][k] for k in
                                                                       ("exp_avg", "exp_avg_sq", "step")))])
        assert all(isinstance(p, DTensor) for p in ps[:4])
        for a, b in zip(*results):  # (fused: the clip inside the kernel, a division by its reciprocal)
            assert torch.equal(a, b) if impl != "fused" else torch.allclose(a, b, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("impl", ["foreach", "for-loop", "fused"])
def test_dtensor_shards_and_odd_gradients_step_as_torchs_adamw(impl):
    start_ranks(_dtensor_worker, (2, free_port(), impl), 2)
