"""train.attention on CPU: the block mask and cumulative lengths built from document ids,
flex (forward: it has no CPU backward) and the varlen layout against dense-mask SDPA,
SDPA's own GQA, which kernel auto picks, and the one-line refusals."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import create_block_mask
from torch.profiler import profile

from shardline import layout as layouts
from shardline.cli import main
from shardline.config import load_config
from shardline.errors import ConfigError
from shardline.models.attention import (
    FlexAttention,
    VarlenAttention,
    document_block_mask,
    document_mask_mod,
    packed_documents,
    resolve_attention,
    use_attention,
)
from shardline.models.factory import build_model_on
from shardline.models.llama.model import ModelArgs, document_causal_mask, sdpa_attention
from shardline.planner.layout import Workload, layout_problem
from shardline.preflight import check_config, check_device, check_layout

S = 256  # one length for every flex call: each new shape costs FlexAttention a trace on CPU


def _docs(lengths_per_row: list[list[int]]) -> torch.Tensor:
    """doc_ids [rows, sum(lengths)]: documents numbered in stream order, as packing does."""
    rows, doc = [], 0
    for lengths in lengths_per_row:
        row = []
        for n in lengths:
            row += [doc] * n
            doc += 1
        rows.append(row)
        doc -= 1  # the next row starts inside the same document (packing cuts documents)
    return torch.tensor(rows)


def _block_grid(counts: torch.Tensor, indices: torch.Tensor, n_kv: int) -> torch.Tensor:
    """BlockMask's lists [b, 1, nq] / [b, 1, nq, nk] -> which blocks are marked, [b, nq, nk]."""
    grid = torch.zeros(counts.shape[0], counts.shape[2], n_kv, dtype=torch.bool)
    for b in range(counts.shape[0]):
        for i in range(counts.shape[2]):
            grid[b, i, indices[b, 0, i, : counts[b, 0, i]].long()] = True
    return grid


def _allowed(doc_ids: torch.Tensor, block: int) -> torch.Tensor:
    """What the BlockMask lets each query see, [b, s, s]: full blocks whole, partial blocks
    through the mask_mod, other blocks nothing."""
    bm = document_block_mask(doc_ids, block)
    b, s = doc_ids.shape
    n = -(-s // block)
    per_token = torch.arange(s) // block
    full = _block_grid(bm.full_kv_num_blocks, bm.full_kv_indices, n)[:, per_token][:, :, per_token]
    partial = _block_grid(bm.kv_num_blocks, bm.kv_indices, n)[:, per_token][:, :, per_token]
    q, k = torch.arange(s)[:, None], torch.arange(s)[None, :]
    mod = document_mask_mod(doc_ids)
    by_mod = torch.stack([mod(torch.tensor(r), 0, q, k) for r in range(b)])
    return full | (partial & by_mod)


@pytest.mark.parametrize("s, block, first_row", [(S, 64, [70, 5, 100, 81]), (200, 64, [64, 64, 1, 71]),
                                                (96, 128, [30, 1, 65])])
def test_block_mask_equals_dense_document_causal_mask(s, block, first_row):
    """Lengths below, at and past block edges; a sequence shorter than one block."""
    doc_ids = _docs([first_row, [s], [1, s - 2, 1]])
    dense = document_causal_mask(doc_ids)[:, 0]
    assert torch.equal(_allowed(doc_ids, block), dense)
    q, k = torch.arange(s)[:, None], torch.arange(s)[None, :]
    mod = document_mask_mod(doc_ids)
    assert all(torch.equal(mod(torch.tensor(r), 0, q, k), dense[r]) for r in range(3))
    # Block by block as torch classifies them from the dense mask (a partial last block never full).
    ours, torchs = document_block_mask(doc_ids, block), create_block_mask(mod, 3, None, s, s, "cpu", block)
    n = -(-s // block)
    for counts, indices in (("kv_num_blocks", "kv_indices"), ("full_kv_num_blocks", "full_kv_indices")):
        assert torch.equal(_block_grid(getattr(ours, counts), getattr(ours, indices), n),
                           _block_grid(getattr(torchs, counts), getattr(torchs, indices), n))


def test_block_mask_skips_blocks_no_document_reaches():
    doc_ids = _docs([[64, 64, 128], [S]])
    bm = document_block_mask(doc_ids, 64)
    computed = (bm.kv_num_blocks + bm.full_kv_num_blocks).sum(-1)[:, 0]
    causal_blocks = 4 * 5 // 2
    assert computed.tolist() == [1 + 1 + 1 + 2, causal_blocks]  # the multi-document row skips half its blocks
    assert bm.full_kv_num_blocks[1, 0].tolist() == [0, 1, 2, 3]  # one document: below the diagonal runs unmasked
    reference = create_block_mask(document_mask_mod(doc_ids), 2, None, S, S, device="cpu", BLOCK_SIZE=64)
    assert torch.equal(bm.to_dense(), reference.to_dense())
    assert torch.equal(bm.full_kv_num_blocks, reference.full_kv_num_blocks)


def test_cumulative_lengths_restart_at_every_row():
    doc_ids = torch.tensor([[0, 0, 0, 1, 1, 2], [2, 2, 3, 3, 3, 3], [3, 3, 3, 3, 3, 3]])
    packed = packed_documents(doc_ids)
    # Document 2 ends row 0 and starts row 1, 3 spans rows 1 and 2: a row's end ends it.
    assert packed.cu_seqlens.tolist() == [0, 3, 5, 6, 8, 12, 18]
    assert packed.cu_seqlens.dtype == torch.int32 and packed.max_len == 6


def _qkv(b=2, h=4, hk=2, s=S, d=16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(b, n, s, d, generator=gen) for n in (h, hk, hk))


def _dense_reference(q, k, v, doc_ids):
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    if doc_ids is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=document_causal_mask(doc_ids))


@pytest.mark.parametrize("masked", [True, False])
def test_sdpa_enable_gqa_equals_repeated_kv(masked):
    q, k, v = (t.requires_grad_() for t in _qkv(s=64))
    doc_ids = _docs([[20, 30, 14], [64]]) if masked else None
    with profile() as prof:
        out = sdpa_attention(q, k, v, document_causal_mask(doc_ids) if masked else None)
    ops = {event.name for event in prof.events()}
    # K/V go in with their own heads, to the CPU flash kernel (no copies, no math fallback).
    assert "aten::_scaled_dot_product_flash_attention_for_cpu" in ops and "aten::repeat_interleave" not in ops
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    ref = _dense_reference(q, k, v, doc_ids)
    ref_grads = torch.autograd.grad(ref.square().sum(), (q, k, v))
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def _tiny_model(attention: str):
    args = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=97, ffn_dim=128)
    model = build_model_on(args, "cpu")
    model.init_weights(seed=3)
    assert use_attention(model, attention, True, torch.device("cpu")) == attention
    return model


def _saved_masks(model, ids, doc_ids, autocast: bool) -> tuple[torch.Tensor, list[torch.Tensor], set[tuple[int, int]]]:
    """(loss, parameter gradients, the distinct storages of [.., s, s] tensors the forward saved
    for backward: (address, bytes)), the forward under bf16 autocast or not."""
    s, found = ids.shape[1], set()

    def keep(t):
        if t.shape[-2:] == (s, s):
            found.add((t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()))
        return t

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t), \
            torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss = model(ids, doc_ids=doc_ids, labels=ids)
    return loss, list(torch.autograd.grad(loss, list(model.parameters()))), found


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_cpu_forward_keeps_one_document_mask_for_every_layer_as_the_planner_prices_it(precision):
    """torch's CPU SDPA turns a boolean mask into an additive one in every call (and autocast casts
    an fp32 one) and keeps each layer's copy for backward: 2-4 bytes a score a layer (a 2-layer
    model at seq 16384 peaked 1 GiB above what the planner said; at 32768, 7 GiB). The model hands
    every layer one additive mask in the compute dtype, which they share, with the same loss and
    gradients bit for bit; the planner prices that mask."""
    args = ModelArgs(dim=64, n_layers=3, n_heads=4, n_kv_heads=2, vocab_size=97, ffn_dim=128)
    model = build_model_on(args, "cpu")
    model.init_weights(seed=3)
    b, s, autocast, width = 2, 96, precision == "bf16", 4 if precision == "fp32" else 2
    ids = torch.randint(0, 97, (b, s), generator=torch.Generator().manual_seed(1))
    doc_ids = _docs([[40, 56], [96]])  # (no other dimension of 96: a saved [.., s, s] tensor is a mask)
    loss, grads, masks = _saved_masks(model, ids, doc_ids, autocast)
    assert len(masks) == 1 and {n for _, n in masks} == {width * b * s * s}
    model.attention_mask = document_causal_mask  # the boolean mask, as it was
    bool_loss, bool_grads, bool_masks = _saved_masks(model, ids, doc_ids, autocast)
    assert len(bool_masks) == args.n_layers  # (what the test would see without the shared mask)
    assert torch.equal(loss, bool_loss) and all(torch.equal(g, h) for g, h in zip(grads, bool_grads))
    # The planner: a document mask adds the mask's bytes to one rank's activations, once.
    from shardline.planner.layout import Layout as PlannerLayout
    from shardline.planner.memory import activation_bytes, ranks

    work = Workload(args, s, b, precision)
    lay = PlannerLayout(micro_batch_size=b)
    with_mask = activation_bytes(work, lay, ranks(work, lay)[0], on_cuda=False)["activations"]
    without = activation_bytes(Workload(args, s, b, precision, False), lay, ranks(work, lay)[0], on_cuda=False)
    assert with_mask - without["activations"] == width * b * s * s


@torch.no_grad()
@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_flex_forward_equals_dense_sdpa_with_gqa_and_documents():
    ids = torch.randint(0, 97, (2, S), generator=torch.Generator().manual_seed(1))
    doc_ids = _docs([[70, 5, 100, 81], [S]])
    dense, flex = _tiny_model("sdpa"), _tiny_model("flex")
    assert isinstance(flex.layers["0"].attention.core.__self__, FlexAttention)
    torch.testing.assert_close(flex(ids, doc_ids), dense(ids, doc_ids), atol=1e-5, rtol=1e-5)
    # Without documents flex builds a causal block mask itself (the model's mask is None).
    q, k, v = _qkv()
    torch.testing.assert_close(FlexAttention(compiled=False).attend(q, k, v, None),
                               _dense_reference(q, k, v, None), atol=1e-5, rtol=1e-5)


def _reference_varlen(q, k, v, cu_q, cu_k, max_q, max_k, enable_gqa=False):
    """varlen_attn's contract, by SDPA one document at a time ([tokens, heads, d])."""
    assert torch.equal(cu_q, cu_k) and max_q == max_k == int((cu_q[1:] - cu_q[:-1]).max())
    out = torch.empty_like(q)
    for a, b in zip(cu_q[:-1].tolist(), cu_q[1:].tolist()):
        piece = [t[a:b].transpose(0, 1) for t in (q, k, v)]
        out[a:b] = F.scaled_dot_product_attention(*piece, is_causal=True, enable_gqa=enable_gqa).transpose(0, 1)
    return out


@pytest.mark.parametrize("with_docs", [True, False])
def test_varlen_layout_equals_dense_sdpa(with_docs):
    """varlen_attn itself needs CUDA (tests/gpu); here its inputs: flattening, cu_seqlens, GQA."""
    q, k, v = _qkv(s=48)
    doc_ids = _docs([[10, 30, 8], [48]]) if with_docs else None
    varlen = VarlenAttention(kernel=_reference_varlen)
    out = varlen.attend(q, k, v, varlen.mask(doc_ids))
    torch.testing.assert_close(out, _dense_reference(q, k, v, doc_ids), atol=1e-5, rtol=1e-5)


def test_auto_resolves_by_device_documents_and_cp_ring():
    assert resolve_attention("auto", True, on_cuda=True) == "flex"
    assert resolve_attention("auto", False, on_cuda=True) == "sdpa"
    assert resolve_attention("auto", True, on_cuda=False) == "sdpa"
    assert resolve_attention("auto", True, on_cuda=True, ring=2) == "context"  # the ring's own blocks
    assert resolve_attention("varlen", True, on_cuda=True) == "varlen"  # also under Ulysses alone (ring 1)


def _config(*extra: str):
    return load_config(None, ["train.seq_len=32", "train.global_batch_size=8", "train.micro_batch_size=4",
                              *extra])


def _one_line_error(check, *args) -> str:
    with pytest.raises(ConfigError) as err:
        check(*args)
    message = str(err.value)
    assert "\n" not in message and "train.attention" in message
    return message


@pytest.mark.parametrize("kernel", ["flex", "varlen"])
def test_flex_and_varlen_training_on_cpu_is_refused(kernel):
    cfg = _config(f"train.attention={kernel}", "train.precision=bf16")
    check_config(cfg)  # the config alone is fine: a GPU would run it
    message = _one_line_error(check_device, cfg, layouts.resolve(cfg, 1), False)
    assert "CUDA only" in message and "auto, sdpa" in message
    check_device(cfg, layouts.resolve(cfg, 1), True)


@pytest.mark.parametrize("kernel", ["flex", "varlen"])
def test_flex_and_varlen_with_a_context_parallel_ring_are_refused_and_under_ulysses_run(kernel):
    """A layout rule (layout.NOT_BUILT): the trainer refuses it and the planner drops such layouts.
    Ulysses alone gathers the whole sequence, where the kernel runs as without cp."""
    model = ModelArgs(dim=64, n_layers=2, n_heads=4, vocab_size=512)
    for mode in ("ring", "hybrid"):
        cfg = _config(f"train.attention={kernel}", "train.precision=bf16", "parallel.cp=4", f"parallel.cp_mode={mode}",
                      "parallel.cp_ulysses=2", "train.micro_batch_size=2")
        assert "use cp_mode=ulysses" in _one_line_error(check_layout, cfg, 4, model)
    check_layout(_config("train.attention=auto", "parallel.cp=2"), 2, model)  # auto takes the ring's own core
    check_layout(_config(f"train.attention={kernel}", "train.precision=bf16", "parallel.cp=2",
                         "parallel.cp_mode=ulysses"), 2, model)
    work = Workload(model, 256, 8, "bf16", attention=kernel)
    assert layout_problem(work, layouts.Layout(cp=2), runnable=True)[0] == "cp"
    assert layout_problem(work, layouts.Layout(cp=2)) is None  # what another trainer could run
    assert layout_problem(work, layouts.Layout(cp=2, cp_mode="ulysses"), runnable=True) is None


def test_varlen_in_fp32_is_refused():
    said = _one_line_error(check_config, _config("train.attention=varlen", "train.precision=fp32"))
    assert "train.precision" in said  # (and the device with it: a CPU's auto settles fp32, and its way out,
    assert "and a CUDA device (train.precision=auto settles fp32 on a CPU)" in said  # bf16, refused next)


def test_dry_run_names_the_kernel_and_refuses_as_a_launch_would(capsys, tmp_path):
    assert main(["train", "--dry-run", f"--run.dir={tmp_path / 'run'}", "--run.device=cuda"]) == 0
    assert "attention flex: block mask from document ids (train.attention=auto, CUDA)" in capsys.readouterr().out
    assert main(["train", "--dry-run", f"--run.dir={tmp_path / 'run'}", "--run.device=cuda", "--world-size=2",
                 "--parallel.cp=2", "--parallel.cp_mode=ulysses"]) == 0
    assert ("attention flex: block mask from document ids, after Ulysses' all-to-all over 2 ranks "
            "(train.attention=auto, CUDA)") in capsys.readouterr().out
    code = main(["train", "--dry-run", f"--run.dir={tmp_path / 'run'}", "--run.device=cpu", "--train.attention=flex"])
    err = capsys.readouterr().err
    assert code == 2 and "train.attention='flex' trains on CUDA only" in err and err.count("\n") == 1


def test_every_configurable_kernel_has_a_core_and_no_other_name_does():
    """The config's list and the cores agree: a kernel added to train.attention's choices alone
    trained as SDPA, in silence."""
    from shardline.config.sections import ATTENTION_KERNELS
    from shardline.models.attention import KERNELS, attention_core

    assert set(ATTENTION_KERNELS) - {"auto"} == set(KERNELS)
    assert type(attention_core("sdpa", False)).__name__ == "DenseAttention"
    with pytest.raises(ValueError, match="attention kernel 'xformers' has no core: one of sdpa, flex, varlen"):
        attention_core("xformers", False)
