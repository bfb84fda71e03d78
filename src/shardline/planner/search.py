"""`shardline plan`: enumerate layouts, prune what cannot run or does not fit, rank by throughput.

The space, for N devices of G per node:

    tp        divisors of G that divide heads, kv heads and ffn_dim (TP stays inside a node)
    cp        1, 2, 4, 8 while each rank keeps >= 1024 tokens of the sequence
    pp        divisors of N / (tp x cp) up to the number of layers; per pp > 1 every
              schedule with its virtual stages (gpipe, 1f1b, interleaved_1f1b v2/v4,
              zbv, dualpipev), one pipeline round per step
    dp        the rest: DDP, FSDP with zero 1/2/3, HSDP (shard groups of whole nodes
              or within one), with and without CPU offload (zero 2 and 3; also on a single
              data-parallel rank, where FSDP2 runs over a size-1 shard dimension; under
              HSDP when cpu_offload or dp_replicate is pinned)
    ep        mixture-of-experts models: 1, and powers of two that divide dp_shard x cp and
              (with tp) the experts, while ep x tp stays inside a node
    mbs       powers of two dividing the per-rank batch (up to 16)
    AC        none, op, selective (every 2nd block), full

Keys given with `--fix` are pinned (the rest is still searched, so a fully pinned
layout is evaluated alone). A layout is pruned when a rule forbids it (counted by
rule: tp, cp, pp, batch, ...) or its peak memory exceeds the device (counted as
memory; the smallest such footprint is kept to explain a request that fits nowhere).
Memory is computed before time, so pruned layouts cost little: a 16,384-GPU search
takes seconds.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field

from shardline.config.job import divisors
from shardline.errors import ConfigError
from shardline.planner.estimate import Estimate, timed
from shardline.planner.hardware import Hardware
from shardline.layout import Layout, model_parallel_hint
from shardline.parallel import float8
from shardline.planner.layout import Workload, layout_problem
from shardline.planner.memory import GiB, largest_term, memory_breakdown
from shardline.planner.offload import HOST_USABLE, OUTSIDE_DEVICE, host_fits, node_ranks
from shardline.planner.pipeline import VIRTUAL_STAGES

STATES = ("params", "grads", "optimizer")  # a does-not-fit line's model states

AC_OPTIONS = (("none", 1), ("op", 1), ("selective", 2), ("full", 1))
MAX_MBS = 16
CP_DEGREES = (1, 2, 4, 8, 16, 32)  # each rank keeps >= 1024 tokens: 128k-token sequences reach cp 32 (Llama 3: 16)


@dataclass
class SearchResult:
    candidates: list[Estimate]  # layouts that fit, best first
    evaluated: int
    pruned: Counter = field(default_factory=Counter)
    smallest_unfit: tuple[float, Layout, dict] | None = None  # (bytes, layout, memory) of the leanest misfit
    smallest_offload: tuple[float, Layout, dict] | None = None  # the same, among layouts with CPU offload
    smallest_host: tuple[float, Layout] | None = None  # (host bytes per node, layout) of the leanest offload
    first_problem: str = ""  # the rule broken by the most model-parallel layout tried (the fewest dp ranks)
    trainer_problem: str = ""  # why `shardline train` cannot run the first fitting layout it pruned (runnable_only)
    _problem_dp: int = 0  # that layout's data-parallel degree
    pinned: dict = field(default_factory=dict)  # the --fix keys the search held
    seconds: float = 0.0


def _options(key: str, default: list, fixed: dict) -> list:
    return [fixed[key]] if key in fixed else default


def _dp_variants(dp: int, tp: int, cp: int, gpn: int, fixed: dict) -> list[dict]:
    """(dp_replicate, dp_shard, zero, cpu_offload) combinations for `dp` data-parallel ranks.

    Hybrid sharding (HSDP) is searched with zero 3; a pinned zero is tried there, on plain DDP
    and on a single data-parallel rank too, so that pinning it never empties the search. CPU
    offload runs at zero 2 and 3 (the layout rules refuse 1), on one rank too (FSDP2 over a size-1
    shard dim). Offload under replicas (HSDP) keeps a copy per replica on the hosts, more than full
    sharding; it is tried only when offload or dp_replicate is pinned (tried always, it made a
    16,384-GPU search ~60% longer)."""
    zero = fixed.get("zero", 3)
    hybrid_offload = fixed.get("cpu_offload") or "dp_replicate" in fixed
    if dp == 1:  # with cp > 1 the states can still be sharded over the cp ranks
        zeros = (1, 2, 3) if cp > 1 and "zero" not in fixed else (zero,)
        out = [{"dp_replicate": 1, "dp_shard": 1, "zero": z, "cpu_offload": False} for z in zeros]
    else:
        out = [{"dp_replicate": dp, "dp_shard": 1, "zero": zero, "cpu_offload": False}]
        for z in (1, 2, 3):
            out.append({"dp_replicate": 1, "dp_shard": dp, "zero": z, "cpu_offload": False})
        for shard in divisors(dp)[1:-1]:
            span = shard * tp * cp
            if span <= gpn or span % gpn == 0:
                out.append({"dp_replicate": dp // shard, "dp_shard": shard, "zero": zero, "cpu_offload": False})
    refused = fixed.get("zero") == 1 and fixed.get("cpu_offload")  # tried, so the rule says why it cannot run
    out += [{**v, "cpu_offload": True} for v in out
            if (v["zero"] != 1 or refused) and (v["dp_replicate"] == 1 or hybrid_offload)]
    keys = ("dp_replicate", "dp_shard", "zero", "cpu_offload")
    out = [v for v in out if all(v[k] == fixed[k] for k in keys if k in fixed)]
    unique = {tuple(v[k] for k in keys): v for v in out}
    return list(unique.values())


def _structures(work: Workload, hw: Hardware, gpus: int, fixed: dict):
    """(tp, cp, pp) triples that divide the world, with their dp degree."""
    gpn, m = hw.network.gpus_per_node, work.model
    tps = _options("tp", [t for t in divisors(min(gpn, gpus)) if gpus % t == 0], fixed)
    cps = _options("cp", [c for c in CP_DEGREES if work.seq_len // c >= 1024 or c == 1], fixed)
    for tp in tps:
        for cp in cps:
            if gpus % (tp * cp):
                continue
            rest = gpus // (tp * cp)
            pps = _options("pp", [p for p in divisors(rest) if p <= m.n_layers], fixed)
            piped = fixed.get("pp_schedule", "1f1b") != "1f1b" or fixed.get("pp_virtual_stages", 1) > 1
            if piped and "pp" not in fixed:  # (a pinned schedule that pp=1 cannot run asks for a pipeline)
                pps = [p for p in pps if p > 1]
            for pp in pps:
                if rest % pp == 0:
                    yield tp, cp, pp, rest // pp


def _schedules(pp: int, fixed: dict) -> list[tuple[str, int]]:
    """(schedule, stages per rank) pairs; a pinned pair off the grid is tried as it is, so
    that the layout rules say why it cannot run instead of the search finding nothing."""
    if pp == 1:
        return [(fixed.get("pp_schedule", "1f1b"), fixed.get("pp_virtual_stages", 1))]
    out = [(s, v) for s, vs in VIRTUAL_STAGES.items() for v in vs if v in (1, 2, 4)]
    pinned = [(s, v) for s, v in out if fixed.get("pp_schedule", s) == s and fixed.get("pp_virtual_stages", v) == v]
    if not pinned and "pp_schedule" in fixed and "pp_virtual_stages" in fixed:
        return [(fixed["pp_schedule"], fixed["pp_virtual_stages"])]
    return pinned


def _micro_batches(local_batch: int, pp: int, fixed: dict) -> list[tuple[int, int]]:
    """(micro_batch_size, pp_microbatches) pairs: one pipeline round per step."""
    sizes = [b for b in (1, 2, 4, 8, MAX_MBS) if local_batch % b == 0]
    sizes = _options("micro_batch_size", sizes, fixed)
    out = []
    for mbs in sizes:
        m = local_batch // mbs if pp > 1 else 1
        out.append((mbs, fixed.get("pp_microbatches", m) if pp > 1 else 1))
    return out


CP_KEYS = ("cp_mode", "cp_ulysses", "cp_balance")


def _cp_modes(work: Workload, tp: int, cp: int, fixed: dict) -> list[dict]:
    """Ring (zigzag), Ulysses when the heads per tp rank split over cp, and the hybrid with the
    largest Ulysses part that splits them. Pinned keys (a mode, a Ulysses part, the balance)
    are taken as they are: the layout rules say when they cannot run."""
    pinned = {k: fixed[k] for k in CP_KEYS if k in fixed}
    if cp == 1:
        return [] if "cp_ulysses" in pinned else [pinned]  # a Ulysses part needs cp > 1
    heads = work.model.n_heads // tp
    modes = [{"cp_mode": "ring", "cp_ulysses": 0}]
    if heads % cp == 0:
        modes.append({"cp_mode": "ulysses", "cp_ulysses": 0})
    hybrid = [u for u in range(2, cp) if cp % u == 0 and heads % u == 0]
    if hybrid or "cp_ulysses" in pinned:
        modes.append({"cp_mode": "hybrid", "cp_ulysses": pinned.get("cp_ulysses", hybrid[-1] if hybrid else 0)})
    if "cp_ulysses" in pinned:  # a Ulysses part is the hybrid's
        modes = [m for m in modes if m["cp_mode"] == "hybrid"]
    modes = [m for m in modes if pinned.get("cp_mode", m["cp_mode"]) == m["cp_mode"]]
    return [{**m, **pinned} for m in modes] or [pinned]


def _ep_options(work: Workload, tp: int, ranks: int, gpn: int, fixed: dict) -> list[int]:
    """Expert-parallel degrees worth pricing: 1, and powers of two dividing the ranks ep borrows
    (dp_shard x cp) and the experts with ep x tp at most a node (beside cp its ranks sit cp x tp
    apart and may still span nodes: ep_comm prices where they sit). Which of them the trainer
    builds is the layout rules' business."""
    n = getattr(work.model, "n_experts", 0)
    options = [1]
    e = 2
    while n and e <= ranks and e * tp <= gpn and n % (e * tp) == 0 and ranks % e == 0:
        options.append(e)
        e *= 2
    return _options("ep", options, fixed)


def candidates(work: Workload, hw: Hardware, gpus: int, fixed: dict):
    """Every layout of the search space (valid or not) for `gpus` devices."""
    base = {k: fixed[k] for k in ("sequence_parallel", "loss_parallel") if k in fixed}  # (ac_every: acs's)
    acs = [(a, fixed.get("ac_every", e)) for a, e in AC_OPTIONS if fixed.get("activation_checkpoint", a) == a]
    for tp, cp, pp, dp in _structures(work, hw, gpus, fixed):
        local = work.global_batch // dp if work.global_batch % dp == 0 else 0
        for dpv in _dp_variants(dp, tp, cp, hw.network.gpus_per_node, fixed):
            if dpv["cpu_offload"] and hw.name == "cpu":
                continue  # offload moves state from a GPU to the host: nothing to gain on CPU ranks
            eps = _ep_options(work, tp, dpv["dp_shard"] * cp, hw.network.gpus_per_node, fixed)
            for schedule, v in _schedules(pp, fixed):
                for mbs, m in _micro_batches(local, pp, fixed) if local else [(1, pp)]:
                    for ac, every in acs:
                        for cpv in _cp_modes(work, tp, cp, fixed):
                            for ep in eps:
                                yield Layout(tp=tp, cp=cp, pp=pp, ep=ep, pp_schedule=schedule,
                                             pp_virtual_stages=v, pp_microbatches=m, micro_batch_size=mbs,
                                             activation_checkpoint=ac, ac_every=every, **cpv, **dpv, **base)


def search(work: Workload, hw: Hardware, gpus: int, fixed: dict | None = None,
           runnable_only: bool = False) -> SearchResult:
    """All fitting layouts, best (highest tokens/s) first.

    runnable_only: also prune layouts `shardline train` cannot run yet (reason "trainer").
    """
    fixed = dict(fixed or {})
    _check_fixed(fixed, gpus)
    start = time.perf_counter()
    result = SearchResult([], 0, pinned=fixed)
    for layout in candidates(work, hw, gpus, fixed):
        result.evaluated += 1
        problem = layout_problem(work, layout)
        if problem:
            result.pruned[problem[0]] += 1
            if not result.first_problem or layout.dp < result._problem_dp:  # the nearest to a batch that divides
                result.first_problem, result._problem_dp = problem[1], layout.dp
            continue
        memory = memory_breakdown(work, layout, hw)
        if memory["total"] > hw.mem_gib * GiB:
            result.pruned["memory"] += 1
            _keep_smallest(result, layout, memory, hw)
            continue
        if not host_fits(memory, layout, hw):
            result.pruned["host memory"] += 1
            _keep_smallest(result, layout, memory, hw)
            continue
        unrunnable = runnable_problem(work, layout) if runnable_only else None
        if unrunnable:
            result.pruned["trainer"] += 1
            result.trainer_problem = result.trainer_problem or unrunnable
            continue
        result.candidates.append(timed(work, layout, hw, memory))
    result.candidates.sort(key=lambda e: (-e.tokens_per_s, e.memory["total"]))
    result.seconds = time.perf_counter() - start
    return result


def _keep_smallest(result: SearchResult, layout: Layout, memory: dict, hw: Hardware) -> None:
    """Remember the leanest misfits, with and without offload apart: a request that only tried
    offload (pinned) is explained by offload's own device and host needs, not by a rule."""
    if not layout.cpu_offload:
        result.smallest_unfit = _leaner(result.smallest_unfit, (memory["total"], layout, memory))
        return
    if memory["total"] > hw.mem_gib * GiB:
        result.smallest_offload = _leaner(result.smallest_offload, (memory["total"], layout, memory))
    per_node = memory["host_offload"] * min(layout.world, hw.network.gpus_per_node)
    if result.smallest_host is None or per_node < result.smallest_host[0]:
        result.smallest_host = (per_node, layout)


def _leaner(kept: tuple | None, new: tuple) -> tuple:
    """The one of two (bytes, ...) misfits that needs fewer bytes."""
    return new if kept is None or new[0] < kept[0] else kept


def _check_fixed(fixed: dict, gpus: int) -> None:
    degrees = {k: fixed[k] for k in ("dp_replicate", "dp_shard", "tp", "pp", "cp") if k in fixed}
    for key, value in (*degrees.items(), *((k, fixed[k]) for k in ("ac_every", "micro_batch_size") if k in fixed)):
        if value < 1:
            raise ConfigError(f"--fix {key}={value} must be >= 1")
    if "ac_every" in fixed and fixed.get("activation_checkpoint", "selective") != "selective":
        raise ConfigError(f"--fix ac_every={fixed['ac_every']} is read by selective checkpointing only, not "
                          f"activation_checkpoint={fixed['activation_checkpoint']}")
    product = 1
    for value in degrees.values():
        product *= value
    if gpus % product:
        raise ConfigError(f"--fix degrees {', '.join(f'{k}={v}' for k, v in degrees.items())} multiply to "
                          f"{product}, which does not divide --gpus {gpus}")


def explain_no_fit(work: Workload, hw: Hardware, gpus: int, result: SearchResult, overrides: bool = True) -> str:
    """The message for a request no layout satisfies: what is missing, in numbers. `overrides`: the
    command takes config overrides (plan does, simulate does not), so the advice may name one."""
    device = result.smallest_unfit or result.smallest_offload
    if device is None and result.smallest_host is None:
        if result.first_problem:
            return f"no valid layout for {gpus} devices: {_within_search(result.first_problem, result.pinned)}"
        if not result.evaluated and result.pinned:
            pins = ",".join(f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in result.pinned.items())
            return (f"no layout of {gpus} devices has every pinned key (--fix {pins}); pin fewer keys "
                    "or other values")
        return f"no layout of {gpus} devices can run this request ({dict(result.pruned)}){_unrunnable(result)}"
    parts = [_device_text(work, hw, device, overrides)] if device is not None else []
    if result.smallest_unfit is not None and result.smallest_offload is not None:
        need, layout, _ = result.smallest_offload
        parts.append(f"with CPU offload the leanest ({layout.describe()}) needs {need / GiB:.1f} GiB per device")
    if result.smallest_host is not None:
        parts.append(_host_text(work, hw, result.smallest_host, alone=device is None))
    return "; ".join(parts) + _unrunnable(result)


def _within_search(problem: str, pinned: dict) -> str:
    """A batch rule's advice to give ranks to tp, cp or pp, as the planner's: the layout it names has
    the fewest data-parallel ranks the search tried (the most model parallelism the model, the
    sequence and --fix allow), so fewer --gpus is the way out left."""
    held = [k for k in ("tp", "cp", "pp") if k in pinned]
    return problem.replace(model_parallel_hint(), ", or fewer --gpus" + (
        f" (or unpin {', '.join(held)} in --fix)" if held else ""))


def _unrunnable(result: SearchResult) -> str:
    """What kept the layouts that fit from being offered (runnable_only), in the trainer's words."""
    if not result.trainer_problem:
        return ""
    return (f"; {result.pruned['trainer']:,} layouts that fit `shardline train` cannot run: "
            f"{result.trainer_problem}")


def _device_text(work: Workload, hw: Hardware, misfit: tuple[float, Layout, dict], overrides: bool) -> str:
    """The leanest layout's device memory, term by term, against the device's."""
    need, layout, mem = misfit
    have = hw.mem_gib * GiB
    ranks = node_ranks(layout, hw)
    if hw.name == "cpu" and need <= have and ranks > 1:  # (each rank fits the host; together they do not)
        return (f"does not fit: the leanest layout ({layout.describe()}) needs {need / GiB:.1f} GiB per rank, "
                f"{ranks * need / GiB:.1f} GiB for the {ranks} ranks sharing this host, more than "
                f"{100 * HOST_USABLE:.0f}% of its {hw.network.host_mem_gib:.1f} GiB; fewer ranks (--gpus), "
                + ("" if layout.activation_checkpoint == "full" else "activation_checkpoint=full, ")
                + "a shorter sequence or a smaller model")
    states = sum(mem.get(k, 0.0) for k in STATES)
    more = max(2, int(-(-need // have)))
    big, big_bytes = largest_term(mem)
    advice = f"use about {more}x more devices, a shorter sequence or a smaller model"
    if big in ("activations", "logits") and states < have:  # a micro-batch's: more data parallelism keeps them
        split = "a larger tp or cp"
        if work.seq_len % 2:  # (no cp and no sequence-parallel tp splits an odd sequence: none was searched)
            split = (f"a seq_len such as {-(-work.seq_len // 1024) * 1024} with a larger tp or cp (neither splits seq "
                     f"{work.seq_len}, an odd length)")
        advice = (f"activations are a micro-batch's, which more data-parallel devices leave as they are: {split}, "
                  "activation_checkpoint=full (if pinned otherwise), or a shorter sequence")
        if layout.dp == 1:  # tp x cp x pp holds every device: larger degrees need more of them
            advice += f"; at this world size, larger ones need about {more}x more devices"
    if big == "logits" and not work.loss_chunk_tokens and overrides:  # (priced: it holds no batch's logits)
        advice = ("the logits go with --train.loss_chunk_tokens=4096 (the output projection and loss a chunk of "
                  f"tokens at a time); beyond them, {advice}")
    terms = ", ".join(f"{k} {v / GiB:.1f}" for k, v in mem.items() if k not in (*OUTSIDE_DEVICE, *STATES) and v)
    return (f"does not fit: the leanest layout ({layout.describe()}) needs {need / GiB:.1f} GiB per device, "
            f"largest term {big} {big_bytes / GiB:.1f} GiB (model states {states / GiB:.1f}, {terms}) but a "
            f"{hw.name} has {hw.mem_gib:.1f} GiB; {advice}")


def _host_text(work: Workload, hw: Hardware, host: tuple[float, Layout], alone: bool) -> str:
    """What the leanest offload layout asks of a node's host memory (`alone`: no device misfit to
    name first, so the layout is named here), and the SSD tier that would lighten it."""
    per_node, layout = host
    text = (f"does not fit: with CPU offload the leanest layout ({layout.describe()}) needs " if alone else
            "CPU offload would need ")
    text += (f"{per_node / GiB:,.0f} GiB of host memory per node, which has "
             f"{hw.network.host_mem_gib:,.0f} GiB")
    if not work.ssd_offload_dir:
        text += " (--ssd-offload-dir: AdamW's moments on the nodes' SSDs instead)"
    return text


def runnable_problem(work: Workload, layout: Layout) -> str | None:
    """Why `shardline train` cannot run this layout today, or None: the trainer's own rules
    (shardline.layout), which `train --dry-run` applies too, and what this torch cannot run
    (fp8 under a split backward before torch 2.13, as preflight refuses it)."""
    problem = layout_problem(work, layout, runnable=True)
    if problem:
        return problem[1]
    return float8.config_problem(work.precision, layout.pp, layout.pp_schedule)
