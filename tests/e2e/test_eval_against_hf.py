"""A run's logged eval loss and `shardline eval`'s against an independent computation over HF Llama.

The reference is written from the README's description, not from shardline's code: the run's
last checkpoint exported as users export it (`shardline convert to-hf`), loaded by transformers'
LlamaForCausalLM (fp32, CPU); the held-out split read through the run's own data objects
(`trainer.data.val`), of which an evaluation takes `train.eval_batches` global batches spread evenly
over it (`eval_batches x global_batch_size` sequences, n of a split of N: sequence floor(i x N / n) for
i < n; a smaller split whole, each sequence once,
`eval_sequences` saying how many); the loss is the mean cross-entropy over every labelled token
of those sequences together (not a mean of per-batch means), with attention kept within each
packed document where `train.document_mask` is on (a 4-D mask to HF) and plain causal where it
is off; the perplexity is exp(loss). The labels themselves are checked against the inputs: text
labels are the next token except where it opens another document; chat labels only cover
assistant replies (each labelled run decodes to part of one reply and its `<|im_end|>`).

Compared, for text with and without the document mask and for chat: (1) the `eval` record the
run logs at its last step, (2) `shardline eval RUN --json` (the run's eval_batches, then
`--batches 0`: the whole split, and a count past the split's size: the whole split too), (3) the
reference. All agree to ~1e-7 relative here; held at 2e-6 (the README's own eval-vs-logged
figure is 1e-6), since a per-batch mean or an unmasked attention moves these tiny models' loss
by only 4e-5 to 7e-4. Sensitivity, tried by temporary edits of src/shardline: a per-micro-batch
mean in the trainer's evaluation, the document mask off in evaluation, labels one token off --
each fails this file (see also the in-test guards below that the data makes those mistakes
visible).
"""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F

from shardline.cli import main
from shardline.config import load_config
from shardline.interop.convert import convert
from shardline.metrics import history
from shardline.trainer import Trainer
from tests.conftest import tiny_overrides, write_small_corpus

transformers = pytest.importorskip("transformers")

IGNORE = -100
STEPS, EVAL_BATCHES, GLOBAL, MICRO = 4, 2, 8, 4
TOL = 2e-6  # relative; fp32 on the CPU agrees to ~1e-7 here
WORDS = "apple river stone cloud horse lamp bread candle tiger window garden silver".split()


@pytest.fixture(scope="module")
def verses(tmp_path_factory):
    """Chapters cut into one document a verse (~40 tokens): most sequences of 32 cross a document
    boundary, where the labels and the document mask act."""
    chapters = write_small_corpus(tmp_path_factory.mktemp("chapters")).read_text(encoding="utf-8").splitlines()[:12]
    lines = [v for c in chapters for v in json.loads(c)["text"].splitlines()[2:] if v.strip()]
    path = tmp_path_factory.mktemp("verses") / "verses.jsonl"
    path.write_text("".join(json.dumps({"text": v}) + "\n" for v in lines), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def chats(tmp_path_factory):
    """Conversations of 1-2 turns, some with a system message, replies of 1-6 words: several
    to a sequence of 128 tokens, kept apart by the document mask."""
    rows, replies = [], set()
    for i in range(400):
        messages = [{"role": "system", "content": "Answer."}] if i % 5 == 0 else []
        for turn in range(1 + i % 2):
            reply = " ".join(WORDS[(i + k) % len(WORDS)] for k in range(1 + (7 * i + turn) % 6)) + "."
            messages += [{"role": "user", "content": f"Name {turn + i % 5} things."},
                         {"role": "assistant", "content": reply}]
            replies.add(reply)
        rows.append(json.dumps({"messages": messages}) + "\n")
    path = tmp_path_factory.mktemp("chat") / "chat.jsonl"
    path.write_text("".join(rows), encoding="utf-8")
    return path, replies


def document_mask(doc_ids: torch.Tensor) -> torch.Tensor:
    """[batch, 1, seq, seq] additive mask: causal within each packed document."""
    s = doc_ids.shape[1]
    keep = torch.ones(s, s, dtype=torch.bool).tril() & (doc_ids[:, :, None] == doc_ids[:, None, :])
    return torch.zeros(keep.shape).masked_fill(~keep, torch.finfo(torch.float32).min)[:, None]


@torch.no_grad()
def reference(hf, val, n: int, doc_mask: bool, per: int | None = None) -> float:
    """Mean cross-entropy over all labelled tokens of n held-out sequences spread over the split (`per`:
    instead the mean of per-chunk means over chunks of `per` sequences, the averaging this file must reject)."""
    b = val.batch([i * len(val) // n for i in range(n)])
    mask = document_mask(b["doc_ids"]) if doc_mask else None
    logits = hf(input_ids=b["input_ids"], attention_mask=mask).logits.float()
    ce = F.cross_entropy(logits.flatten(0, 1), b["labels"].flatten(), ignore_index=IGNORE, reduction="none")
    ce, labelled = ce.view(n, -1), (b["labels"] != IGNORE)
    if per is None:
        return (ce.sum() / labelled.sum()).item()
    chunks = [(ce[i:i + per].sum() / labelled[i:i + per].sum()).item() for i in range(0, n, per)]
    return sum(chunks) / len(chunks)


def train_and_load(cfg, tmp_path):
    trainer = Trainer(cfg).build()
    trainer.train()
    evals = [r for r in history(cfg.run.dir) if r["kind"] == "eval"]
    assert evals and evals[-1]["step"] == STEPS
    convert("to-hf", str(cfg.run.dir), str(tmp_path / "hf"))
    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf", attn_implementation="sdpa",
                                                       torch_dtype=torch.float32).eval()
    return trainer.data, evals[-1], hf


def cli_eval(capsys, run, *args: str) -> dict:
    assert main(["eval", str(run), *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def compare(capsys, cfg, data, logged, hf, doc_mask: bool):
    val, n = data.val, EVAL_BATCHES * GLOBAL
    assert len(val) > n + 2, "the split should hold more than an eval reads"
    want = reference(hf, val, n, doc_mask)
    # (1) the run's own eval record at its last step
    assert logged["eval_sequences"] == n
    assert logged["eval_loss"] == pytest.approx(want, rel=TOL)
    assert logged["eval_ppl"] == pytest.approx(math.exp(want), rel=TOL)
    # (2) shardline eval: the run's eval_batches, the whole split, and a count past the split
    got = cli_eval(capsys, cfg.run.dir)
    assert got["step"] == STEPS and got["sequences"] == n
    assert got["loss"] == pytest.approx(want, rel=TOL) and got["perplexity"] == pytest.approx(math.exp(want), rel=TOL)
    whole = reference(hf, val, len(val), doc_mask)
    for batches in ("0", str(len(val) // GLOBAL + 3)):
        got = cli_eval(capsys, cfg.run.dir, "--batches", batches)
        assert got["sequences"] == len(val), batches
        assert got["loss"] == pytest.approx(whole, rel=TOL), batches
        assert got["perplexity"] == pytest.approx(math.exp(whole), rel=TOL), batches
    # the data makes the mistakes this file is meant to catch visible (each >> 1e-5 away)
    assert max(abs(reference(hf, val, n, doc_mask, per=MICRO) / want - 1),  # a mean of micro-batch means
               abs(reference(hf, val, len(val), doc_mask, per=MICRO) / whole - 1)) > 5 * TOL
    if doc_mask:
        assert abs(reference(hf, val, n, False) / want - 1) > 5 * TOL  # the document mask ignored
    return whole


@pytest.mark.parametrize("doc_mask", [True, False], ids=["doc-mask", "no-doc-mask"])
def test_text_eval_matches_hf_llama(tmp_path, verses, capsys, doc_mask):
    cfg = load_config(None, tiny_overrides(
        tmp_path / "run", verses, f"train.steps={STEPS}", f"train.eval_interval={STEPS}",
        f"checkpoint.interval={STEPS}", f"train.eval_batches={EVAL_BATCHES}", f"train.global_batch_size={GLOBAL}",
        f"train.micro_batch_size={MICRO}", "data.val_fraction=0.1",
        "train.precision=fp32", f"train.document_mask={str(doc_mask).lower()}"))
    data, logged, hf = train_and_load(cfg, tmp_path)
    b = data.val.batch(list(range(len(data.val))))  # labels: the next token, but not across documents
    x, y, docs = b["input_ids"], b["labels"], b["doc_ids"]
    same = docs[:, 1:] == docs[:, :-1]
    assert torch.equal(y[:, :-1][same], x[:, 1:][same]) and (y[:, :-1][~same] == IGNORE).all()
    assert (~same).sum() > len(data.val) // 2  # many sequences hold a boundary
    compare(capsys, cfg, data, logged, hf, doc_mask)


def test_chat_eval_matches_hf_llama(tmp_path, chats, capsys):
    path, replies = chats
    cfg = load_config(None, tiny_overrides(
        tmp_path / "run", path, "data.format=chat", "train.seq_len=128", "optim.lr=1e-2", f"train.steps={STEPS}",
        f"train.eval_interval={STEPS}", f"checkpoint.interval={STEPS}", f"train.eval_batches={EVAL_BATCHES}",
        f"train.global_batch_size={GLOBAL}", f"train.micro_batch_size={MICRO}",
        "data.val_fraction=0.1", "train.precision=fp32"))
    data, logged, hf = train_and_load(cfg, tmp_path)
    b = data.val.batch(list(range(len(data.val))))
    x, y = b["input_ids"], b["labels"]
    labelled = y != IGNORE
    assert 0.1 < labelled.float().mean() < 0.7  # assistant tokens only: far from every token
    assert torch.equal(y[:, :-1][labelled[:, :-1]], x[:, 1:][labelled[:, :-1]])  # where labelled, the next token
    ends = [r + "<|im_end|>\n<|endoftext|>" for r in replies]  # (the packing's end-of-text closes a reply)
    for row in y.tolist():  # each labelled run is part of one reply (and its end marker), never a user turn
        run = []
        for v in row + [IGNORE]:
            if v != IGNORE:
                run.append(v)
            elif run:
                text = data.tokenizer.decode(run, skip_special_tokens=False)
                assert any(text in e for e in ends), text
                run = []
    compare(capsys, cfg, data, logged, hf, doc_mask=True)
