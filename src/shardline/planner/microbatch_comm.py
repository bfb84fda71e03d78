"""Communication of one micro-batch: the TP, CP, EP, FSDP and pipeline collectives of its
blocks and ends, and CPU offload's copies.

Split from estimate.py, which sums these per micro-batch (its docstring says which of them
overlap with compute and how); the once-per-step communication is step_comm.py's.
"""

from __future__ import annotations

import dataclasses

from shardline.layout import Layout, RankStages
from shardline.layout.rules import ep_built
from shardline.planner import comm
from shardline.planner import compute as cmp
from shardline.planner import host
from shardline.planner.activations import dtype_bytes, fsdp_gather_bytes
from shardline.planner.hardware import Hardware
from shardline.planner.layout import Workload
from shardline.planner.memory import expert_layer_params, layer_params, params_per_rank, stage_params


def _tokens(work: Workload, layout: Layout) -> int:
    return layout.micro_batch_size * work.seq_len // layout.cp


def _tp_layer(work: Workload, layout: Layout, hw: Hardware, rec: float) -> float:
    """TP collectives of one block: one entering and one leaving each of attention and MLP.

    With sequence parallelism the norm output is all-gathered in fp32 (the residual
    stream and norms are fp32; autocast casts after the gather) and the row-parallel
    output, in the compute dtype, reduce-scattered; backward mirrors the two. Without,
    the outputs are all-reduced forward and the fp32 input gradients backward.

    rec: the share of blocks whose forward reruns in backward (every block under op-level
    AC too: no policy saves a collective's output). A rerun replays what the block's
    backward needs: both gathers and attention's reduce-scatter (SP), or attention's
    all-reduce; the MLP's outgoing one feeds only the block's output, and the rerun stops
    before it (torch's checkpoint early stop). Counted on gloo ranks (2 layers, tp 2):
    op and full AC each add 2 gathers + 1 reduce-scatter per block, or 1 all-reduce.
    """
    if layout.tp == 1:
        return 0.0
    g, net = comm.group(layout.tp, 1, hw.network.gpus_per_node), hw.network
    elems = _tokens(work, layout) * work.model.dim
    c, r = dtype_bytes(work.precision), work.runtime.residual_bytes
    if layout.sp:
        gather, scatter = comm.all_gather(r * elems, g, net)[0], comm.reduce_scatter(c * elems, g, net)[0]
        fwd = bwd = gather + scatter
        replay = 2 * gather + scatter
    else:
        fwd, bwd = comm.all_reduce(c * elems, g, net)[0], comm.all_reduce(r * elems, g, net)[0]
        replay = fwd
    bwd *= 1.0 - work.runtime.tp_backward_overlap  # Runtime: the share hidden under weight-gradient GEMMs
    return 2 * (fwd + bwd) + rec * replay  # attention and MLP, and the replays of a rerun forward


def tp_block(work: Workload, layout: Layout, hw: Hardware, rec: float) -> float:
    """TP communication of one block per micro-batch: the alpha-beta cost of its collectives,
    or on CPU ranks with a wall-time calibration the block's whole measured extra (the
    forward, about a third of it, once more per rerun forward; rec as in _tp_layer)."""
    wall = host.tp_block_wall(hw, layout, work)
    if wall is None:
        return _tp_layer(work, layout, hw, rec)
    return wall * (1 + rec / 3)


def tp_head(work: Workload, layout: Layout, hw: Hardware, stage: RankStages,
             collectives: tuple[float, float] | None = None) -> float:
    """Vocabulary-parallel embedding (fp32 out) and output projection: one all-reduce's bytes
    per end over forward and backward (the embedding's forward sum, the output's input-gradient
    sum; under sequence parallelism a reduce-scatter and an all-gather each); on the last
    stage the loss-parallel sums, or without loss parallelism the logits' all-gather.

    collectives: what tp_head_collectives returns, when the caller prices several pipeline ranks."""
    if layout.tp == 1:
        return 0.0
    wall = host.tp_ends_wall(hw, layout, work, stage.first, stage.last)
    if wall is not None:  # CPU ranks: the ends' calibrated wall time, collectives included
        return wall
    one, loss = collectives or tp_head_collectives(work, layout, hw)
    heads = int(stage.first) + int(stage.last)
    return heads * one + (loss if stage.last else 0.0)


def tp_head_collectives(work: Workload, layout: Layout, hw: Hardware) -> tuple[float, float]:
    """(one end's all-reduce, the last stage's loss-side collective) of tp_head: the same on
    every pipeline rank."""
    if layout.tp == 1:
        return 0.0, 0.0
    g, net = comm.group(layout.tp, 1, hw.network.gpus_per_node), hw.network
    tokens = _tokens(work, layout)
    one = comm.all_reduce(work.runtime.residual_bytes * tokens * work.model.dim, g, net)[0]
    if layout.loss_parallel:  # max, sum of exponentials, target logit: fp32 per token
        return one, 3 * comm.all_reduce(4 * tokens, g, net)[0]
    logits = tokens * work.model.vocab_size * dtype_bytes(cmp.compute_dtype(work.precision))
    return one, comm.all_gather(logits, g, net)[0]  # the replicated logits the plain loss reads


# How the trainer runs context parallelism, as named assumptions: the ring starts each
# K/V transfer before the block's attention, forward and backward (overlapped); the
# backward's fp32 dK/dV accumulators travel while the next block computes (overlapped),
# but the last hop home has nothing left to hide behind; Ulysses' all-to-alls sit
# between the projections and attention, with nothing to hide behind.
RING_KV_OVERLAP = True
RING_GRAD_OVERLAP = True


def cp_layer(work: Workload, layout: Layout, hw: Hardware, lt: cmp.LayerTimes) -> float:
    """Context parallelism per layer and micro-batch: the ring's K/V passes (R-1 hops forward
    and again backward, then R hops of their fp32 gradients) and Ulysses' all-to-alls (q, k,
    v and the output forward, their gradients backward)."""
    if layout.cp == 1:
        return 0.0
    m, ring, u = work.model, *layout.cp_degrees
    width = dtype_bytes(work.precision) / layout.tp
    tokens = _tokens(work, layout)  # this rank's tokens; a ring shard holds u x as many
    total = 0.0
    if u > 1:
        g = comm.group(u, layout.tp, hw.network.gpus_per_node)
        kv_heads = m.kv_heads if (m.kv_heads // layout.tp) % u == 0 else m.n_heads  # else repeated
        per_layer = tokens * (2 * m.n_heads + 2 * kv_heads) * m.head_size * width  # q, out, k, v
        total += 2 * comm.all_to_all(per_layer, g, hw.network)[0]  # forward and backward
    if ring > 1:
        g = comm.group(ring, layout.tp * u, hw.network.gpus_per_node)
        kv_bytes = 2 * tokens * u * m.kv_heads / u * m.head_size * width  # the ring shard's K/V, 1/u of heads
        hop = comm.p2p(kv_bytes, g.nodes > 1, hw.network)
        grad_hop = comm.p2p(kv_bytes * 4 / dtype_bytes(work.precision), g.nodes > 1, hw.network)
        kv_passes = (ring - 1) * hop
        if RING_KV_OVERLAP:  # hidden behind the attention forward, and its ~2.5x backward
            total += max(0.0, kv_passes - lt.attention) + max(0.0, kv_passes - 2.5 * lt.attention)
        else:
            total += 2 * kv_passes
        if RING_GRAD_OVERLAP:
            total += max(0.0, (ring - 1) * grad_hop - 2.5 * lt.attention) + grad_hop
        else:
            total += ring * grad_hop
    return total


def ep_layer(work: Workload, layout: Layout, hw: Hardware, lt: cmp.LayerTimes, rec: float = 0.0) -> float:
    """Expert parallelism: dispatch and combine all-to-alls of each MoE block, forward and backward,
    and again in the share `rec` of forwards that activation checkpointing recomputes (no policy
    saves the exchange's output).

    Only mixture-of-experts models (a `n_experts` field, `moe_top_k` routed experts per
    token) have them. The ep ranks sit tp apart when ep borrows the cp ranks (the mesh puts
    them next to each other), cp x tp apart otherwise. DualPipeV pairs one micro-batch's
    forward with another's backward, hiding the all-to-alls under that compute.
    """
    if layout.ep == 1 or not getattr(work.model, "n_experts", 0):
        return 0.0
    g = comm.group(layout.ep, ep_stride(layout), hw.network.gpus_per_node)
    routed = _tokens(work, layout) * getattr(work.model, "moe_top_k", 1)
    one = comm.all_to_all(routed * work.model.dim * dtype_bytes(work.precision), g, hw.network)[0]
    total = (4 + 2 * rec) * one
    if layout.pp_schedule == "dualpipev" and layout.pp > 1:
        return max(0.0, total - (lt.forward + lt.backward))
    return total


def ep_stride(layout: Layout) -> int:
    """How many ranks apart the ep ranks sit: tp when ep borrows the cp ranks (the mesh puts them next to
    each other), cp x tp otherwise."""
    return layout.tp * (1 if layout.ep_borrows_cp else layout.cp)


def ep_placement(layout: Layout, hw: Hardware, experts: int) -> str:
    """A sentence where the expert-parallel group spans nodes (its all-to-alls then cross the slower links
    between them), else "": what the estimate's ep_comm rests on, and the ep degrees that keep the group in
    one node, among those the layout rules build that hold whole experts (one that dp_shard does not divide
    borrows every cp rank and sits tp apart)."""
    gpn = hw.network.gpus_per_node
    if layout.ep == 1 or hw.name == "cpu":
        return ""
    stride = ep_stride(layout)
    group = comm.group(layout.ep, stride, gpn)
    if group.per_node >= layout.ep:
        return ""
    fits = [e for e in range(2, layout.dp_shard * layout.cp + 1) if ep_built(layout, e) and experts % (e * layout.tp)
            == 0 and e * ep_stride(dataclasses.replace(layout, ep=e)) <= gpn]  # (as the layout rules allow: _valid_ep)
    way = f"ep={' or '.join(map(str, fits[-2:]))} keeps it inside a node" if fits else \
        "no ep the layout allows keeps it inside a node"
    return (f"the {layout.ep} expert-parallel ranks sit {f'{stride} ranks apart' if stride > 1 else 'side by side'}, "
            f"{group.per_node} on a node of {gpn}: each all-to-all crosses {group.nodes} nodes over the links "
            f"between them (ep_comm); {way}")


def fsdp_exposed(work: Workload, layout: Layout, hw: Hardware, lt: cmp.LayerTimes, stage: RankStages,
                  block: tuple | None = None) -> float:
    """Exposed FSDP/HSDP communication of one micro-batch, a step's share under pp
    (estimate.py's docstring says what overlaps).

    Blocks overlap as described there; the root module (embedding, final norm, output)
    is gathered before the first block and reduce-scattered after the last: exposed.
    On saturated CPU ranks nothing overlaps (cmp.saturated). block: fsdp_block's, if known.

    Without pp every micro-batch gathers and reduce-scatters (gradient accumulation keeps
    the gradients sharded). Under pp torch's stages keep the gradients unsharded and the
    weights gathered after each backward until the step's last micro-batch: the stage
    reduce-scatters once per step, ZeRO-2 gathers once per step, and ZeRO-3 (which reshards
    after forward) gathers once per micro-batch plus the warm-up's pp - 1 forwards (counted
    at pp 2 x FSDP 2 with 4 micro-batches: 5 gathers of each block and 1 reduce-scatter per
    step at zero 3, 1 and 1 at zero 2).
    """
    block = block or fsdp_block(work, layout, hw)
    if block is None:
        return 0.0
    g, per_layer, gather, scatter = block
    net, layers = hw.network, stage.layers
    hide = 0.0 if cmp.saturated(hw, layout) else 1.0
    root = stage_params(work, layout, stage, per_layer) - layers * per_layer
    root_comm = (comm.all_gather(fsdp_gather_bytes(work) * root, g, net)[0]
                 + comm.reduce_scatter(work.runtime.grad_bytes * root, g, net)[0])
    if layout.pp == 1:
        bwd_gather = gather if layout.zero == 3 else 0.0  # resharded after forward (HSDP too: apply_fsdp)
        fwd = gather + (layers - 1) * max(0.0, gather - hide * lt.forward)
        bwd = bwd_gather + scatter + (layers - 1) * max(0.0, bwd_gather + scatter - hide * lt.backward)
        return fwd + bwd + root_comm
    m = max(layout.pp_microbatches, 1)
    gathers = gather + (layers - 1) * max(0.0, gather - hide * lt.forward)  # one pass over the stage's blocks
    scatters = scatter + (layers - 1) * max(0.0, scatter - hide * lt.backward)
    return (host.fsdp_passes(layout, m)[0] * gathers + scatters + root_comm) / m


def fsdp_block(work: Workload, layout: Layout, hw: Hardware) -> tuple | None:
    """(shard group, parameters, gather s, scatter s) of one block under FSDP/HSDP, else None:
    the same on every pipeline rank, so _microbatch's callers price it once per layout."""
    if layout.dp_mode not in ("fsdp", "zero2", "hsdp"):
        return None
    net, shard = hw.network, layout.shard_degree
    g = comm.group(shard, layout.tp, net.gpus_per_node)
    per_layer = layer_params(work, layout.tp)
    gather, scatter = _block_gather_scatter(work, layout, hw, g, per_layer)
    if layout.dp_replicate > 1:
        rg = comm.group(layout.dp_replicate, layout.tp * shard, net.gpus_per_node)
        scatter += comm.all_reduce(work.runtime.grad_bytes * per_layer / shard, rg, net)[0]  # the replicas' grads
    return g, per_layer, gather, scatter


def _block_gather_scatter(work: Workload, layout: Layout, hw: Hardware, g, per_layer: float) -> tuple[float, float]:
    """FSDP's all-gather and reduce-scatter seconds of one block's parameters.

    Under expert parallelism a rank gathers only its ep-th of the routed experts, and over
    the efsdp ranks (the shard group / ep) that hold the same experts: EP shrinks the
    experts' FSDP traffic by ep, what it pays for with its all-to-alls.
    """
    net, c, grad = hw.network, fsdp_gather_bytes(work), work.runtime.grad_bytes
    experts = expert_layer_params(work, layout.tp) if layout.ep > 1 else 0.0
    dense = per_layer - experts
    gather = comm.all_gather(c * dense, g, net)[0]
    scatter = comm.reduce_scatter(grad * dense, g, net)[0]
    if experts:
        eg = comm.group(layout.shard_degree // layout.ep, layout.tp * layout.ep, net.gpus_per_node)
        gather += comm.all_gather(c * experts / layout.ep, eg, net)[0]
        scatter += comm.reduce_scatter(grad * experts / layout.ep, eg, net)[0]
    return gather, scatter


def pp_p2p(work: Workload, layout: Layout, hw: Hardware) -> float:
    """Send the residual stream (fp32 here) forward and its gradient back, per virtual stage.

    With Runtime.pp_scatter_gather (Megatron) each TP rank sends only its 1/tp slice and
    the receiving stage all-gathers it over NVLink; sequence parallelism has it sliced already.
    """
    if layout.pp == 1:
        return 0.0
    size = work.runtime.residual_bytes * _tokens(work, layout) * work.model.dim / (layout.tp if layout.sp else 1)
    crosses = layout.world // layout.pp >= hw.network.gpus_per_node
    gather = 0.0
    if work.runtime.pp_scatter_gather and layout.tp > 1 and not layout.sp:
        gather = comm.all_gather(size, comm.group(layout.tp, 1, hw.network.gpus_per_node), hw.network)[0]
        size /= layout.tp
    return 2 * layout.pp_virtual_stages * (comm.p2p(size, crosses, hw.network) + gather)


def offload_copies(work: Workload, layout: Layout, hw: Hardware) -> float:
    """Host<->device copies per micro-batch: sharded weights in (twice at zero=3), gradients out."""
    if not layout.cpu_offload:
        return 0.0
    shard_params = params_per_rank(work, layout)
    copies = (2 if layout.zero == 3 else 1) * 4 * shard_params + work.runtime.grad_bytes * shard_params
    return copies / (hw.network.host_bw_gbs * 1e9)
