"""The [data] section of the training config: where the text comes from, how it is tokenized and
held out, and the sources of a mixture (each with its own weight, format and text field)."""

from __future__ import annotations

from dataclasses import dataclass, field

from shardline.errors import require as _require

MAX_TRAINED_VOCAB = 1 << 20  # data.vocab_size: past any real vocabulary (256k); far past it the BPE trainer aborts

DATA_FORMATS = ("text", "chat")


@dataclass
class MixSource:
    """One source of a data mixture: a path as data.path takes, and its sampling weight."""

    path: str = ""
    weight: float = 1.0
    format: str = ""  # text | chat; "" = data.format (chat SFT with text replay: one source of each)
    text_field: str = ""  # the field (column) of its text; "" = data.text_field (sources written by different tools)


@dataclass
class DataConfig:
    # "" = the shipped corpus; else a .txt/.jsonl/.parquet/.arrow file (or .gz), a folder of them,
    # or a folder made by `shardline prepare` (memory-mapped; its tokenizer and split are the folder's)
    path: str = ""
    text_field: str = "text"  # field holding the text in .jsonl, .parquet and .arrow files (chat reads "messages")
    tokenizer: str = ""  # "" = train a byte-level BPE on the data (cached); else a tokenizer.json
    vocab_size: int = 4096  # size of the trained BPE
    val_fraction: float = 0.01  # share of documents held out for evaluation (0: none, with train.eval_interval=0)
    # which raw documents are held out: content (each by its hash: files added move none) | position (the
    # rule before 2026-12-07, to resume a run on raw files saved before it); a prepared folder's is its own
    split: str = "content"
    # "" = evaluate on the held-out share; else data to evaluate on alone, read whole (as path takes:
    # files, a folder, a pattern or a prepared folder), and the training data holds nothing out
    val_path: str = ""
    format: str = "text"  # text | chat (.jsonl "messages"; loss on assistant tokens only)
    # Text documents start with the tokens the tokenizer's post-processor puts first (Llama's
    # <|begin_of_text|>, Mistral's <s>), as HF's tokenizer(text) starts them; none for a tokenizer
    # without them (the trained BPE, Qwen's). Chat documents get what their template writes.
    add_bos: bool = True
    mix: list[MixSource] = field(default_factory=list)  # [{path = "...", weight = 0.7}, ...] instead of path

    def check(self) -> None:
        _require(self.vocab_size >= 260, "data.vocab_size", self.vocab_size, "must be >= 260 (256 bytes + specials)")
        _require(self.vocab_size <= MAX_TRAINED_VOCAB, "data.vocab_size", self.vocab_size,  # (the trainer aborts)
                 f"must be <= {MAX_TRAINED_VOCAB} for a BPE trained here; a larger one comes with data.tokenizer")
        _require(0 <= self.val_fraction < 0.5, "data.val_fraction", self.val_fraction,
                 "must be in [0, 0.5) (0 holds nothing out: no evaluation)")
        _require(self.split in ("content", "position"), "data.split", self.split, "content or position")
        _require(bool(self.text_field), "data.text_field", self.text_field, "must be a field name")
        _require(self.format in DATA_FORMATS, "data.format", self.format, f"one of {', '.join(DATA_FORMATS)}")
        _require(not (self.mix and self.path), "data.mix", "[...]", "set data.path or data.mix, not both")
        for i, source in enumerate(self.mix):
            _require(bool(source.path), f"data.mix[{i}].path", source.path, "a data path or prepared folder")
            _require(source.weight > 0, f"data.mix[{i}].weight", source.weight, "must be > 0")
            _require(source.format in ("", *DATA_FORMATS), f"data.mix[{i}].format", source.format,
                     f"one of {', '.join(DATA_FORMATS)} (or unset: data.format)")
        for i, (fmt, name) in enumerate(zip(self.formats(), self.text_fields())):
            key = f"data.mix[{i}].text_field" if self.mix and self.mix[i].text_field else "data.text_field"
            _require(fmt == "chat" or name != "messages", key, name,
                     "holds conversations (role, content): set data.format=chat, which reads them"
                     + (" (or format = \"chat\" on the data.mix sources that hold them)" if self.mix else ""))

    def formats(self) -> list[str]:
        """Each source's format, in data.mix order (data.path's alone): its own, else data.format."""
        return [s.format or self.format for s in self.mix] or [self.format]

    def text_fields(self) -> list[str]:
        """Each source's text field, as formats(): its own, else data.text_field (a chat source reads
        "messages" whatever it says)."""
        return [s.text_field or self.text_field for s in self.mix] or [self.text_field]

    @property
    def chat(self) -> bool:
        """Whether any source is chat: the run renders with a chat template, exports and generates with it."""
        return "chat" in self.formats()


def saved_formats(data: dict) -> list[str]:
    """DataConfig.formats of a run's saved `data` section (a checkpoint's config, as a dict); [] where
    none was saved (weights converted from HF)."""
    if not data:
        return []
    mix = [MixSource(format=s.get("format") or "") for s in data.get("mix", []) if isinstance(s, dict)]
    return DataConfig(format=data.get("format", "text"), mix=mix).formats()
