"""Text and JSON output of `shardline plan` and `shardline estimate`."""

from __future__ import annotations

from shardline.devices import mfu_peak_dtype
from shardline.planner import attention
from shardline.planner.estimate import Estimate
from shardline.planner.hardware import Hardware
from shardline.planner.layout import Workload
from shardline.models import num_params
from shardline.models.flops import flops_per_token, matmul_params
from shardline.planner.microbatch_comm import ep_placement
from shardline.planner.memory import GiB, largest_term, total_params
from shardline.planner.offload import OUTSIDE_DEVICE, ssd_spill
from shardline.planner.search import SearchResult


def describe_request(work: Workload, hw: Hardware, gpus: int, ring: int = 1) -> str:
    gpn = hw.network.gpus_per_node
    n = gpus // gpn
    nodes = f" ({n} node{'s' if n > 1 else ''} x {gpn})" if gpus >= gpn and gpus % gpn == 0 and hw.name != "cpu" else ""
    active = f", {_count(num_params(work.model, active=True))} active" if work.model.moe else ""
    return (f"{work.label} ({_count(total_params(work))} params{active}) on {gpus:,} x "
            f"{hw.name}{nodes}, "
            f"seq {work.seq_len}, global batch {work.global_batch:,} seqs ("
            + (f"{work.tokens / 1e6:.2f} M" if work.tokens >= 1e6 else f"{work.tokens:,}") + " tokens), "
            f"{work.precision}{', document mask' if work.document_mask else ''}, {_compile_words(work)}; "
            f"{attention_words(work, hw, ring)}")


def _compile_words(work: Workload) -> str:
    """Whether the blocks are priced compiled: it moves step time and activation memory a lot."""
    if work.compiled:
        return "compiled blocks (train.compile; its pricing rests on one 1B-shape run on one H200)"
    return "eager blocks (train.compile=false; --train.compile=true prices them compiled)"


def _count(n: int) -> str:
    """A parameter count as people say it: 70.55 B, 5.2 M (a tiny model read "0.01 B")."""
    return f"{n / 1e9:.2f} B" if n >= 1e9 else f"{n / 1e6:.1f} M"


def attention_words(work: Workload, hw: Hardware, ring: int = 1) -> str:
    """The kernel priced and the share of the s x s scores it computes (planner/attention.py)."""
    kernel = attention.kernel(work, hw, ring)
    share = attention.computed_fraction(kernel, work.seq_len, work.document_mask, work.mean_doc_tokens)
    docs = ("causal" if not work.document_mask else f"documents of {work.mean_doc_tokens:,.0f} tokens on average"
            if work.mean_doc_tokens else "one document per sequence assumed")
    return f"attention {kernel}: {100 * share:.0f}% of the s² scores computed ({docs})"


# What two of the memory terms hold (ZeRO's accounting), which their names alone do not say.
MEMORY_TERMS = ("params: autocast's 16-bit weight copies alive at the peak (none in fp32; FSDP's gathered weights "
                "are in buffers), and the fp32 weights where every rank keeps them whole (ZeRO-1; fp32 ZeRO-2); "
                "optimizer: the fp32 weights and AdamW's two moments, 12 bytes a parameter (ZeRO-1: the moments, 8)")


def mfu_words(work: Workload) -> str:
    """What MFU divides, the trainer's convention (devices.mfu_peak_dtype): fp8 against the bf16 peak."""
    return (f"MFU = model FLOPs (6N + 12·L·d·s: N the {'active ' if work.model.moe else ''}matmul parameters, every "
            f"score counted, as PaLM's MFU) / the {mfu_peak_dtype(work.precision)} dense peak, as the trainer logs it")


def mfu_over_words(mfu: float) -> list[str]:
    """A line for an MFU above 100%, which model FLOPs give where the kernel skips work they count."""
    if mfu <= 1.0:
        return []
    return ["(MFU above 100%: model FLOPs count every score of a row, and the kernel skips those in the future "
            "and between documents, which at long sequences is most of the work; tokens/s is the figure to compare)"]


def scores_words(work: Workload, hw: Hardware, ring: int = 1) -> list[str]:
    """A line where the scores are a large part of the FLOPs MFU counts: the kernel computes a share of
    them (causal: about half), so at long sequences the hardware does much less work than MFU counts."""
    counted = flops_per_token(work.model, work.seq_len)
    scores = counted - 6.0 * matmul_params(work.model)
    if scores < 0.25 * counted:
        return []
    kernel = attention.kernel(work, hw, ring)
    share = attention.computed_fraction(kernel, work.seq_len, work.document_mask, work.mean_doc_tokens)
    run = (counted - scores * (1 - share)) / counted
    return [f"(at seq {work.seq_len:,} the scores are {100 * scores / counted:.0f}% of the FLOPs MFU counts and "
            f"{'the cp ring' if kernel == 'context' else kernel} computes {100 * share:.0f}% of them: the devices run "
            f"about {100 * run:.0f}% of the FLOPs counted, recomputation aside; compare tokens/s)"]


PLAN_CAVEAT = ("predicted by the cost model (within 15% on 14 of 16 published GPU runs of other trainers: "
               "docs/planner.md); this trainer has run on one GPU, not yet on many (pipeline schedules, cp and ep on "
               "CPU ranks only): run the top rows a few steps each before a long run")


def plan_table(work: Workload, hw: Hardware, gpus: int, result: SearchResult, shown: list[Estimate],
               not_runnable: dict[int, str]) -> str:
    pruned = ", ".join(f"{k} {v:,}" for k, v in result.pruned.most_common())
    ring = next((e.layout.cp_degrees[0] for e in shown if e.layout.cp_degrees[0] > 1), 1)
    ringed = attention.kernel(work, hw, ring)  # (the layouts shown with cp > 1 run another kernel: say which)
    share = attention.computed_fraction(ringed, work.seq_len, work.document_mask, work.mean_doc_tokens)
    rings = (f"; with cp > 1, context parallelism's ring: {100 * share:.0f}% of them"
             if ring > 1 and ringed != attention.kernel(work, hw) else "")
    lines = [f"plan: {describe_request(work, hw, gpus)}{rings}",
             f"searched {result.evaluated:,} layouts in {result.seconds:.1f} s: {len(result.candidates):,} fit"
             + (f"; pruned by the rule they broke (memory: did not fit): {pruned}" if pruned else ""),
             mfu_words(work),
             *scores_words(work, hw, shown[0].layout.cp_degrees[0] if shown else 1),
             f"GiB/dev: the peak per device of {hw.mem_gib:.1f}, with {100 * hw.fragmentation:.0f}% allocator slack "
             f"and {hw.reserved_gib:g} GiB outside it (CUDA context, NCCL) counted; to keep more free, a --profile "
             "with a lower mem_gib",
             "",
             ""]
    width = max([len("layout")] + [len(e.layout.describe()) for e in shown])
    lines[-1] = f"{'#':>2}  {'layout':<{width}} {'tokens/s':>12} {'MFU':>6} {'step s':>8} {'GiB/dev':>8}  why"
    for i, e in enumerate(shown, 1):
        mark = "*" if i - 1 in not_runnable else " "
        lines.append(f"{i:>2}{mark} {e.layout.describe():<{width}} {e.tokens_per_s:>12,.0f} {100 * e.mfu:>5.1f}% "
                     f"{e.step_time_s:>8.2f} {e.memory['total'] / GiB:>8.1f}  {_why(e)}")
    lines += mfu_over_words(max((e.mfu for e in shown), default=0.0))
    if hw.name != "cpu" and shown:  # (no layout of many GPUs has run this trainer: a ranking to measure, not a fact)
        lines += ["", PLAN_CAVEAT]
    if not_runnable:
        reasons = sorted(set(not_runnable.values()))
        lines += ["", "* `shardline train` cannot run this layout yet: " + "; ".join(reasons)]
    return "\n".join(lines)


def _why(e: Estimate) -> str:
    """The reasons without the memory figure, which has its own column."""
    return "; ".join(p for p in e.reasons().split("; ") if not p.startswith("mem ")) or "compute-bound"


def estimate_text(work: Workload, hw: Hardware, e: Estimate) -> str:
    lines = [f"estimate: {describe_request(work, hw, e.layout.world, e.layout.cp_degrees[0])}",
             f"layout: {e.layout.describe()}  ({e.info['micro_batches_per_step']} micro-batches per rank per step)",
             "",
             f"step time {e.step_time_s:.4g} s   tokens/s {e.tokens_per_s:,.0f} (global)   MFU {100 * e.mfu:.1f}%",
             f"({mfu_words(work)})", *mfu_over_words(e.mfu), *scores_words(work, hw, e.layout.cp_degrees[0]),
             "",
             "time per step (s):"]
    for key, value in sorted(e.breakdown.items(), key=lambda kv: -kv[1]):
        lines.append(f"  {key:<18} {value:10.4f}  {100 * value / e.step_time_s:5.1f}%")
    placed = ep_placement(e.layout, hw, getattr(work.model, "n_experts", 0))
    lines += [f"  ({placed})"] * bool(placed)
    lines += ["", f"memory on the busiest rank at its peak (GiB; on a GPU the terms alive then), "
                  f"capacity {e.capacity / GiB:.1f} ({MEMORY_TERMS}):"]
    for key, value in e.memory.items():
        if key not in OUTSIDE_DEVICE:
            lines.append(f"  {key:<18} {value / GiB:10.3f}")
    big, big_bytes = largest_term(e.memory)
    fits = "fits" if e.memory["total"] <= e.capacity else \
        (f"DOES NOT FIT ({e.memory['total'] / GiB:.1f} > {e.capacity / GiB:.1f} GiB; "
         f"largest term {big} {big_bytes / GiB:.1f})")
    lines.append(f"  {'total':<18} {e.memory['total'] / GiB:10.3f}  {fits}")
    if e.memory.get("host_offload"):
        host = "" if e.host_ok else f"  DOES NOT FIT the host's {hw.network.host_mem_gib:.0f} GiB per node"
        lines.append(f"  {'on the host':<18} {e.memory['host_offload'] / GiB:10.3f}  (CPU offload){host}")
    if e.memory.get("ssd_offload"):
        spill = ssd_spill(e.memory, e.layout, hw)
        cache = (f"more than the page cache holds: {spill / GiB:.1f} GiB a node read each step" if spill
                 else "the page cache holds them")
        cache += ", all written back each step"
        lines.append(f"  {'on the SSD':<18} {e.memory['ssd_offload'] / GiB:10.3f}  (memory.ssd_offload_dir: AdamW's "
                     f"moments; {cache})")
    return "\n".join(lines)


def plan_json(work: Workload, hw: Hardware, gpus: int, result: SearchResult, shown: list[Estimate],
              not_runnable: dict[int, str]) -> dict:
    candidates = []
    for i, e in enumerate(shown):
        item = e.to_json()
        item["runnable"] = i not in not_runnable
        if i in not_runnable:
            item["not_runnable_reason"] = not_runnable[i]
        candidates.append(item)
    return {"candidates": candidates,
            "request": {"model": work.model_ref, "model_overrides": list(work.model_overrides),
                        "params": total_params(work), "gpu": hw.name, "gpus": gpus,
                        "gpus_per_node": hw.network.gpus_per_node, "seq_len": work.seq_len,
                        "global_batch": work.global_batch, "global_batch_tokens": work.tokens,
                        "precision": work.precision, "document_mask": work.document_mask,
                        "attention": work.attention, "mean_doc_tokens": work.mean_doc_tokens,
                        "mfu_peak_dtype": mfu_peak_dtype(work.precision)},
            "search": {"evaluated": result.evaluated, "fit": len(result.candidates),
                       "pruned": dict(result.pruned), "seconds": round(result.seconds, 3)}}
