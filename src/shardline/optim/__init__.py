"""AdamW and learning-rate schedules (linear warmup, then cosine / linear / WSD / constant /
inverse square root).

Which AdamW: torch's on a GPU (fused, the clip's scale inside its kernel: fused.py); on the host (a
CPU run, or CPU offload) the same AdamW stepped a cache-sized window at a time (windowed.py); with
`memory.ssd_offload_dir`, that one with its moments in files on an SSD (ssd_offload.py); under
ZeRO-1, parallel/zero1.py's.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from shardline.config import SCHEDULES, OptimConfig
from shardline.errors import ConfigError, on_every_rank
from shardline.parallel.distributed import agreed
from shardline.parallel.zero1 import StridedSlices, Zero1AdamW
from shardline.optim.fused import FusedAdamW
from shardline.optim.ssd_offload import SSDAdamW
from shardline.optim.windowed import WindowedAdamW, local


def build_optimizer(model: torch.nn.Module, cfg: OptimConfig,
                    zero1_mesh: DeviceMesh | None = None, zero1_dim: str = "dp_shard",
                    zero1_experts: tuple[DeviceMesh, str] | None = None, ssd_dir: str = "",
                    rank: int = 0, world_size: int = 1) -> torch.optim.AdamW:
    """AdamW over the model's parameters; with `zero1_mesh`, states sharded over its `zero1_dim`
    (routed experts under ep over `zero1_experts`' dim: parallel/zero1.py); with `ssd_dir`, its
    moments in memory-mapped files there (ssd_offload.py; ssd_offload.problem refuses zero=1 before a
    launch gets here, so a ZeRO-1 optimizer never sees it); else, where every parameter is on the
    host, stepped a window at a time (windowed.py: the same bits, fewer trips through memory); else
    torch's, fused on a GPU with clipping's multiply in its kernel (fused.py)."""
    # Norm weights (1-D) are not decayed: shrinking them toward zero only hurts.
    decay = [p for p in model.parameters() if p.requires_grad and p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.ndim < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    impl = cfg.implementation
    if impl == "auto":
        # The fused kernel: on a GPU, and on the host too (a CPU run, the states of CPU offload), where it
        # steps in about half foreach's time (benchmarks/clip_fold.py); windowed.py steps a tensor laid out
        # unlike its gradient through plain copies, as that kernel reads memory, not strides. Not for
        # parameters on two kinds of device: torch's fused step would read one's skip verdict unwaited.
        kinds = {local(p).device.type for p in decay + no_decay}
        impl = "fused" if len(kinds) <= 1 else "foreach"
    kwargs = {"fused": True} if impl == "fused" else {"foreach": impl == "foreach"}
    hyper = {"lr": cfg.lr, "betas": (cfg.beta1, cfg.beta2), "eps": cfg.eps, **kwargs}
    if zero1_mesh is None:
        if ssd_dir:  # (no collective inside) a node's full SSD stops every rank, not its own alone
            return agreed(lambda: SSDAdamW(groups, ssd_dir, rank, **hyper), world_size)
        on_host = all(local(p).device.type == "cpu" for p in decay + no_decay)
        if on_host:
            return WindowedAdamW(groups, **hyper)
        return FusedAdamW(groups, **hyper) if hyper.get("fused") else torch.optim.AdamW(groups, **hyper)

    def zero1(**kwargs):
        return Zero1AdamW(model, groups, zero1_mesh, zero1_dim, zero1_experts, **kwargs)

    try:
        built, strided = zero1(**hyper), ""
    except StridedSlices as e:  # under tp or ep: auto takes foreach, an explicit fused is refused
        built, strided = None, str(e)
    if hyper.get("fused") and world_size > 1:  # decided alike on every rank: pipeline stages hold other
        seen = [""] * world_size              # parameters (a dense stage's would pass), and the anomaly
        dist.all_gather_object(seen, strided)  # check and the scaler follow the choice
        strided = next((s for s in seen if s), "")
    if not strided:
        return built
    if cfg.implementation == "fused":
        raise on_every_rank(ConfigError(f"optim.implementation=fused is invalid with this layout: {strided}; "
                                        "use auto, foreach or for-loop"))
    return zero1(**{**hyper, "fused": None, "foreach": True})


def lr_multiplier(step: int, total_steps: int, cfg: OptimConfig) -> float:
    """Multiplier of cfg.lr for the update that follows `step` completed updates."""
    warmup = min(cfg.warmup_steps, total_steps)
    if step < warmup:
        return (step + 1) / warmup
    floor = cfg.min_lr_ratio
    if cfg.schedule == "constant":
        return 1.0
    if cfg.schedule == "rsqrt":  # inverse square root of the update's number, never under the floor
        return max(floor, math.sqrt(warmup / (step + 1)))
    if cfg.schedule == "wsd":  # warmup-stable-decay: flat, then linear decay at the end
        decay_start = total_steps - wsd_decay_steps(total_steps, cfg)[1]
        if step < decay_start:
            return 1.0
        return 1.0 - (1.0 - floor) * min(1.0, (step - decay_start + 1) / max(1, total_steps - decay_start))
    progress = min(1.0, (step - warmup + 1) / max(1, total_steps - warmup))
    if cfg.schedule == "linear":
        return 1.0 - (1.0 - floor) * progress
    if cfg.schedule == "cosine":
        return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
    # A name config.SCHEDULES lists without a curve here trained as cosine in silence: a new one needs both
    raise ConfigError(f"optim.schedule={cfg.schedule!r} has no learning-rate curve here: one of "
                      f"{', '.join(SCHEDULES)}")


def wsd_decay_steps(total_steps: int, cfg: OptimConfig) -> tuple[int, int]:
    """(asked, given): the updates of a WSD decay that decay_fraction asks for (a half rounded up, at
    least one), and those it gets. The decay starts after the warm-up even where that leaves fewer
    (the multiplier never jumps down); the launch says so (the wsd_decay_cut note)."""
    asked = max(1, math.floor(total_steps * cfg.decay_fraction + 0.5))
    return asked, min(asked, total_steps - min(cfg.warmup_steps, total_steps))


def schedule_settings(total_steps: int, cfg: OptimConfig) -> dict:
    """What the learning-rate schedule is computed from: a checkpoint's scheduler holds only the
    step, so a resume with other values changes the lr curve from there on (and says so)."""
    return {"train.steps": total_steps, "warmup_steps": cfg.warmup_steps, "schedule": cfg.schedule,
            "min_lr_ratio": cfg.min_lr_ratio, "decay_fraction": cfg.decay_fraction}


def next_lr_change(step: int, saved: dict, total_steps: int, cfg: OptimConfig) -> list[float] | None:
    """[saved, now]: the lr of the update after `step` under the lr and schedule of a checkpoint's
    run config (`saved`, as Config.to_dict gives it) and under this config's, where they differ. A
    resume that changes train.steps or the schedule moves the curve from there on, warm-up counted
    from step 0 (extending a decayed cosine raises it again): the two numbers show by how much.
    None where they agree or the saved config does not say."""
    try:
        kept = {k: saved["optim"][k] for k in ("lr", "warmup_steps", "schedule", "min_lr_ratio", "decay_fraction")
                if k in saved["optim"]}
        before = dataclasses.replace(cfg, **kept)
        old = before.lr * lr_multiplier(step, int(saved["train"]["steps"]), before)
    except (KeyError, TypeError, ValueError, ConfigError):  # (a schedule this shardline has no curve for)
        return None
    new = cfg.lr * lr_multiplier(step, total_steps, cfg)
    if math.isclose(old, new, rel_tol=1e-9):
        return None
    return [float(f"{x:.12g}") for x in (old, new)]  # (read by eye: 0.0003, not 0.00030000000000000003)


def build_scheduler(opt: torch.optim.Optimizer, total_steps: int, cfg: OptimConfig):
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda step: lr_multiplier(step, total_steps, cfg))


def apply_hyperparameters(opt: torch.optim.Optimizer, scheduler, cfg: OptimConfig) -> dict[str, list]:
    """After a resume, the config's lr, betas, eps and weight decay apply, not the checkpoint's
    (which loading the optimizer and the schedule brought back): resuming with a lower
    optim.lr after a loss spike lowers it; and the implementation this run built (fused,
    foreach), not the saving run's. Returns what changed, {key: [saved, now]}."""
    saved = {"lr": scheduler.base_lrs[0], "beta1": opt.param_groups[0]["betas"][0],
             "beta2": opt.param_groups[0]["betas"][1], "eps": opt.param_groups[0]["eps"],
             "weight_decay": opt.param_groups[0]["weight_decay"]}
    scheduler.base_lrs = [cfg.lr for _ in opt.param_groups]
    # How the update runs is this build's too: it chose fused or foreach for this device and layout (fused
    # kernels refuse strided ZeRO-1 slices; only fused takes the device anomaly check's found_inf).
    built = {k: opt.defaults[k] for k in ("fused", "foreach", "capturable", "differentiable") if k in opt.defaults}
    for i, group in enumerate(opt.param_groups):  # build_optimizer's order: decayed, then not
        group.update(initial_lr=cfg.lr, lr=cfg.lr * scheduler.lr_lambdas[i](scheduler.last_epoch),
                     betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, weight_decay=cfg.weight_decay if i == 0 else 0.0,
                     **built)
        _place_steps(opt, group)
    return {key: [value, getattr(cfg, key)] for key, value in saved.items() if value != getattr(cfg, key)}


def _place_steps(opt: torch.optim.Optimizer, group: dict) -> None:
    """Each step count where this group's implementation reads it: the load placed them by the
    saved groups' flags (a fused save resumed by a foreach run left them on the GPU, read back to
    the host for every parameter at every step)."""
    for p in group["params"]:
        step = opt.state.get(p, {}).get("step")
        if isinstance(step, torch.Tensor):
            where = p.device if group.get("fused") or group.get("capturable") else torch.device("cpu")
            opt.state[p]["step"] = step.to(where, torch.float32)


@torch.no_grad()
def init_optimizer_state(opt: torch.optim.Optimizer) -> None:
    """Create every state tensor (step, moments) so a checkpoint can be loaded in place.

    Runs one update with zero gradients and lr 0, which changes no parameter; the
    loaded checkpoint then overwrites the state, step counts included.
    """
    lrs = [g["lr"] for g in opt.param_groups]
    for g in opt.param_groups:
        g["lr"] = 0.0
        for p in g["params"]:
            p.grad = torch.zeros_like(p)
    opt.step()
    for g, lr in zip(opt.param_groups, lrs):
        g["lr"] = lr
    opt.zero_grad(set_to_none=True)
