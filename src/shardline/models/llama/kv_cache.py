"""A key/value cache for sampling from a trained model one token at a time (`shardline generate`)."""

from __future__ import annotations

import torch

from shardline.models.llama.model import sdpa_attention


class KVCache:
    """The keys and values each attention block has seen, so that only the tokens not run yet
    go through the model: n new tokens cost n one-token passes instead of n passes of the whole
    text. Installed, for a `with`, as each block's attention core (the seam the model keeps
    for another kernel)."""

    def __init__(self, model: torch.nn.Module, device: torch.device, window: int | None = None):
        """`window`: the model's sliding window (ModelArgs.sliding_window): each token attends to
        itself and the window - 1 tokens before it, in every layer, and the cache keeps those alone,
        as the weights were trained (Mistral 7B v0.1, Phi-3-mini)."""
        self.model, self.device, self.window = model, device, window
        self.blocks = [block.attention for block in model.layers.values()]
        self.clear()

    def clear(self) -> None:
        self.keys: list[torch.Tensor | None] = [None] * len(self.blocks)
        self.values: list[torch.Tensor | None] = [None] * len(self.blocks)
        self.length = 0  # the tokens cached, at positions 0..length-1

    def __enter__(self) -> KVCache:
        self.saved = [block.core for block in self.blocks], self.model.output
        for i, block in enumerate(self.blocks):
            block.core = self._core(i)
        # Logits of the last position only: a prompt's [tokens, vocab] in fp32 is gigabytes.
        self.model.output = _LastPosition(self.model.output)
        return self

    def __exit__(self, *exc) -> None:
        cores, self.model.output = self.saved
        for block, core in zip(self.blocks, cores):
            block.core = core

    def _core(self, i: int):
        def core(q, k, v, mask):
            return self._attend(i, q, k, v)

        core.windowed = self.window is not None  # (a longer sequence than the window is its to mask)
        return core

    def next_logits(self, ids: list[int]) -> torch.Tensor:
        """The logits of the token after `ids` (whose first `length` are the cached ones)."""
        fresh = torch.tensor([ids[self.length:]], device=self.device)
        positions = torch.arange(self.length, len(ids), device=self.device)
        logits = self.model(fresh, positions=positions)[0, -1]
        self.length = len(ids)
        return logits

    def _attend(self, i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if self.keys[i] is not None:
            k, v = torch.cat((self.keys[i], k), dim=2), torch.cat((self.values[i], v), dim=2)
        keep = k.shape[2] if self.window is None else self.window - 1  # what the next token may see
        start = max(k.shape[2] - keep, 0)  # (fewer keys than that: all of them; a negative start kept the last few)
        self.keys[i], self.values[i] = k[:, :, start:], v[:, :, start:]
        # Query j is at key index past + j and sees keys 0..past + j (within the window: from
        # past + j - window + 1). SDPA's is_causal would align the two at the top left instead.
        past = k.shape[2] - q.shape[2]
        if past == 0 and (self.window is None or q.shape[2] <= self.window):  # a prompt: plain causal
            return sdpa_attention(q, k, v, None)
        seen = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril(past)
        if self.window is not None:
            seen &= torch.ones_like(seen).triu(past - self.window + 1)
        return sdpa_attention(q, k, v, seen[None, None])


class _LastPosition(torch.nn.Module):
    """The output projection of the last position alone."""

    def __init__(self, output: torch.nn.Module):
        super().__init__()
        self.output = output

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.output(h[:, -1:])
