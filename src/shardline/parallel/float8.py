"""train.precision = fp8: the matmuls of the Linear layers in float8, through torchao.

torchao's float8 training swaps each chosen `nn.Linear` for a `Float8Linear`, which casts
its input, weight and output gradient to float8 (with dynamic scales) for the three
GEMMs of forward and backward; its parameter keeps the name, shape and fp32 master copy,
so initialisation, the optimizer and checkpoints see the same model as under bf16.
Everything else (attention, norms, embedding, loss) runs under bf16 autocast.

What is converted, and why the rest is not:

* the attention and feed-forward projections (wq, wk, wv, wo, w1, w2, w3, and the MoE
  shared experts, which are the same feed-forward) whose two dims are multiples of 16
  (of 16 x tp under tensor parallelism: each rank's shard), the shape the float8 GEMM
  (`torch._scaled_mm`) requires;
* not the output projection: the loss multiplies by its weight directly
  (models/loss.py), and the logits are the most precision-sensitive matmul;
* not an MoE router's gate (tiny, and routing decisions flip with its rounding), nor the
  routed experts, which are one grouped 3-D weight, not `nn.Linear`: they stay bf16.

Conversion runs on the meta model before tensor parallelism, pipeline cutting and FSDP
(torchtitan's order), so the swap happens once and every later step sees Float8Linear.

Recipes ([fp8] recipe): tensorwise (one scale per tensor: the fastest) or rowwise (one
per row: more accurate, slower). With tensorwise and FSDP sharding parameters,
`fp8.fsdp_all_gather` makes FSDP gather the weights already cast to float8 (half the
bytes of bf16); their scales are then computed for all weights in one all-reduce after
each optimizer step (`precompute_scales`).

Tensor parallelism (models/llama/parallelize.py `apply_tp`, models/moe/parallelize.py for
the shared experts) uses torch's plain Colwise/RowwiseParallel styles for both recipes.
Each Float8Linear then gets DTensor operands (its weight sharded by columns or rows, its
input replicated or sharded) and casts them itself. The amax of a sharded DTensor is
reduced across the tp ranks by DTensor (a small max all-reduce), so every rank quantises
with the scale one process would use, per tensor (tensorwise) or per row (rowwise):
tp ranks train like one process (tests/distributed/test_float8_fsdp.py checks the scales
and the losses). The sequence-parallel all-gathers and reduce-scatters carry bf16.

torchao's float8 TP styles (Float8ColwiseParallel, Float8RowwiseParallel,
PrepareFloat8ModuleInput) would cast the sequence-sharded activation to float8 before
its all-gather (half the bytes) and are what torchtitan uses with tensorwise. They are
not used: that all-gather sends a float8 tensor, which gloo refuses ("Invalid scalar
type"), so they cannot run on CPU ranks, and no multi-GPU NCCL run has checked them:
they would ship untested. They are tensorwise-only anyway
(torchtitan too keeps the plain styles for rowwise).

Zero-bubble pipeline schedules (zbv, dualpipev) split each backward into an input pass and
a weight pass through the same autograd nodes; torchao's float8 matmul computes both its
gradients in every call, so under them each converted Linear is bound to
`_SplitFloat8Matmul`, whose backward runs only the GEMM the pass asks for (needs torch >=
2.13, `config_problem`).

Hardware: float8 GEMMs need compute capability >= 8.9 (Ada, Hopper and newer). On a CPU
the run is *allowed* in torchao's emulation mode (operands quantised to float8 and
multiplied back in fp32): the same conversion, recipes, FSDP all-gather and scale
updates run end to end, so CPU tests and CI cover the whole path. It is slower than
fp32 and gains nothing, which the launch's fp8_emulated note says; it is for testing.
"""

from __future__ import annotations

import dataclasses
import functools
import logging

import torch
from torch import nn

from shardline.errors import ConfigError
from shardline.layout import SPLIT_BACKWARD
from shardline.layout.rules import fp8_aligned as aligned
from shardline.parallel.pipeline import split_backward_takes_custom_nodes

log = logging.getLogger(__name__)

TORCHAO_PIN = "torchao==0.18.0"
MIN_CAPABILITY = (8, 9)
SKIPPED = ("output",)  # module names never converted (see the module doc)
SKIPPED_PARTS = ("router",)  # nor any Linear below a module of these names


def _import_quietly() -> None:
    """Import torchao.float8 with the warnings of its import silenced: they are about parts
    float8 training does not use (its CUTLASS and MX kernels failing to load on a CPU build
    of torch, no triton) or a torch deprecation, and would read as if fp8 were broken."""
    loggers = [logging.getLogger(name) for name in ("torchao", "torch.utils._pytree")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        import torchao.float8  # noqa: F401
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


def require_torchao() -> None:
    """One line telling how to install torchao, instead of an ImportError mid-build."""
    try:
        _import_quietly()
    except ImportError as exc:
        raise ConfigError(f"train.precision=fp8 needs torchao ({exc}): pip install '{TORCHAO_PIN}' (in a source tree, "
                          "the fp8 extra: pip install '.[fp8]'; its wheel declares no torch, so the installed torch "
                          "stays)"
                          ) from None


def capability_problem(capability: tuple[int, int] | None) -> str | None:
    """Why fp8 cannot run on a CUDA device of this (major, minor) capability; None: it can
    (None in: a CPU, where torchao emulates)."""
    if capability is None or tuple(capability) >= MIN_CAPABILITY:
        return None
    major, minor = capability
    return (f"train.precision=fp8 needs compute capability >= 8.9 (Ada/Hopper); this GPU is {major}.{minor}; "
            "use train.precision=bf16")


def config_problem(precision: str, pp: int, schedule: str, torch_version: str = torch.__version__) -> str | None:
    """What the config alone rules out for fp8 on this torch (one line), else None: zbv and
    dualpipev need a torch whose split backward runs through the float8 matmul's autograd node."""
    if precision == "fp8" and pp > 1 and schedule in SPLIT_BACKWARD and not split_backward_takes_custom_nodes(
            torch_version):
        return (f"train.precision='fp8' with parallel.pp_schedule={schedule!r} needs torch >= 2.13 (this is "
                f"{torch_version}: its split backward fails on the float8 Linear's autograd function); use "
                "pp_schedule 1f1b, gpipe or interleaved_1f1b, or precision bf16")
    return None


def local_capability(on_cuda: bool) -> tuple[int, int] | None:
    """This machine's CUDA capability when the run uses CUDA and one is visible, else None."""
    if not (on_cuda and torch.cuda.is_available()):
        return None
    return torch.cuda.get_device_capability()


def converts(module: nn.Module, fqn: str, tp: int = 1) -> bool:
    """Whether the Linear at `fqn` runs in float8 (see the module doc for what is kept). Its
    dims must be multiples of FP8_GEMM_MULTIPLE (16) on each rank: under tensor parallelism of 16 x tp
    (either dim may be the one split), so that every shard stays aligned (layout.rules.fp8_aligned)."""
    if not isinstance(module, nn.Linear) or fqn in SKIPPED:
        return False
    if any(part in SKIPPED_PARTS for part in fqn.split(".")):
        return False
    return aligned(tp, module.in_features, module.out_features)


def linear_config(recipe: str, emulate: bool, fsdp_all_gather: bool):
    """torchao's Float8LinearConfig for `recipe`; all-gather in float8 exists for tensorwise only."""
    from torchao.float8 import Float8LinearConfig

    base = Float8LinearConfig.from_recipe_name(recipe)
    return dataclasses.replace(base, emulate=emulate,
                               enable_fsdp_float8_all_gather=fsdp_all_gather and recipe == "tensorwise")


def convert(model: nn.Module, recipe: str, emulate: bool, fsdp_all_gather: bool,
            split_backward: bool = False, tp: int = 1, shard: int = 1) -> list[str]:
    """Swap the chosen Linear layers of `model` (in place, any device including meta) for
    Float8Linear; returns their names. `tp`: the degree that will split them; `shard`: FSDP's.
    `split_backward`: a zero-bubble pipeline schedule will split each backward in two passes, so
    each float8 Linear computes only the gradients a pass asks for (`_SplitFloat8Matmul`)."""
    require_torchao()
    from torchao.float8 import convert_to_float8_training
    from torchao.float8.float8_linear import Float8Linear

    chosen = [name for name, m in model.named_modules() if converts(m, name, tp)]
    rows = {n: model.get_submodule(n).out_features for n in chosen}
    uneven = [n for n in chosen if rows[n] % (shard * tp)]
    if fsdp_all_gather and uneven:  # torchao's float8 gather sends each rank's shard as it is: sizes differ
        fsdp_all_gather = False
        log.warning(f"fp8.fsdp_all_gather: FSDP's {shard} shards of {uneven[0]}'s {rows[uneven[0]]} rows (tp {tp}) "
                    "are unequal, which torchao's float8 all-gather does not take: weights gather in bf16")
    convert_to_float8_training(model, module_filter_fn=functools.partial(converts, tp=tp),
                               config=linear_config(recipe, emulate, fsdp_all_gather))
    if split_backward:
        for module in model.modules():
            if isinstance(module, Float8Linear):
                module.forward = functools.partial(_split_backward_forward, module)  # picklable, copyable
    return chosen  # (emulated on a CPU: the launch's fp8_emulated note says so, once)


def precompute_scales(model: nn.Module) -> None:
    """After an optimizer step: the float8 scales of every FSDP-gathered float8 weight in one
    all-reduce (instead of one per weight at its next all-gather). No-op without such weights."""
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    precompute_float8_dynamic_scale_for_fsdp(model)


@torch.compiler.disable  # eager: the engine query in its backward means nothing in a traced graph
def _split_backward_forward(linear: nn.Module, input: torch.Tensor) -> torch.Tensor:
    """Float8Linear's forward through `_SplitFloat8Matmul` (bound to each converted Linear
    under a split backward): the same input cast under autocast, matmul and bias."""
    if torch.is_autocast_enabled("cuda"):  # as Float8Linear: autocast's dtype for its input
        input = input.to(torch.get_autocast_dtype("cuda"))
    output = _SplitFloat8Matmul.apply(input, linear.weight.t(), linear.linear_mm_config, linear.config)
    return output if linear.bias is None else output + linear.bias.to(output.dtype)


class _SplitFloat8Matmul(torch.autograd.Function):
    """torchao's float8 matmul whose backward computes only the gradients this backward
    pass will use.

    torchao's own Function computes the input and the weight gradient in every backward
    call. zbv and dualpipev split a micro-batch's backward into an input pass (gradients
    of the stage input only) and a later weight pass (the weights only), and each pass
    calls this one autograd node: with torchao's Function every float8 backward GEMM
    would run twice. Autograd tells a node which of its input edges the running pass will
    execute (`torch._C._will_engine_execute_node`), so this backward skips the other GEMM.
    The forward is torchao's own; each backward GEMM casts its operands as torchao's does
    for the config's recipe (same roles, targets and scaling axes), which
    tests/unit/test_float8.py holds bit for bit against torchao's gradients.
    """

    @staticmethod
    def forward(ctx, input_hp, weight_hp_t, linear_mm_config, config):
        from torchao.float8.float8_linear import matmul_with_hp_or_float8_args

        return matmul_with_hp_or_float8_args.forward(ctx, input_hp, weight_hp_t, linear_mm_config, config)

    @staticmethod
    def backward(ctx, grad_output):
        from torchao.float8.float8_training_tensor import GemmInputRole

        input_hp, weight_hp_t = ctx.saved_tensors
        c = ctx.config
        grad_2d = grad_output.reshape(-1, grad_output.shape[-1])
        grad_input = grad_weight = None
        if _pass_needs(ctx, 0):  # grad_input = grad_output @ weight
            grad = _cast(ctx, grad_2d, c.cast_config_grad_output, GemmInputRole.GRAD_OUTPUT, -1)
            weight_t = _cast(ctx, weight_hp_t, c.cast_config_weight_for_grad_input, GemmInputRole.WEIGHT, -1)
            grad_input = torch.mm(grad, weight_t.t())
            grad_input = grad_input.reshape(*grad_output.shape[:-1], grad_input.shape[-1])
        if _pass_needs(ctx, 1):  # grad_weight = grad_output^T @ input, as the transposed weight's gradient
            grad = _cast(ctx, grad_2d, c.cast_config_grad_output_for_grad_weight, GemmInputRole.GRAD_OUTPUT, 0)
            input_2d = _cast(ctx, input_hp.reshape(-1, input_hp.shape[-1]), c.cast_config_input_for_grad_weight,
                             GemmInputRole.INPUT, 0)
            grad_weight = torch.mm(grad.t(), input_2d).t()
        return grad_input, grad_weight, None, None


def _pass_needs(ctx, index: int) -> bool:
    """Whether the running backward pass uses the gradient of the node's input `index`.
    A leaf input (a stage's received activation fed straight to the Linear) cannot be
    asked about under `autograd.grad`, which the pipeline's passes use: its gradient is
    computed whenever it requires one (correct, at worst a GEMM the pass did not need)."""
    node = ctx.next_functions[index][0]
    if not ctx.needs_input_grad[index] or node is None:
        return False
    return type(node).__name__ == "AccumulateGrad" or torch._C._will_engine_execute_node(node)


def _cast(ctx, tensor: torch.Tensor, cast_config, role, axis: int) -> torch.Tensor:
    """`tensor` as a float8 GEMM operand in `role`, scaled along `axis` if the recipe scales
    by axis; as it is if already float8 (FSDP's float8 all-gather) or the cast is disabled."""
    from torchao.float8.config import ScalingType
    from torchao.float8.distributed_utils import tensor_already_casted_to_fp8
    from torchao.float8.float8_scaling_utils import get_maybe_axiswise_dim, hp_tensor_to_float8_dynamic

    if tensor_already_casted_to_fp8(tensor) or cast_config.scaling_type is ScalingType.DISABLED:
        return tensor
    return hp_tensor_to_float8_dynamic(
        tensor, cast_config.target_dtype, ctx.linear_mm_config, gemm_input_role=role,
        scaling_granularity=cast_config.scaling_granularity,
        axiswise_dim=get_maybe_axiswise_dim(axis, cast_config.scaling_granularity),
        round_scales_to_power_of_2=ctx.config.round_scales_to_power_of_2)
